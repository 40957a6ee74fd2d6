"""The engine actor's waiting-queue bound: the one place that says "overloaded"."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.engine_core import EngineCore, EngineOverloaded
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.helpers import make_group


class _Exec:
    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner

    async def execute(self, so):
        await asyncio.sleep(0)
        return self.runner.execute_model(so)


def _core(**bounds) -> EngineCore:
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=1, max_model_len=256)
    return EngineCore(Scheduler(cfg), _Exec(FakeRunner(64, 4)), **bounds)


async def test_bound_counts_inbox_and_queue_and_frees_up():
    core = _core(max_waiting_requests=3)
    core.start()
    try:
        streams = [core.add(make_group(f"r{i}", [1, 2, 3], 50)) for i in range(3)]
        with pytest.raises(EngineOverloaded):
            core.add(make_group("r3", [1, 2, 3], 50))
        # n samples count as n sequences; a multi-group admit is all or nothing.
        with pytest.raises(EngineOverloaded):
            core.admit([make_group("x", [1], 5, n=2)])
        assert core.num_rejected == 2
        # Once the first runs (max_num_seqs=1), one slot opens.
        for _ in range(200):
            if core.queued()[0] < 3:
                break
            await asyncio.sleep(0.01)
        core.add(make_group("r4", [1, 2, 3], 2))
        for gid in ("r0", "r1", "r2"):
            core.abort(gid)
        for s in streams:
            while not s.finished:
                await s.get()
        await asyncio.wait_for(core.idle.wait(), 10)
        assert core.queued() == (0, 0)
    finally:
        await core.stop()


async def test_token_bound():
    core = _core(max_waiting_tokens=10)
    core.add(make_group("a", list(range(1, 7)), 5))
    with pytest.raises(EngineOverloaded, match="prompt tokens"):
        core.add(make_group("b", list(range(1, 7)), 5))
    core.add(make_group("c", [1, 2, 3, 4], 5))
    assert core.queued() == (2, 10)


def test_unbounded_by_default():
    core = _core()
    for i in range(100):
        core.add(make_group(f"r{i}", [1, 2], 5))
    assert core.queued()[0] == 100
