"""Back-pressure with real clients that stop reading (tiny receive buffers, loopback):
their generations are aborted and their KV blocks freed, the WebSocket is closed with
1008 and a reason, the SSE connection is dropped, and a normal client beside them
never notices."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.checkpoints import tiny_checkpoint
from tests.reliability.clients import sse_completion
from tests.reliability.slow_client import RawSSE, RawWebSocket
from tests.service.live_server import live_server


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


# The engine in a child process too (`serve --engine-process`): the abort of a slow
# reader's generations crosses the boundary, and the KV check reads the child's pool.
@pytest.fixture(scope="module", params=[False, True], ids=["inline", "engine-process"])
def server(model, request):
    with live_server(
        model,
        engine_process=request.param,
        max_buffered_bytes=16 << 10,
        send_timeout=5.0,
        socket_send_buffer=16 << 10,
        engine_kwargs={"num_kv_blocks": 1024},
    ) as s:
        yield s


def slow_count(server, transport: str) -> float:
    m = server.state.metrics
    return m.slow_clients.labels(m.model_name, transport)._value.get()


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_websocket_reader_that_stops_is_aborted_and_closed_1008(server):
    before = slow_count(server, "ws")
    ws = await asyncio.to_thread(RawWebSocket, server.config.port)
    try:
        for i in range(32):
            ws.send_json({"type": "generate", "id": f"g{i}", "prompt": [5, 6, 7 + i],
                          "params": {"max_tokens": 400, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        # A well-behaved client on another connection, at the same time.
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [9, 9, 9], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            good = await asyncio.wait_for(sse_completion(s, server.url, body), 120)
        assert good.finish == "length" and good.done
        # Not reading: the server gives up on it, aborts its 32 generations, frees blocks.
        await asyncio.to_thread(wait_for, lambda: slow_count(server, "ws") > before, 90, "1008")
        await asyncio.to_thread(server.wait_kv_free, 10)
        # Reading now, the client finds what was buffered, then the close frame.
        code, reason, frames = await asyncio.to_thread(ws.read_until_close)
        assert code == 1008 and "too slow" in reason, (code, reason, frames)
        assert frames > 0
    finally:
        ws.close()


async def test_sse_reader_that_stops_is_dropped_and_aborted(server):
    before = slow_count(server, "sse")
    body = {"prompt": [4, 4, 4], "max_tokens": 500, "temperature": 0.0, "ignore_eos": True,
            "n": 8, "logprobs": 20}  # fmt: skip
    sse = await asyncio.to_thread(RawSSE, server.config.port, body)
    try:
        await asyncio.to_thread(wait_for, lambda: slow_count(server, "sse") > before, 90, "abort")
        await asyncio.to_thread(server.wait_kv_free, 10)
        n, finished = await asyncio.to_thread(sse.drain)
        assert n > 0 and not finished  # cut off, never completed
        # And the request did not run to its end: it was aborted.
        assert server.num_running() == 0
    finally:
        sse.close()
