"""Speculative decoding in the scheduler, with the fake runner (whose "KV" holds token ids
read back through the block tables): n-gram drafts ride as extra query tokens, rejected
ones are rolled back and their blocks freed, only accepted tokens are ever hashed (a
later prefix hit reading a rejected draft would change its output), the token budget
holds the k + 1 tokens, and the output equals decoding without speculation."""

from __future__ import annotations

import random

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.spec import NgramProposer, SpecConfig, SpecDecoder
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import EOS, assert_all_free, drive, make_group

VOCAB = 3  # a "model" that is often predictable from its own context


def spec_scheduler(num_blocks: int, block_size: int = 4, budget: int = 24, k: int = 3):
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        max_model_len=min(256, num_blocks * block_size),
    )
    spec = SpecDecoder(
        SpecConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            disable_by_batch_size=64,
            min_acceptance_rate=0.0,
        )
    )
    return Scheduler(cfg, spec=spec), FakeRunner(num_blocks, block_size, vocab=VOCAB)


def workload(seed: int, n: int, shared: int = 8):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [
        (prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))], rng.randint(4, 30))
        for _ in range(n)
    ]


def check_outputs(run, work, sample_n: int = 1) -> None:
    for i, (prompt, max_tokens) in enumerate(work):
        for s in range(sample_n):
            rid = f"r{i}" if s == 0 else f"r{i}#{s}"
            ref = reference_generate(prompt, max_tokens, VOCAB, None, sample_index=s)
            assert run.outputs[rid] == ref, rid


def test_ngram_matches_plain_decoding_with_prefix_hits_and_preemption():
    work = workload(1, 24)
    sched, runner = spec_scheduler(num_blocks=24)
    arrivals = {i: [make_group(f"r{i}", p, m)] for i, (p, m) in enumerate(work)}
    run = drive(sched, runner, arrivals)
    check_outputs(run, work)
    st = sched.spec.stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens
    assert sched.num_preemptions > 0
    assert sched.kv.prefix_hits > 0
    assert_all_free(sched, runner)
    # Verify chunks carry k + 1 tokens inside the one budget.
    assert any(r.num_draft for so in run.steps for r in so.scheduled)
    assert all(so.num_scheduled_tokens <= 24 for so in run.steps)


def test_ngram_with_parallel_samples():
    work = workload(2, 8)
    sched, runner = spec_scheduler(num_blocks=200, budget=32)
    arrivals = {i: [make_group(f"r{i}", p, m, n=3)] for i, (p, m) in enumerate(work)}
    run = drive(sched, runner, arrivals)
    check_outputs(run, work, sample_n=3)
    assert sched.spec.stats.num_accepted_tokens > 0
    assert_all_free(sched, runner)


def test_drafts_respect_max_tokens_and_stop_tokens():
    """No draft past max_tokens; a stop token among accepted drafts ends the request
    there, and what followed it is dropped."""
    sched, runner = spec_scheduler(num_blocks=64, k=4)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = SamplingParams(max_tokens=5, temperature=0)
    req = Request("a", prompt, params, eos_token_ids=(EOS,), max_tokens=5)
    run = drive(sched, runner, {0: [[req]]})
    assert len(run.outputs["a"]) == 5
    assert all(
        len(r.input_ids) == 1 and r.start_pos + 1 + r.num_draft <= len(prompt) + 5 - 1 + 1
        for so in run.steps
        for r in so.scheduled
        if r.num_draft
    )
    # Stop token: the fake model's vocab is {0, 1, 2}; make 2 a stop token.
    sched, runner = spec_scheduler(num_blocks=64, k=4)
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[2])
    req = Request("b", prompt, params, eos_token_ids=(), max_tokens=40)
    run = drive(sched, runner, {0: [[req]]})
    ref = reference_generate(prompt, 40, VOCAB, 2)
    assert run.outputs["b"] == ref and run.finish["b"] == "stop"
    assert_all_free(sched, runner)


def test_batch_size_turns_speculation_off():
    # Above the threshold a step is exactly the plain step: no drafts, no verify tokens
    # (so the runner has nothing to propose or verify); output unchanged throughout.
    sched, runner = spec_scheduler(num_blocks=256, budget=64)
    sched.spec.config.disable_by_batch_size = 2
    work = workload(3, 6, shared=0)
    arrivals = {0: [make_group(f"r{i}", p, m) for i, (p, m) in enumerate(work)]}
    run = drive(sched, runner, arrivals)
    busy = [so for so in run.steps if len(so.scheduled) > 2]
    assert busy and len(busy) < len(run.steps)
    for so in busy:
        assert not any(r.num_draft or r.draft_ids for r in so.scheduled)
        assert so.num_scheduled_tokens == sum(len(r.input_ids) for r in so.scheduled)
    assert any(r.num_draft for so in run.steps for r in so.scheduled)  # the tail speculates
    check_outputs(run, work)
    assert_all_free(sched, runner)


def _speculating(so) -> bool:
    return any(r.num_draft for r in so.scheduled)


def _cost_run(seconds, seed: int):
    sched, runner = spec_scheduler(num_blocks=512, budget=256)
    sched.spec.config.disable_by_batch_size = None
    work = workload(seed, 8, shared=0)
    work = [(p, 120) for p, _ in work]
    arrivals = {0: [make_group(f"r{i}", p, m) for i, (p, m) in enumerate(work)]}
    run = drive(sched, runner, arrivals, step_seconds=seconds)
    check_outputs(run, work)
    assert_all_free(sched, runner)
    decode_steps = [so for so in run.steps[2:] if so.num_scheduled_tokens]
    return sum(map(_speculating, decode_steps)) / len(decode_steps)


def test_measured_cost_decides_whether_a_step_speculates():
    # Compute-bound: every query token costs the same, so a verify step's k + 1 tokens
    # cost more than the drafts it keeps can pay for; only the policy's re-measuring
    # steps (one in 32 per batch size) speculate.  Memory-bound: a step costs nearly
    # the same whatever its tokens, so drafts are nearly free and nearly every step
    # speculates.  The output is the same either way.
    def compute_bound(so):
        return 1.0 + so.num_scheduled_tokens

    def memory_bound(so):
        return 1.0 + 0.001 * so.num_scheduled_tokens

    assert _cost_run(compute_bound, 5) < 0.1
    assert _cost_run(memory_bound, 5) > 0.8


def test_cost_policy_weighs_expected_tokens_against_measured_seconds():
    from scheduler.spec import StepCostPolicy

    p = StepCostPolicy()
    # Warm-up: a run of speculating steps, then one of plain ones; the first of each run
    # pays the switch (here 9x a steady step) and is kept apart from the figures.
    for side, steady in ((True, 3.0), (False, 1.0)):
        for i in range(p.RUN):
            assert p.choose(8, 9.0) == side
            p.observe(8, side, steady * (9.0 if i == 0 else 1.0))
    assert p.figures(8) == (3.0, 1.0) and p.switch[(8, True)] == 27.0
    # A verify step costs 3x a plain one: worth it only if it emits over 3x the tokens
    # (24 for 8 rows) and no row emits under 3 x 0.95.
    assert not p.choose(8, 20.0, 2.5)
    p.observe(8, False, 1.0)
    assert p.choose(8, 30.0, 3.5)
    # Enough tokens in all, but one row without drafts would decode 3x slower: plain.
    p.observe(8, True, 3.0)
    assert not p.choose(8, 30.0, 1.0)
    # Sizes 5-8 share a bucket; 16 is near enough to borrow 8's figures (no warm-up run).
    assert p.bucket(5) == p.bucket(8) == 8 and p.bucket(9) == 16
    assert not p.choose(9, 9.5, 1.0) and not p.samples.get((16, True))
    # The figure follows a change of load within a few steps.
    for _ in range(3):
        p.observe(8, True, 1.2)
    assert p.seconds(8, True) == 1.2


def test_draft_depth_follows_acceptance():
    spec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=4))
    # The j-th draft is accepted with probability rate ** j; draft while that is >= 0.2.
    assert [spec.depth(r) for r in (1.0, 0.9, 0.6, 0.5, 0.3, 0.19)] == [4, 4, 3, 2, 1, 0]
    req = Request("x", [1, 2, 1, 2, 1, 2, 1, 2], SamplingParams(), max_tokens=100)
    assert spec.wanted(req, 10) == 4  # a fresh request drafts the full k
    for _ in range(6):  # every verify rejects the first draft
        spec.observe(req, 4, 0)
    assert req.spec_rate < 0.2
    # Off, but for a one-token probe every PROBE_EVERY output tokens.
    req.token_ids += [1] * (spec.PROBE_EVERY - req.num_output_tokens % spec.PROBE_EVERY + 1)
    assert spec.wanted(req, 10) == 0
    req.token_ids.pop()
    assert req.num_output_tokens % spec.PROBE_EVERY == 0 and spec.wanted(req, 10) == 1
    for _ in range(20):  # it turns repetitive: every draft accepted again
        spec.observe(req, 1, 1)
    assert spec.depth(req.spec_rate) == 4
    # Rate per token, whatever the depth: 2 of 4 accepted then a rejection is 2 / 3.
    req2 = Request("y", [1, 2, 3], SamplingParams(), max_tokens=10)
    for _ in range(40):
        spec.observe(req2, 4, 2)
    assert abs(req2.spec_rate - 2 / 3) < 1e-3


def test_low_acceptance_stops_drafting_but_keeps_output():
    # Drafts that are always wrong: speculation fades out and output is still exact.
    sched, runner = spec_scheduler(num_blocks=256, budget=64, k=3)
    sched.spec.config.min_acceptance_rate = 0.2
    sched.spec.proposer.propose = lambda req, k: [(req.token_ids[-1] + 1) % VOCAB] * k
    work = workload(5, 2, shared=0)
    work = [(p, 60) for p, _ in work]
    arrivals = {0: [make_group(f"r{i}", p, m) for i, (p, m) in enumerate(work)]}
    run = drive(sched, runner, arrivals)
    drafted = [sum(r.num_draft for r in so.scheduled) for so in run.steps]
    assert sum(drafted[:5]) > 0 and sum(drafted[-20:]) < 20 * 3 * 2 / 4
    check_outputs(run, work)
    assert_all_free(sched, runner)


def test_ngram_proposer():
    p = NgramProposer(1, 3)

    def req(toks):
        return Request("x", toks, SamplingParams(), max_tokens=10)

    # The longest suffix that occurred before, and what followed its latest occurrence
    # with room for k tokens.
    assert p.propose(req([5, 6, 7, 8, 1, 5, 6, 7]), 2) == [8, 1]
    assert p.propose(req([1, 2, 3, 4]), 2) == []
    assert p.propose(req([9] * 8), 3) == [9, 9, 9]
    assert p.propose(req([9] * 4), 3) == [9]  # the longest n wins, even if cut short


def test_a_seeded_sampling_request_never_drafts():
    # Whether a step speculates depends on measured time; a seeded request's verify draws
    # depend on its drafts; so it must never draft (its output then equals decoding
    # without speculation, under any load).  A greedy request beside it still drafts.
    sched, runner = spec_scheduler(num_blocks=128, budget=64)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    seeded = Request(
        "s", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        eos_token_ids=(), max_tokens=24,
    )  # fmt: skip
    run = drive(sched, runner, {0: [[seeded], make_group("g", prompt, 24)]})
    drafted = {r.req_id for so in run.steps for r in so.scheduled if r.num_draft}
    assert "g" in drafted and "s" not in drafted
    assert len(run.outputs["s"]) == 24
    assert_all_free(sched, runner)
