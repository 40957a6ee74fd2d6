"""The aiohttp application: routes, auth, limits, engine lifecycle and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
from aiohttp import WSCloseCode, web

from scheduler.engine_core import (
    DuplicateRequestId,
    EngineDeadError,
    EngineOverloaded,
    StepInfo,
)
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service import cors, utility_api
from service.async_engine import AsyncEngine, RequestFailed, rss_bytes
from service.cors import cors_middleware
from service.generation_defaults import GenerationDefaults
from service.http_util import SPEC_FIELD, TENANT_SALT, error_response, json_response, salted
from service.metrics import Metrics
from service.openai_api import OpenAIServing
from service.openapi import openapi_document
from service.prep import Preprocessor
from service.protocol import BadRequest, check_messages, decode_prefix
from service.reasoning import ReasoningParser
from service.request_ids import LIVE_IDS, TENANT, echo_request_id, release_request_id
from service.response_store import make_response_store
from service.security import AccessLogger, host_refusal, server_ssl_context
from service.state import STATE, ServerConfig, ServerState
from service.ws import websocket_handler

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    # Anthropic's SDK (and Claude Code given ANTHROPIC_API_KEY) sends the key here.
    if (key := request.headers.get("x-api-key")) is not None:
        return key.strip()
    # Browsers cannot set headers on a WebSocket: accept the key as a query parameter there.
    if request.path == "/v1/ws":
        return request.query.get("api_key")
    return None


def _authorized(state: ServerState, given: str | None) -> tuple[bool, str | None, str | None]:
    """(key accepted, that key's salt, its tenant id).  Every key is compared, so the time
    taken does not say which one nearly matched."""
    ok, salt, tenant = False, None, None
    raw = (given or "").encode()
    for key, key_salt_, key_tenant_ in state.keys:
        if hmac.compare_digest(raw, key):
            ok, salt, tenant = True, key_salt_, key_tenant_
    return ok, salt, tenant


@web.middleware
async def host_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """DNS rebinding: answer only Hosts on the allow-list (`--allowed-hosts`), before
    anything else runs (the WebSocket's same-origin check included)."""
    state = request.app[STATE]
    refused = host_refusal(request, state.allowed_hosts, state.trusted_proxies)
    if refused is not None:
        return error_response(
            f"the {refused} header names a host this server does not answer for "
            "(see --allowed-hosts)",
            421,
            refused,
            code="host_not_allowed",
        )
    return await handler(request)


_KEYED_PATHS = ("/score", "/rerank", "/classify", "/pooling", "/invocations")


def _needs_key(state: ServerState, path: str) -> bool:
    if path.startswith(("/v1", "/v2", "/debug")) or path in _KEYED_PATHS:
        return True
    return path in ("/tokenize", "/detokenize") and not state.config.public_tokenize


@web.middleware
async def connection_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Count requests in progress per connection (see ServerState.connections)."""
    state = request.app[STATE]
    conns = state.connections
    proto = request.protocol
    if proto not in conns and len(conns) >= state.connections_prune_at:
        # Closed connections stay here until pruned (a protocol takes no weak reference,
        # and aiohttp offers no close hook), each holding its parser and buffers: prune
        # whenever the table doubles past what was live last time, so what it holds stays
        # proportional to the connections really open, and once traffic stops
        # (_trim_when_idle), so an idle server holds none (a soak test measures it).
        prune_closed_connections(state)
    conns[proto] = conns.get(proto, 0) + 1
    try:
        return await handler(request)
    finally:
        conns[proto] -= 1


def prune_closed_connections(state: ServerState) -> None:
    conns = state.connections
    for p in [p for p, n in conns.items() if n == 0 and p.transport is None]:
        del conns[p]
    state.connections_prune_at = 2 * len(conns) + 64


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
    """API key check for /v1, /debug, /tokenize and /detokenize (unless --public-tokenize),
    and OpenAI-shaped errors for everything that goes wrong (with Anthropic's
    `"type": "error"` on top for its Messages routes)."""
    resp = await _api(request, handler)
    anthropic = request.path.startswith("/v1/messages")
    body = resp.body if anthropic and isinstance(resp, web.Response) else None
    if resp.status >= 400 and isinstance(body, bytes):
        with contextlib.suppress(ValueError):
            err = orjson.loads(body)
            if isinstance(err, dict) and "error" in err:
                resp.body = orjson.dumps({"type": "error", **err})  # type: ignore[union-attr]
    return resp


# The operator's routes: what they change or show is the whole server's, not one caller's.
_ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _admin_refusal(state: ServerState, request: web.Request) -> web.Response | None:
    """With --admin-api-key, an operator's route takes an admin key and nothing else: 401
    without one, 403 for an API key (every key is compared, as in _authorized)."""
    given = _bearer(request)
    admin = False
    for key in state.admin_keys:
        admin |= hmac.compare_digest((given or "").encode(), key)
    if admin:
        return None
    if _authorized(state, given)[0]:
        return error_response(
            "this route takes an admin key (--admin-api-key), not an API key", 403,
            code="admin_key_required",
        )  # fmt: skip
    return error_response("invalid or missing admin key", 401, code="invalid_api_key")


async def _api(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[STATE]
    if state.admin_keys and request.path.startswith(("/debug", *_ADMIN_ROUTES)):
        refused = _admin_refusal(state, request)
        if refused is not None:
            return refused
    elif state.keys and _needs_key(state, request.path):
        ok, salt, tenant = _authorized(state, _bearer(request))
        if not ok:
            return error_response("invalid or missing API key", 401, code="invalid_api_key")
        if salt is not None:
            request[TENANT_SALT] = salt
        if tenant is not None:
            request[TENANT] = tenant
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
    except EngineOverloaded as e:
        if state.metrics is not None:
            state.metrics.on_rejected("overloaded")
        return error_response(
            str(e), 429, code="server_overloaded",
            headers={"Retry-After": str(max(1, round(e.retry_after)))},
        )  # fmt: skip
    except EngineDeadError as e:
        return error_response(str(e), 503)
    except RequestFailed as e:
        param = request.get(SPEC_FIELD) if e.status < 500 else None
        return error_response(str(e), e.status, param, code="request_failed")
    except DuplicateRequestId as e:
        return error_response(str(e), 409, "X-Request-Id")
    except RequestRejected as e:  # the engine refused the request as it was queued
        return error_response(str(e), 400)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal server error", 500)
    finally:
        release_request_id(request)


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Load the model in the background (so /health answers 503 meanwhile), run the engine,
    and stop it on cleanup."""
    state = app[STATE]
    task = asyncio.create_task(_load_engine(app, state))
    trimmer = asyncio.create_task(_trim_when_idle(state))
    yield
    for t in (task, trimmer):
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
    if state.engine is not None:
        await state.engine.shutdown()
    if state.prep is not None:
        await state.prep.close()
    if state.serving is not None:
        await state.serving.store.close()


async def _load_engine(app: web.Application, state: ServerState) -> None:
    try:
        engine = app.get(PRESET_ENGINE)
        if engine is None:
            engine = await asyncio.to_thread(AsyncEngine.from_config, state.config.engine)
        given = state.config.served_model_name
        names = [given] if isinstance(given, str) else list(given or [engine.model_name])
        if str(engine.model_dir) not in names:
            names.append(str(engine.model_dir))
        # Before the render pool starts: its worker processes take a copy of the templates.
        engine.tokenizer.use_chat_template(
            state.config.chat_template, state.config.chat_template_content_format
        )
        metrics = _engine_metrics(engine, names[0])
        metrics.watch_streams(state.streams)
        if hasattr(engine.core, "ranks"):  # data parallelism: each rank's load
            metrics.watch_ranks(engine.core)
        waiting = engine.config.scheduler.max_waiting_requests or 1024
        prep = Preprocessor(engine, state.config.limits, waiting)
        prep.on_truncated = metrics.on_truncated
        state.prep = prep  # before the first await: cleanup must find it
        await prep.start()
        await engine.start()
        task = engine.core._task
        assert task is not None
        task.add_done_callback(lambda t: _on_engine_done(state, t))
        state.metrics = metrics
        state.serving = _openai_serving(state, engine, names, prep, metrics)
        metrics.watch_responses(state.serving)
        state.engine = engine
        if state.config.exit_on_engine_failure:  # this process is the server (run_server)
            _freeze_startup_heap()
        log.info("model loaded: %s (max_model_len %d)", engine.model_dir, engine.max_model_len)
    except Exception as e:
        state.load_error = e
        log.exception("model failed to load")


def _freeze_startup_heap() -> None:
    """Leave what start-up built (modules, the engine, its block pool: a few hundred
    thousand objects that live as long as the server) out of the cycle collector's
    oldest generation, as vLLM's API server does: every full collection walked them all,
    tens of ms of CPU each, every second or two at 256 streams.  Only in a
    process that is the server: tests that start servers in their own process would
    freeze their own objects too."""
    gc.collect()
    gc.freeze()


def _engine_metrics(engine: AsyncEngine, name: str) -> Metrics:
    """Prometheus metrics fed by the engine's step and request hooks."""
    metrics = Metrics(name)
    metrics.set_kv_cache_info(engine.runner)

    def on_step(info: StepInfo) -> None:
        stats = info.stats if info.stats is not None else engine.scheduler.stats()
        metrics.on_step(info, stats)
        if engine.tier is not None:
            metrics.on_tier(engine.tier.name, engine.tier.stats, engine.tier.healthy)

    engine.add_step_hook(on_step)
    engine.request_hooks.append(metrics.on_request_done)
    return metrics


def _openai_serving(
    state: ServerState,
    engine: AsyncEngine,
    names: list[str],
    prep: Preprocessor,
    metrics: Metrics,
) -> OpenAIServing:
    serving = OpenAIServing(
        engine,
        names,
        prep,
        send_timeout=state.config.send_timeout,
        on_slow_client=metrics.slow_clients.labels(names[0], "sse").inc,
        socket_send_buffer=state.config.socket_send_buffer,
        max_buffered_bytes=state.config.max_buffered_bytes,
        prompt_tokens_details=state.config.enable_prompt_tokens_details,
        tool_call_parser=state.config.tool_call_parser,
        reasoning=(
            ReasoningParser.load(state.config.reasoning_parser, engine.tokenizer)
            if state.config.reasoning_parser
            else None
        ),
        defaults=_generation_defaults(state.config, engine),
        streams=state.streams,
        response_role=state.config.response_role,
        tokens_as_ids=state.config.return_tokens_as_token_ids,
        force_usage=state.config.enable_force_include_usage,
        log_requests=state.config.enable_log_requests,
        max_log_len=state.config.max_log_len,
    )
    serving.pooler_config = state.config.pooler_config
    cfg = state.config
    serving.store = make_response_store(
        cfg.response_store,
        cfg.engine.prefix_tier.redis_url,
        cfg.max_stored_responses,
        cfg.max_stored_response_bytes,
    )
    return serving


def _generation_defaults(config: ServerConfig, engine: AsyncEngine) -> GenerationDefaults:
    defaults = GenerationDefaults.load(
        config.generation_config, engine.model_dir, config.override_generation_config
    )
    if defaults:
        # As vLLM says it: a client that expects the API's neutral defaults should know.
        log.info("sampling defaults for fields a request leaves out: %s", defaults.describe())
    return defaults


PRESET_ENGINE = web.AppKey("pagestream_preset_engine", AsyncEngine)

TRIM_IDLE_SECONDS = 2.0  # how long the engine must have been idle before a trim


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


async def _trim_when_idle(state: ServerState) -> None:
    """After a burst of traffic, hand the allocator's free pages back to the OS once the
    engine has gone idle.  A storm's steps allocate and free many short-lived tensors and
    buffers across threads; glibc keeps the freed memory in its heaps, so without this
    RSS ratchets up to each burst's high-water mark (the soak test measures it).  The
    burst's closed connections are dropped first, so their buffers are among what goes
    back."""
    trim = _malloc_trim()
    trimmed_at = -1
    while True:
        await asyncio.sleep(TRIM_IDLE_SECONDS)
        engine = state.engine
        if engine is None or state.inflight or not engine.core.idle.is_set():
            continue
        prune_closed_connections(state)  # a few idle entries: cheap every tick
        steps = engine.core.num_steps
        if steps != trimmed_at and trim is not None:
            trimmed_at = steps
            await asyncio.to_thread(trim, 0)


ENGINE_FAILURE_EXIT = 70  # EX_SOFTWARE: the engine failed; a supervisor should restart us
FATAL_FLUSH_SECONDS = 5.0  # how long in-flight handlers get to send their errors


def _on_engine_done(state: ServerState, task: asyncio.Task[None]) -> None:
    if task.cancelled() or task.exception() is None:
        return  # a normal stop (shutdown)
    state.fatal_task = asyncio.get_running_loop().create_task(_engine_failed(state))


async def _engine_failed(state: ServerState) -> None:
    """The engine died: every in-flight stream has already been failed with an error;
    let the handlers deliver those errors, close the sockets with 1011, then (under
    `pagestream serve`) end the process with a non-zero exit so it gets restarted.
    /health answers 503 from the moment the engine died."""
    log.critical("engine failed: %s", state.engine.dead if state.engine else "?")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.idle.wait(), FATAL_FLUSH_SECONDS)
    for ws in list(state.websockets):
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"engine failed")
    if state.config.exit_on_engine_failure:
        state.exit_code = ENGINE_FAILURE_EXIT
        log.critical("exiting with code %d so the supervisor restarts the server", state.exit_code)
        signal.raise_signal(signal.SIGTERM)  # aiohttp's graceful shutdown, then exit


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


async def _generation(request: web.Request, route: str) -> web.StreamResponse:
    serving = _serving(request)
    body = await request.read()
    state = request.app[STATE]
    state.inflight_inc()  # counted so SIGTERM can wait for it to finish
    try:
        if route == "chat":
            return await serving.chat(request, body)
        if route == "responses":
            return await serving.responses(request, body)
        if route == "messages":
            return await serving.messages(request, body)
        if route == "embeddings":
            return await serving.embeddings(request, body)
        if route == "score":
            return await serving.score(request, body)
        if route == "rerank":
            return await serving.rerank(request, body)
        if route == "classify":
            return await serving.classify(request, body)
        if route == "pooling":
            return await serving.pooling(request, body)
        return await serving.completions(request, body)
    finally:
        state.inflight_dec()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "chat")


class _InvocationKeys(msgspec.Struct):
    """The keys /invocations routes by; their values are not decoded here (an absent
    key's Raw is empty)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    query: msgspec.Raw = msgspec.Raw()
    queries: msgspec.Raw = msgspec.Raw()
    text_1: msgspec.Raw = msgspec.Raw()


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's (and vLLM's) one route for every task, told apart by the body: `messages`
    is a chat completion, `prompt` a completion, `input` an embedding (a classifier's:
    classify), `query` a rerank, `queries` or `text_1` a score."""
    try:
        keys = msgspec.json.decode(await request.read(), type=_InvocationKeys)
    except msgspec.DecodeError as e:
        return error_response(f"the body is not a JSON object: {e}", 400)
    if keys.messages:
        route = "chat"
    elif keys.prompt:
        route = "completions"
    elif keys.input:
        serving = _serving(request)
        route = "classify" if serving.pooler.classifier else "embeddings"
    elif keys.query:
        route = "rerank"
    elif keys.queries or keys.text_1:
        route = "score"
    else:
        return error_response(
            "/invocations takes a chat (messages), completion (prompt), embedding or "
            "classification (input), rerank (query) or score (queries / text_1) body",
            400,
            "messages",
        )
    return await _generation(request, route)


async def ping(request: web.Request) -> web.Response:
    """SageMaker's health check: /health's answer."""
    return await health(request)


async def get_model(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.serving is None:
        return error_response("the model is still loading", 503)
    return await state.serving.model(request, request.match_info["model"])


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "completions")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "responses")


async def messages(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "messages")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "embeddings")


async def score(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "score")


async def rerank(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "rerank")


async def classify(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "classify")


async def pooling(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "pooling")


async def count_message_tokens(request: web.Request) -> web.Response:
    return await _serving(request).count_tokens(request)


async def get_response(request: web.Request) -> web.Response:
    return await _serving(request).get_response(request)


async def response_input_tokens(request: web.Request) -> web.Response:
    return await _serving(request).input_tokens(request)


async def cancel_response(request: web.Request) -> web.Response:
    return await _serving(request).cancel_response(request)


async def response_input_items(request: web.Request) -> web.Response:
    return await _serving(request).input_items(request)


async def delete_response(request: web.Request) -> web.Response:
    return await _serving(request).delete_response(request)


def _conversations(method: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of one /v1/conversations route: `OpenAIServing.<method>`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await getattr(_serving(request), method)(request)  # type: ignore[no-any-return]

    return handler


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/streams/{id}: a stream whose connection dropped, from Last-Event-ID on
    (service/resume.py).  Served while draining too: draining waits for such streams."""
    serving = request.app[STATE].serving
    if serving is None:
        return error_response("the model is still loading", 503)
    return await serving.resume(request)


async def register_prefix(request: web.Request) -> web.StreamResponse:
    """POST /v1/cache/prefixes {"messages": [...]} or {"prompt": str | [ids]}: compute a
    shared prefix (typically a system prompt) and publish its KV to the shared tier now,
    so every replica can load it instead of recomputing."""
    serving = _serving(request)
    body = await request.read()
    state = request.app[STATE]
    state.inflight_inc()  # it runs a prefill: SIGTERM waits for it like any generation
    try:
        return await _register_prefix(request, serving, decode_prefix(body))
    finally:
        state.inflight_dec()


async def _register_prefix(
    request: web.Request, serving: OpenAIServing, req
) -> web.Response:  # req: PrefixRegistration
    engine = serving.engine
    serving.check_model(req.model)
    if (req.messages is None) == (req.prompt is None):
        raise BadRequest("give exactly one of messages or prompt", "messages")
    if req.messages is not None:
        check_messages(req.messages)
        ids = await serving.prep.chat_ids(
            [m.as_template_dict() for m in req.messages], add_generation_prompt=False
        )
    else:
        (ids,) = await serving.prep.prompt_ids([req.prompt])
    try:
        engine.resolve_max_tokens(len(ids), SamplingParams(max_tokens=1))
    except RequestRejected as e:
        raise BadRequest(str(e), "prompt") from e
    result = await engine.register_prefix(
        ids,
        cache_salt=salted(request.get(TENANT_SALT), req.cache_salt),
        tenant=request.get(TENANT),
    )
    if not request.app[STATE].config.enable_prompt_tokens_details:
        del result["cached_tokens"]  # an oracle for what others sent, like usage's
    result["shared_tier"] = engine.tier.name if engine.tier is not None else None
    return json_response(result)


async def tokenize(request: web.Request) -> web.StreamResponse:
    return await utility_api.tokenize(_serving(request), request)


async def detokenize(request: web.Request) -> web.StreamResponse:
    return await utility_api.detokenize(_serving(request), request)


async def load_lora_adapter(request: web.Request) -> web.StreamResponse:
    return await utility_api.load_lora(_serving(request), request)


async def unload_lora_adapter(request: web.Request) -> web.StreamResponse:
    return await utility_api.unload_lora(_serving(request), request)


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
    if engine is not None:
        stats, used = await engine.scheduler_stats()
        state.metrics.refresh(stats, used, engine.hook_errors)
        if engine.tier is not None:
            # The tier's writer publishes between steps; an idle replica has no step to
            # copy its counters on, so they are brought up to date at scrape time too.
            tier = engine.tier
            state.metrics.on_tier(tier.name, tier.stats, tier.healthy)
    return web.Response(
        body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


async def debug_state(request: web.Request) -> web.Response:
    """What is running, waiting and held, for operators and the reliability tests:
    after a storm every count here but the baselines must be back to zero."""
    state = request.app[STATE]
    engine = state.engine
    body: dict[str, object] = {
        "inflight": state.inflight,
        "websockets": len(state.websockets),
        "asyncio_tasks": len(asyncio.all_tasks()),
        "rss_bytes": rss_bytes(),
    }
    if (
        request.query.get("gc") == "1"
    ):  # a full gc pass: costly with many objects, so only on request
        gc.collect()
        # Frozen ones too (_freeze_startup_heap): a start-up object freed and replaced by
        # a new one is no growth.
        body["gc_objects"] = len(gc.get_objects()) + gc.get_freeze_count()
    if engine is not None:
        counts = await engine.debug_counts()
        engine_rss = counts.pop("process_rss_bytes", None)
        body |= counts
        if engine.in_child:
            body["engine_rss_bytes"] = engine_rss  # the child's memory: rss_bytes is ours
            # This side of the boundary: streams still delivered into here, and adds the
            # engine's process has not taken (a leak on either side shows).
            core = engine.core
            body["server_streams"] = len(core.streams)
            body["server_inbox"] = len(core._inbox)  # type: ignore[union-attr]
    return json_response(body)


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document(request.app[STATE].config.root_path))


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def create_app(config: ServerConfig, engine: AsyncEngine | None = None) -> web.Application:
    """The application; pass `engine` to serve an already-built engine (tests, embedding)."""
    policy = cors.CorsPolicy.build(
        config.allowed_origins, config.allowed_methods, config.allowed_headers,
        config.allow_credentials,
    )  # fmt: skip
    # No origin allowed (the default): no CORS middleware in every request's path.
    preflight = [cors_middleware] if policy is not None else []
    app = web.Application(
        client_max_size=config.max_request_bytes,
        middlewares=[host_middleware, *preflight, connection_middleware, api_middleware],
    )
    app[STATE] = ServerState(config)
    cors.install(app, policy)
    app[LIVE_IDS] = app[STATE].request_ids
    if engine is not None:
        app[PRESET_ENGINE] = engine
    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(on_shutdown)
    app.on_response_prepare.append(echo_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/version", utility_api.version_handler)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/invocations", invocations)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/ping", ping)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_message_tokens)
    app.router.add_post("/v1/embeddings", embeddings)
    # vLLM's paths for the same two routes (Jina's and Cohere's clients use /v1 and /v2).
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    for path in ("/classify", "/v1/classify"):
        app.router.add_post(path, classify)
    for path in ("/pooling", "/v1/pooling"):
        app.router.add_post(path, pooling)
    app.router.add_post("/v1/responses/input_tokens", response_input_tokens)
    app.router.add_get("/v1/responses/{id}", get_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)
    app.router.add_get("/v1/responses/{id}/input_items", response_input_items)
    app.router.add_post("/v1/responses/{id}/cancel", cancel_response)
    for method, path, name in (
        ("POST", "/v1/conversations", "create_conversation"),
        ("GET", "/v1/conversations/{id}", "get_conversation"),
        ("POST", "/v1/conversations/{id}", "update_conversation"),
        ("DELETE", "/v1/conversations/{id}", "delete_conversation"),
        ("POST", "/v1/conversations/{id}/items", "create_items"),
        ("GET", "/v1/conversations/{id}/items", "list_items"),
        ("GET", "/v1/conversations/{id}/items/{item_id}", "get_item"),
        ("DELETE", "/v1/conversations/{id}/items/{item_id}", "delete_item"),
    ):
        app.router.add_route(method, path, _conversations(name))
    app.router.add_get("/v1/streams/{id}", resume_stream)
    app.router.add_post("/v1/cache/prefixes", register_prefix)
    if config.engine.model.allow_runtime_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/v1/ws", websocket_handler)
    if config.enable_debug_routes:
        app.router.add_get("/debug/state", debug_state)
    if config.openapi_docs:
        app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/", index)
    if STATIC_DIR.is_dir():
        app.router.add_static("/static/", STATIC_DIR)
    return app


def run_server(config: ServerConfig, engine: AsyncEngine | None = None) -> int:
    """Serve until SIGTERM/SIGINT, on uvloop when available; returns the exit code
    (non-zero after an engine failure).  `engine`: one built already (bench.host_server's,
    around a stand-in model)."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    app = create_app(config, engine)
    tls = server_ssl_context(config)
    if config.uds:
        where = f"unix:{config.uds}"
        url = "http://localhost/"
    else:
        where = url = f"{'https' if tls else 'http'}://{config.host}:{config.port}/"

    def announce(_: str) -> None:
        print(
            f"pagestream serving on {where} (OpenAI API at {url}v1, chat page at {url})",
            flush=True,
        )

    config.exit_on_engine_failure = True
    where_kw: dict[str, Any] = (
        {"path": config.uds} if config.uds else {"host": config.host, "port": config.port}
    )
    web.run_app(
        app,
        **where_kw,
        ssl_context=tls,
        loop=loop,
        handler_cancellation=True,
        shutdown_timeout=config.shutdown_timeout + 5.0,
        print=announce,
        access_log=logging.getLogger("pagestream.access") if config.access_log else None,
        access_log_class=AccessLogger,
    )
    return app[STATE].exit_code
