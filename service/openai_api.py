"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Streaming responses are server-sent events.  The request is aborted in the engine the
moment its client goes away: the server runs with handler cancellation, so the handler
is cancelled on disconnect and the generator's finally block sends the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
from aiohttp import web

from scheduler.contract import TokenLogprobs
from scheduler.engine_core import EngineDeadError
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import (
    AsyncEngine,
    MaxTokensTooLarge,
    RequestFailed,
    RequestOutput,
    Submitted,
)
from service.completion_extras import best_of, echo_logprobs, join_logprobs, prompt_logprobs_json
from service.limits import Limits
from service.prep import Preprocessor
from service.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    check_messages,
    decode_chat,
    decode_completion,
)
from service.request_ids import request_id
from service.structured import GrammarError
from service.tool_calls import (
    Mode,
    ToolStream,
    constraint,
    make_parser,
    merge_delta,
    parse_output,
    template_tools,
    tool_mode,
)


class SlowClient(ConnectionResetError):
    """An SSE client stopped reading; its connection has been dropped."""


log = logging.getLogger(__name__)


async def wait_drained(transport: asyncio.BaseTransport | None, limit: int) -> None:
    """Wait until at most `limit` bytes wait in the transport's buffer.  (aiohttp drains
    only every 64 KiB written, and only above asyncio's high-water mark; this bound is
    the operator's.)  Polls: it only runs for a client that is already behind."""
    if transport is None:
        return
    while transport.get_write_buffer_size() > limit:  # type: ignore[attr-defined]
        if transport.is_closing():
            raise ConnectionResetError("the client went away")
        await asyncio.sleep(0.05)


def limit_send_buffer(request: web.Request, nbytes: int | None) -> None:
    """Cap the kernel send buffer of a streaming connection (None: the OS autotunes it,
    up to net.ipv4.tcp_wmem's maximum, 4 MiB by default).  What a stalled reader can make
    the server hold is this plus the transport's and the outbox's bounds."""
    if not nbytes or request.transport is None:
        return
    sock = request.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)


SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


# Request key under which the auth middleware leaves the caller's API-key salt.
TENANT_SALT = web.RequestKey("pagestream_tenant_salt", str)


def salted(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's prefix blocks are hashed under: its API key's (None when the
    operator shares the cache or has no keys), then the client's own `cache_salt` inside
    it, so no client-chosen salt can reach another key's blocks."""
    if tenant is None:
        return cache_salt
    return f"{tenant}/{cache_salt}" if cache_salt else tenant


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> bytes:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    )


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=error_body(message, status, param, code),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def json_response(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


@dataclass(slots=True)
class ChoiceDelta:
    """A snapshot of one choice's progress, taken when its generator yields."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


async def _snapshots(
    gen: AsyncIterator[RequestOutput], prompt_index: int, n: int
) -> AsyncIterator[tuple[list[ChoiceDelta], RequestOutput]]:
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for out in gen:
            deltas = [
                ChoiceDelta(
                    prompt_index * n + o.index,
                    o.delta_text,
                    o.delta_token_ids,
                    o.delta_logprobs,
                    o.finish_reason,
                    o.stop_reason,
                )
                for o in out.outputs
                if o.delta_text or o.delta_token_ids or o.finish_reason
            ]
            yield deltas, out


async def merge(
    gens: list[AsyncIterator[RequestOutput]], n: int
) -> AsyncIterator[tuple[list[ChoiceDelta], RequestOutput]]:
    """Interleave the outputs of several prompts' generators as they come."""
    if len(gens) == 1:
        # Closed explicitly all the way down: a consumer that stops early (a client gone)
        # must abort the request now, not when the generators are garbage collected.
        async with contextlib.aclosing(_snapshots(gens[0], 0, n)) as items:
            async for item in items:
                yield item
        return
    queue: asyncio.Queue[tuple[list[ChoiceDelta], RequestOutput] | BaseException | None] = (
        asyncio.Queue()
    )

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(_snapshots(g, i, n)) as items:
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


class OpenAIServing:
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
    ) -> None:
        self.engine = engine
        self.details = prompt_tokens_details
        self.prep = prep
        self.limits: Limits = prep.limits
        self.names = served_model_names
        self.tokenizer = engine.tokenizer
        self.tool_call_parser = tool_call_parser
        self._token_text: dict[int, str] = {}
        self.send_timeout = send_timeout
        self.on_slow_client = on_slow_client
        self.socket_send_buffer = socket_send_buffer
        self.max_buffered_bytes = max_buffered_bytes

    def limit_send_buffer(self, request: web.Request) -> None:
        limit_send_buffer(request, self.socket_send_buffer)

    async def write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """One SSE write, bounded: while more than `max_buffered_bytes` wait in the socket's
        buffer the stream pauses (so does its generator: the engine merges what piles up),
        and a client that does not drain it within `send_timeout` seconds loses its
        connection, and the request is aborted (its KV blocks freed)."""
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

    async def compile(self, params: SamplingParams, field: str | None) -> None:
        """Compile the request's grammar off the loop; what cannot be compiled is a 400."""
        try:
            await self.engine.compile_grammar(params)
        except GrammarError as e:
            raise BadRequest(str(e), field) from e

    # ---------------------------------------------------------------- helpers
    def _usage(self, prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": None,
        }
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False)
            self._token_text[tid] = s
        return s

    def chat_logprobs(self, lps: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            content.append(
                {
                    "token": tok,
                    "logprob": lp.logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(i)),
                            "logprob": v,
                            "bytes": list(t.encode()),
                        }
                        for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                }
            )
        return {"content": content}

    def completion_logprobs(
        self, lps: list[TokenLogprobs] | None, offset: int
    ) -> tuple[dict[str, Any] | None, int]:
        if lps is None:
            return None, offset
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            tokens.append(tok)
            token_lps.append(lp.logprob)
            tops.append(
                {
                    self.token_text(i): v
                    for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
            offsets.append(offset)
            offset += len(tok)
        return (
            {
                "tokens": tokens,
                "token_logprobs": token_lps,
                "top_logprobs": tops,
                "text_offset": offsets,
            },
            offset,
        )

    def _start(
        self,
        request_id: str,
        prompts: list[list[int]],
        texts: list[str | None],
        params: SamplingParams,
        cache_salt: str | None,
        max_tokens_field: str = "max_tokens",
    ) -> tuple[list[AsyncIterator[RequestOutput]], list[Submitted]]:
        """Queue every prompt now, all or none (400 for a bad one, EngineOverloaded -> 429
        when the queue is full), so errors come before the response starts.  The caller
        must `release` the Submitted ones in a finally (aborts any never streamed)."""
        suffix = len(prompts) > 1
        rids = [f"{request_id}-{i}" if suffix else request_id for i in range(len(prompts))]
        try:
            subs = self.engine.submit_many(
                list(zip(rids, prompts, strict=True)), params, cache_salt
            )
        except MaxTokensTooLarge as e:
            raise BadRequest(str(e), max_tokens_field) from e
        except RequestRejected as e:
            raise BadRequest(str(e), "messages" if texts == [None] else "prompt") from e
        gens = [
            self.engine.generate(text or "", submitted=sub)
            for sub, text in zip(subs, texts, strict=True)
        ]
        return gens, subs

    def _release(self, subs: list[Submitted]) -> None:
        for sub in subs:
            self.engine.release(sub)

    # ---------------------------------------------------------------- /v1/models
    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": now,
                        "owned_by": "pagestream",
                        "root": str(self.engine.model_dir),
                        "max_model_len": self.engine.max_model_len,
                    }
                    for name in self.names
                ],
            }
        )

    # ---------------------------------------------------------------- chat
    async def chat(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req: ChatCompletionRequest = decode_chat(body)
        self.check_model(req.model)
        check_messages(req.messages)
        params = req.to_sampling_params()
        self.limits.check_sampling(params, logprobs_field="top_logprobs")
        mode = tool_mode(req, self.tool_call_parser)
        spec = req.structured()
        if (tc := constraint(req, mode)) is not None:
            if spec is not None:
                raise BadRequest(
                    f"tool_choice {mode!r} constrains the output; it cannot be combined "
                    f"with {spec[1]}",
                    "tool_choice",
                )
            spec = tc
            params = msgspec.structs.replace(params, structured_outputs=tc[0])
        await self.compile(params, spec[1] if spec else None)
        template, template_field, kwargs = req.template_request()
        ids = await self.prep.chat_ids(
            [m.as_template_dict() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            chat_template=template,
            template_param=template_field,
            kwargs=kwargs,
            tools=template_tools(req) if req.tools else None,
        )
        rid = request_id(request, req.request_id, "chatcmpl")
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        salt = salted(request.get(TENANT_SALT), req.cache_salt)
        gens, subs = self._start(rid, [ids], [None], params, salt, field)
        model = req.model or self.names[0]
        try:
            if req.stream:
                return await self._chat_stream(request, req, rid, model, ids, gens[0], params, mode)
            return await self._chat_full(req, rid, model, ids, gens[0], params, mode)
        finally:
            self._release(subs)

    async def _chat_full(
        self,
        req: ChatCompletionRequest,
        rid: str,
        model: str,
        ids: list[int],
        gen: AsyncIterator[RequestOutput],
        params: SamplingParams,
        mode: Mode | None,
    ) -> web.Response:
        last: RequestOutput | None = None
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            async for out in gen:
                last = out
        assert last is not None
        parser = make_parser(self.tool_call_parser) if mode == "auto" else None
        choices = []
        for o in last.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": o.text}
            finish = o.finish_reason
            if mode is not None:
                content, calls = parse_output(mode, o.text, parser, req)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    if mode != "named" and finish == "stop":
                        finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": o.index,
                "message": message,
                "logprobs": self.chat_logprobs(o.logprobs),
                "finish_reason": finish,
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = o.token_ids
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in last.outputs)
        resp: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self._usage(len(ids), completion, last.num_cached_tokens),
        }
        if req.return_token_ids:
            resp["prompt_token_ids"] = ids
        if req.prompt_logprobs is not None:
            resp["prompt_logprobs"] = prompt_logprobs_json(last.prompt_logprobs, self.token_text)
        return json_response(resp)

    async def _chat_stream(
        self,
        request: web.Request,
        req: ChatCompletionRequest,
        rid: str,
        model: str,
        ids: list[int],
        gen: AsyncIterator[RequestOutput],
        params: SamplingParams,
        mode: Mode | None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        self.limit_send_buffer(request)
        await resp.prepare(request)
        created = int(time.time())
        parser = make_parser(self.tool_call_parser) if mode == "auto" else None
        tools = {i: ToolStream(mode, parser, req) for i in range(params.n)} if mode else {}
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        completion_tokens = 0

        async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk: dict[str, Any] = {**base, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await self.write(request, resp, b"data: " + orjson.dumps(chunk) + b"\n\n")

        first: dict[str, Any] = {"role": "assistant", "content": ""}
        head = [
            {"index": i, "delta": dict(first), "logprobs": None, "finish_reason": None}
            for i in range(params.n)
        ]
        if req.return_token_ids:
            base_first = {**base, "prompt_token_ids": ids}
            await self.write(
                request, resp, b"data: " + orjson.dumps({**base_first, "choices": head}) + b"\n\n"
            )
        else:
            await send(head)
        cached = 0
        try:
            async with contextlib.aclosing(merge([gen], params.n)) as events:
                async for deltas, out in events:
                    cached = out.num_cached_tokens
                    choices = []
                    for d in deltas:
                        completion_tokens += len(d.token_ids)
                        delta: dict[str, Any] = {"content": d.text} if d.text else {}
                        finish = d.finish_reason
                        if (ts := tools.get(d.index)) is not None:
                            delta = ts.feed(d.text)
                            if finish is not None:
                                last, called = ts.finish()
                                delta = merge_delta(delta, last)
                                if called and mode != "named" and finish == "stop":
                                    finish = "tool_calls"
                            if not delta and finish is None and d.logprobs is None:
                                continue  # text held back until the call can be parsed
                        c: dict[str, Any] = {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": self.chat_logprobs(d.logprobs),
                            "finish_reason": finish,
                        }
                        if d.finish_reason is not None:
                            c["stop_reason"] = d.stop_reason
                        if req.return_token_ids:
                            c["token_ids"] = d.token_ids
                        choices.append(c)
                    if choices:
                        usage = (
                            self._usage(len(ids), completion_tokens, cached) if continuous else None
                        )
                        await send(choices, usage)
        except SlowClient:
            return resp  # dropped; the request was aborted as its generator closed
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            return await self._stream_error(request, resp, e)
        if include_usage:
            await send([], self._usage(len(ids), completion_tokens, cached))
        await self.write(request, resp, b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _stream_error(
        self, request: web.Request, resp: web.StreamResponse, e: Exception
    ) -> web.StreamResponse:
        """A stream that failed after its headers went out: an error event in OpenAI's
        shape, then [DONE]."""
        if isinstance(e, RequestRejected):
            body = error_body(str(e), 400)
        elif isinstance(e, EngineDeadError):
            body = error_body(str(e), 503)
        else:
            if not isinstance(e, RequestFailed):
                log.exception("stream failed")
            body = error_body(f"generation failed: {e}", 500)
        await self.write(request, resp, b"data: " + body + b"\n\n")
        await self.write(request, resp, b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---------------------------------------------------------------- completions
    async def completions(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req: CompletionRequest = decode_completion(body)
        self.check_model(req.model)
        params = req.to_sampling_params()
        spec = req.structured()
        await self.compile(params, spec[1] if spec else None)
        raw = req.prompts()
        self.limits.check_prompt_count(len(raw))
        self.limits.check_sampling(params, prompts=len(raw))
        prompts = await self.prep.prompt_ids(raw)
        texts = [p if isinstance(p, str) else None for p in raw]
        rid = request_id(request, req.request_id, "cmpl")
        salt = salted(request.get(TENANT_SALT), req.cache_salt)
        gens, subs = self._start(rid, prompts, texts, params, salt)
        model = req.model or self.names[0]
        # echo: the prompt as text (token-id prompts decoded), before each choice's output.
        echo = [t if t is not None else self.tokenizer.decode(ids) for t, ids in zip(texts, prompts, strict=True)] if req.echo else None  # fmt: skip
        try:
            if req.stream:
                return await self._completion_stream(
                    request, req, rid, model, prompts, gens, params, echo
                )
            return await self._completion_full(req, rid, model, prompts, gens, echo)
        finally:
            self._release(subs)

    async def _completion_full(
        self,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[list[int]],
        gens: list[AsyncIterator[RequestOutput]],
        echo: list[str] | None,
    ) -> web.Response:
        finals: dict[int, RequestOutput] = {}

        async def run(i: int, g: AsyncIterator[RequestOutput]) -> None:
            async with contextlib.aclosing(g):  # type: ignore[type-var]
                async for out in g:
                    finals[i] = out

        # One prompt failing fails the request; the TaskGroup aborts the others.
        try:
            async with asyncio.TaskGroup() as tg:
                for i, g in enumerate(gens):
                    tg.create_task(run(i, g))
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        choices = []
        completion = 0
        cached = 0
        for i in range(len(prompts)):
            out = finals[i]
            cached += out.num_cached_tokens
            completion += sum(len(o.token_ids) for o in out.outputs)
            for o in best_of(out.outputs, req.n):
                head = "" if echo is None else echo[i]
                if echo is not None and req.logprobs is not None and out.prompt_logprobs:
                    pre = echo_logprobs(out.prompt_logprobs, self.token_text, prompts[i])
                    lp, _ = self.completion_logprobs(o.logprobs, len(head))
                    lp = join_logprobs(pre, lp)
                else:
                    lp, _ = self.completion_logprobs(o.logprobs, len(head))
                choice: dict[str, Any] = {
                    "index": i * req.n + o.index,
                    "text": head + o.text,
                    "logprobs": lp if req.logprobs is not None else None,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(
                        out.prompt_logprobs, self.token_text
                    )
                if req.return_token_ids:
                    choice["prompt_token_ids"] = prompts[i]
                    choice["token_ids"] = o.token_ids
                choices.append(choice)
        return json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": self._usage(sum(map(len, prompts)), completion, cached),
            }
        )

    async def _completion_stream(
        self,
        request: web.Request,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[list[int]],
        gens: list[AsyncIterator[RequestOutput]],
        params: SamplingParams,
        echo: list[str] | None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        self.limit_send_buffer(request)
        await resp.prepare(request)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_tokens = sum(map(len, prompts))
        completion_tokens = 0
        offsets: dict[int, int] = {}
        sent_prompt_ids: set[int] = set()
        cached: dict[int, int] = {}
        try:
            async with contextlib.aclosing(merge(gens, params.n)) as events:
                async for deltas, out in events:
                    choices = []
                    for d in deltas:
                        completion_tokens += len(d.token_ids)
                        first = d.index not in offsets
                        head = echo[d.index // params.n] if echo is not None and first else ""
                        pre = None
                        if head and req.logprobs is not None and out.prompt_logprobs:
                            ids = prompts[d.index // params.n]
                            pre = echo_logprobs(out.prompt_logprobs, self.token_text, ids)
                        lp, offsets[d.index] = self.completion_logprobs(
                            d.logprobs, offsets.get(d.index, 0) + len(head)
                        )
                        c: dict[str, Any] = {
                            "index": d.index,
                            "text": head + d.text,
                            "logprobs": lp if pre is None else join_logprobs(pre, lp),
                            "finish_reason": d.finish_reason,
                        }
                        if first and req.prompt_logprobs is not None:
                            c["prompt_logprobs"] = prompt_logprobs_json(
                                out.prompt_logprobs, self.token_text
                            )
                        if d.finish_reason is not None:
                            c["stop_reason"] = d.stop_reason
                        if req.return_token_ids:
                            if d.index not in sent_prompt_ids:
                                c["prompt_token_ids"] = prompts[d.index // params.n]
                                sent_prompt_ids.add(d.index)
                            c["token_ids"] = d.token_ids
                        choices.append(c)
                    cached[id(out)] = out.num_cached_tokens
                    if choices:
                        chunk: dict[str, Any] = {**base, "choices": choices}
                        if continuous:
                            chunk["usage"] = self._usage(
                                prompt_tokens, completion_tokens, sum(cached.values())
                            )
                        await self.write(request, resp, b"data: " + orjson.dumps(chunk) + b"\n\n")
        except SlowClient:
            return resp  # dropped; the request was aborted as its generator closed
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            return await self._stream_error(request, resp, e)
        if include_usage:
            chunk = {
                **base,
                "choices": [],
                "usage": self._usage(prompt_tokens, completion_tokens, sum(cached.values())),
            }
            await self.write(request, resp, b"data: " + orjson.dumps(chunk) + b"\n\n")
        await self.write(request, resp, b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
