"""The aiohttp application: routes, auth, limits, engine lifecycle and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import orjson
from aiohttp import WSCloseCode, web

from scheduler.engine_core import EngineDeadError, StepInfo
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import AsyncEngine, EngineArgs
from service.metrics import Metrics
from service.openai_api import OpenAIServing, error_response, json_response
from service.protocol import BadRequest, decode_prefix
from service.ws import websocket_handler

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


@dataclass
class ServerConfig:
    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_request_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0


class ServerState:
    """What handlers share; owned by the event loop thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: Metrics | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.websockets: set[web.WebSocketResponse] = set()
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._conn_ids = itertools.count(1)
        self.started = time.time()

    def next_conn_id(self) -> str:
        return str(next(self._conn_ids))

    def inflight_inc(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def inflight_dec(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None and not self.draining


STATE = web.AppKey("pagestream_state", ServerState)


def check_origin(request: web.Request, allowed: list[str]) -> bool:
    """Refuse cross-site WebSocket hijacking: a browser always sends Origin; it must be this
    server's own origin or one the operator allowed.  Non-browser clients send none."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed or origin in allowed:
        return True
    host = urlsplit(origin).netloc
    return host.lower() == request.host.lower()


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    # Browsers cannot set headers on a WebSocket: accept the key as a query parameter there.
    if request.path == "/v1/ws":
        return request.query.get("api_key")
    return None


@web.middleware
async def api_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """API key check for /v1, and OpenAI-shaped errors for everything that goes wrong."""
    state = request.app[STATE]
    key = state.config.api_key
    if key and request.path.startswith("/v1"):
        given = _bearer(request)
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            return error_response("invalid or missing API key", 401, code="invalid_api_key")
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
            metrics.set_kv_cache_info(engine.runner)

            def on_step(info: StepInfo) -> None:
                metrics.on_step(info, engine.scheduler.stats())
                if engine.tier is not None:
                    metrics.on_tier(engine.tier.name, engine.tier.stats, engine.tier.healthy)

            engine.add_step_hook(on_step)
            engine.request_hooks.append(metrics.on_request_done)
            await engine.start()
            state.metrics = metrics
            state.serving = OpenAIServing(engine, names)
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
    result = await engine.register_prefix(ids, cache_salt=req.cache_salt)
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


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics is None:
        return web.Response(text="", content_type="text/plain")
    return web.Response(
        body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def create_app(config: ServerConfig, engine: AsyncEngine | None = None) -> web.Application:
    """The application; pass `engine` to serve an already-built engine (tests, embedding)."""
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[api_middleware])
    app[STATE] = ServerState(config)
    if engine is not None:
        app[PRESET_ENGINE] = engine
    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(on_shutdown)
    app.router.add_get("/health", health)
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
        access_log=None,
    )
