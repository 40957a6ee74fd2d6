"""The aiohttp application: routes, auth, limits, engine lifecycle and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
from aiohttp import WSCloseCode, web

from scheduler.engine_core import EngineDeadError, StepInfo
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import AsyncEngine
from service.metrics import Metrics
from service.openai_api import (
    TENANT_SALT,
    OpenAIServing,
    error_response,
    json_response,
    salted,
)
from service.protocol import BadRequest, decode_prefix
from service.security import AccessLogger
from service.state import STATE, ServerConfig, ServerState
from service.ws import websocket_handler

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    # Browsers cannot set headers on a WebSocket: accept the key as a query parameter there.
    if request.path == "/v1/ws":
        return request.query.get("api_key")
    return None


def _authorized(state: ServerState, given: str | None) -> tuple[bool, str | None]:
    """(key accepted, that key's salt).  Every key is compared, so the time taken does not
    say which one nearly matched."""
    ok, salt = False, None
    raw = (given or "").encode()
    for key, key_salt_ in state.keys:
        if hmac.compare_digest(raw, key):
            ok, salt = True, key_salt_
    return ok, salt


@web.middleware
async def connection_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Count requests in progress per connection (see ServerState.connections)."""
    conns = request.app[STATE].connections
    proto = request.protocol
    if proto not in conns and len(conns) >= 4096:
        for p in [p for p, n in conns.items() if n == 0 and p.transport is None]:
            del conns[p]
    conns[proto] = conns.get(proto, 0) + 1
    try:
        return await handler(request)
    finally:
        conns[proto] -= 1


def close_idle_connections(state: ServerState) -> int:
    """Close keep-alive connections with no request in progress.  aiohttp's shutdown marks
    them closing (they ignore what arrives next) but leaves them open until the drain is
    over, so a balancer's next request on one would wait out the whole drain unanswered;
    closed, the balancer retries that request on another replica at once."""
    closed = 0
    for proto, n in list(state.connections.items()):
        if n == 0:
            if proto.transport is not None:
                proto.force_close()
                closed += 1
            del state.connections[proto]
    return closed


@web.middleware
async def api_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """API key check for /v1, and OpenAI-shaped errors for everything that goes wrong."""
    state = request.app[STATE]
    if state.keys and request.path.startswith("/v1"):
        ok, salt = _authorized(state, _bearer(request))
        if not ok:
            return error_response("invalid or missing API key", 401, code="invalid_api_key")
        if salt is not None:
            request[TENANT_SALT] = salt
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(e.message, e.status, e.param)
    except web.HTTPRequestEntityTooLarge:
        limit = state.config.max_request_bytes
        return error_response(f"request body is larger than the limit of {limit} bytes", 413)
    except web.HTTPException as e:
        if e.status >= 400 and request.path.startswith("/v1"):
            return error_response(e.reason or "error", e.status)
        raise
    except EngineDeadError as e:
        return error_response(str(e), 503)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal server error", 500)


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Load the model in the background (so /health answers 503 meanwhile), run the engine,
    and stop it on cleanup."""
    state = app[STATE]

    async def load() -> None:
        try:
            engine = app.get(PRESET_ENGINE)
            if engine is None:
                engine = await asyncio.to_thread(AsyncEngine.from_args, state.config.engine)
            names = [state.config.served_model_name or engine.model_name]
            if str(engine.model_dir) not in names:
                names.append(str(engine.model_dir))
            metrics = Metrics(names[0])

            def on_step(info: StepInfo) -> None:
                metrics.on_step(info, engine.scheduler.stats())
                if engine.tier is not None:
                    metrics.on_tier(engine.tier.name, engine.tier.stats, engine.tier.healthy)

            engine.add_step_hook(on_step)
            engine.request_hooks.append(metrics.on_request_done)
            await engine.start()
            state.metrics = metrics
            state.serving = OpenAIServing(
                engine, names, prompt_tokens_details=state.config.enable_prompt_tokens_details
            )
            state.engine = engine
            log.info("model loaded: %s (max_model_len %d)", engine.model_dir, engine.max_model_len)
        except Exception as e:
            state.load_error = e
            log.exception("model failed to load")

    task = asyncio.create_task(load())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if state.engine is not None:
        await state.engine.shutdown()


PRESET_ENGINE = web.AppKey("pagestream_preset_engine", AsyncEngine)


async def on_shutdown(app: web.Application) -> None:
    """SIGTERM: stop taking work, let in-flight streams finish up to the deadline, then
    close WebSockets with GOING_AWAY.  (aiohttp has already stopped accepting connections.)"""
    state = app[STATE]
    state.draining = True
    close_idle_connections(state)
    try:
        await asyncio.wait_for(state.idle.wait(), state.config.shutdown_timeout)
    except TimeoutError:
        log.warning("shutdown deadline reached with %d streams still running", state.inflight)
    for ws in list(state.websockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


# ----------------------------------------------------------------------------- handlers
def _serving(request: web.Request) -> OpenAIServing:
    state = request.app[STATE]
    if state.draining:
        raise BadRequest("the server is shutting down", status=503)
    if state.serving is None:
        if state.load_error is not None:
            raise BadRequest(f"the model failed to load: {state.load_error}", status=503)
        raise BadRequest("the model is still loading", status=503)
    return state.serving


async def _generation(request: web.Request, chat: bool) -> web.StreamResponse:
    serving = _serving(request)
    body = await request.read()
    state = request.app[STATE]
    state.inflight_inc()  # counted so SIGTERM can wait for it to finish
    try:
        if chat:
            return await serving.chat(request, body)
        return await serving.completions(request, body)
    finally:
        state.inflight_dec()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, chat=False)


async def register_prefix(request: web.Request) -> web.StreamResponse:
    """POST /v1/cache/prefixes {"messages": [...]} or {"prompt": str | [ids]}: compute a
    shared prefix (typically a system prompt) and publish its KV to the shared tier now,
    so every replica can load it instead of recomputing."""
    serving = _serving(request)
    body = await request.read()
    req = decode_prefix(body)
    engine = serving.engine
    if (req.messages is None) == (req.prompt is None):
        raise BadRequest("give exactly one of messages or prompt", "messages")
    if req.messages is not None:
        try:
            ids = engine.render_chat(
                [m.as_template_dict() for m in req.messages], add_generation_prompt=False
            )
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e
    else:
        try:
            ids = engine.encode_prompt(req.prompt)  # type: ignore[arg-type]
        except RequestRejected as e:
            raise BadRequest(str(e), "prompt") from e
    try:
        engine.resolve_max_tokens(len(ids), SamplingParams(max_tokens=1))
    except RequestRejected as e:
        raise BadRequest(str(e), "prompt") from e
    result = await engine.register_prefix(
        ids, cache_salt=salted(request.get(TENANT_SALT), req.cache_salt)
    )
    if not request.app[STATE].config.enable_prompt_tokens_details:
        del result["cached_tokens"]  # an oracle for what others sent, like usage's
    result["shared_tier"] = engine.tier.name if engine.tier is not None else None
    return json_response(result)


async def models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.serving is None:
        return error_response("the model is still loading", 503)
    return await state.serving.models(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return json_response({"status": "ok"})
    if state.draining:
        why = "draining"
    elif state.load_error is not None:
        why = f"load failed: {state.load_error}"
    elif state.engine is not None and state.engine.dead is not None:
        why = f"engine stopped: {state.engine.dead}"
    else:
        why = "loading"
    return web.Response(
        body=orjson.dumps({"status": why}), status=503, content_type="application/json"
    )


async def live(request: web.Request) -> web.Response:
    """Liveness for a supervisor (Kubernetes livenessProbe): 200 while the process serves,
    also while it loads or drains; 503 once the model failed to load or the engine died,
    which only a restart cures.  /health is the readiness signal."""
    state = request.app[STATE]
    dead = state.load_error or (state.engine.dead if state.engine is not None else None)
    if dead is not None:
        return web.Response(
            body=orjson.dumps({"status": f"dead: {dead}"}),
            status=503,
            content_type="application/json",
        )
    return json_response({"status": "alive"})


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics is None:
        return web.Response(text="", content_type="text/plain")
    engine = state.engine
    if engine is not None and engine.tier is not None:
        # The tier's writer publishes between steps; an idle replica has no step to copy
        # its counters on, so they are brought up to date at scrape time too.
        tier = engine.tier
        state.metrics.on_tier(tier.name, tier.stats, tier.healthy)
    return web.Response(
        body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def create_app(config: ServerConfig, engine: AsyncEngine | None = None) -> web.Application:
    """The application; pass `engine` to serve an already-built engine (tests, embedding)."""
    app = web.Application(
        client_max_size=config.max_request_bytes,
        middlewares=[connection_middleware, api_middleware],
    )
    app[STATE] = ServerState(config)
    if engine is not None:
        app[PRESET_ENGINE] = engine
    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(on_shutdown)
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/cache/prefixes", register_prefix)
    app.router.add_get("/v1/ws", websocket_handler)
    app.router.add_get("/", index)
    if STATIC_DIR.is_dir():
        app.router.add_static("/static/", STATIC_DIR)
    return app


def run_server(config: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, on uvloop when available."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    app = create_app(config)
    url = f"http://{config.host}:{config.port}/"

    def announce(_: str) -> None:
        print(
            f"pagestream serving on {url} (OpenAI API at {url}v1, chat page at {url})", flush=True
        )

    web.run_app(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout + 5.0,
        print=announce,
        access_log=logging.getLogger("pagestream.access") if config.access_log else None,
        access_log_class=AccessLogger,
    )
