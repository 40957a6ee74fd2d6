"""Request-scoped failures (ModelOutput.errors) and engine-scoped ones, without torch."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.engine_core import EngineCore, EngineDeadError, ExecutorFailed
from scheduler.executor import ThreadExecutor
from scheduler.faults import FaultPlan, InjectedFault
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import assert_pool_consistent, drive, make_group

VOCAB = 1000


class FailingRunner(FakeRunner):
    """The fake runner, reporting an error for chosen requests at their k-th sample, as
    the real runner does when one request's sampling fails."""

    def __init__(self, *a, fail: dict[str, int], **kw) -> None:
        super().__init__(*a, **kw)
        self.fail = fail
        self.samples: dict[str, int] = {}

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        out = super().execute_model(so)
        keep = [], []
        for rid, tok in zip(out.req_ids, out.sampled_token_ids, strict=True):
            k = self.samples.get(rid, 0)
            self.samples[rid] = k + 1
            if self.fail.get(rid) == k:
                out.errors[rid] = f"injected failure of {rid}"
            else:
                keep[0].append(rid)
                keep[1].append(tok)
        out.req_ids, out.sampled_token_ids = keep
        return out


@pytest.mark.parametrize("fail_at", [0, 3])
def test_one_failed_request_leaves_the_others_identical(fail_at):
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] * (i + 2) for i in range(6)}
    sched = Scheduler(
        SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    )
    runner = FailingRunner(64, 4, VOCAB, fail={"r2": fail_at})
    run = drive(sched, runner, {0: [make_group(r, p, 12) for r, p in prompts.items()]})
    assert run.finish["r2"] == "error"
    assert len(run.outputs.get("r2", [])) == fail_at
    for rid, p in prompts.items():
        if rid != "r2":
            assert run.outputs[rid] == reference_generate(p, 12, VOCAB, None), rid
            assert run.finish[rid] == "length"
    assert_pool_consistent(sched)
    assert sched.kv.pool.num_free == 64 and not sched.requests and not runner.known


def test_failed_parent_finishes_its_forked_children():
    sched = Scheduler(
        SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    )
    runner = FailingRunner(64, 4, VOCAB, fail={"p": 0})
    other = [5, 6, 7, 8, 9]
    run = drive(sched, runner, {0: [make_group("p", [1, 2, 3, 4, 5, 6], 8, n=4),
                                   make_group("q", other, 8)]})  # fmt: skip
    for rid in ("p", "p#1", "p#2", "p#3"):
        assert run.finish[rid] == "error", rid
    assert run.outputs["q"] == reference_generate(other, 8, VOCAB, None)
    assert sched.kv.pool.num_free == 64 and not sched.groups and not runner.known


def test_failed_request_leaves_no_unwritten_block_in_the_prefix_cache():
    sched = Scheduler(
        SchedulerConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    )
    runner = FailingRunner(32, 4, VOCAB, fail={"a": 0})
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    drive(sched, runner, {0: [make_group("a", prompt, 4)]})
    # Its blocks may not have been written (a runner may drop a failed request from the
    # batch), so they must not be offered as prefix hits.
    assert not sched.kv.pool.cached
    run = drive(sched, runner, {0: [make_group("b", prompt, 4)]})
    assert run.outputs["b"] == reference_generate(prompt, 4, VOCAB, None)


def test_fault_plan_parsing():
    plan = FaultPlan.parse("sample-token=7@2, register-token=9,detok-token=11,step=5")
    assert plan is not None and plan.sample == {7: 2} and plan.register == {9}
    assert plan.detok == {11: 0} and plan.steps == {5}
    assert FaultPlan.parse("") is None
    for bad in ("explode=1", "sample-token", "step=x"):
        with pytest.raises(ValueError, match="fault-injection rule"):
            FaultPlan.parse(bad)
    with pytest.raises(InjectedFault):
        plan.check_sample("r", [1, 7, 3], 2)
    plan.check_sample("r", [1, 7, 3], 1)  # not its turn yet
    plan.check_sample("r", [1, 2, 3], 2)  # not marked


class ExplodingRunner(FakeRunner):
    def __init__(self, *a, explode_at: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.explode_at = explode_at

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        if so.step == self.explode_at:
            raise RuntimeError("the device fell over")
        return super().execute_model(so)


async def _collect(stream) -> list:
    got = []
    while True:
        ups = await stream.get()
        got += ups
        if stream._live == 0:  # every sequence finished (an engine error raises instead)
            return got


async def test_failing_hooks_never_stop_the_engine():
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    ex = ThreadExecutor(FakeRunner(64, 4, VOCAB))
    calls = []

    def bad_hook(info) -> None:
        calls.append(info.so.step)
        raise ValueError("metrics exploded")

    core = EngineCore(sched, ex, on_step=bad_hook)
    core.start()
    try:
        ups = await asyncio.wait_for(_collect(core.add(make_group("a", [1, 2, 3], 6))), 10)
        assert [t for u in ups for t in u.new_token_ids] == reference_generate(
            [1, 2, 3], 6, VOCAB, None
        )
        assert len(calls) >= 6 and core.dead is None
        assert core.hook_errors == {"on_step hook": len(calls)}
    finally:
        await core.stop()
        ex.shutdown()


async def test_engine_failure_fails_every_stream_including_queued_ones():
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    ex = ThreadExecutor(ExplodingRunner(64, 4, VOCAB, explode_at=3))
    core = EngineCore(sched, ex)
    task = core.start()
    try:
        streams = [core.add(make_group(f"r{i}", [1, 2, 3 + i], 50)) for i in range(4)]
        for s in streams:
            with pytest.raises(EngineDeadError, match=r"step 3|fell over"):
                await asyncio.wait_for(_collect(s), 10)
        with pytest.raises(Exception, match="fell over"):
            await task
        with pytest.raises(EngineDeadError):
            core.add(make_group("late", [1, 2], 4))
    finally:
        ex.shutdown()


async def test_executor_failure_between_steps_kills_an_idle_engine():
    """An executor that learns on its own that it cannot go on (a tensor-parallel rank
    exited while nothing ran) posts ExecutorFailed: the engine dies at once."""
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    ex = ThreadExecutor(FakeRunner(64, 4, VOCAB))
    core = EngineCore(sched, ex)
    task = core.start()
    try:
        await asyncio.wait_for(_collect(core.add(make_group("a", [1, 2, 3], 4))), 10)
        core.inbox.put_nowait(ExecutorFailed(RuntimeError("rank 1 exited")))
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            await asyncio.wait_for(task, 10)
        assert "rank 1 exited" in str(core.dead)
        with pytest.raises(EngineDeadError):
            core.add(make_group("late", [1, 2], 4))
    finally:
        ex.shutdown()
