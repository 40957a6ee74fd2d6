"""Tensor parallelism under the engine process (`serve --tensor-parallel-size 2
--engine-process`): the engine's process builds the TP executor, whose rank process is
its child.  The server answers what TP without the process answers; a SIGKILLed server
leaves neither its engine process nor the rank behind; a killed rank fails the streams in
flight and ends the server with the engine-failure exit code, engine process and all."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from scheduler.sampling_params import SamplingParams
from service.app import ENGINE_FAILURE_EXIT
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.reliability.clients import completion, sse_completion
from tests.reliability.test_tp_live import PROMPTS, body, tp_workers
from tests.service.test_engine_process import engine_children, server, wait_gone


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama", num_hidden_layers=2))


def _args(model: str) -> list[str]:
    return ["--model", model, "--num-kv-blocks", "64", "--dtype", "float32",
            "--tensor-parallel-size", "2", "--tensor-parallel-timeout", "20",
            "--engine-process"]  # fmt: skip


def _engine_and_rank(pid: int) -> tuple[int, int]:
    (kid,) = engine_children(pid)
    assert tp_workers(pid) == [], "a rank is the engine process's child, not the server's"
    (rank,) = tp_workers(kid)
    return kid, rank


@pytest.mark.slow
async def test_tp_in_the_engine_process_matches_tp_and_dies_with_a_killed_server(model, tmp_path):
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
             tensor_parallel_size=2) as llm:  # fmt: skip
        want = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]  # fmt: skip
    with server(tmp_path, "service.cli", *_args(model)) as (proc, url):
        kid, rank = _engine_and_rank(proc.pid)
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(completion(s, url, body(p, 8)) for p in PROMPTS))
        assert [g.token_ids for g in got] == want
        proc.kill()
        proc.wait(10)
        assert await asyncio.to_thread(wait_gone, kid, 10), "the engine process outlived it"
        assert await asyncio.to_thread(wait_gone, rank, 20), "the rank outlived the server"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["streaming", "idle"])
async def test_a_killed_rank_ends_the_engine_process_and_the_server(model, tmp_path, when):
    """Streaming: the step's collective fails, the stream ends with 503.  Idle: the rank
    watcher in the engine's process fails the engine at once, naming the rank."""
    with server(tmp_path, "service.cli", *_args(model)) as (proc, url):
        kid, rank = _engine_and_rank(proc.pid)
        if when == "idle":
            os.kill(rank, signal.SIGKILL)
        else:
            async with aiohttp.ClientSession() as s:
                stream = asyncio.ensure_future(sse_completion(s, url, body([9, 10], 900)))
                await asyncio.sleep(0.5)  # streaming by now
                os.kill(rank, signal.SIGKILL)
                seen = await asyncio.wait_for(stream, 60)
            assert seen.status == 200 and seen.token_ids, seen
            assert seen.error is not None and seen.error["code"] == 503 and not seen.finish
        assert await asyncio.to_thread(proc.wait, 60) == ENGINE_FAILURE_EXIT
        assert await asyncio.to_thread(wait_gone, kid, 10)
        log = next(Path(tmp_path).glob("server-*.log")).read_text()
        assert "engine failed" in log, log[-3000:]
        if when == "idle":
            assert "pagestream-tp1" in log, log[-3000:]
