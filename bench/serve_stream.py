"""`pagestream bench serve`'s request drivers: one streamed request over SSE, or one
generation over a pool of WebSockets, each turned into a RequestResult."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from bench.serve_workload import BenchConfig, RequestResult, SampleRequest

# The server's cap on concurrent generations per WebSocket (service.ws), repeated here so
# that this client does not import the server.
WS_MAX_PER_SOCKET = 64
# Longest SSE line we buffer: a first chunk echoes the prompt's token ids, so it may be
# large, but a line without end means a broken stream, not a reason to eat memory.
MAX_SSE_LINE_BYTES = 64 << 20


# ----------------------------------------------------------------------------- SSE
class SSEParser:
    """Incremental server-sent-events parser: feed bytes as they arrive, get the `data`
    payload of every complete event.  Handles events split across reads, CRLF line ends,
    comment lines and multi-line data (joined with newlines, as the spec says)."""

    def __init__(self, max_line: int = MAX_SSE_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._max_line = max_line

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        start = 0
        # Bounded by the buffer: each turn consumes one line.
        while (nl := self._buf.find(b"\n", start)) >= 0:
            line = bytes(self._buf[start:nl]).rstrip(b"\r")
            start = nl + 1
            self._line(line, events)
        del self._buf[:start]
        if len(self._buf) > self._max_line:
            raise ValueError(f"SSE line longer than {self._max_line} bytes")
        return events

    def close(self) -> list[str]:
        """End of stream: an event not followed by a blank line still counts."""
        events: list[str] = []
        if self._buf:
            self._line(bytes(self._buf).rstrip(b"\r"), events)
            self._buf.clear()
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[str]) -> None:
        if not line:  # a blank line dispatches the event
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b":"):  # a comment (keep-alive)
            return
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value.removeprefix(b" ").decode())
        # event:, id:, retry: carry nothing the OpenAI stream uses


@dataclass
class StreamEvent:
    """What one SSE payload or WS frame means to the benchmark."""

    kind: Literal["delta", "done", "error", "other"]
    text: str = ""
    token_ids: list[int] | None = None  # None: the server did not send ids
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str = ""


def parse_sse_payload(payload: str, chat: bool) -> StreamEvent:
    """One `data:` payload of an OpenAI stream (completions or chat chunk)."""
    if payload.strip() == "[DONE]":
        return StreamEvent("done")
    obj = orjson.loads(payload)
    if not isinstance(obj, dict):
        return StreamEvent("error", error=f"unexpected SSE payload: {payload[:200]}")
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return StreamEvent("error", error=msg)
    ev = StreamEvent("other")
    usage = obj.get("usage")
    if isinstance(usage, dict):
        ev.prompt_tokens = usage.get("prompt_tokens")
        ev.completion_tokens = usage.get("completion_tokens")
    # n == 1: one choice per chunk at most.
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        ids = choice.get("token_ids")
        ev.text += text or ""
        if ids is not None:
            ev.token_ids = (ev.token_ids or []) + list(ids)
        ev.finish_reason = choice.get("finish_reason") or ev.finish_reason
        if ev.text or ev.token_ids:
            ev.kind = "delta"
    return ev


class _Recorder:
    """Turns the events of one stream into a RequestResult."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.r = result
        self.sent = sent
        self.last: float | None = None
        self.ids_seen = False
        self.ids = 0
        self.text_deltas = 0
        self.usage_completion: int | None = None

    def event(self, now: float, ev: StreamEvent) -> None:
        if ev.prompt_tokens is not None:
            self.r.prompt_len = ev.prompt_tokens  # the server's count beats our estimate
        if ev.completion_tokens is not None:
            self.usage_completion = ev.completion_tokens
        if ev.finish_reason is not None:
            self.r.finish_reason = ev.finish_reason
        if ev.token_ids is not None:
            self.ids_seen = True
            self.ids += len(ev.token_ids)
        if ev.kind != "delta":
            return
        self.text_deltas += 1
        if self.last is None:
            self.r.ttft = now - self.sent
        else:
            self.r.itl.append(now - self.last)
        self.last = now

    def finish(self, now: float) -> RequestResult:
        r = self.r
        r.e2e = now - self.sent
        if self.ids_seen:
            r.output_tokens = self.ids
        elif self.usage_completion is not None:
            r.output_tokens = self.usage_completion
        else:
            r.output_tokens = self.text_deltas
        if self.last is None:
            r.success, r.error = False, "the stream ended without any token"
        else:
            r.success = True
        return r


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _error_text(resp: aiohttp.ClientResponse) -> str:
    body = await resp.read()
    try:
        err = orjson.loads(body)["error"]
        msg = err["message"] if isinstance(err, dict) else str(err)
    except Exception:
        msg = body[:500].decode(errors="replace")
    return f"HTTP {resp.status}: {msg}"


def _sse_body(cfg: BenchConfig, model: str, req: SampleRequest) -> tuple[str, dict[str, Any]]:
    """The URL and JSON body of one streamed completions or chat request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        return cfg.base_url.rstrip("/") + "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return cfg.base_url.rstrip("/") + "/v1/completions", body


async def sse_request(
    session: aiohttp.ClientSession,
    cfg: BenchConfig,
    model: str,
    req: SampleRequest,
    t0: float,
) -> RequestResult:
    """One streamed request over SSE; never raises except on cancellation."""
    chat = cfg.endpoint == "chat"
    url, body = _sse_body(cfg, model, req)
    result = RequestResult(prompt_len=req.prompt_len)
    sent = time.perf_counter()
    result.start = sent - t0
    rec = _Recorder(result, sent)
    parser = SSEParser()
    done = False
    try:
        async with session.post(
            url,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **_auth_headers(cfg.api_key)},
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout),
        ) as resp:
            if resp.status != 200:
                result.error = await _error_text(resp)
                result.e2e = time.perf_counter() - sent
                return result
            # Ends with the response body; the ClientTimeout bounds it in time.
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for payload in parser.feed(chunk):
                    ev = parse_sse_payload(payload, chat)
                    if ev.kind == "error":
                        result.error = ev.error
                        result.e2e = now - sent
                        return result
                    if ev.kind == "done":
                        done = True
                        break
                    rec.event(now, ev)
                if done:
                    break
            if not done:
                for payload in parser.close():
                    done = done or parse_sse_payload(payload, chat).kind == "done"
            if not done:
                result.error = "the stream ended before [DONE]"
                result.e2e = time.perf_counter() - sent
                return result
            return rec.finish(time.perf_counter())
    except TimeoutError:
        result.error = f"timed out after {cfg.request_timeout:g}s"
    except (aiohttp.ClientError, ValueError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - sent
    return result


# ----------------------------------------------------------------------------- WebSocket
class _WSConn:
    """One socket and the reader that routes its frames to generations by id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.active = 0
        self.waiting: dict[str, asyncio.Queue[tuple[float, dict[str, Any] | None]]] = {}
        self.started: set[str] = set()  # generations that got at least one frame
        self.closed = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self.ws:  # ends when the socket closes
                now = time.perf_counter()
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    frame = orjson.loads(msg.data)
                except orjson.JSONDecodeError:
                    continue
                gid = frame.get("id")
                if gid is None and frame.get("type") == "error":
                    # A frame the server could not decode names no id.  Our frames differ
                    # only in prompt and length, so the cause (bad params) hits all of
                    # them: fail every generation that has heard nothing yet.
                    for g, q in self.waiting.items():
                        if g not in self.started:
                            q.put_nowait((now, frame))
                    continue
                q = self.waiting.get(gid)
                if q is not None:
                    self.started.add(gid)
                    q.put_nowait((now, frame))
        finally:
            self.closed = True
            for q in self.waiting.values():
                q.put_nowait((time.perf_counter(), None))


class WSPool:
    """`size` sockets; each generation goes to the least-loaded open one."""

    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None) -> None:
        self.session = session
        self.url = url
        self.headers = _auth_headers(api_key)
        self.conns: list[_WSConn] = []
        self.slots: asyncio.Semaphore | None = None
        self._ids = itertools.count()

    async def open(self, size: int) -> None:
        socks = await asyncio.gather(
            *(
                self.session.ws_connect(self.url, headers=self.headers, max_msg_size=64 << 20)
                for _ in range(size)
            )
        )
        self.conns = [_WSConn(ws) for ws in socks]
        self.slots = asyncio.Semaphore(size * WS_MAX_PER_SOCKET)

    async def close(self) -> None:
        for c in self.conns:
            await c.ws.close()
        await asyncio.gather(*(c.reader for c in self.conns), return_exceptions=True)

    @contextlib.asynccontextmanager
    async def generation(self) -> AsyncIterator[tuple[_WSConn, str]]:
        assert self.slots is not None, "open() first"
        async with self.slots:
            # The semaphore guarantees a socket below the per-socket cap.
            conn = min(
                (c for c in self.conns if not c.closed), key=lambda c: c.active, default=None
            )
            if conn is None:
                raise ConnectionError("every WebSocket of the pool is closed")
            gid = f"g{next(self._ids)}"
            conn.active += 1
            conn.waiting[gid] = asyncio.Queue()
            try:
                yield conn, gid
            finally:
                conn.active -= 1
                conn.waiting.pop(gid, None)
                conn.started.discard(gid)


async def _ws_frames(
    q: asyncio.Queue[tuple[float, dict[str, Any] | None]], rec: _Recorder
) -> RequestResult | None:
    """Feed one generation's frames to its recorder until done (its result), or an error,
    an abort or the socket closing (None, with the result's error set)."""
    result = rec.r
    # Ends at done/error/close; the caller's timeout bounds it in time.
    while True:
        now, msg = await q.get()
        if msg is None:
            result.error = "the WebSocket closed mid-generation"
            return None
        kind = msg.get("type")
        if kind == "delta":
            rec.event(
                now,
                StreamEvent(
                    "delta",
                    text=msg.get("text") or "",
                    token_ids=list(msg.get("token_ids") or []),
                ),
            )
        elif kind == "error":
            result.error = f"{msg.get('code')}: {msg.get('message')}"
            return None
        elif kind == "done":
            usage = msg.get("usage") or {}
            rec.event(
                now,
                StreamEvent(
                    "done",
                    finish_reason=msg.get("finish_reason"),
                    prompt_tokens=usage.get("prompt_tokens"),
                    completion_tokens=usage.get("completion_tokens"),
                ),
            )
            if result.finish_reason == "abort":
                result.error = "the server aborted the generation"
                return None
            return rec.finish(now)


async def ws_request(
    pool: WSPool, cfg: BenchConfig, req: SampleRequest, t0: float
) -> RequestResult:
    """One generation over the WebSocket pool; never raises except on cancellation."""
    result = RequestResult(prompt_len=req.prompt_len)
    params = {
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    try:
        async with pool.generation() as (conn, gid):
            frame: dict[str, Any] = {"type": "generate", "id": gid, "params": params}
            if cfg.endpoint == "chat":
                frame["messages"] = [{"role": "user", "content": req.prompt}]
            else:
                frame["prompt"] = req.prompt
            q = conn.waiting[gid]
            sent = time.perf_counter()
            result.start = sent - t0
            rec = _Recorder(result, sent)
            await conn.ws.send_str(orjson.dumps(frame).decode())
            try:
                async with asyncio.timeout(cfg.request_timeout):
                    finished = await _ws_frames(q, rec)
                    if finished is not None:
                        return finished
            except TimeoutError:
                result.error = f"timed out after {cfg.request_timeout:g}s"
                with contextlib.suppress(Exception):  # free the server's slot
                    await conn.ws.send_str(orjson.dumps({"type": "cancel", "id": gid}).decode())
    except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - sent
    return result


def _ws_url(base_url: str) -> str:
    parts = urlsplit(base_url.rstrip("/"))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path + "/v1/ws", "", ""))
