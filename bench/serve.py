"""`pagestream bench serve`: a load generator against a running server.

It sends `--num-prompts` requests with Poisson (or gamma, `--burstiness`) arrivals at
`--request-rate`, at most `--max-concurrency` in flight, over SSE (`/v1/completions` or
`/v1/chat/completions` with `stream: true`) or the WebSocket (`/v1/ws`), and reports
throughput plus TTFT, TPOT, ITL and end-to-end latency, the way vLLM's
`benchmarks/serve.py` does, so numbers from the two are comparable.

Prompts of the `random` dataset are random token ids, sent as a token-id prompt so the
input length is exact; `ignore_eos` makes the output length exact too.  The chat endpoint
takes text, so there the prompt is random words and the server's usage report gives the
real prompt length.

Definitions (per successful request; times from just before the request is sent):
  TTFT   the first delta that carries a token (or text)
  ITL    every gap between consecutive deltas; a delta holding k tokens is one gap
  TPOT   (E2E - TTFT) / (output tokens - 1), for requests with more than one token
  E2E    the end of the stream ([DONE] / the `done` frame)

WebSocket pooling: one socket per concurrency slot (`--max-concurrency`, else one per
prompt), at most `--ws-connections` (default 256) sockets; beyond that, generations are
multiplexed on the least-loaded socket, as the protocol allows (the server takes up to 64
per socket).  A generation waiting for a socket slot waits like one at the semaphore:
its clock starts when its frame is sent.

This is a client: it imports nothing that pulls in torch or the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np
import orjson

# The server's cap on concurrent generations per WebSocket (service.ws), repeated here so
# that this client does not import the server.
WS_MAX_PER_SOCKET = 64
# Longest SSE line we buffer: a first chunk echoes the prompt's token ids, so it may be
# large, but a line without end means a broken stream, not a reason to eat memory.
MAX_SSE_LINE_BYTES = 64 << 20
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
# Words for text prompts (chat endpoint): common words that most BPE vocabularies hold as
# one token each, so the prompt length in tokens is close to the word count.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at",
    "from", "that", "this", "be", "or", "an", "it", "have", "not", "but", "which", "all", "were",
    "when", "we", "there", "can", "had", "one", "more", "out", "if", "has", "its", "so", "some",
    "what", "time", "only", "other", "new", "like", "into", "two", "may", "then", "first", "any",
    "year", "work", "these", "now", "people", "over",
)
# fmt: on


@dataclass
class BenchConfig:
    """What `pagestream bench serve` takes; the CLI flags map one to one."""

    base_url: str = "http://127.0.0.1:8000"
    transport: Literal["sse", "ws"] = "sse"
    endpoint: Literal["completions", "chat"] = "completions"
    api_key: str | None = None
    model: str | None = None  # None: the first id of /v1/models
    dataset: Literal["random"] = "random"
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # random tokens shared by every prompt, ahead of input_len
    vocab_size: int | None = None  # None: asked of the server
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    warmup: int = 0
    request_timeout: float = 600.0
    ws_connections: int = 256
    result_json: str | None = None

    def validate(self) -> None:
        if self.transport not in ("sse", "ws"):
            raise ValueError(f"transport must be sse or ws, not {self.transport!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, not {self.endpoint!r}")
        if self.dataset != "random":
            raise ValueError(f"unknown dataset {self.dataset!r}; only 'random' is supported")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.prefix_len < 0 or self.warmup < 0:
            raise ValueError("prefix_len and warmup must not be negative")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if not self.percentiles or any(not 0.0 <= p <= 100.0 for p in self.percentiles):
            raise ValueError("percentiles must be in [0, 100]")
        if self.request_timeout <= 0 or self.ws_connections < 1:
            raise ValueError("request_timeout and ws_connections must be positive")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int] | str
    prompt_len: int  # exact for token ids; the word count for text
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per gap between deltas
    e2e: float = 0.0
    start: float = 0.0  # when it was sent, seconds after the benchmark started
    finish_reason: str | None = None


# ----------------------------------------------------------------------------- workload
def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of n requests.  Gaps are gamma distributed
    with mean 1/rate and shape `burstiness` (1: Poisson; < 1 burstier; > 1 steadier); the
    first request goes at 0.  An infinite rate sends everything at once."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: the rate never moves prompts
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int | None = None,
    prefix_len: int = 0,
    seed: int = 0,
    text: bool = False,
) -> list[SampleRequest]:
    """The `random` dataset: lengths uniform in [len*(1-r), len*(1+r)]; prompts are random
    token ids (needs vocab_size) or, with text=True, random words."""
    rng = np.random.default_rng([seed, 0])
    in_lens = _lengths(rng, n, input_len, range_ratio)
    out_lens = _lengths(rng, n, output_len, range_ratio)
    if text:
        words = np.array(_WORDS)
        prefix_words = " ".join(rng.choice(words, size=prefix_len).tolist())
        out = []
        for il, ol in zip(in_lens, out_lens):
            body = " ".join(rng.choice(words, size=il).tolist())
            prompt = f"{prefix_words} {body}" if prefix_len else body
            out.append(SampleRequest(prompt, prefix_len + il, ol))
        return out
    if vocab_size is None:
        raise ValueError("token-id prompts need vocab_size")
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    return [
        SampleRequest(prefix + rng.integers(0, vocab_size, size=il).tolist(), prefix_len + il, ol)
        for il, ol in zip(in_lens, out_lens)
    ]


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


async def sse_request(
    session: aiohttp.ClientSession,
    cfg: BenchConfig,
    model: str,
    req: SampleRequest,
    t0: float,
) -> RequestResult:
    """One streamed request over SSE; never raises except on cancellation."""
    chat = cfg.endpoint == "chat"
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        url = cfg.base_url.rstrip("/") + "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        url = cfg.base_url.rstrip("/") + "/v1/completions"
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
                    # Ends at done/error/close; the timeout bounds it in time.
                    while True:
                        now, msg = await q.get()
                        if msg is None:
                            result.error = "the WebSocket closed mid-generation"
                            break
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
                            break
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
                                break
                            return rec.finish(now)
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


# ----------------------------------------------------------------------------- metrics
def _pct_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def summarize(
    results: Sequence[RequestResult], duration: float, percentiles: Sequence[float]
) -> dict[str, Any]:
    """Aggregate metrics of a run, vLLM's names: throughputs, and for ttft/tpot/itl/e2el
    the mean, median, std and the given percentiles in ms (0 when there is no sample)."""
    ok = [r for r in results if r.success]
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    for name, xs in samples.items():
        ms = np.asarray(xs, dtype=np.float64) * 1000.0
        have = ms.size > 0
        out[f"mean_{name}_ms"] = float(ms.mean()) if have else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if have else 0.0
        out[f"std_{name}_ms"] = float(ms.std()) if have else 0.0
        for p in percentiles:
            out[f"{_pct_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if have else 0.0
    return out


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table (vLLM's layout)."""
    width = 50

    def rule(title: str, c: str) -> str:
        return f"{title:{c}^{width}}"

    def row(label: str, value: Any) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {v}"

    lines = [
        rule(" Serving Benchmark Result ", "="),
        row("Backend:", result["backend"]),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Maximum request concurrency:", result["max_concurrency"]),
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        lines.append(rule(title, "-"))
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in result["percentiles"]:
            if p != 50:  # the median already says it
                key = _pct_key(p)
                lines.append(row(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"]))
    lines.append("=" * width)
    errors = result.get("errors") or []
    distinct = sorted({e for e in errors if e})
    if distinct:
        lines.append(f"Errors ({len(distinct)} distinct, first 5):")
        lines += [f"  {e[:200]}" for e in distinct[:5]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run
async def _model_info(
    session: aiohttp.ClientSession, cfg: BenchConfig
) -> tuple[str, dict[str, Any]]:
    url = cfg.base_url.rstrip("/") + "/v1/models"
    async with session.get(url, headers=_auth_headers(cfg.api_key)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url} failed: {await _error_text(resp)}")
        data = (await resp.json())["data"]
    if cfg.model is None:
        if not data:
            raise RuntimeError(f"GET {url} lists no model")
        return data[0]["id"], data[0]
    entry = next((m for m in data if m.get("id") == cfg.model), {})
    return cfg.model, entry


async def _vocab_size(
    session: aiohttp.ClientSession, cfg: BenchConfig, model: str, entry: dict[str, Any]
) -> int:
    """--vocab-size, else what the server says, else the checkpoint's config.json when it
    is on this machine, else the range in the server's out-of-vocabulary error."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    if isinstance(entry.get("vocab_size"), int):
        return entry["vocab_size"]
    root = entry.get("root")
    if isinstance(root, str):
        with contextlib.suppress(OSError, ValueError, TypeError):
            conf = json.loads((Path(root) / "config.json").read_text())
            v = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
            if isinstance(v, int):
                return v
    url = cfg.base_url.rstrip("/") + "/v1/completions"
    body = {"model": model, "prompt": [2**31 - 1], "max_tokens": 1}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.post(url, json=body, headers=_auth_headers(cfg.api_key)) as resp:
            m = re.search(r"\(0\.\.(\d+)\)", await resp.text())
            if resp.status == 400 and m:
                return int(m.group(1)) + 1
    raise RuntimeError("could not learn the model's vocabulary size; pass --vocab-size")


def _check_lengths(cfg: BenchConfig, entry: dict[str, Any]) -> None:
    max_len = entry.get("max_model_len")
    if not isinstance(max_len, int):
        return
    longest = (
        cfg.prefix_len
        + int(cfg.input_len * (1 + cfg.range_ratio))
        + int(cfg.output_len * (1 + cfg.range_ratio))
    )
    if longest > max_len:
        raise ValueError(
            f"prompt + output may reach {longest} tokens, but the server's max_model_len is "
            f"{max_len}; lower --input-len/--output-len/--range-ratio"
        )


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run one benchmark against a running server and return its metrics, the config and
    the per-request data (and write it to config.result_json when set)."""
    cfg = config
    cfg.validate()
    concurrency = cfg.max_concurrency or cfg.num_prompts
    text = cfg.endpoint == "chat"
    connector = aiohttp.TCPConnector(limit=max(concurrency, cfg.warmup, 1) + 1)
    # Per-request timeouts are set on each call; this one bounds the set-up calls.
    timeout = aiohttp.ClientTimeout(total=max(60.0, cfg.request_timeout))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model, entry = await _model_info(session, cfg)
        vocab = None
        if not text:
            _check_lengths(cfg, entry)
            vocab = await _vocab_size(session, cfg, model, entry)
        # Warm-up prompts come after the measured ones, from the same stream, so they never
        # prefix-cache-hit the measured ones any more than two measured prompts do.
        reqs = random_requests(
            cfg.num_prompts + cfg.warmup,
            cfg.input_len,
            cfg.output_len,
            cfg.range_ratio,
            vocab,
            cfg.prefix_len,
            cfg.seed,
            text=text,
        )
        measured, warm = reqs[: cfg.num_prompts], reqs[cfg.num_prompts :]

        pool: WSPool | None = None
        if cfg.transport == "ws":
            pool = WSPool(session, _ws_url(cfg.base_url), cfg.api_key)
            await pool.open(min(concurrency, cfg.ws_connections))

        async def one(req: SampleRequest, t0: float) -> RequestResult:
            if pool is not None:
                return await ws_request(pool, cfg, req, t0)
            return await sse_request(session, cfg, model, req, t0)

        try:
            if warm:
                t0 = time.perf_counter()
                sem = asyncio.Semaphore(concurrency)

                async def warm_one(req: SampleRequest) -> RequestResult:
                    async with sem:
                        return await one(req, t0)

                wres = await asyncio.gather(*(warm_one(r) for r in warm))
                bad = next((r for r in wres if not r.success), None)
                if bad is not None:
                    raise RuntimeError(f"a warm-up request failed: {bad.error}")

            results, duration, peak = await _timed_run(cfg, measured, concurrency, one)
        finally:
            if pool is not None:
                await pool.close()

    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": f"pagestream-{cfg.transport}",
        "model_id": model,
        "base_url": cfg.base_url,
        "transport": cfg.transport,
        "endpoint": cfg.endpoint,
        "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "percentiles": list(cfg.percentiles),
        "max_concurrent_requests": peak,
        "config": {
            k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
            for k, v in asdict(cfg).items()
            if k != "api_key"
        },
        **summarize(results, duration, cfg.percentiles),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2e for r in results],
        "start_times": [r.start for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "errors": [r.error for r in results],
    }
    if cfg.result_json:
        Path(cfg.result_json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return out


async def _timed_run(
    cfg: BenchConfig,
    reqs: list[SampleRequest],
    concurrency: int,
    one: Callable[[SampleRequest, float], Awaitable[RequestResult]],
) -> tuple[list[RequestResult], float, int]:
    """Send reqs on the arrival schedule; a request that arrives while `concurrency` are in
    flight waits at the semaphore (its clock starts when it is sent, as in vLLM)."""
    offsets = arrival_offsets(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(concurrency)
    inflight = peak = 0
    t0 = time.perf_counter()
    ends: list[float] = []

    async def run(req: SampleRequest) -> RequestResult:
        nonlocal inflight, peak
        async with sem:
            inflight += 1
            peak = max(peak, inflight)
            try:
                return await one(req, t0)
            finally:
                inflight -= 1
                ends.append(time.perf_counter())

    tasks: list[asyncio.Task[RequestResult]] = []
    try:
        for req, at in zip(reqs, offsets):  # bounded by the prompt count
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run(req)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
    duration = (max(ends) if ends else time.perf_counter()) - t0
    return results, duration, peak


# ----------------------------------------------------------------------------- CLI
def _percentiles(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}") from e


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pagestream bench serve",
        description="load-test a running pagestream (or OpenAI-compatible) server: "
        "throughput, TTFT, TPOT, ITL and end-to-end latency",
    )
    d = BenchConfig()
    ap.add_argument("--base-url", default=d.base_url)
    ap.add_argument("--transport", choices=["sse", "ws"], default=d.transport,
                    help="SSE (OpenAI streaming) or the /v1/ws WebSocket")  # fmt: skip
    ap.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint,
                    help="completions: token-id prompts (exact lengths); chat: text prompts")  # fmt: skip
    ap.add_argument("--api-key", default=os.environ.get("PAGESTREAM_API_KEY") or None,
                    help="bearer token (default: $PAGESTREAM_API_KEY)")  # fmt: skip
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--dataset", choices=["random"], default=d.dataset)
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--input-len", type=int, default=d.input_len)
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--range-ratio", type=float, default=d.range_ratio,
                    help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    ap.add_argument("--prefix-len", type=int, default=d.prefix_len,
                    help="random tokens shared by every prompt, before --input-len")  # fmt: skip
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="token ids are drawn from [0, V) (default: learned from the server)")  # fmt: skip
    ap.add_argument("--request-rate", type=float, default=d.request_rate,
                    help="requests per second; inf sends all at once")  # fmt: skip
    ap.add_argument("--burstiness", type=float, default=d.burstiness,
                    help="gamma shape of the arrival gaps; 1 = Poisson")  # fmt: skip
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--percentiles", type=_percentiles, default=d.percentiles,
                    help="comma-separated, e.g. 50,90,99")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=d.warmup,
                    help="requests sent (and checked) before the timed run")  # fmt: skip
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout,
                    help="seconds one request may take")  # fmt: skip
    ap.add_argument("--ws-connections", type=int, default=d.ws_connections,
                    help="most WebSockets to open; beyond, generations share sockets")  # fmt: skip
    ap.add_argument("--result-json", default=None, help="write metrics + per-request data here")
    return ap


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=a.base_url,
        transport=a.transport,
        endpoint=a.endpoint,
        api_key=a.api_key,
        model=a.model,
        dataset=a.dataset,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        prefix_len=a.prefix_len,
        vocab_size=a.vocab_size,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        seed=a.seed,
        temperature=a.temperature,
        percentiles=a.percentiles,
        warmup=a.warmup,
        request_timeout=a.request_timeout,
        ws_connections=a.ws_connections,
        result_json=a.result_json,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table; exit 1 when any request failed (the numbers are then not a
    clean measurement), 2 on bad arguments or an unreachable server."""
    ap = build_parser()
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from_args(a)
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (RuntimeError, ValueError, aiohttp.ClientError, OSError) as e:
        print(f"pagestream bench serve: {e}", file=sys.stderr)
        return 2
    print(format_report(result), flush=True)
    return 1 if result["failed"] else 0
