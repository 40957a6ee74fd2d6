"""What the OpenAI chat and completion routes share: `ServingBase` (queueing a request's
prompts, bounded SSE writes, usage and token text, the stream's error and end events) and
`merge`, which interleaves the outputs of a multi-prompt request as they come."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from aiohttp import web

from scheduler.contract import TokenLogprobs
from scheduler.engine_core import DuplicateRequestId, EngineDeadError
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import AsyncEngine, EmbeddingOnly, MaxTokensTooLarge, RequestFailed
from service.beam_search import BeamSearchParams, start_searches
from service.completion_extras import token_labels
from service.generation_defaults import NONE as NO_DEFAULTS
from service.generation_defaults import GenerationDefaults
from service.http_util import (
    SPEC_FIELD,
    SSE_HEADERS,
    SlowClient,
    error_body,
    limit_send_buffer,
    wait_drained,
    write_cannot_wait,
    write_now,
)
from service.limits import Limits
from service.outputs import RequestOutput, Submitted
from service.prep import Preprocessor
from service.protocol import BadRequest
from service.protocol_openai import StreamOptions
from service.reasoning import ReasoningParser
from service.request_ids import TENANT, take_claim
from service.resume import STREAM_LOG, SSESink, StreamLog, StreamRegistry, follow
from service.structured import GrammarError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _refusals(max_tokens_field: str, prompt_field: str) -> Iterator[None]:
    """What the engine refuses at submission, as the 4xx naming the field."""
    try:
        yield
    except DuplicateRequestId as e:  # never with the ids request_ids.py makes
        raise BadRequest(str(e), "X-Request-Id", status=409) from e
    except EmbeddingOnly as e:
        raise BadRequest(str(e), "model") from e
    except MaxTokensTooLarge as e:  # the message says the field the client sent
        raise BadRequest(str(e).replace("max_tokens", max_tokens_field, 1), max_tokens_field) from e
    except RequestRejected as e:
        raise BadRequest(str(e), prompt_field) from e


async def end_stream(resp: web.StreamResponse) -> None:
    """The chunked stream's terminator.  A client may close as soon as it reads [DONE]
    (it has the whole answer): the closed transport is then no error of the request's."""
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()


@dataclass(slots=True)
class ChoiceDelta:
    """A snapshot of one choice's progress, taken when its generator yields."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


def deltas_of(out: RequestOutput, first: int) -> list[ChoiceDelta]:
    """Snapshots of the choices that moved in `out` (taken as its generator yields:
    it reuses the output); `first`: the choice index of its sample 0."""
    return [
        ChoiceDelta(
            first + o.index,
            o.delta_text,
            o.delta_token_ids,
            o.delta_logprobs,
            o.finish_reason,
            o.stop_reason,
        )
        for o in out.outputs
        if o.delta_text or o.delta_token_ids or o.finish_reason
    ]


async def _snapshots(
    gen: AsyncIterator[RequestOutput], first: int
) -> AsyncIterator[tuple[list[ChoiceDelta], RequestOutput]]:
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for out in gen:
            yield deltas_of(out, first), out


async def merge(
    gens: list[AsyncIterator[RequestOutput]], n: int
) -> AsyncIterator[tuple[list[ChoiceDelta], RequestOutput]]:
    """Interleave the outputs of several prompts' generators as they come, each with
    its snapshots taken as it was yielded (the generator reuses its output)."""
    queue: asyncio.Queue[tuple[list[ChoiceDelta], RequestOutput] | BaseException | None] = (
        asyncio.Queue()
    )

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(_snapshots(g, i * n)) as items:
                async for item in items:
                    queue.put_nowait(item)
        except BaseException as e:  # re-raised in the consumer
            queue.put_nowait(e)
            raise
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# A stream's chunks for one step of one prompt: (the choices that moved, the output).
# A chunk is a dict, or an event already encoded (`sse` of it).
ChunksOf = Callable[[list[ChoiceDelta], RequestOutput], Sequence[dict[str, Any] | bytes]]


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass(slots=True)
class StreamUsage:
    """The token counts of one streamed response, for its usage chunks."""

    prompt_tokens: int
    include: bool  # a last chunk with the totals (stream_options.include_usage)
    continuous: bool  # usage on every chunk (stream_options.continuous_usage_stats)
    completion_tokens: int = 0
    cached: int = 0
    reasoning_tokens: int | None = None  # counted when a reasoning parser runs
    prediction: tuple[int, int] | None = None  # RequestOutput.prediction_tokens

    @classmethod
    def of(cls, prompt_tokens: int, opts: StreamOptions | None, force: bool = False) -> StreamUsage:
        """force: --enable-force-include-usage, the totals whatever the request asks."""
        return cls(
            prompt_tokens,
            include=force or bool(opts and opts.include_usage),
            continuous=bool(opts and opts.continuous_usage_stats),
        )


REQUEST_LOG = logging.getLogger("pagestream.requests")


def log_request(
    rid: str, ids: list[int], text: str | None, params: SamplingParams, max_len: int | None
) -> None:
    """One queued prompt, as vLLM's --enable-log-requests logs it."""
    REQUEST_LOG.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora: %s",
        rid, text[:max_len] if text is not None else None, params, ids[:max_len], params.lora,
    )  # fmt: skip


class ServingBase:
    """State and steps both OpenAI routes use; `OpenAIServing` (service/openai_api.py)
    is this plus the chat and completion routes."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: list[str],
        prep: Preprocessor,
        *,
        send_timeout: float = 30.0,
        on_slow_client: Callable[[], None] | None = None,
        socket_send_buffer: int | None = None,
        max_buffered_bytes: int = 4 << 20,
        prompt_tokens_details: bool = False,
        tool_call_parser: str | None = None,
        reasoning: ReasoningParser | None = None,
        defaults: GenerationDefaults = NO_DEFAULTS,
        streams: StreamRegistry | None = None,
        response_role: str = "assistant",
        tokens_as_ids: bool = False,
        force_usage: bool = False,
        log_requests: bool = False,
        max_log_len: int | None = None,
    ) -> None:
        self.engine = engine
        # --enable-log-requests: each queued prompt (its text and ids, cut to
        # --max-log-len) and its sampling parameters, at INFO on pagestream.requests.
        self.log_requests, self.max_log_len = log_requests, max_log_len
        self.response_role = response_role  # --response-role
        self.tokens_as_ids = tokens_as_ids  # --return-tokens-as-token-ids
        self.force_usage = force_usage  # --enable-force-include-usage
        self.streams = streams  # resumable streams (service/resume.py); None: off
        self.details = prompt_tokens_details
        self.prep = prep
        self.limits: Limits = prep.limits
        self.names = served_model_names
        self.tokenizer = engine.tokenizer
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning  # --reasoning-parser (service/reasoning.py)
        self.defaults = defaults  # the model's sampling (service/generation_defaults.py)
        self._token_text: dict[int, str] = {}
        self.send_timeout = send_timeout
        self.on_slow_client = on_slow_client
        self.socket_send_buffer = socket_send_buffer
        self.max_buffered_bytes = max_buffered_bytes

    def limit_send_buffer(self, request: web.Request) -> None:
        limit_send_buffer(request, self.socket_send_buffer)

    async def write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """One event of the stream `request` answers: into its resume log when it has one
        (service/resume.py: the log writes it to whichever connection follows it), else
        straight to `resp`."""
        stream = request.get(STREAM_LOG)
        if stream is not None:
            await stream.put(data)
        else:
            await self.send(request, resp, data)

    def send_now(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> bool:
        """`send` done at once when it cannot wait (True); False: nothing written."""
        return write_now(request, resp, data, self.max_buffered_bytes)

    async def send(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """One SSE write, bounded: while more than `max_buffered_bytes` wait in the socket's
        buffer the stream pauses (so does its generator: the engine merges what piles up),
        and a client that does not drain it within `send_timeout` seconds loses its
        connection, and the request is aborted (its KV blocks freed)."""
        if write_cannot_wait(request, len(data), self.max_buffered_bytes):
            # Nothing here can wait: skip the timer (a timeout is armed and cancelled
            # per event otherwise, for every stream on every step).
            await resp.write(data)
            return
        try:
            async with asyncio.timeout(self.send_timeout):
                await resp.write(data)
                await wait_drained(request.transport, self.max_buffered_bytes)
        except TimeoutError:
            if self.on_slow_client is not None:
                self.on_slow_client()
            transport = request.transport
            if transport is not None:
                transport.abort()
            raise SlowClient(
                f"the client did not read the stream for {self.send_timeout:g} s"
            ) from None

    async def compile(
        self, request: web.Request, params: SamplingParams, field: str | None
    ) -> None:
        """Compile the request's grammar off the loop; what cannot be compiled is a 400."""
        try:
            await self.engine.compile_grammar(params)
        except GrammarError as e:
            raise BadRequest(str(e), field) from e
        if field is not None:
            request[SPEC_FIELD] = field

    def _usage(
        self,
        prompt: int,
        completion: int,
        cached: int = 0,
        reasoning: int | None = None,
        prediction: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": None,
        }
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        details: dict[str, int] = {}
        if reasoning is not None:
            details["reasoning_tokens"] = reasoning
        if prediction is not None:
            # Predicted-output drafts the model kept, and those it refused (verified and
            # wasted: OpenAI bills such tokens too).
            details["accepted_prediction_tokens"] = prediction[0]
            details["rejected_prediction_tokens"] = prediction[1]
        if details:
            usage["completion_tokens_details"] = details
        return usage

    def stream_usage(self, usage: StreamUsage) -> dict[str, Any]:
        return self._usage(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached,
            usage.reasoning_tokens,
            usage.prediction,
        )

    def check_model(self, model: str | None) -> str | None:
        """404 for a model this server does not serve; the LoRA adapter it names, if any
        (--lora-modules: its requests run the base model with that adapter)."""
        if model is None or model in self.names:
            return None
        if model in self.engine.lora_salts:
            return model
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)

    @staticmethod
    def with_lora(params: SamplingParams, lora: str | None) -> SamplingParams:
        return params if lora is None else msgspec.structs.replace(params, lora=lora)

    def labels(self, req: Any) -> Callable[[int], str] | None:
        """How a response's logprobs name tokens: by id when the request or the server
        (--return-tokens-as-token-ids) asks, else by text (None)."""
        return token_labels(self.tokens_as_ids or bool(req.return_tokens_as_token_ids))

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False)
            self._token_text[tid] = s
        return s

    def _start(
        self,
        request_id: str,
        prompts: list[list[int]],
        texts: list[str | None],
        params: SamplingParams,
        cache_salt: str | None,
        max_tokens_field: str = "max_tokens",
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        priority: int = 0,
        prompt_field: str = "prompt",
        beam: BeamSearchParams | None = None,
    ) -> tuple[list[AsyncIterator[RequestOutput]], list[Submitted]]:
        """Queue every prompt now, all or none (400 for a bad one, EngineOverloaded -> 429
        when the queue is full), so errors come before the response starts.  The caller
        must `release` the Submitted ones in a finally (aborts any never streamed).
        request_id: the engine's (service/request_ids.py); tenant: the API key's hash;
        conversation: the key its KV is pinned under (request_ids.conversation_key)."""
        suffix = len(prompts) > 1
        rids = [f"{request_id}-{i}" if suffix else request_id for i in range(len(prompts))]
        with _refusals(max_tokens_field, prompt_field):
            if beam is not None and params.lora is not None:
                beam = dataclasses.replace(beam, lora=params.lora)
            if beam is not None:  # each prompt's first step queued now (service/beam_search.py)
                searches, subs = start_searches(
                    self.engine, list(zip(rids, prompts, strict=True)), beam, cache_salt,
                    tenant=tenant, priority=priority,
                )  # fmt: skip
                return [s.run() for s in searches], subs
            subs = self.engine.submit_many(
                list(zip(rids, prompts, strict=True)), params, cache_salt,
                tenant=tenant, conversation=conversation, priority=priority,
            )  # fmt: skip
        if self.log_requests:
            for rid, ids, text in zip(rids, prompts, texts, strict=True):
                log_request(rid, ids, text, params, self.max_log_len)
        gens = [
            self.engine.generate(text or "", submitted=sub)
            for sub, text in zip(subs, texts, strict=True)
        ]
        return gens, subs

    def _release(self, subs: list[Submitted]) -> None:
        for sub in subs:
            self.engine.release(sub)

    # ---------------------------------------------------------------- streams
    async def streamed(
        self,
        request: web.Request,
        rid: str,
        subs: list[Submitted],
        stream: Coroutine[Any, Any, web.StreamResponse],
        started: Callable[[StreamLog], None] | None = None,
    ) -> web.StreamResponse:
        """Serve `stream` (a route's `_..._stream`) so that it outlives its connection:
        it runs as its own task writing into a resume log keyed by the response id, and
        this connection follows the log (service/resume.py).  The producer takes `subs`
        over (the caller's list is emptied: its finally must not abort them).  Without
        resume (--resume-grace 0) the stream runs here and ends with its connection.
        `started(log)`: told once the producer runs (a background response's keeps on
        whether or not anyone reads it)."""
        log = None if self.streams is None else self.streams.open(request.get(TENANT), "sse", rid)
        if log is None:
            return await stream
        assert self.streams is not None
        log.claim = take_claim(request)
        request[STREAM_LOG] = log
        owned = list(subs)
        subs.clear()
        self.streams.run(log, stream, lambda: self._release(owned))
        if started is not None:
            started(log)
        resp = await self._prepare_sse(request)
        if await follow(log, self._sink(request, resp), 0):
            await end_stream(resp)
        return resp

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/streams/{id}: the events after Last-Event-ID, then the live tail."""
        if self.streams is None or not self.streams.enabled:
            raise BadRequest("streams are not resumable here (--resume-grace 0)", "id", 404)
        log, after = self.streams.lookup_sse(request, request.get(TENANT))
        resp = await self._prepare_sse(request)
        await self.send(request, resp, self.streams.retry_field())
        if await follow(log, self._sink(request, resp), after):
            await end_stream(resp)
        return resp

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        stream = request.get(STREAM_LOG)
        if stream is not None:
            return stream  # type: ignore[return-value]  # written to as a response is
        return await self._prepare_sse(request)

    async def _prepare_sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        self.limit_send_buffer(request)
        await resp.prepare(request)
        return resp

    def _sink(self, request: web.Request, resp: web.StreamResponse) -> SSESink:
        """`resp` as the connection following a resume log."""
        return SSESink(
            functools.partial(self.send, request, resp),
            functools.partial(self.send_now, request, resp),
        )

    def _chunk(
        self, base: dict[str, Any], choices: list[dict[str, Any]], usage: StreamUsage
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {**base, "choices": choices}
        if usage.continuous:
            chunk["usage"] = self.stream_usage(usage)
        return chunk

    async def _run_stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        gens: list[AsyncIterator[RequestOutput]],
        n: int,
        chunks_of: ChunksOf,
        base: dict[str, Any],
        usage: StreamUsage,
        *,
        tail: Callable[[], Awaitable[list[bytes]]] | None = None,
        error_event: Callable[[bytes], list[bytes]] | None = None,
    ) -> web.StreamResponse:
        """Write the chunks of each output (`chunks_of`) as events, then the usage totals
        if asked, then [DONE]; or, given `tail`, the events it returns instead (a stream
        that ends on its own event).  A failure after the headers went out becomes an error
        event (`error_event` turns the error body into another API's events).  One prompt's generator is read here directly (a generator layer between
        would cost every stream a hop every step); several prompts' through `merge`.
        Closed explicitly all the way down: a stream that stops early (a client gone)
        aborts its requests now, not when the generators are garbage collected."""
        stream = request.get(STREAM_LOG)
        one = len(gens) == 1
        try:
            async with contextlib.aclosing(gens[0] if one else merge(gens, n)) as items:  # type: ignore[type-var]
                async for item in items:
                    deltas, out = (deltas_of(item, 0), item) if one else item
                    for chunk in chunks_of(deltas, out):
                        data = chunk if type(chunk) is bytes else sse(chunk)  # type: ignore[arg-type]
                        # Most events are written at once, without a coroutine between
                        # here and the transport (every stream, every step).
                        if stream is not None:
                            pending = stream.offer(data)
                            if pending is not None:
                                await pending
                        elif not self.send_now(request, resp, data):
                            await self.send(request, resp, data)
            for data in await tail() if tail is not None else ():
                await self.write(request, resp, data)
        except SlowClient:
            return resp  # dropped; the request was aborted as its generator closed
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            return await self._stream_error(request, resp, e, error_event)
        if tail is None:
            if usage.include:
                totals = self.stream_usage(usage)
                await self.write(request, resp, sse({**base, "choices": [], "usage": totals}))
            await self.write(request, resp, b"data: [DONE]\n\n")
        await end_stream(resp)
        return resp

    async def _stream_error(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        e: Exception,
        error_event: Callable[[bytes], list[bytes]] | None = None,
    ) -> web.StreamResponse:
        """A stream that failed after its headers went out: an error event in OpenAI's
        shape, then [DONE]."""
        if isinstance(e, RequestRejected):
            body = error_body(str(e), 400)
        elif isinstance(e, EngineDeadError):
            body = error_body(str(e), 503)
        elif isinstance(e, RequestFailed):
            param = request.get(SPEC_FIELD) if e.status < 500 else None
            body = error_body(f"generation failed: {e}", e.status, param, "request_failed")
        else:
            log.exception("stream failed")
            body = error_body(f"generation failed: {e}", 500)
        if error_event is not None:
            for data in error_event(body):
                await self.write(request, resp, data)
        else:
            await self.write(request, resp, b"data: " + body + b"\n\n")
            await self.write(request, resp, b"data: [DONE]\n\n")
        await end_stream(resp)
        return resp
