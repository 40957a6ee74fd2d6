"""A bounded storm against one live server on loopback: hundreds of concurrent WebSocket
generations and SSE streams, with cancels and dropped sockets, while a prober checks
that /health keeps answering.  Returns what every client saw."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import websockets


@dataclass
class StormResult:
    ws_done: int = 0  # generations that ended with `done` (length)
    ws_cancelled: int = 0  # cancelled by the client and acknowledged
    ws_dropped: int = 0  # on sockets the client dropped mid-stream
    ws_errors: list[dict[str, Any]] = field(default_factory=list)
    sse_done: int = 0
    sse_dropped: int = 0
    sse_errors: list[str] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)  # what the `extra` coroutines returned
    health_max_s: float = 0.0
    health_failures: int = 0
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return self.ws_done + self.ws_cancelled + self.ws_dropped + self.sse_done + self.sse_dropped


def _params(rng: random.Random) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": rng.randrange(4, 24), "ignore_eos": True}
    if rng.random() < 0.5:
        p["temperature"] = 0
    else:
        p |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)}
    return p


def _prompt(rng: random.Random) -> list[int]:
    # A shared head (prefix-cache hits) on a third of them.
    head = [11, 12, 13, 14, 15, 16, 17, 18] * 2 if rng.random() < 0.33 else []
    return head + [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 48))]


async def _ws_socket(
    url: str, sock: int, gens: int, mode: str, rng: random.Random, res: StormResult
) -> None:
    """mode: "normal", "cancel" (cancels half its generations after a first delta) or
    "drop" (the client vanishes mid-stream without a close frame)."""
    ids = [f"s{sock}g{i}" for i in range(gens)]
    async with websockets.connect(url, max_size=None, open_timeout=60) as ws:
        for gid in ids:
            frame = {"type": "generate", "id": gid, "prompt": _prompt(rng), "params": _params(rng)}
            await ws.send(json.dumps(frame))
        live = set(ids)
        to_cancel = set(ids[::2]) if mode == "cancel" else set()
        while live:
            f = json.loads(await ws.recv())
            gid = f.get("id")
            if f["type"] == "delta" and mode == "drop":
                ws.transport.abort()  # gone: no close frame, no cancel
                res.ws_dropped += len(live)
                return
            if f["type"] == "delta" and gid in to_cancel:
                to_cancel.discard(gid)
                await ws.send(json.dumps({"type": "cancel", "id": gid}))
            elif f["type"] == "done":
                live.discard(gid)
                if f["finish_reason"] == "abort":
                    res.ws_cancelled += 1
                else:
                    assert f["finish_reason"] == "length", f
                    res.ws_done += 1
            elif f["type"] == "error":
                live.discard(gid)
                res.ws_errors.append(f)


async def _sse(
    session: aiohttp.ClientSession, url: str, drop: bool, rng: random.Random, res: StormResult
) -> None:
    body = {"prompt": _prompt(rng), "stream": True, **_params(rng)}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            res.sse_errors.append(f"{r.status}: {await r.text()}")
            return
        finish = None
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            conn = r.connection
            if drop and conn is not None and conn.transport is not None:
                conn.transport.abort()
                res.sse_dropped += 1
                return
            # (A short answer may have arrived whole already: aiohttp has released its
            # connection, there is nothing left to drop, and it is read as a finished one.)
            if line == b"data: [DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                res.sse_errors.append(str(obj["error"]))
                return
            for c in obj["choices"]:
                finish = c["finish_reason"] or finish
        if finish == "length":
            res.sse_done += 1
        else:
            res.sse_errors.append(f"finish {finish}")


async def _probe_health(url: str, res: StormResult, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
                    if r.status != 200:
                        res.health_failures += 1
            except (TimeoutError, aiohttp.ClientError):
                res.health_failures += 1
            res.health_max_s = max(res.health_max_s, time.monotonic() - t0)
            with_timeout = asyncio.ensure_future(stop.wait())
            await asyncio.wait([with_timeout], timeout=0.2)
            with_timeout.cancel()


async def storm(
    url: str,
    *,
    ws_sockets: int = 30,
    gens_per_socket: int = 10,
    sse_streams: int = 100,
    seed: int = 0,
    extra: list[Any] | None = None,
    timeout: float = 300.0,
) -> StormResult:
    """ws_sockets x gens_per_socket WebSocket generations and sse_streams SSE streams, all
    at once; one socket in ten cancels half its generations, one in ten drops mid-stream,
    one SSE stream in ten drops.  `extra` coroutines (hostile requests) run beside it."""
    rng = random.Random(seed)
    res = StormResult()
    ws_url = url.replace("http://", "ws://") + "/v1/ws"
    stop = asyncio.Event()
    prober = asyncio.ensure_future(_probe_health(url, res, stop))
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        jobs = []
        for k in range(ws_sockets):
            mode = "cancel" if k % 10 == 3 else "drop" if k % 10 == 7 else "normal"
            jobs.append(
                _ws_socket(ws_url, k, gens_per_socket, mode, random.Random(rng.random()), res)
            )
        for k in range(sse_streams):
            jobs.append(_sse(session, url, k % 10 == 5, random.Random(rng.random()), res))
        try:
            async with asyncio.timeout(timeout):
                results = await asyncio.gather(*jobs, *(extra or []))
            res.extra = results[len(jobs) :]
        finally:
            stop.set()
            await prober
    res.seconds = time.monotonic() - t0
    return res
