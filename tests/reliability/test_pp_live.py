"""Pipeline parallelism across two "hosts": two `pagestream serve` process trees on
loopback (node 0 serves the API and holds stage 0, node 1 runs stage 1 only), joined by
torch.distributed's rendezvous.  Node 0 answers over HTTP what PP=1 answers; a killed
rank on node 1 fails the streams in flight and ends both nodes with the engine-failure
exit code.  In one process tree: a hung stage times out, a stage exiting while idle
fails the engine at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import aiohttp
import pytest

from scheduler.sampling_params import SamplingParams
from service.app import ENGINE_FAILURE_EXIT
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.reliability.clients import completion, sse_completion
from tests.reliability.test_faults_live import _wait_health
from tests.reliability.test_tp_live import PROMPTS, body, tp_workers
from tests.service.live_server import free_port


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama", num_hidden_layers=2))


def _port_pair() -> int:
    """A free port whose successor is free too (the rendezvous, then the step port)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _serve(model: str, log: Path, *extra: str) -> subprocess.Popen:
    with log.open("w") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--model", model, "--dtype",
             "float32", "--num-kv-blocks", "64", "--pipeline-parallel-size", "2", "--nnodes",
             "2", "--master-addr", "127.0.0.1", "--tensor-parallel-timeout", "30", *extra],
            stdout=out, stderr=subprocess.STDOUT, text=True,
            # faulthandler: a SIGABRT (_stacks) writes every thread's stack to the log.
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip


def _stacks(nodes: tuple[subprocess.Popen, ...], logs: tuple[Path, ...]) -> str:
    """Every process of both trees aborted with its stacks written to its node's log; the
    logs' tails (what a start that never finished was waiting on)."""
    pids = [p.pid for p in nodes if p.poll() is None]
    for pid in [*pids, *(w for node in pids for w in tp_workers(node))]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGABRT)
    time.sleep(2)
    for p in nodes:
        p.kill()
        p.wait()

    def tail(log: Path) -> str:  # without the probes' access lines
        lines = [ln for ln in log.read_text().splitlines() if "pagestream.access" not in ln]
        return "\n".join(lines)[-8000:]

    return "".join(f"--- {log.name}\n{tail(log)}\n" for log in logs)


def _two_nodes(model: str, tmp_path: Path) -> tuple[subprocess.Popen, subprocess.Popen, str, Path]:
    """Node 1, then node 0; returns once node 0's /health and node 1's answer 200 (and node
    0's log).  A start that hangs is retried once on fresh ports, every process's stacks
    kept as a warning: one hung in ~1 of 4 runs of this file right after a heavy job on a
    2-core machine (node 0's /health 503 for minutes, node 1 past spawning its rank), the
    cause not yet known."""
    for attempt in range(2):
        master, http, http1 = _port_pair(), free_port(), free_port()
        url = f"http://127.0.0.1:{http}"
        logs = tmp_path / f"node0.{attempt}.log", tmp_path / f"node1.{attempt}.log"
        # Node 1 first: its ranks wait for node 0 (as on hosts that start in any order).  It
        # serves no API, only /health and /live for the probes of a shared pod template.
        node1 = _serve(model, logs[1], "--node-rank", "1", "--master-port", str(master),
                       "--port", str(http1))  # fmt: skip
        node0 = _serve(model, logs[0], "--node-rank", "0", "--master-port", str(master),
                       "--port", str(http))  # fmt: skip
        try:
            _wait_health(url, node0, timeout=120 if attempt == 0 else 240)
            _wait_health(f"http://127.0.0.1:{http1}", node1, timeout=10)
        except (TimeoutError, RuntimeError) as e:
            stacks = _stacks((node0, node1), logs)
            if attempt == 1:
                raise AssertionError(stacks) from e
            warnings.warn(f"two-node start hung ({e}); retrying on fresh ports:\n{stacks}",
                          stacklevel=2)  # fmt: skip
            continue
        return node0, node1, url, logs[0]
    raise AssertionError("unreachable")


def _ended_with_engine_failure(node0: subprocess.Popen, node1: subprocess.Popen, log: Path):
    try:
        codes = node0.wait(60), node1.wait(60)
        text = log.read_text()
        assert codes == (ENGINE_FAILURE_EXIT, ENGINE_FAILURE_EXIT), (codes, text[-3000:])
        assert "engine failed" in text, text[-3000:]
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
async def test_two_nodes_serve_through_node0_then_a_killed_remote_rank_ends_both(model, tmp_path):
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]  # fmt: skip
    node0, node1, url, log0 = _two_nodes(model, tmp_path)
    try:
        assert tp_workers(node0.pid) == []  # node 0 runs rank 0 in the server only
        (rank1,) = tp_workers(node1.pid)
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(completion(s, url, body(p, 8)) for p in PROMPTS))
            assert [g.token_ids for g in got] == want
            stream = asyncio.ensure_future(sse_completion(s, url, body([9, 10], 900)))
            await asyncio.sleep(0.5)  # streaming by now
            os.kill(rank1, signal.SIGKILL)
            seen = await asyncio.wait_for(stream, 60)
            assert seen.status == 200 and seen.token_ids, seen
            assert seen.error is not None and seen.error["code"] == 503 and not seen.finish, seen
    finally:
        _ended_with_engine_failure(node0, node1, log0)


@pytest.mark.slow
def test_remote_rank_exiting_while_idle_ends_both_at_once(model, tmp_path):
    """No request in flight: node 0 sees the remote rank's step connection close."""
    node0, node1, _url, log0 = _two_nodes(model, tmp_path)
    try:
        (rank1,) = tp_workers(node1.pid)
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        node0.wait(30)
        assert time.monotonic() - t0 < 30
        assert "closed its connection" in log0.read_text()
    finally:
        _ended_with_engine_failure(node0, node1, log0)


@pytest.mark.slow
def test_hung_stage_times_out(model):
    """A stopped (not dead) last stage: rank 0 gives up on its output after the timeout,
    the request fails, and shutting down reaps the stopped process."""
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, pipeline_parallel_size=2,
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
def test_stage_exiting_while_idle_fails_the_engine_at_once(model):
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, pipeline_parallel_size=2)
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
