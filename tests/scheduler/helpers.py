"""Drive a Scheduler with the FakeRunner, synchronously."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.contract import SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner

EOS = 7


def make_group(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    n: int = 1,
    ignore_eos: bool = True,
    salt: str | None = None,
    max_model_len: int = 10_000,
) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos, temperature=0)
    cap = min(max_tokens, max_model_len - len(prompt))
    group = [Request(rid, prompt, params, eos_token_ids=(EOS,), max_tokens=cap, cache_salt=salt)]
    for i in range(1, n):
        group.append(
            Request(
                f"{rid}#{i}",
                prompt,
                params,
                eos_token_ids=(EOS,),
                max_tokens=cap,
                cache_salt=salt,
                sample_index=i,
                group_id=rid,
            )
        )
    return group


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)


def drive(
    sched: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[list[Request]]],
    max_steps: int = 100_000,
    check_invariants: bool = True,
    step_seconds: Callable[[SchedulerOutput], float] | None = None,
) -> Run:
    """Run until every request finished; arrivals[k] are added before step k.
    step_seconds: what each step "took", told to the scheduler as the engine does."""
    run = Run()
    step = 0
    pending = dict(arrivals)
    while pending or sched.has_unfinished():
        assert step < max_steps, "did not finish"
        for group in pending.pop(step, []):
            sched.add_request(group)
        so = sched.schedule()
        run.steps.append(so)
        assert so.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        mo = runner.execute_model(so)
        if check_invariants:
            assert_tables_synced(sched, runner, so)
        for u in sched.update_from_output(so, mo):
            run.outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finish_reason:
                run.finish[u.req_id] = u.finish_reason
        if step_seconds is not None:
            sched.observe_step_time(step_seconds(so))
        if check_invariants:
            assert_pool_consistent(sched)
        step += 1
    # One more (empty) step delivers the last finished ids to the runner.
    runner.execute_model(sched.schedule())
    return run


def assert_pool_consistent(sched: Scheduler) -> None:
    pool = sched.kv.pool
    owners: dict[int, int] = {}
    for blocks in sched.kv.req_blocks.values():
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == owners.get(b.block_id, 0), f"{b} owners={owners.get(b.block_id)}"
    free = list(pool.free_queue) + list(pool.pinned_queue)
    assert len(free) == pool.num_free
    assert all(b.pins for b in pool.pinned_queue)
    assert not any(b.pins for b in pool.free_queue)
    assert all(b.ref_cnt == 0 for b in free)
    assert pool.num_free + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks
    for rid, blocks in sched.kv.req_blocks.items():
        assert sched.kv.req_block_ids[rid] == [b.block_id for b in blocks]
    for h, b in pool.cached.items():
        assert b.block_hash == h


def assert_all_free(sched: Scheduler, runner: FakeRunner | None = None) -> None:
    assert not sched.has_unfinished()
    assert not sched.requests, sched.requests
    assert not sched.groups
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert not sched.kv.req_blocks
    assert not sched.tenant_seqs, sched.tenant_seqs
    if runner is not None:
        assert not runner.known, runner.known


def new_scheduler(
    num_blocks: int = 256,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 64,
    max_model_len: int = 256,
    prefix_caching: bool = True,
) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
    )
    return Scheduler(cfg), FakeRunner(num_blocks, block_size)


def assert_tables_synced(sched: Scheduler, runner: FakeRunner, so: SchedulerOutput) -> None:
    """The tables the runner rebuilt from this step's deltas are the scheduler's."""
    for r in so.all_scheduled():
        if r.req_id in sched.requests:  # not ended by this step's update
            assert runner.tables[r.req_id] == sched.kv.block_ids(r.req_id), r.req_id
