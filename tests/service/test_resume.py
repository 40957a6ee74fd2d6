"""Resumable streams (issue 51, first bullet) against a live server on loopback: a
client's connection is cut mid-answer (the socket aborted, no close handshake), the client
comes back with the last position it saw, and what it ends up with equals an
uninterrupted greedy run's, every event exactly once.  SSE through raw aiohttp and httpx
clients, the WebSocket through `websockets`; another API key is refused; nothing is left
held (KV blocks, logs, request ids) once the grace period is over."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
import pytest
import websockets

from service.security import key_tenant
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import LiveServer, live_server

pytestmark = pytest.mark.timeout(90)

KEY_A, KEY_B = "resume-key-a", "resume-key-b"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
GRACE = 1.5
# ~1 s of decoding for the tiny model on one thread (0.65 ms a token on a Zen 4): still
# running when the client is back, on a machine a few times faster too.
LONG = 1500
# What a test waits to see aborted (by the grace timer, a cancel, a full buffer) must not
# end by its length first on any machine: ~20 s of decoding here.
ENDLESS = 30_000


def _live(engine_process: bool) -> Iterator[LiveServer]:
    with live_server(
        str(tiny_checkpoint("llama", max_position_embeddings=32_768)),
        api_keys=[KEY_A, KEY_B], resume_grace=GRACE, engine_process=engine_process,
        engine_kwargs={"num_kv_blocks": 2_048},
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def inline_server() -> Iterator[LiveServer]:
    yield from _live(False)


@pytest.fixture(scope="module")
def process_server() -> Iterator[LiveServer]:
    yield from _live(True)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> LiveServer:
    """The inline engine's server, or (BOTH) the engine-process one's too."""
    mode = getattr(request, "param", "inline")
    return request.getfixturevalue(f"{mode.replace('-', '_')}_server")


# With the engine core in a child process (`serve --engine-process`): what a resume
# leans on crosses the boundary (the grace timer's abort, a resumed cancel, a closed
# socket's unpin), and the idle checks read the child's scheduler and pool.
BOTH = pytest.mark.parametrize("server", ["inline", "process"], indirect=True)


# ----------------------------------------------------------------- SSE, parsed properly
class SSEReader:
    """Complete SSE events ({field: value}) out of a byte stream; a partial event at a
    cut is dropped, as a browser drops it."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[dict[str, str]]:
        self.buf += data.replace(b"\r\n", b"\n")
        *blocks, self.buf = self.buf.split(b"\n\n")
        out = []
        for block in blocks:
            ev: dict[str, str] = {}
            for line in block.decode().split("\n"):
                name, _, value = line.partition(":")
                if name:
                    ev[name] = value[1:] if value.startswith(" ") else value
            out.append(ev)
        return out


def answer(events: list[dict[str, str]], chat: bool) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of the data events of one completion stream."""
    text, ids, finish = "", [], None
    for ev in events:
        if "data" not in ev or ev["data"] == "[DONE]":
            continue
        for c in json.loads(ev["data"])["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            ids += c.get("token_ids") or []
            finish = c["finish_reason"] or finish
    return text, ids, finish


def check_positions(events: list[dict[str, str]]) -> None:
    """Every data event has the next position: none missing, none twice, [DONE] last."""
    data = [ev for ev in events if "data" in ev]
    assert [int(ev["id"]) for ev in data] == list(range(1, len(data) + 1))
    assert data[-1]["data"] == "[DONE]"


async def read_events(resp: aiohttp.ClientResponse, until: int | None = None) -> list[dict]:
    """Events of `resp` until `until` of them came (then the caller cuts), else its end."""
    reader, got = SSEReader(), []
    async with asyncio.timeout(60):
        while until is None or len(got) < until:
            chunk = await resp.content.readany()
            if not chunk:
                break
            got += reader.feed(chunk)
    return got


def cut(resp: aiohttp.ClientResponse) -> None:
    """The network goes: the socket is aborted under the client, no FIN handshake."""
    assert resp.connection is not None and resp.connection.transport is not None
    resp.connection.transport.abort()
    resp.close()


def busy(server: LiveServer) -> bool:
    if server.in_child:
        return bool(server.debug_counts()["requests"])
    return server.on_loop(lambda: bool(server.engine.scheduler.requests))


def kv_used(server: LiveServer) -> int:
    """KV blocks held, pinned free ones counted."""
    if server.in_child:
        return int(server.debug_counts()["kv_blocks_used"])
    return server.on_loop(lambda: server.engine.scheduler.kv.pool.num_used)


def logs(server: LiveServer) -> int:
    return server.on_loop(lambda: len(server.state.streams.logs))


def aborted(server: LiveServer, at_least: float = 0.0) -> float:
    """Requests the engine finished as aborted so far (its Prometheus counter); waits up
    to 5 s for it to reach `at_least` (the count lands when the request's hooks run,
    a moment after its stream ends)."""
    deadline = time.monotonic() + 5
    while True:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r'^pagestream_request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                      text, re.M)  # fmt: skip
        n = float(m.group(1)) if m else 0.0
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH_A) as s:
        yield s


def completion(max_tokens: int = LONG, prompt: list[int] | None = None) -> dict[str, Any]:
    return {"prompt": prompt or [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip


async def reference(http: aiohttp.ClientSession, url: str, body: dict, chat: bool) -> tuple:
    async with http.post(url, json=body) as r:
        assert r.status == 200
        events = await read_events(r)
    check_positions(events)
    return answer(events, chat)


@BOTH
async def test_sse_cut_twice_resumes_to_the_uninterrupted_answer(server, http) -> None:
    url = server.url + "/v1/completions"
    want = await reference(http, url, completion(), chat=False)
    r = await http.post(url, json=completion())
    events = await read_events(r, until=15)
    cut(r)
    rid = json.loads(events[-1]["data"])["id"]
    await asyncio.sleep(0.2)
    assert await asyncio.to_thread(busy, server)  # it ran on through the gap
    # Back with the position it saw; the live tail follows the replay.
    r = await http.get(
        f"{server.url}/v1/streams/{rid}", headers={"Last-Event-ID": events[-1]["id"]}
    )
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    more = await read_events(r, until=30)
    assert more[0] == {"retry": str(int(GRACE * 250))}  # an EventSource is back within grace
    cut(r)
    events += more[1:]
    assert await asyncio.to_thread(busy, server)
    # A second gap, resumed through the query parameter (a new EventSource's way).
    last = events[-1]["id"]
    async with http.get(f"{server.url}/v1/streams/{rid}?last_event_id={last}") as r:
        events += (await read_events(r))[1:]
    check_positions(events)
    assert answer(events, chat=False) == want
    assert want[2] == "length" and len(want[1]) == LONG
    await asyncio.to_thread(server.wait_kv_free, 10)


async def test_sse_chat_resumed_with_httpx(server) -> None:
    """httpx's client, chat completions, a client-chosen X-Request-Id (the resume address
    is the response id it names)."""
    body = {"messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    url = server.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(headers=AUTH_A) as s:
        want = await reference(s, url, body, chat=True)
    async with httpx.AsyncClient(headers=AUTH_A, timeout=60) as client:
        reader, events = SSEReader(), []
        async with client.stream("POST", url, json=body, headers={"X-Request-Id": "mine-1"}) as r:
            assert r.headers["X-Request-Id"] == "mine-1"
            async for chunk in r.aiter_raw():
                events += reader.feed(chunk)
                if len(events) >= 10:
                    break  # leaving the block closes the connection mid-answer
        # While the generation runs (through the gap too) its id stays taken: 409.
        r = await client.post(url, json=body, headers={"X-Request-Id": "mine-1"})
        assert r.status_code == 409 and r.json()["error"]["param"] == "X-Request-Id"
        headers = {"Last-Event-ID": events[-1]["id"]}
        async with client.stream("GET", f"{server.url}/v1/streams/chatcmpl-mine-1",
                                 headers=headers) as r:  # fmt: skip
            assert r.status_code == 200
            reader = SSEReader()
            async for chunk in r.aiter_raw():
                events += [e for e in reader.feed(chunk) if "data" in e]
    check_positions(events)
    assert answer(events, chat=True) == want
    assert json.loads(events[0]["data"])["choices"][0]["delta"]["role"] == "assistant"


async def test_another_key_cannot_resume_and_bad_positions_are_400(server, http) -> None:
    r = await http.post(server.url + "/v1/completions", json=completion())
    events = await read_events(r, until=5)
    cut(r)
    rid = json.loads(events[-1]["data"])["id"]
    base = f"{server.url}/v1/streams/{rid}"
    refusals = [  # (headers, query, status, param)
        (AUTH_B | {"Last-Event-ID": "5"}, "", 404, "id"),  # another key: not its stream
        (AUTH_A | {"Last-Event-ID": "x1"}, "", 400, "Last-Event-ID"),
        (AUTH_A | {"Last-Event-ID": "-1"}, "", 400, "Last-Event-ID"),
        (AUTH_A, "?last_event_id=" + "9" * 40, 400, "last_event_id"),
        (AUTH_A | {"Last-Event-ID": "999999"}, "", 400, "Last-Event-ID"),  # past the end
    ]
    async with aiohttp.ClientSession() as anon:
        for headers, query, status, param in refusals:
            async with anon.get(base + query, headers=headers) as bad:
                body = await bad.json()
                assert bad.status == status, (headers, query, body)
                assert body["error"]["param"] == param and body["error"]["message"]
                assert set(body["error"]) == {"message", "type", "param", "code"}
        async with anon.get(base) as bad:  # no key at all
            assert bad.status == 401
        async with anon.get(f"{server.url}/v1/streams/cmpl-nothing", headers=AUTH_A) as bad:
            assert bad.status == 404 and (await bad.json())["error"]["param"] == "id"
    # Refused resumes take nothing away from the owner: it resumes, all of it, once.
    async with http.get(base, headers={"Last-Event-ID": events[-1]["id"]}) as r:
        events += (await read_events(r))[1:]
    check_positions(events)
    assert answer(events, chat=False)[2] == "length"


async def test_a_resume_takes_the_stream_over_from_a_stale_connection(server, http) -> None:
    """The old connection may look alive to the server (a phone that changed networks);
    the resume takes the stream over and the old response ends, without [DONE]."""
    r = await http.post(server.url + "/v1/completions", json=completion())
    events = await read_events(r, until=8)
    rid = json.loads(events[-1]["data"])["id"]
    async with http.get(f"{server.url}/v1/streams/{rid}",
                        headers={"Last-Event-ID": events[-1]["id"]}) as r2:  # fmt: skip
        stale = await read_events(r)  # ends: the stream was taken over
        assert all(ev.get("data") != "[DONE]" for ev in stale)
        events += (await read_events(r2))[1:]
    r.close()
    check_positions(events)
    await asyncio.to_thread(server.wait_kv_free, 10)


@BOTH
async def test_no_resume_within_grace_aborts_and_frees_everything(server, http) -> None:
    await asyncio.to_thread(server.wait_kv_free, 10)
    free = await asyncio.to_thread(server.kv_free_blocks)
    before_logs = await asyncio.to_thread(wait_logs_drained, server)
    n_aborted = await asyncio.to_thread(aborted, server)
    r = await http.post(server.url + "/v1/completions", json=completion(max_tokens=ENDLESS),
                        headers={"X-Request-Id": "gone-1"})  # fmt: skip
    await read_events(r, until=5)
    cut(r)
    t0 = time.monotonic()
    await asyncio.sleep(GRACE / 2)
    assert await asyncio.to_thread(busy, server)  # running on, waiting for a resume
    await asyncio.to_thread(server.wait_kv_free, GRACE + 5)
    assert time.monotonic() - t0 >= GRACE * 0.9  # aborted by the grace timer, not earlier
    assert (
        await asyncio.to_thread(aborted, server, n_aborted + 1) == n_aborted + 1
    )  # not run to its end
    assert await asyncio.to_thread(server.kv_free_blocks) == free
    assert logs(server) == before_logs == 0
    assert server.on_loop(lambda: server.state.request_ids.live) == set()
    async with http.get(f"{server.url}/v1/streams/cmpl-gone-1") as gone:
        assert gone.status == 404
    # The id is free again.
    async with http.post(server.url + "/v1/completions", json=completion(max_tokens=2),
                         headers={"X-Request-Id": "gone-1"}) as again:  # fmt: skip
        assert again.status == 200
        await again.read()


def wait_logs_drained(server: LiveServer) -> int:
    """Finished streams' logs are kept for the grace period: wait them out."""
    wait_for(lambda: logs(server) == 0, GRACE + 5, "finished streams' logs to drop")
    return logs(server)


@BOTH
async def test_buffer_overflow_without_a_reader_aborts_and_resume_is_410(server, http) -> None:
    streams = server.state.streams
    cap = streams.cap
    server.on_loop(lambda: setattr(streams, "cap", 4096))
    try:
        r = await http.post(server.url + "/v1/completions", json=completion(max_tokens=ENDLESS))
        events = await read_events(r, until=3)
        cut(r)
        t0 = time.monotonic()
        # 4 KiB of events is ~30 tokens: aborted long before the grace period is over.
        await asyncio.to_thread(server.wait_kv_free, GRACE)
        assert time.monotonic() - t0 < GRACE
        rid = json.loads(events[-1]["data"])["id"]
        async with http.get(f"{server.url}/v1/streams/{rid}",
                            headers={"Last-Event-ID": events[-1]["id"]}) as gone:  # fmt: skip
            body = await gone.json()
            assert gone.status == 410 and body["error"]["param"] == "Last-Event-ID"
            assert "aborted" in body["error"]["message"]
    finally:
        server.on_loop(lambda: setattr(streams, "cap", cap))


async def test_grace_zero_is_abort_at_once_without_positions(server, http) -> None:
    streams = server.state.streams
    server.on_loop(lambda: setattr(streams, "grace", 0.0))
    try:
        r = await http.post(server.url + "/v1/completions", json=completion(max_tokens=ENDLESS))
        events = await read_events(r, until=3)
        assert all("id" not in ev for ev in events)
        cut(r)
        t0 = time.monotonic()
        await asyncio.to_thread(server.wait_kv_free, 5)
        assert time.monotonic() - t0 < 1.5
        rid = json.loads(events[-1]["data"])["id"]
        async with http.get(f"{server.url}/v1/streams/{rid}") as gone:
            assert gone.status == 404
    finally:
        server.on_loop(lambda: setattr(streams, "grace", GRACE))


# ----------------------------------------------------------------------------- WebSocket
async def ws_frames(ws: Any, gid: str, until: Any) -> list[dict]:
    got = []
    async with asyncio.timeout(60):
        while True:
            f = json.loads(await ws.recv())
            if f.get("id") == gid:
                got.append(f)
                if until(f):
                    return got


def generate(gid: str, max_tokens: int = LONG) -> str:
    return json.dumps({"type": "generate", "id": gid, "prompt": [9, 8, 7],
                       "params": {"max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}})  # fmt: skip


def ws_answer(frames: list[dict]) -> tuple[str, list[int], str]:
    deltas = [f for f in frames if f["type"] == "delta"]
    done = [f for f in frames if f["type"] == "done"]
    assert len(done) == 1
    return (
        "".join(f["text"] for f in deltas),
        [t for f in deltas for t in f["token_ids"]],
        done[0]["finish_reason"],
    )


def ws_url(server: LiveServer, key: str = KEY_A) -> str:
    return f"{server.ws_url}?api_key={key}"


async def test_ws_cut_and_resume_on_a_new_socket(server) -> None:
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(generate("ref"))
        want = ws_answer(await ws_frames(ws, "ref", lambda f: f["type"] == "done"))
    ws = await websockets.connect(ws_url(server))
    await ws.send(generate("g1"))
    frames = await ws_frames(ws, "g1", lambda f: f.get("seq", 0) >= 12)
    ws.transport.abort()  # the network goes: no close frame, no cancel
    token = frames[-1]["resume"]
    assert all(f["resume"] == token for f in frames if f["type"] == "delta")
    await asyncio.sleep(0.2)
    assert await asyncio.to_thread(busy, server)
    async with websockets.connect(ws_url(server, KEY_B)) as other:  # another key: refused
        await other.send(json.dumps({"type": "resume", "id": "g1", "resume": token, "after": 12}))
        err = json.loads(await other.recv())
        assert err["type"] == "error" and err["code"] == 404 and err["param"] == "resume"
    async with websockets.connect(ws_url(server)) as ws2:
        for bad, code, param in [({"after": 10**6}, 400, "after"), ({"id": "g2"}, 404, "resume"),
                                 ({"after": -1}, 400, "after")]:  # fmt: skip
            frame = {"type": "resume", "id": "g1", "resume": token, "after": 12} | bad
            await ws2.send(json.dumps(frame))
            err = json.loads(await ws2.recv())
            assert (err["type"], err["code"], err["param"]) == ("error", code, param), err
        await ws2.send(json.dumps({"type": "resume", "id": "g1", "resume": token, "after": 12}))
        frames += await ws_frames(ws2, "g1", lambda f: f["type"] == "done")
    assert [f["seq"] for f in frames] == list(range(1, len(frames) + 1))
    assert ws_answer(frames) == want and want[2] == "length"
    await asyncio.to_thread(server.wait_kv_free, 10)


@BOTH
async def test_ws_cancel_reaches_a_resumed_generation(server) -> None:
    ws = await websockets.connect(ws_url(server))
    await ws.send(generate("c1", max_tokens=ENDLESS))
    frames = await ws_frames(ws, "c1", lambda f: f["type"] == "delta")
    ws.transport.abort()
    async with websockets.connect(ws_url(server)) as ws2:
        await ws2.send(json.dumps({"type": "resume", "id": "c1", "resume": frames[-1]["resume"],
                                   "after": frames[-1]["seq"]}))  # fmt: skip
        frames += await ws_frames(ws2, "c1", lambda f: f["type"] == "delta")
        await ws2.send(json.dumps({"type": "cancel", "id": "c1"}))
        frames += await ws_frames(ws2, "c1", lambda f: f["type"] == "done")
    assert frames[-1]["finish_reason"] == "abort"
    assert [f["seq"] for f in frames] == list(range(1, len(frames) + 1))
    await asyncio.to_thread(server.wait_kv_free, 10)


@BOTH
async def test_ws_no_resume_within_grace_frees_everything(server) -> None:
    await asyncio.to_thread(server.wait_kv_free, 10)
    await asyncio.to_thread(wait_logs_drained, server)
    n_aborted = await asyncio.to_thread(aborted, server)
    ws = await websockets.connect(ws_url(server))
    await ws.send(generate("lost", max_tokens=ENDLESS))
    frames = await ws_frames(ws, "lost", lambda f: f["type"] == "delta")
    ws.transport.abort()
    await asyncio.sleep(GRACE / 2)
    assert await asyncio.to_thread(busy, server)
    await asyncio.to_thread(server.wait_kv_free, GRACE + 5)
    await asyncio.to_thread(wait_for, lambda: logs(server) == 0, 5, "the log to drop")
    assert await asyncio.to_thread(aborted, server, n_aborted + 1) == n_aborted + 1
    await asyncio.to_thread(wait_for, lambda: kv_used(server) == 0, 5,
                            "no block held or pinned")  # fmt: skip
    assert server.on_loop(lambda: server.state.inflight) == 0
    async with websockets.connect(ws_url(server)) as ws2:
        await ws2.send(json.dumps({"type": "resume", "id": "lost",
                                   "resume": frames[0]["resume"], "after": 1}))  # fmt: skip
        err = json.loads(await ws2.recv())
        assert (err["type"], err["code"]) == ("error", 404)


@BOTH
async def test_ws_generation_that_ends_after_its_socket_leaves_no_pinned_kv(server) -> None:
    """A socket's conversation KV is unpinned when it closes (scheduler pins); a
    generation that ran on after the close and then ended must not leave its KV pinned."""
    await asyncio.to_thread(server.wait_kv_free, 10)
    ws = await websockets.connect(ws_url(server))
    await ws.send(generate("short", max_tokens=120))
    await ws_frames(ws, "short", lambda f: f["type"] == "delta")
    ws.transport.abort()
    await asyncio.to_thread(wait_for, lambda: not busy(server), 10, "the generation to end")
    # num_used counts pinned free blocks too (they wait in their own queue).
    await asyncio.to_thread(wait_for, lambda: kv_used(server) == 0, 5,
                            "its KV to be unpinned")  # fmt: skip


# ------------------------------------------------------- the total cap and the metrics
def metric(server: LiveServer, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


def stream_state(server: LiveServer, rid: str) -> tuple[bool, bool, str]:
    """(done, detached, lost_why) of an SSE stream's log."""

    def read() -> tuple[bool, bool, str]:
        log = server.state.streams.find(key_tenant(KEY_A), "sse", rid)
        assert log is not None
        return log.done, log.detached, log.lost_why

    return server.on_loop(read)


async def _cut_after(http: aiohttp.ClientSession, server: LiveServer, max_tokens: int) -> tuple:
    """A stream cut after 3 events: (its id, the events its client got)."""
    r = await http.post(server.url + "/v1/completions", json=completion(max_tokens=max_tokens))
    events = await read_events(r, until=3)
    cut(r)
    return json.loads(events[-1]["data"])["id"], events


async def test_detached_streams_share_a_total_cap_oldest_aborted_first(server, http) -> None:
    """Two finished-but-unread streams that each fit the total cap but not together: the
    one detached first is dropped (410 naming the flag), the newer still resumes in full;
    a running stream over the cap is aborted at once, its KV freed.  /metrics counts it."""
    streams = server.state.streams
    await asyncio.to_thread(wait_logs_drained, server)
    assert server.on_loop(lambda: (len(streams.detached), streams.detached_bytes)) == (0, 0)
    url = server.url + "/v1/completions"
    want = await reference(http, url, completion(max_tokens=30), chat=False)
    await asyncio.to_thread(wait_logs_drained, server)  # its log too (kept for the grace)
    expired = metric(server, "pagestream_resume_streams_expired_total", reason="memory")
    resumed = metric(server, "pagestream_resume_streams_resumed_total")
    total = streams.total_cap
    try:
        old, _ = await _cut_after(http, server, 30)
        await asyncio.to_thread(wait_for, lambda: stream_state(server, old)[:2] == (True, True),
                                10, "the first stream to end, detached")  # fmt: skip
        size = server.on_loop(lambda: streams.detached_bytes)
        assert size > 0 and metric(server, "pagestream_resume_buffered_bytes") == size
        assert metric(server, "pagestream_resume_streams_detached") == 1
        # Either stream fits alone; both do not.
        server.on_loop(lambda: setattr(streams, "total_cap", size * 3 // 2))
        new, events = await _cut_after(http, server, 30)
        await asyncio.to_thread(wait_for, lambda: stream_state(server, new)[:2] == (True, True),
                                10, "the second stream to end, detached")  # fmt: skip
        assert stream_state(server, old) == (True, False, "memory")
        async with http.get(f"{server.url}/v1/streams/{old}",
                            headers={"Last-Event-ID": "3"}) as gone:  # fmt: skip
            body = await gone.json()
            assert gone.status == 410 and "--resume-buffer-total-bytes" in body["error"]["message"]
        async with http.get(f"{server.url}/v1/streams/{new}",
                            headers={"Last-Event-ID": events[-1]["id"]}) as r:  # fmt: skip
            events += (await read_events(r))[1:]
        check_positions(events)
        assert answer(events, chat=False) == want
        assert metric(server, "pagestream_resume_streams_resumed_total") == resumed + 1
        # A running stream alone past the cap: aborted well before its grace period.
        server.on_loop(lambda: setattr(streams, "total_cap", 4096))
        t0 = time.monotonic()
        running, _ = await _cut_after(http, server, 1800)
        await asyncio.to_thread(server.wait_kv_free, GRACE)
        assert time.monotonic() - t0 < GRACE
        assert stream_state(server, running)[2] == "memory"
        assert metric(server, "pagestream_resume_streams_expired_total",
                      reason="memory") == expired + 2  # fmt: skip
    finally:
        server.on_loop(lambda: setattr(streams, "total_cap", total))
    await asyncio.to_thread(wait_logs_drained, server)
    assert metric(server, "pagestream_resume_streams_detached") == 0
    assert metric(server, "pagestream_resume_buffered_bytes") == 0


def test_total_cap_flag() -> None:
    from service.cli import build_parser, server_config

    a = build_parser().parse_args(["serve", "--resume-buffer-total-bytes", "12345"])
    assert server_config(a).resume_buffer_total_bytes == 12345
    d = build_parser().parse_args(["serve"])
    assert server_config(d).resume_buffer_total_bytes == 64 << 20
