"""Small real clients for the reliability suites: SSE over aiohttp, WebSocket over
`websockets`, both on loopback, each returning what the client saw."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import websockets


@dataclass
class Seen:
    status: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    error: dict[str, Any] | None = None  # OpenAI error object, or the WebSocket error frame
    done: bool = False  # [DONE] / `done` frame seen


async def sse_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Seen:
    """POST /v1/completions with stream=True; parse every event."""
    seen = Seen()
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        seen.status = r.status
        if r.status != 200:
            seen.error = (await r.json())["error"]
            return seen
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                seen.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                seen.error = obj["error"]
                continue
            for c in obj["choices"]:
                seen.text += c["text"]
                seen.token_ids += c.get("token_ids") or []
                seen.finish = c["finish_reason"] or seen.finish
    return seen


async def completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Seen:
    seen = Seen()
    async with session.post(url + "/v1/completions", json=body) as r:
        seen.status = r.status
        obj = await r.json()
    if "error" in obj:
        seen.error = obj["error"]
    else:
        c = obj["choices"][0]
        seen.text, seen.finish, seen.done = c["text"], c["finish_reason"], True
        seen.token_ids = c.get("token_ids") or []
    return seen


async def ws_generations(ws_url: str, frames: list[dict[str, Any]]) -> dict[str, Seen]:
    """Run several generations on one socket; collect each until its done/error."""
    out = {f["id"]: Seen(status=101) for f in frames}
    async with websockets.connect(ws_url, max_size=None) as ws:
        for f in frames:
            await ws.send(json.dumps({"type": "generate", **f}))
        live = set(out)
        while live:
            f = json.loads(await ws.recv())
            s = out.get(f.get("id"))
            if s is None:
                continue
            if f["type"] == "delta":
                s.text += f["text"]
                s.token_ids += f["token_ids"]
            elif f["type"] == "done":
                s.finish, s.done = f["finish_reason"], True
                live.discard(f["id"])
            elif f["type"] == "error":
                s.error = f
                live.discard(f["id"])
    return out
