"""The HTTP loop never waits on the engine (issue 47): a real server process
(bench/host_server.py: the real server around a stand-in model) whose steps take 200 ms,
on the device (GIL-free) or as host work on the engine's side (pure Python holding the
GIL); meanwhile `/health` answers within 50 ms and no SSE stream's chunks are spaced more
than 100 ms past the step period.  With the engine inline on the HTTP loop, 200 ms of host
work a step holds `/health` up: the control that shows the probe can fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import server_process

STEP_S = 0.2
HEALTH_BUDGET_S = 0.05
GAP_SLACK_S = 0.1


@contextlib.contextmanager
def host_server(tmp_path: Path, *args: str) -> Iterator[str]:
    model = str(tiny_checkpoint("llama"))
    with server_process(tmp_path, "bench.host_server", "--model", model, *args,
                        graceful=True) as (_, url):  # fmt: skip
        yield url


async def probe(url: str, streams: int = 4, tokens: int = 6) -> tuple[float, float, int]:
    """SSE streams of `tokens` tokens each, with `/health` polled every 10 ms beside them:
    (slowest /health, largest gap between two chunks of one stream, chunks received)."""
    health_max = 0.0
    gap_max = 0.0
    chunks = 0
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def stream(i: int) -> None:
            nonlocal gap_max, chunks
            body = {"model": model, "prompt": f"hello {i}", "max_tokens": tokens,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                last = None
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    assert "choices" in json.loads(line[6:])
                    now = time.perf_counter()
                    if last is not None:
                        gap_max = max(gap_max, now - last)
                    last = now
                    chunks += 1

        async def poll() -> None:
            nonlocal health_max
            while not done.is_set():
                t0 = time.perf_counter()
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                    await r.read()
                health_max = max(health_max, time.perf_counter() - t0)
                await asyncio.sleep(0.01)

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.05)  # the poller's connection is open before the steps start
        health_max = 0.0
        await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(streams))), 60)
        done.set()
        await poller
    return health_max, gap_max, chunks


@pytest.mark.parametrize("where", ["device", "host"])
async def test_health_and_streams_flow_while_a_step_runs_200ms(tmp_path, where):
    step = ["--step-ms", "200"] if where == "device" else ["--host-ms", "200"]
    with host_server(tmp_path, *step, "--engine-thread", "on") as url:
        health_max, gap_max, chunks = await probe(url)
    assert chunks >= 4 * 6
    assert health_max < HEALTH_BUDGET_S, f"/health took {health_max * 1e3:.0f} ms"
    assert gap_max < STEP_S + GAP_SLACK_S, f"a stream waited {gap_max * 1e3:.0f} ms"


async def test_inline_engine_holds_health_up_for_its_host_work(tmp_path):
    with host_server(tmp_path, "--host-ms", "200", "--engine-thread", "off") as url:
        health_max, _, _ = await probe(url)
    assert health_max > 2 * HEALTH_BUDGET_S, f"/health took only {health_max * 1e3:.0f} ms"
