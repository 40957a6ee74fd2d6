"""Tensor parallelism through a real `pagestream serve --tensor-parallel-size 2`: the
server answers what TP=1 answers; a killed rank fails the streams in flight and ends the
process with the engine-failure exit code; a hung rank times out instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from scheduler.sampling_params import SamplingParams
from service.app import ENGINE_FAILURE_EXIT
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.reliability.clients import completion, sse_completion
from tests.reliability.test_faults_live import _wait_health
from tests.service.live_server import free_port

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [300] * 20]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama", num_hidden_layers=2))


def tp_workers(pid: int) -> list[int]:
    """The server's rank processes (they name themselves pagestream-tp<rank>)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().startswith("pagestream-tp"):
                out.append(int(child))
    return out


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip


@pytest.mark.slow
async def test_server_matches_tp1_then_a_killed_rank_ends_it(model, tmp_path):
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", model, "--port", str(port),
         "--num-kv-blocks", "64", "--dtype", "float32", "--tensor-parallel-size", "2",
         "--tensor-parallel-timeout", "20"],
        stdout=log_file, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        try:
            _wait_health(url, proc, timeout=180)
        except (TimeoutError, RuntimeError) as e:
            raise AssertionError((tmp_path / "server.log").read_text()[-4000:]) from e
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(completion(s, url, body(p, 8)) for p in PROMPTS))
            assert [g.token_ids for g in got] == want
            workers = tp_workers(proc.pid)
            assert len(workers) == 1, workers
            stream = asyncio.ensure_future(sse_completion(s, url, body([9, 10], 900)))
            await asyncio.sleep(0.5)  # streaming by now
            os.kill(workers[0], signal.SIGKILL)
            seen = await asyncio.wait_for(stream, 60)
            assert seen.status == 200 and seen.token_ids, seen
            assert seen.error is not None and seen.error["code"] == 503 and not seen.finish, seen
        try:
            rc = proc.wait(60)
        finally:
            log = (tmp_path / "server.log").read_text()
            print(log[-5000:])
        assert rc == ENGINE_FAILURE_EXIT, log
        assert "engine failed" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_hung_rank_times_out(model):
    """A stopped (not dead) rank: rank 0's collective gives up after the timeout, the
    request fails, and shutting down reaps the stopped process."""
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, tensor_parallel_size=2,
              tensor_parallel_timeout=5)  # fmt: skip
    executor = llm.engine.executor
    (pid,) = executor.worker_pids
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception, match=r"(?i)engine|timed out|failed"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
        assert time.monotonic() - t0 < 30
        assert llm.engine.dead is not None
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in executor._procs)


@pytest.mark.slow
def test_rank_exiting_while_idle_fails_the_engine_at_once(model):
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "pagestream-tp1" in str(llm.engine.dead)
        with pytest.raises(Exception, match="engine"):
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.shutdown()
