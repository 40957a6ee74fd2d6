"""EngineCore(own_thread=True): the engine on its own thread and loop, the consumers on
theirs.  Outputs cross once per step and arrive whole and in order; admission bounds hold
(from the engine's snapshot of its queue); a dying engine fails every stream and its
future; a message posted from a third thread reaches it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scheduler.engine_core import (
    EngineCore,
    EngineDeadError,
    EngineOverloaded,
    ExecutorFailed,
    StepInfo,
)
from scheduler.executor import ThreadExecutor
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.helpers import make_group
from tests.scheduler.test_faults import VOCAB, ExplodingRunner, _collect


def _core(runner=None, **kw) -> tuple[EngineCore, ThreadExecutor]:
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_model_len=256)
    ex = ThreadExecutor(runner or FakeRunner(64, 4, VOCAB))
    return EngineCore(Scheduler(cfg), ex, own_thread=True, **kw), ex


async def _until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_outputs_cross_whole_and_in_order_once_per_step():
    steps: list[tuple[int, int]] = []  # (thread id, rows) of each step, on the engine side

    def on_step(info: StepInfo) -> None:
        steps.append((threading.get_ident(), len(info.mo.req_ids)))

    core, ex = _core(on_step=on_step)
    core.start()
    try:
        streams = [core.add(make_group(f"r{i}", [1, 2, 3 + i], 12, n=1 + i % 2)) for i in range(6)]
        wakes = [0] * len(streams)

        async def consume(i: int) -> dict[str, list[int]]:
            toks: dict[str, list[int]] = {}
            while not streams[i].finished:
                for u in await streams[i].get():
                    toks.setdefault(u.req_id, []).extend(u.new_token_ids)
                wakes[i] += 1
            return toks

        outs = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(6))), 10)
        for i, toks in enumerate(outs):
            assert len(toks) == 1 + i % 2 and all(len(t) == 12 for t in toks.values())
            assert wakes[i] <= len(steps)  # at most once a step
        assert {t for t, _ in steps} == {core._loop_thread}
        assert core._loop_thread != threading.get_ident()
        await _until(lambda: not core.streams and core.idle.is_set())
    finally:
        await core.stop()
        ex.shutdown()
    assert core._thread is None


class _SlowRunner(FakeRunner):
    """20 ms a step: a running request stays running while the test looks."""

    def execute_model(self, so):
        time.sleep(0.02)
        return super().execute_model(so)


async def test_admission_bound_from_the_snapshot():
    core, ex = _core(_SlowRunner(64, 4, VOCAB), max_waiting_requests=3, max_waiting_tokens=40)
    cfg = core.scheduler.config
    cfg.max_num_seqs = 1  # one runs, the others wait
    core.start()
    try:
        # The engine thread may take r0 into the running seat at any moment after its add,
        # so the bound is probed once that has happened (then only the queue moves: r0
        # runs 200 tokens of 20 ms steps).
        streams = [core.add(make_group(f"r{i}", [1, 2, 3], 200)) for i in range(3)]
        await _until(lambda: core.queued()[0] < 3)  # the first one runs
        assert core.queued() == (2, 6)
        streams.append(core.add(make_group("r3", [1, 2, 3], 2)))  # the third waiting seat
        with pytest.raises(EngineOverloaded, match="sequences"):
            core.add(make_group("r4", [1, 2, 3], 2))
        assert core.queued() == (3, 9)
        for gid in ("r0", "r1", "r2", "r3"):
            core.abort(gid)
        for s in streams:
            await asyncio.wait_for(_collect(s), 10)
        await _until(lambda: core.queued() == (0, 0) and core.idle.is_set())
        # and the token bound: 40 prompt tokens wait at most
        core.add(make_group("long", list(range(1, 36)), 200))
        await _until(lambda: core.queued()[0] == 0)  # it runs
        streams = [core.add(make_group("w1", list(range(1, 31)), 2))]
        with pytest.raises(EngineOverloaded, match="tokens"):
            core.add(make_group("w2", list(range(1, 12)), 2))
        for gid in ("long", "w1"):
            core.abort(gid)
        await asyncio.wait_for(_collect(streams[0]), 10)
        await _until(lambda: core.queued() == (0, 0) and core.idle.is_set())
    finally:
        await core.stop()
        ex.shutdown()


class _GatedExplodingRunner(ExplodingRunner):
    """Steps once the test has queued every request: the engine thread would otherwise
    reach the failing step with the first one alone while a loaded machine keeps the test
    from adding the rest."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def execute_model(self, so):
        assert self.gate.wait(10)
        return super().execute_model(so)


async def test_engine_failure_fails_every_stream_and_its_future():
    runner = _GatedExplodingRunner(64, 4, VOCAB, explode_at=3)
    core, ex = _core(runner)
    task = core.start()
    try:
        streams = [core.add(make_group(f"r{i}", [1, 2, 3 + i], 50)) for i in range(4)]
        runner.gate.set()
        for s in streams:
            with pytest.raises(EngineDeadError, match=r"step 3|fell over"):
                await asyncio.wait_for(_collect(s), 10)
        with pytest.raises(Exception, match="fell over"):
            await task
        with pytest.raises(EngineDeadError):
            core.add(make_group("late", [1, 2], 4))
    finally:
        await core.stop()
        ex.shutdown(wait=False)


async def test_a_message_from_a_third_thread_reaches_the_engine():
    core, ex = _core()
    task = core.start()
    try:
        await asyncio.wait_for(_collect(core.add(make_group("a", [1, 2, 3], 4))), 10)
        t = threading.Thread(target=core.post, args=(ExecutorFailed(RuntimeError("rank gone")),))
        t.start()
        t.join()
        with pytest.raises(RuntimeError, match="rank gone"):
            await asyncio.wait_for(task, 10)
    finally:
        await core.stop()
        ex.shutdown(wait=False)
