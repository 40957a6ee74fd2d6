"""Fair shares inside the step (scheduler/scheduler.py with scheduler/fair_queue.py): once
one tenant's requests run, another tenant's new request still gets its share of the
step's prompt tokens, and a running set full of one tenant makes room by preempting that
tenant's newest request.  Every output is checked token for token against the FakeRunner's
reference, so the preemptions cannot change what a request generates."""

from __future__ import annotations

import random

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import Run, assert_all_free, drive

VOCAB = 1000


def _group(rid: str, tenant: str, prompt: list[int], out: int, n: int = 1) -> list[Request]:
    params = SamplingParams(max_tokens=out, n=n, ignore_eos=True, temperature=0)
    return [
        Request(
            rid if i == 0 else f"{rid}#{i}", prompt, params, max_tokens=out, tenant=tenant,
            sample_index=i, group_id=rid,
        )
        for i in range(n)
    ]  # fmt: skip


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _run(cfg: SchedulerConfig, arrivals: dict[int, list[list[Request]]]) -> tuple[Run, Scheduler]:
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_kv_blocks, cfg.block_size, VOCAB)
    expected = {
        r.req_id: reference_generate(
            r.token_ids[: r.prompt_len], r.max_tokens, VOCAB, None, r.sample_index
        )
        for groups in arrivals.values()
        for g in groups
        for r in g
    }
    run = drive(sched, runner, arrivals)
    assert run.outputs == expected  # greedy output unchanged by any preemption
    assert_all_free(sched, runner)
    return run, sched


def _first_token_step(run: Run, rid: str) -> int:
    """Index of the step that sampled `rid`'s first token."""
    for i, so in enumerate(run.steps):
        if any(sr.req_id == rid and sr.sample for sr in so.all_scheduled()):
            return i
    raise AssertionError(f"{rid} never sampled")


def _flood_and_chat(
    cfg_kw: dict, flood: int, flood_len: tuple[int, int], chats: dict[int, int], n: int = 1
) -> dict[str, tuple[list[int], int]]:
    """Per policy: (steps from each chat request's arrival to its first token, preemptions
    made for fair shares)."""
    out = {}
    for policy in ("fcfs", "fair"):
        rng = random.Random(5)
        arrivals: dict[int, list[list[Request]]] = {
            0: [
                _group(f"f{i}", "flood", _prompt(rng, flood_len[0]), flood_len[1])
                for i in range(flood)
            ]
        }
        for step, plen in chats.items():
            arrivals[step] = [_group(f"c{step}", "chat", _prompt(rng, plen), 4, n=n)]
        run, sched = _run(SchedulerConfig(scheduling_policy=policy, **cfg_kw), arrivals)
        out[policy] = (
            [_first_token_step(run, f"c{s}") - s for s in chats],
            sched.num_fair_preemptions,
        )
    return out


def test_a_running_set_full_of_one_key_makes_room_for_another():
    """max_num_seqs sequences of the flood run; a chat request (n=2: two seats) takes the
    newest flood request's place at once instead of waiting for one to finish."""
    cfg = dict(num_kv_blocks=1024, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
               max_model_len=512)  # fmt: skip
    got = _flood_and_chat(cfg, flood=12, flood_len=(40, 60), chats={10: 12, 40: 12, 90: 12}, n=2)
    fair_ttft, fair_preempted = got["fair"]
    fcfs_ttft, fcfs_preempted = got["fcfs"]
    assert fair_ttft == [0, 0, 0]  # in the step right after it arrived
    assert fair_preempted >= 3
    assert min(fcfs_ttft) > 20 and fcfs_preempted == 0  # behind the flood's running set


def test_a_pool_full_of_one_key_makes_room_for_another():
    """The flood fills the KV blocks (not the seats) and preempts itself for room; a chat
    request still gets in within a step, by blocks taken from the flood."""
    cfg = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=32,
               max_model_len=128)  # fmt: skip
    got = _flood_and_chat(cfg, flood=10, flood_len=(40, 40), chats={12: 8, 30: 8, 47: 8})
    fair_ttft, fair_preempted = got["fair"]
    assert fair_ttft == [0, 0, 0] and fair_preempted >= 1
    assert min(got["fcfs"][0]) > 5


def _chunk_tokens(run: Run, step: int) -> dict[str, int]:
    per: dict[str, int] = {}
    for sr in run.steps[step].all_scheduled():
        if len(sr.input_ids) > 1:
            key = sr.req_id[0]
            per[key] = per.get(key, 0) + len(sr.input_ids)
    return per


def test_prompt_tokens_split_by_weight_and_work_conserving():
    """Long prompts of one key are mid-prefill when another key's long prompt arrives:
    from then on the step's prompt tokens are split by weight; alone, a key takes them
    all; a key that needs less than its share leaves the rest to the other.  (The chat
    key's prompt is past its quantum, so it is not sparse: test_fair_latency.py has the
    short steps a sparse key gets.)"""
    for weights, split in (({}, (32, 32)), ({"chat": 3.0}, (48, 16))):
        cfg = SchedulerConfig(num_kv_blocks=1024, block_size=4, max_num_batched_tokens=64,
                              max_num_seqs=16, max_model_len=1024, tenant_weights=weights)  # fmt: skip
        rng = random.Random(1)
        arrivals = {
            0: [_group(f"f{i}", "flood", _prompt(rng, 1000), 2) for i in range(3)],
            3: [_group("c0", "chat", _prompt(rng, 800), 2)],
            40: [_group("c1", "chat", _prompt(rng, 10), 2)],
        }
        run, _ = _run(cfg, arrivals)
        assert _chunk_tokens(run, 2) == {"f": 64}  # alone: the whole budget
        for step in range(3, 7):
            assert _chunk_tokens(run, step) == {"c": split[0], "f": split[1]}, step
        # The short one takes 10 and the flood the other 54 of that step.
        assert _chunk_tokens(run, 40) == {"c": 10, "f": 54}


def test_one_key_alone_is_scheduled_as_before():
    """With a single key (or none), fair shares change nothing: the same steps as FCFS."""
    rng = random.Random(3)
    prompts = [(_prompt(rng, rng.randrange(5, 120)), rng.randrange(1, 30)) for _ in range(30)]
    steps = {}
    for policy in ("fcfs", "fair"):
        arrivals: dict[int, list[list[Request]]] = {}
        for i, (p, o) in enumerate(prompts):
            arrivals.setdefault(i // 3, []).append(_group(f"r{i}", "only", p, o))
        cfg = SchedulerConfig(num_kv_blocks=96, block_size=4, max_num_batched_tokens=48,
                              max_num_seqs=8, max_model_len=256, scheduling_policy=policy)  # fmt: skip
        run, sched = _run(cfg, arrivals)
        assert sched.num_preemptions > 0  # the pool is short: preemption is exercised
        steps[policy] = [
            [(sr.req_id, len(sr.input_ids)) for sr in so.all_scheduled()] for so in run.steps
        ]
    assert steps["fair"] == steps["fcfs"]


def test_the_victim_is_the_over_share_keys_lowest_priority_request():
    """vLLM's priority preemption within the key that gives up a seat: its lowest
    priority request goes back, though it arrived first."""
    cfg = SchedulerConfig(num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                          max_num_seqs=2, max_model_len=256)  # fmt: skip
    sched, runner = Scheduler(cfg), FakeRunner(256, 4, VOCAB)
    rng = random.Random(2)
    low = _group("f-low", "flood", _prompt(rng, 20), 50)
    low[0].priority = 5
    sched.add_request(low)
    sched.update_from_output(so := sched.schedule(), runner.execute_model(so))
    sched.add_request(_group("f-high", "flood", _prompt(rng, 20), 50))  # the newest
    for _ in range(2):
        sched.update_from_output(so := sched.schedule(), runner.execute_model(so))
    assert [r.req_id for r in sched.running] == ["f-low", "f-high"]
    sched.add_request(_group("chat", "chat", _prompt(rng, 8), 2))
    so = sched.schedule()
    assert any(sr.req_id == "chat" and sr.sample for sr in so.all_scheduled())
    assert sched.requests["f-low"].status.name == "WAITING"
    assert sched.requests["f-high"].status.name == "RUNNING"
    assert sched.num_fair_preemptions == 1
