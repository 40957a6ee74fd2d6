"""The host benchmark's load: N streams at once against a server, SSE or WebSocket.

    python -m bench.host_client URL --streams 256 --tokens 256 --proto sse|ws

Prints one JSON line: wall seconds of the round, tokens delivered, each stream's TPOT
(first to last event over tokens - 1) and its largest gap between events.  Light on
purpose, since it shares the cores with the server it measures: SSE over raw asyncio
streams (no HTTP client library), events found by a prefix test, no JSON parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlparse

import aiohttp


class Stats:
    def __init__(self) -> None:
        self.first = 0.0
        self.last = 0.0
        self.events = 0
        self.max_gap = 0.0

    def event(self) -> None:
        now = time.perf_counter()
        if self.events:
            self.max_gap = max(self.max_gap, now - self.last)
        else:
            self.first = now
        self.last = now
        self.events += 1


async def sse_stream(host: str, port: int, body: bytes) -> Stats:
    st = Stats()
    r, w = await asyncio.open_connection(host, port)
    w.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
    )
    head = await r.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    # Chunked framing lines (sizes, blank lines) are skipped by the prefix test: the
    # server writes whole events per chunk.
    while line := await r.readline():
        if line.startswith(b"data: {"):
            st.event()
        elif line.startswith(b"data: [DONE]"):
            break
    w.close()
    return st


async def ws_stream(session: aiohttp.ClientSession, url: str, i: int, gen: dict) -> Stats:
    st = Stats()
    async with session.ws_connect(url) as ws:
        await ws.send_str(json.dumps({**gen, "id": f"g{i}"}))
        async for msg in ws:
            data = msg.data
            if '"delta"' in data:
                st.event()
            elif '"done"' in data:
                break
            elif '"error"' in data:
                raise RuntimeError(data[:200])
    return st


async def round_(args: argparse.Namespace) -> dict:
    u = urlparse(args.url)
    prompt = list(range(100, 100 + args.prompt))
    if args.proto == "sse":
        body = json.dumps({"model": args.model, "prompt": prompt, "max_tokens": args.tokens,
                           "stream": True, "ignore_eos": True, "temperature": 0}).encode()  # fmt: skip
        t = time.perf_counter()
        stats = await asyncio.gather(
            *(
                sse_stream(u.hostname or "127.0.0.1", u.port or 80, body)
                for _ in range(args.streams)
            )
        )
    else:
        gen = {"type": "generate", "prompt": prompt,
               "params": {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 0}}  # fmt: skip
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            t = time.perf_counter()
            ws_url = f"ws://{u.netloc}/v1/ws"
            stats = await asyncio.gather(
                *(ws_stream(s, ws_url, i, gen) for i in range(args.streams))
            )
    wall = time.perf_counter() - t
    tpot = [(x.last - x.first) / max(1, args.tokens - 1) for x in stats]
    return {"wall": wall, "tokens": args.tokens * len(stats), "events": sum(x.events for x in stats),
            "tpot": tpot, "max_gap": [x.max_gap for x in stats]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", default="pagestream-default")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--proto", choices=["sse", "ws"], default="sse")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    print(json.dumps(asyncio.run(round_(args))), flush=True)


if __name__ == "__main__":
    main()
