"""Async scheduling (scheduler/ahead.py): step N+1 scheduled, and here even run, before
step N's update.  The fake runner reads every context back through its block tables, so a
wrong placeholder token, slot or prefix-cache entry changes the output: outputs must
equal the reference (and the synchronous scheduler's) with stop tokens ending rows that
the next step already carries, lengths, preemption, n > 1, aborts mid-flight, grammars
and speculation (the last two synchronous), and no block may leak."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from scheduler.contract import PLACEHOLDER, DecodeColumns, ModelOutput
from scheduler.engine_core import EngineCore
from scheduler.executor import ThreadExecutor, resolve_placeholders
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import (
    EOS,
    Run,
    assert_all_free,
    assert_pool_consistent,
    drive,
    make_group,
    new_scheduler,
)
from tests.scheduler.test_faults import FailingRunner
from tests.scheduler.test_spec_scheduler import spec_scheduler
from tests.scheduler.test_structured_scheduler import ScriptedMatcher

VOCAB = 16  # EOS (7) comes up often: rows end on a stop token while the next step runs


def _collect(run: Run, updates) -> None:
    for u in updates:
        run.outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
        if u.finish_reason:
            run.finish[u.req_id] = u.finish_reason


def drive_ahead(
    sched: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[list[Request]]],
    aborts: dict[int, list[str]] | None = None,
) -> Run:
    """The engine's order with async scheduling, on one thread: while step N is in flight
    the next is scheduled ahead and run, and only then is N updated (the worst order for a
    block freed at N's update).  Arrivals and aborts land between, as the engine handles
    its inbox while a step scheduled ahead runs."""
    ex = ThreadExecutor(runner)
    run, pending, aborts = Run(), dict(arrivals), dict(aborts or {})
    flight = None
    k = 0
    try:
        while pending or sched.has_unfinished() or flight is not None:
            assert k < 10_000, "did not finish"
            for group in pending.pop(k, []):
                sched.add_request(group)
            for gid in aborts.pop(k, []):
                _collect(run, sched.abort(gid))
            if flight is None:
                so = sched.schedule()
                flight = (so, ex.execute_sync(so))
            so, mo = flight
            run.steps.append(so)
            nxt = sched.schedule_ahead(so)
            nmo = ex.execute_sync(nxt) if nxt is not None else None
            _collect(run, sched.update_from_output(so, mo))
            assert_pool_consistent(sched)
            if nxt is not None:  # a row its length ends is never carried past it
                assert not [r for r in nxt.decodes.req_ids if run.finish.get(r) == "length"]
            flight = (nxt, nmo) if nxt is not None else None
            k += 1
        ex.execute_sync(sched.schedule())  # the last finished ids reach the runner
    finally:
        ex.shutdown()
    return run


def _workload(seed: int, n: int, eos: bool = True, fork: int = 1):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(6)]
    groups = {}
    for i in range(n):
        prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        g = make_group(f"r{i}", prompt, rng.randint(1, 40), n=fork, ignore_eos=not eos)
        groups.setdefault(rng.randrange(12), []).append(g)
    return groups


def _check(run: Run, arrivals, eos: bool = True, aborted: frozenset[str] = frozenset()):
    for groups in arrivals.values():
        for g in groups:
            for r in g:
                ref = reference_generate(
                    r.token_ids[: r.prompt_len],
                    r.max_tokens,
                    VOCAB,
                    EOS if eos else None,
                    r.sample_index,
                )
                got = run.outputs.get(r.req_id, [])
                if r.group_id in aborted:
                    assert got == ref[: len(got)], r.req_id
                    assert run.finish[r.req_id] == "abort"
                else:
                    assert got == ref, r.req_id


def _sched(num_blocks: int = 256, budget: int = 64, max_seqs: int = 64) -> Scheduler:
    sched, _ = new_scheduler(
        num_blocks=num_blocks,
        budget=budget,
        max_seqs=max_seqs,
        max_model_len=min(256, 4 * num_blocks),
    )
    return sched


@pytest.mark.parametrize("eos", [True, False])
def test_ahead_matches_reference_and_the_synchronous_scheduler(eos):
    arrivals = _workload(1, 24, eos=eos)
    sched = _sched()
    run = drive_ahead(sched, FakeRunner(256, 4, VOCAB), arrivals)
    _check(run, arrivals, eos=eos)
    assert sched.num_ahead_steps > len(run.steps) // 2
    assert_all_free(sched)
    sync = drive(_sched(), FakeRunner(256, 4, VOCAB), _workload(1, 24, eos=eos))
    assert sync.outputs == run.outputs and sync.finish == run.finish
    if eos:  # rows ended on a stop token while the next step carried them
        assert any(reason == "stop" for reason in run.finish.values())


def test_ahead_under_preemption_and_forks():
    arrivals = _workload(2, 20, fork=2)
    sched = _sched(num_blocks=24, budget=16, max_seqs=16)
    runner = FakeRunner(24, 4, VOCAB)
    run = drive_ahead(sched, runner, arrivals)
    _check(run, arrivals)
    assert sched.num_preemptions > 0 and sched.num_ahead_steps > 0
    assert_all_free(sched, runner)


def test_abort_mid_flight_frees_everything():
    arrivals = {0: [make_group(f"r{i}", [1, 2, 3 + i], 30) for i in range(6)]}
    sched = _sched()
    runner = FakeRunner(256, 4, VOCAB)
    # Aborted while a step scheduled ahead carries them.
    run = drive_ahead(sched, runner, arrivals, aborts={5: ["r1"], 9: ["r2", "r4"]})
    _check(run, {0: arrivals[0]}, eos=False, aborted=frozenset({"r1", "r2", "r4"}))
    assert 0 < len(run.outputs["r1"]) < 30
    assert_all_free(sched, runner)


def test_a_row_the_runner_fails_while_the_next_step_carries_it():
    # r2 fails at its 6th sample, a plain decode step with the next already scheduled
    # ahead: that step got r2's row with no token (PLACEHOLDER) and its output is dropped.
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] * (i + 2) for i in range(6)}
    sched = _sched(num_blocks=64)
    runner = FailingRunner(64, 4, VOCAB, fail={"r2": 5})
    arrivals = {0: [make_group(r, p, 12) for r, p in prompts.items()]}
    run = drive_ahead(sched, runner, arrivals)
    assert run.finish["r2"] == "error" and len(run.outputs["r2"]) == 5
    carried = [t for so in run.steps for r, t in zip(so.decodes.req_ids, so.decodes.token_ids)
               if r == "r2"]  # fmt: skip
    assert carried[-1] == PLACEHOLDER and PLACEHOLDER not in carried[:-1]
    for rid, p in prompts.items():
        if rid != "r2":
            assert run.outputs[rid] == reference_generate(p, 12, VOCAB, None), rid
    assert sched.num_ahead_steps > 0
    assert_all_free(sched, runner)


def test_speculation_and_grammars_stay_synchronous():
    sched, runner = spec_scheduler(64)
    arrivals = {0: [make_group(f"r{i}", [1, 2, 1, 2, 1], 20) for i in range(3)]}
    run = drive_ahead(sched, runner, arrivals)
    assert sched.num_ahead_steps == 0
    for g in arrivals[0]:
        assert run.outputs[g[0].req_id] == reference_generate([1, 2, 1, 2, 1], 20, 3, None)

    sched = _sched()
    script = reference_generate([1, 2, 3], 12, VOCAB, None)
    p = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    grammar = ScriptedMatcher(script, VOCAB)
    g = Request("g", [1, 2, 3], p, eos_token_ids=(EOS,), max_tokens=20, grammar=grammar)
    arrivals = {0: [[g], make_group("plain", [4, 5], 30, ignore_eos=True)]}
    run = drive_ahead(sched, FakeRunner(256, 4, VOCAB), arrivals)
    assert run.outputs["g"] == script and run.finish["g"] == "stop"
    assert run.outputs["plain"] == reference_generate([4, 5], 30, VOCAB, None)
    assert sched.num_ahead_steps > 0
    # Every step that carried the grammar row was scheduled after its predecessor's update.
    for so in run.steps:
        if any(r.req_id == "g" for r in so.scheduled):
            assert "g" not in so.decodes.req_ids


def test_no_ahead_while_requests_wait():
    sched = _sched(max_seqs=2)
    for i in range(3):
        sched.add_request(make_group(f"r{i}", [1, 2, 3], 20))
    ex = ThreadExecutor(FakeRunner(256, 4, VOCAB))
    try:
        for _ in range(2):  # the prompts, then one general decode each
            so = sched.schedule()
            sched.update_from_output(so, ex.execute_sync(so))
        so = sched.schedule()  # two plain decodes, one request waiting for a seat
        assert len(so.decodes.req_ids) == 2 and sched.waiting
        assert sched.schedule_ahead(so) is None
        sched.abort("r2")  # nothing waits now: the same step goes ahead
        assert sched.schedule_ahead(so) is not None
    finally:
        ex.shutdown()


def test_placeholders_resolve_by_row_or_by_id():
    prev = ModelOutput(req_ids=["a", "b", "c"], sampled_token_ids=[10, 11, 12])
    d = DecodeColumns(req_ids=["c", "a"], token_ids=[PLACEHOLDER] * 2, positions=[5, 6],
                      prev_rows=[2, 0])  # fmt: skip
    resolve_placeholders(d, prev)
    assert d.token_ids == [12, 10] and not d.prev_rows
    # The previous step failed row "a" (mo.errors): the rows moved, found by id instead.
    prev = ModelOutput(req_ids=["b", "c"], sampled_token_ids=[11, 12], errors={"a": "bad"})
    d = DecodeColumns(req_ids=["c", "a"], token_ids=[PLACEHOLDER] * 2, positions=[5, 6],
                      prev_rows=[2, 0])  # fmt: skip
    resolve_placeholders(d, prev)
    assert d.token_ids == [12, PLACEHOLDER]


class _SlowRunner(FakeRunner):
    def execute_model(self, so):
        time.sleep(0.003)  # aborts land while steps are in flight
        return super().execute_model(so)


async def _consume(stream) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    while not stream.finished:
        for u in await stream.get():
            toks.setdefault(u.req_id, []).extend(u.new_token_ids)
    return toks


@pytest.mark.parametrize("own_thread", [False, True])
async def test_engine_core_async_scheduling(own_thread):
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=256)
    sched = Scheduler(cfg)
    runner = _SlowRunner(64, 4, VOCAB)
    ex = ThreadExecutor(runner)
    core = EngineCore(sched, ex, own_thread=own_thread, async_scheduling=True)
    assert core.async_scheduling
    core.start()
    try:
        groups = [make_group(f"r{i}", [1, 2, 3 + i], 25, n=1 + i % 2, ignore_eos=i % 3 == 0)
                  for i in range(6)]  # fmt: skip
        streams = [core.add(g) for g in groups]
        doomed = core.add(make_group("x", [9, 9, 9], 200))
        outs = asyncio.gather(*(_consume(s) for s in streams))
        while len(await doomed.get()) == 0 or sched.num_ahead_steps < 3:
            pass
        core.abort("x", doomed)
        for g, toks in zip(groups, await asyncio.wait_for(outs, 20), strict=True):
            for r in g:
                eos = None if r.params.ignore_eos else EOS
                want = reference_generate(
                    r.token_ids[: r.prompt_len], 25, VOCAB, eos, r.sample_index
                )
                assert toks[r.req_id] == want, r.req_id
        while not (core.idle.is_set() and not core.streams):
            await asyncio.sleep(0.01)
        assert sched.num_ahead_steps > 0 and doomed.finished
        assert_pool_consistent(sched)
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    finally:
        await core.stop()
        ex.shutdown()
