"""Scheduler behaviour against a runner whose KV cache holds token ids (see fake_runner)."""

from __future__ import annotations

import random

import pytest

from scheduler.scheduler import RequestRejected
from tests.scheduler.fake_runner import reference_generate
from tests.scheduler.helpers import (
    EOS,
    assert_all_free,
    drive,
    make_group,
    new_scheduler,
)

VOCAB = 1000


def _workload(seed: int, n_req: int, shared_prefix: int = 0, max_prompt: int = 60):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, VOCAB) for _ in range(shared_prefix)]
    reqs = []
    for i in range(n_req):
        plen = rng.randint(1, max_prompt)
        prompt = prefix + [rng.randrange(10, VOCAB) for _ in range(plen)]
        reqs.append((f"r{i}", prompt, rng.randint(1, 40)))
    return reqs


def _check(run, reqs, n=1):
    for rid, prompt, max_tokens in reqs:
        assert run.outputs[rid] == reference_generate(prompt, max_tokens, VOCAB, None), rid
        assert run.finish[rid] == "length"
        for i in range(1, n):
            cid = f"{rid}#{i}"
            assert run.outputs[cid] == reference_generate(prompt, max_tokens, VOCAB, None, i)


@pytest.mark.parametrize(
    ("budget", "blocks", "arrive_spread"),
    [(512, 512, 0), (16, 512, 0), (7, 512, 5), (64, 40, 0), (13, 33, 3), (3, 30, 2)],
)
def test_outputs_match_reference(budget, blocks, arrive_spread):
    sched, runner = new_scheduler(num_blocks=blocks, budget=budget, max_model_len=120)
    reqs = _workload(budget * 7 + blocks, 36)
    arrivals: dict[int, list] = {}
    for i, (rid, prompt, mt) in enumerate(reqs):
        arrivals.setdefault(i * arrive_spread // 3, []).append(make_group(rid, prompt, mt))
    run = drive(sched, runner, arrivals)
    _check(run, reqs)
    assert_all_free(sched, runner)
    if blocks <= 40:
        assert sched.num_preemptions > 0, "this configuration should force preemption"


def _live_later(run, k: int) -> set[str]:
    return {r.req_id for so in run.steps[k + 1 :] for r in so.scheduled}


def test_chunked_prefill_respects_budget_and_never_stalls_decodes():
    sched, runner = new_scheduler(num_blocks=512, budget=8, max_model_len=400)
    run = drive(
        sched,
        runner,
        {
            0: [make_group("short", [11, 12, 13], 30)],
            3: [make_group("long", list(range(20, 320)), 5)],
        },
    )
    long_steps = 0
    for k, so in enumerate(run.steps):
        ids = {r.req_id: r for r in so.scheduled}
        if "long" in ids and not ids["long"].sample:
            long_steps += 1
            assert len(ids["long"].input_ids) <= 8
            if "short" in _live_later(run, k):
                assert "short" in ids, f"step {k}: the long prompt stalled a decode"
    assert long_steps > 10, "the long prompt should be chunked"
    assert run.outputs["short"] == reference_generate([11, 12, 13], 30, VOCAB, None)
    assert_all_free(sched, runner)


def test_decodes_are_scheduled_before_prefill_chunks():
    sched, runner = new_scheduler(num_blocks=512, budget=10, max_model_len=400)
    groups = [make_group(f"d{i}", [100 + i, 5], 50) for i in range(6)]
    run = drive(sched, runner, {0: groups, 2: [make_group("big", list(range(30, 230)), 3)]})
    checked = 0
    for k, so in enumerate(run.steps):
        names = [r.req_id for r in so.scheduled]
        if "big" in names and not so.scheduled[names.index("big")].sample:
            live = {r for r in _live_later(run, k) if r.startswith("d")}
            assert live <= set(names), f"step {k}: decodes {live - set(names)} were skipped"
            assert names[-1] == "big"
            assert all(len(r.input_ids) == 1 for r in so.scheduled[:-1])
            checked += 1
    assert checked > 5
    assert_all_free(sched, runner)


def test_prefix_cache_hits_shared_system_prompt():
    sched, runner = new_scheduler(num_blocks=512, budget=64, max_model_len=200)
    reqs = _workload(3, 20, shared_prefix=40, max_prompt=20)
    arrivals = {i * 2: [make_group(rid, p, mt)] for i, (rid, p, mt) in enumerate(reqs)}
    run = drive(sched, runner, arrivals)
    _check(run, reqs)
    # Later requests skip the 40-token prefix (10 blocks of 4).
    assert sched.kv.prefix_hits >= 19 * 40
    assert runner.tokens_computed < sum(len(p) + mt for _, p, mt in reqs) - 19 * 40 + 19
    assert_all_free(sched, runner)


def test_full_prompt_hit_still_computes_last_token():
    sched, runner = new_scheduler(num_blocks=64, budget=64, max_model_len=100)
    prompt = list(range(100, 116))  # exactly 4 blocks of 4
    run = drive(sched, runner, {0: [make_group("a", prompt, 3)], 10: [make_group("b", prompt, 3)]})
    assert run.outputs["a"] == run.outputs["b"]
    b_first = next(r for so in run.steps for r in so.scheduled if r.req_id == "b")
    # 3 blocks hit, the last block (holding the last prompt token) is recomputed.
    assert b_first.start_pos == 12 and len(b_first.input_ids) == 4
    assert_all_free(sched, runner)


def test_cache_salt_separates_caches():
    sched, runner = new_scheduler(num_blocks=64, budget=64, max_model_len=100)
    prompt = list(range(100, 140))
    drive(
        sched,
        runner,
        {0: [make_group("a", prompt, 2, salt="x")], 5: [make_group("b", prompt, 2, salt="y")]},
    )
    assert sched.kv.prefix_hits == 0
    drive(sched, runner, {0: [make_group("c", prompt, 2, salt="x")]})
    assert sched.kv.prefix_hits == 36


@pytest.mark.parametrize(("n", "plen", "blocks"), [(4, 10, 256), (3, 8, 256), (5, 13, 40)])
def test_parallel_sampling_forks_share_prompt(n, plen, blocks):
    sched, runner = new_scheduler(num_blocks=blocks, budget=32, max_model_len=100)
    reqs = _workload(n * plen, 8, max_prompt=plen)
    arrivals = {i: [make_group(rid, p, mt, n=n)] for i, (rid, p, mt) in enumerate(reqs)}
    run = drive(sched, runner, arrivals)
    _check(run, reqs, n=n)
    # The prompt was computed once per group, not n times (unless preempted).
    if sched.num_preemptions == 0:
        expected = sum(len(p) + n * (mt - 1) for _, p, mt in reqs)
        assert runner.tokens_computed == expected
    assert_all_free(sched, runner)


def test_copy_on_write_for_partial_shared_block():
    sched, runner = new_scheduler(num_blocks=64, budget=64, max_model_len=100)
    run = drive(sched, runner, {0: [make_group("g", [50, 51, 52, 53, 54, 55], 4, n=3)]})
    copies = [c for so in run.steps for c in so.copy_blocks]
    # 6 tokens = 1 full + 1 partial block; 2 of the 3 samples copy the partial one.
    assert len(copies) == 2
    assert_all_free(sched, runner)


def test_eos_and_stop_token_ids_finish():
    sched, runner = new_scheduler(num_blocks=512, budget=64, max_model_len=2000)
    # Find prompts whose reference output hits EOS early with a small vocab.
    runner.vocab = 12
    reqs = []
    for i in range(40):
        prompt = [100 + i, 3]
        ref = reference_generate(prompt, 50, 12, EOS)
        reqs.append((f"e{i}", prompt, ref))
    arrivals = {0: [make_group(rid, p, 50, ignore_eos=False) for rid, p, _ in reqs]}
    run = drive(sched, runner, arrivals)
    stopped = 0
    for rid, _, ref in reqs:
        assert run.outputs[rid] == ref
        if ref[-1] == EOS:
            stopped += 1
            assert run.finish[rid] == "stop"
    assert stopped > 5
    assert_all_free(sched, runner)


def test_abort_frees_blocks_everywhere():
    sched, runner = new_scheduler(num_blocks=128, budget=16, max_model_len=200)
    groups = [make_group(f"a{i}", list(range(10 + i, 60 + i)), 100, n=2) for i in range(6)]
    for g in groups:
        sched.add_request(g)
    for _ in range(6):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    ups = []
    for g in groups:
        ups += sched.abort(g[0].group_id)
    assert all(u.finish_reason == "abort" for u in ups)
    assert len(ups) == 12
    runner.execute_model(sched.schedule())
    assert_all_free(sched, runner)


def test_rejects_prompt_longer_than_max_model_len():
    sched, _ = new_scheduler(num_blocks=64, max_model_len=50)
    with pytest.raises(RequestRejected, match="50"):
        sched.add_request(make_group("x", list(range(50)), 5))
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(make_group("y", [], 5))


def test_length_capped_by_max_model_len():
    sched, runner = new_scheduler(num_blocks=64, max_model_len=30)
    run = drive(sched, runner, {0: [make_group("x", list(range(100, 120)), 100, max_model_len=30)]})
    assert len(run.outputs["x"]) == 10 and run.finish["x"] == "length"


def test_cache_too_small_for_one_sequence_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        new_scheduler(num_blocks=4, block_size=4, max_model_len=100)


def test_requests_needing_blocks_held_by_others_wait_then_finish():
    # 30 blocks of 4 = 120 tokens; every request needs up to 100.
    sched, runner = new_scheduler(num_blocks=30, budget=64, max_model_len=100)
    reqs = [(f"w{i}", list(range(200 + i, 260 + i)), 40) for i in range(8)]
    run = drive(sched, runner, {0: [make_group(r, p, m) for r, p, m in reqs]})
    _check(run, reqs)
    assert sched.num_preemptions > 0
    assert_all_free(sched, runner)
