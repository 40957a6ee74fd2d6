"""The engine's process compiles a request's grammar again before it takes the add (the
server's process compiled it to check it): that compile, up to two COMPILE_TIMEOUT_S
(the worker's check, then the compile), must hold up no other request's messages, as in
one process each handler compiles its own, while the messages for that request (an
abort) and for its conversation (a closed socket's release) still come after its add.

The child's engine comes from a builder that makes a marked schema's compile take
DELAY seconds there (a schema that compiles for seconds, deterministic); the server,
the child, the clients and the sockets are real."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
import websockets

from scheduler.config import EngineConfig
from service.app import ServerConfig
from service.async_engine import AsyncEngine
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import LiveServer

DELAY = 2.5
MARK = "slowcompilemarker"
KEY = "grammar-proc-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW = {"type": "object", "properties": {MARK: {"type": "integer"}}, "required": [MARK]}


def slow_compile_builder(config: EngineConfig) -> AsyncEngine:
    """Runs in the engine's process: the engine, with MARK's compile DELAY s longer."""
    engine = AsyncEngine.from_config(config)
    compile_grammar = engine.compile_grammar

    async def slow(params) -> None:  # type: ignore[no-untyped-def]
        so = params.structured_outputs
        if so is not None and MARK in str(so.json):
            await asyncio.sleep(DELAY)
        await compile_grammar(params)

    engine.compile_grammar = slow  # type: ignore[method-assign]
    return engine


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    args = EngineConfig.from_kwargs(
        model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=256, threads=1,
        engine_process=True,
    )  # fmt: skip
    engine = AsyncEngine.in_process(args, slow_compile_builder)
    # Grace 0: a dropped stream is aborted at once (not kept for a resume).
    srv = LiveServer(ServerConfig(engine=args, api_keys=[KEY], resume_grace=0), engine)
    try:
        yield srv.start()
    finally:
        srv.stop()
        assert engine.core._proc.poll() is not None  # type: ignore[union-attr]


def aborted(server: LiveServer) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^pagestream_request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                  text, re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


def body(**kw) -> dict:  # type: ignore[no-untyped-def]
    return {"prompt": "hi", "max_tokens": 4, "temperature": 0, **kw}


async def test_a_compiling_grammar_holds_up_no_other_request(server) -> None:
    url = server.url + "/v1/completions"
    async with aiohttp.ClientSession(headers=AUTH) as s:

        async def timed(b: dict) -> tuple[int, float, dict]:
            t0 = time.monotonic()
            async with s.post(url, json=b) as r:
                return r.status, time.monotonic() - t0, await r.json()

        slow = asyncio.create_task(timed(body(guided_json=SLOW)))
        await asyncio.sleep(0.5)  # checked here; the child compiles it now
        assert not slow.done()
        took = []
        for i in range(3):
            status, t, obj = await timed(body(prompt=f"plain {i}"))
            assert status == 200, obj
            took.append(t)
        # Was: each waited in the child's reader behind the compile (DELAY).
        assert max(took) < DELAY / 3, took
        status, t, obj = await slow
        assert status == 200 and t >= DELAY, (status, t, obj)
        assert MARK in obj["choices"][0]["text"] or obj["choices"][0]["finish_reason"]
    await asyncio.to_thread(server.wait_kv_free, 10)


async def test_an_abort_while_its_grammar_compiles_comes_after_its_add(server) -> None:
    """The client leaves while the child compiles its grammar: the abort waits for the
    add there, so the request is aborted, not run to its end nor left held."""
    n = await asyncio.to_thread(aborted, server)
    url = server.url + "/v1/completions"
    long = body(guided_json=SLOW, max_tokens=2000, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession(headers=AUTH) as s:
        r = await s.post(url, json=long)
        assert r.status == 200
        await asyncio.sleep(0.5)
        assert r.connection is not None and r.connection.transport is not None
        r.connection.transport.abort()
        r.close()
    await asyncio.to_thread(server.wait_kv_free, DELAY + 10)
    assert await asyncio.to_thread(aborted, server) == n + 1


async def test_a_socket_closed_while_its_grammar_compiles_leaves_no_pin(server) -> None:
    """A keyed WebSocket pins its conversation's KV; closed while the child compiles a
    generation's grammar, its release must come after that add (and its abort), or the
    add would pin KV that no release frees."""
    ws_url = server.ws_url + f"?api_key={KEY}"
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "prompt": list(range(20, 70)),
                                  "params": {"max_tokens": 8, "structured_outputs": {"json": SLOW}}}))  # fmt: skip
        await asyncio.sleep(0.5)
    await asyncio.to_thread(server.wait_kv_free, DELAY + 10)
    await asyncio.to_thread(no_pins, server)
    # A socket that stays: its generation pins, its close releases.
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "h", "prompt": list(range(20, 70)),
                                  "params": {"max_tokens": 4}}))  # fmt: skip
        while json.loads(await ws.recv())["type"] != "done":
            pass
        assert (await asyncio.to_thread(server.debug_counts))["conversation_pins"] == 1
    await asyncio.to_thread(no_pins, server)


def no_pins(server: LiveServer, timeout: float = 10.0) -> None:
    """Until no conversation holds a pin (a closed socket's release follows its
    generations' ends)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = server.debug_counts()
        if not counts["conversation_pins"] and not counts["kv_blocks_pinned"]:
            return
        assert time.monotonic() < deadline, f"a pin outlived its socket: {counts}"
        time.sleep(0.05)


async def test_the_idle_check_sees_a_request_on_either_side(server) -> None:
    """live_server's KV/idle check reads the child through its query path: a request
    running there (its KV held) shows, so the suites' leak checks can fail here."""
    url = server.url + "/v1/completions"
    long = body(max_tokens=300, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession(headers=AUTH) as s:
        r = await s.post(url, json=long)
        assert r.status == 200
        await r.content.readline()
        busy = await asyncio.to_thread(server._busy)
        assert busy.get("kv_blocks_held") and busy.get("requests"), busy
        assert busy.get("server_streams"), busy
        r.close()
    await asyncio.to_thread(server.wait_kv_free, 10)
