"""Latency first under fair shares (scheduler/fair_queue.py `LatencyFirst`, `StepCost`): while
a sparse key (one short request at a time) shares the server with a flooding key, every
step is sized for the sparse key's prompt, so its prompt neither waits behind a long step
nor rides one; the flood splits what is left, and keys that are all backlogged (or all
sparse) are scheduled as before.  Each run checks every output token for token against
the FakeRunner's reference."""

from __future__ import annotations

import random

from scheduler.contract import SchedulerOutput
from scheduler.fair_queue import QUANTUM_TOKENS, LatencyFirst, StepCost
from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import Run, assert_all_free, drive
from tests.scheduler.test_fair_step import VOCAB, _group, _prompt

FIXED, PER_TOKEN = 0.004, 0.0002  # the timed step cost: its floor is 20 tokens


def _timed(so: SchedulerOutput) -> float:
    return FIXED + PER_TOKEN * so.num_scheduled_tokens


def _run(
    cfg: SchedulerConfig,
    arrivals: dict[int, list[list[Request]]],
    primed: bool = True,
    linger_steps: float = 6,
) -> tuple[Run, Scheduler]:
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_kv_blocks, cfg.block_size, VOCAB)
    if primed:  # as an engine that has timed a short step and a long one
        for n in (1, cfg.max_num_batched_tokens):
            sched.latency.cost.observe(n, FIXED + PER_TOKEN * n)
    # A clock that counts steps, so "seconds" of lingering are steps here.
    sched.latency.clock = lambda: float(sched.step_id)
    sched.latency.linger_s = linger_steps
    expected = {
        r.req_id: reference_generate(r.token_ids[: r.prompt_len], r.max_tokens, VOCAB, None, 0)
        for groups in arrivals.values()
        for g in groups
        for r in g
    }
    run = drive(sched, runner, arrivals, step_seconds=_timed)
    assert run.outputs == expected  # greedy output unchanged by the limits
    assert_all_free(sched, runner)
    return run, sched


def _per_key(so: SchedulerOutput) -> dict[str, int]:
    """Tokens each key (a request id's first letter) takes in the step."""
    per: dict[str, int] = {}
    for sr in so.all_scheduled():
        per[sr.req_id[0]] = per.get(sr.req_id[0], 0) + len(sr.input_ids) + sr.num_draft
    return per


def _first_sample(run: Run, rid: str) -> int:
    for i, so in enumerate(run.steps):
        if any(sr.req_id == rid and sr.sample for sr in so.all_scheduled()):
            return i
    raise AssertionError(f"{rid} never sampled")


def _cfg(**kw) -> SchedulerConfig:
    base = dict(num_kv_blocks=2048, block_size=4, max_num_batched_tokens=256, max_num_seqs=64,
                max_model_len=1024)  # fmt: skip
    return SchedulerConfig(**{**base, **kw})


def _flood(rng: random.Random, key: str, n: int, plen: int = 300, out: int = 40) -> list:
    return [_group(f"{key}{i}", key, _prompt(rng, plen), out) for i in range(n)]


def test_a_sparse_keys_prompt_rides_a_short_step():
    """A flood keeps every step at the full budget; a chat key's 24-token prompt arrives:
    from then on each step holds at most max(24, the fitted floor of 20) tokens, the prompt
    runs whole in the next step, and the flood takes the rest of each step.  Without
    latency first the prompt's step carried the flood's share (a full 256 tokens)."""
    rng = random.Random(1)
    chat = {20: "c0", 60: "c1"}
    arrivals = {0: _flood(rng, "f", 40)}
    for at, rid in chat.items():
        arrivals[at] = [_group(rid, "chat", _prompt(rng, 24), 6)]
    run, _ = _run(_cfg(), arrivals)
    assert all(so.num_scheduled_tokens == 256 for so in run.steps[2:20])
    for at, rid in chat.items():
        assert _first_sample(run, rid) == at  # the whole prompt in the step it arrived for
        assert _per_key(run.steps[at]) == {"c": 24}  # sized for it: room for no one else
        for so in run.steps[at + 1 : at + 6]:  # its decodes: the flood takes the rest
            assert so.num_scheduled_tokens == 24 and _per_key(so).get("c") == 1
    # The timing floor and the 24-token prompt both bind nowhere else: full steps again.
    assert max(so.num_scheduled_tokens for so in run.steps[40:60]) == 256


def test_a_key_between_requests_keeps_steps_short_for_a_while():
    """After its request ends, the chat key stays present for `linger_s`: a client that
    sends its next request within it finds short steps (half its last prompt, so the step
    it waits for and its own cost about one and a half of its own alone), and the flood
    has its whole budget back after that."""
    rng = random.Random(2)
    arrivals = {0: _flood(rng, "f", 40), 20: [_group("c0", "chat", _prompt(rng, 24), 6)]}
    run, sched = _run(_cfg(), arrivals, linger_steps=9)
    end = next(i for i in range(20, 40) if "c" not in _per_key(run.steps[i]))  # c0 done
    assert end == 26  # its prompt step with its first token, then five decodes
    for so in run.steps[end : end + 9]:
        assert so.num_scheduled_tokens == 12 and "c" not in _per_key(so)
    assert run.steps[end + 9].num_scheduled_tokens == 256
    assert "chat" not in sched.latency.linger  # expired, nothing kept of it
    assert "chat" not in sched.latency.prompt


def test_the_floor_comes_from_the_timed_steps():
    """Every step so far filled the budget, so the fit has nothing to go on: a 4-token
    sparse prompt gets a 4-token step.  That step gives the fit its second size, and from
    then on no step is shorter than the fixed cost's worth of tokens (20 here)."""
    rng = random.Random(1)
    arrivals = {0: _flood(rng, "f", 40), 20: [_group("c0", "chat", _prompt(rng, 4), 6)]}
    run, sched = _run(_cfg(), arrivals, primed=False)
    assert all(so.num_scheduled_tokens == 256 for so in run.steps[:20])
    assert _per_key(run.steps[20]) == {"c": 4}
    assert sched.latency.cost.min_tokens() == FIXED / PER_TOKEN
    for so in run.steps[21:26]:
        assert _per_key(so) == {"c": 1, "f": 19}


def test_a_key_that_keeps_asking_stops_being_sparse():
    """Sparse priority lasts one quantum a busy period: a chat request with a long output
    caps the steps until its key has been served a quantum, then the steps are full
    again while it is still running (it cannot starve the flood)."""
    rng = random.Random(3)
    out = QUANTUM_TOKENS  # prompt 24 + this many decodes pass the quantum
    arrivals = {0: _flood(rng, "f", 60, out=80), 20: [_group("c0", "chat", _prompt(rng, 24), out)]}
    run, _ = _run(_cfg(max_num_seqs=128), arrivals)
    served = 24
    for i in range(21, 240):  # the flood has work all along
        assert _per_key(run.steps[i]).get("c") == 1
        size = run.steps[i].num_scheduled_tokens
        # Sparse while what it was served plus its prompt stays within the quantum.
        assert size == (24 if served + 24 <= QUANTUM_TOKENS else 256), (i, served)
        served += 1
    assert served + 24 > QUANTUM_TOKENS


def test_backlogged_keys_split_the_room_by_weight():
    """Two flooding keys of weights 3 and 1 beside a sparse key: what the sparse key leaves
    of its step goes 3:1 between them; with no sparse key present the steps are full."""
    rng = random.Random(4)
    cfg = _cfg(tenant_weights={"a": 3.0, "b": 1.0}, max_num_seqs=128)
    arrivals = {
        0: _flood(rng, "a", 60, plen=200) + _flood(rng, "b", 60, plen=200),
        30: [_group("c0", "chat", _prompt(rng, 40), 8)],
    }
    run, _ = _run(cfg, arrivals)
    full = [_per_key(so) for so in run.steps[3:30]]
    assert all(sum(p.values()) == 256 for p in full)
    # 3:1, but for the whole tokens the split rounds to and the decodes the prompt tokens
    # are split after (a decode takes its one token outside the split).
    assert all(190 <= p["a"] <= 194 and 62 <= p["b"] <= 66 for p in full), full
    a, b = sum(p["a"] for p in full), sum(p["b"] for p in full)
    assert 2.9 <= a / b <= 3.1
    assert _per_key(run.steps[30]) == {"c": 40}
    for so in run.steps[31:38]:
        assert _per_key(so) == {"c": 1, "a": 30, "b": 9}  # 39 left, 3:1, the odd one to a


def test_step_cost_fits_the_fixed_and_per_token_cost():
    cost = StepCost()
    assert cost.min_tokens() == 1
    for _ in range(5):
        cost.observe(100, FIXED + PER_TOKEN * 100)
    assert cost.min_tokens() == 1  # one size: the two terms cannot be told apart
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randrange(1, 512)
        cost.observe(n, FIXED + PER_TOKEN * n)
    assert abs(cost.fixed - FIXED) < 1e-9 and abs(cost.per_token - PER_TOKEN) < 1e-12
    assert cost.min_tokens() == 20
    for _ in range(500):  # a long run of one size leaves the last good fit standing
        cost.observe(48, 2 * (FIXED + PER_TOKEN * 48))
    assert cost.min_tokens() > 1
    stalled = StepCost()
    for _ in range(50):
        n = rng.randrange(1, 512)
        stalled.observe(n, FIXED + PER_TOKEN * n)
    stalled.observe(24, 45.0)  # the process stopped for 45 s mid-step
    assert 15 <= stalled.min_tokens() <= 30  # counted as 3x the fit's figure, not 45 s
    crowded = StepCost()  # steps cost the same whatever their size: no short step pays
    for n in (1, 48, 1, 48, 1024, 48):
        crowded.observe(n, 0.4)
    assert crowded.min_tokens() >= 1024


def test_limits_need_both_a_sparse_and_a_backlogged_key():
    lat = LatencyFirst()
    for n in (1, 400):
        lat.cost.observe(n, FIXED + PER_TOKEN * n)
    w = {"a": 1.0, "b": 1.0, "c": 1.0}
    need = {"a": 256, "b": 256, "c": 10}
    lat.served("a", 300)
    lat.served("b", 1)
    assert lat.sparse(need, w) == {"c"}
    assert lat.limits({"c"}, need, w, 256) == {"a": 5, "b": 5}  # the floor 20 less 10, split
    assert lat.limits(set(), need, w, 256) is None
    assert lat.limits({"a", "c"}, {"a": 3, "c": 10}, w, 256) is None
    # Between requests a key asks nothing, but the step keeps room for its last prompt.
    now = [100.0]
    lat.clock = lambda: now[0]
    lat.admitted("c", 30)
    lat.went_idle("c")
    now[0] += lat.linger_s - 1
    assert lat.lingering() == {"c"}
    need = {"a": 300, "c": 0}
    assert lat.sparse(need, w) == {"c"}
    assert lat.limits({"c"}, need, w, 256) == {"a": 15}  # half of it, below the floor
    lat.served("c", QUANTUM_TOKENS - 20)
    assert lat.sparse(need, w) == set()  # its quantum is spent
    now[0] += 1
    assert lat.lingering() == set() and not lat.prompt  # present linger_s, then gone


def test_a_sparse_prompt_gets_in_past_more_decodes_than_the_budget():
    """The flood runs more decodes than a step's budget.  Its limit leaves most of them
    out of the step, so the prompt tokens they would have taken are there for the chat
    key's share: its prompt runs in the step it arrived for (with every decode counted
    against the budget, its share was 0 and it waited for the flood to end)."""
    rng = random.Random(6)
    arrivals = {
        0: _flood(rng, "f", 100, plen=8, out=80),
        20: [_group("c0", "chat", _prompt(rng, 16), 4)],
    }
    run, _ = _run(_cfg(max_num_batched_tokens=64, max_num_seqs=128), arrivals)
    assert all(so.num_scheduled_tokens == 64 for so in run.steps[14:20])  # decodes only
    assert _first_sample(run, "c0") == 20
    assert _per_key(run.steps[20]) == {"c": 16, "f": 4}  # the floor of 20 tokens


def _chat_phase(sched: Scheduler, runner: FakeRunner, clock: list[float], n: int, start: float):
    """`n` chat requests of 48/8 tokens, each sent 2 ms after the last one ended, the first
    at `start`, on a clock each step advances by its cost: (TTFTs, flood tokens a second,
    counted as bench/fair.py counts them: a prompt once its first token is out, and each
    token out; a prompt chunk that no first token follows yet counts for nothing)."""
    rng, ttft, flood, t0 = random.Random(len(sched.groups)), {}, 0, clock[0]
    started: set[str] = set()
    nxt, asked, rid = start, None, ""
    while len(ttft) < n or asked is not None:
        if asked is None and clock[0] >= nxt:
            rid, asked = f"c{nxt}", nxt
            sched.add_request(_group(rid, "chat", _prompt(rng, 48), 8))
        if not sched.has_unfinished():
            clock[0] = max(clock[0], nxt)
            continue
        so = sched.schedule()
        clock[0] += FIXED + PER_TOKEN * so.num_scheduled_tokens
        for u in sched.update_from_output(so, runner.execute_model(so)):
            if u.req_id[0] == "f" and u.new_token_ids:
                flood += len(u.new_token_ids)
                if u.req_id not in started:
                    started.add(u.req_id)
                    flood += sched.requests[u.req_id].prompt_len
            if u.req_id == rid and asked is not None and rid not in ttft:
                ttft[rid] = clock[0] - asked
            if u.req_id == rid and u.finish_reason:
                asked, nxt = None, clock[0] + 0.002
        sched.observe_step_time(FIXED + PER_TOKEN * so.num_scheduled_tokens)
    return list(ttft.values()), flood / (clock[0] - t0)


def test_the_fair_bench_on_a_clock_of_step_costs():
    """bench/fair.py's shape on a simulated clock (a step costs FIXED + PER_TOKEN a token):
    20 chat requests alone, then 100 flood requests of 512/64 and, half a second on, the
    20 chat requests again.  The chat key's worst TTFT stays within 2x of alone (the step
    in flight, about half its prompt's cost, and its own), where FCFS makes it wait for
    the flood; the flood keeps at least half its throughput meanwhile, counted as the
    bench counts it (its admissions ahead of its running prompts began a prompt a step
    and finished none: 0.37 of FCFS's)."""
    worst, rate = {}, {}
    for policy in ("fcfs", "fair"):
        cfg = _cfg(num_kv_blocks=8000, block_size=16, max_num_batched_tokens=1024,
                   max_num_seqs=256, max_model_len=2048, scheduling_policy=policy)  # fmt: skip
        sched, runner = Scheduler(cfg), FakeRunner(8000, 16, VOCAB)
        clock = [0.0]
        sched.latency.clock = lambda clock=clock: clock[0]
        alone, _ = _chat_phase(sched, runner, clock, 20, 0.0)
        rng = random.Random(7)
        for g in _flood(rng, "f", 100, plen=512, out=64):
            sched.add_request(g)
        crowded, rate[policy] = _chat_phase(sched, runner, clock, 20, clock[0] + 0.5)
        worst[policy] = max(crowded) / max(alone)
    assert worst["fair"] <= 2.0, worst
    assert worst["fcfs"] > 20, worst
    assert rate["fair"] >= 0.5 * rate["fcfs"], rate  # what the floor promises


def test_a_sparse_key_without_a_seat_never_stalls_the_server():
    """One seat, held by the flood; a chat key's prompt arrives.  The limits leave the
    flood nothing while the chat request cannot be seated (nobody is over a share it could
    be preempted for): such a step runs without the limits instead of running nothing (the
    server then waited for ever, every step empty)."""
    rng = random.Random(11)
    arrivals = {
        0: _flood(rng, "f", 5, plen=120, out=30),
        12: [_group("c0", "chat", _prompt(rng, 20), 4)],
    }
    run, _ = _run(_cfg(max_num_seqs=1, max_num_batched_tokens=1024), arrivals)
    assert all(so.num_scheduled_tokens > 0 for so in run.steps)


def test_a_backlogged_keys_running_prompts_go_before_its_new_ones():
    """A chat request decodes beside a flood, so every step is short and the flood's
    limit is a few tokens.  The flood's oldest prompt takes them until it is computed,
    then the next one starts: a flood request admitted ahead of the running ones (early,
    the flood being under its seat share) began one more prompt every step and finished
    none while the chat request ran."""
    rng = random.Random(12)
    arrivals = {
        0: [_group("c0", "chat", _prompt(rng, 24), 60)],
        1: _flood(rng, "f", 40, plen=120, out=4),
    }
    run, _ = _run(_cfg(), arrivals)
    started: list[str] = []
    for so in run.steps[1:55]:
        assert so.num_scheduled_tokens == 24 and _per_key(so)["c"] == 1
        for sr in so.all_scheduled():
            if sr.req_id[0] == "f" and sr.req_id not in started:
                started.append(sr.req_id)
    # 54 steps of 23 flood tokens: about ten 120-token prompts, in arrival order.
    assert started == [f"f{i}" for i in range(len(started))] and len(started) <= 12, started
    assert _first_sample(run, "f0") == 1 + 120 // 23
