"""Conversation KV pins (scheduler/pins.py) at scheduler level: a pinned conversation's next
turn hits its last turn's blocks after a storm that evicts everything evictable, an
unpinned one misses; the cap, the TTL, replacement and release hold; nothing leaks."""

from __future__ import annotations

import random

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import assert_all_free, assert_pool_consistent, drive

VOCAB = 1000
BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sched(blocks: int = 64, fraction: float = 0.25, ttl: float = 60.0):
    cfg = SchedulerConfig(
        num_kv_blocks=blocks, block_size=BS, max_num_batched_tokens=64, max_num_seqs=16,
        max_model_len=blocks * BS, pinned_kv_fraction=fraction, session_ttl=ttl,
    )  # fmt: skip
    sched = Scheduler(cfg)
    clock = Clock()
    sched.kv.pins.clock = clock
    return sched, FakeRunner(blocks, BS, VOCAB), clock


def _req(rid: str, prompt: list[int], out: int, conv: str | None = None) -> list[Request]:
    params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
    return [Request(rid, prompt, params, max_tokens=out, conversation=conv)]


def _turn(sched, runner, rid, prompt, out, conv=None) -> tuple[list[int], int]:
    """Run one request alone: (its output, prompt tokens it found cached)."""
    group = _req(rid, prompt, out, conv)
    run = drive(sched, runner, {0: [group]})
    assert run.outputs[rid] == reference_generate(prompt, out, VOCAB, None)
    return run.outputs[rid], group[0].num_cached_tokens


def _storm(sched, runner, rng: random.Random, n: int = 12, plen: int = 60) -> None:
    """Distinct prompts that together pass through every block of the pool, two at a time
    (what fits beside the pins: more at once would need the pinned blocks too)."""
    for w in range(0, n, 2):
        groups = [
            _req(f"storm{i}", [rng.randrange(10, VOCAB) for _ in range(plen)], 8)
            for i in range(w, w + 2)
        ]
        drive(sched, runner, {0: groups})
    pool = sched.kv.pool
    # Every unpinned block was handed out again: nothing from before the storm is left.
    assert all(b.block_hash is None or b.pins or b.hits == 0 for b in pool.free_queue)


def test_pinned_second_turn_hits_after_storm_unpinned_misses():
    sched, runner, _ = _sched()
    rng = random.Random(1)
    a1 = [rng.randrange(10, VOCAB) for _ in range(22)]
    b1 = [rng.randrange(10, VOCAB) for _ in range(22)]
    out_a, _ = _turn(sched, runner, "a1", a1, 10, conv="t1/chat-a")
    out_b, _ = _turn(sched, runner, "b1", b1, 10)
    pinned = sched.kv.pool.num_pinned
    assert pinned == (22 + 10 - 1) // BS  # every full block with computed KV
    _storm(sched, runner, rng)
    assert sched.kv.pool.num_pinned == pinned  # the storm had unpinned blocks to take
    a2 = a1 + out_a + [11, 12, 13]
    b2 = b1 + out_b + [11, 12, 13]
    _, hit_a = _turn(sched, runner, "a2", a2, 4, conv="t1/chat-a")
    _, hit_b = _turn(sched, runner, "b2", b2, 4)
    assert hit_a == pinned * BS and hit_b == 0
    st = sched.stats().pins
    assert st is not None and st.followup_turns == 1 and st.followup_hit_turns == 1
    assert st.followup_cached_tokens == hit_a
    assert_all_free(sched, runner)


def test_cap_holds_and_oldest_pins_make_room():
    sched, runner, _ = _sched(blocks=64, fraction=0.25)
    cap = 16
    rng = random.Random(2)
    for i in range(8):
        prompt = [rng.randrange(10, VOCAB) for _ in range(30)]
        _turn(sched, runner, f"c{i}", prompt, 6, conv=f"conv{i}")
        assert sched.kv.pool.num_pinned <= cap
        assert_pool_consistent(sched)
    pins = sched.kv.pins
    assert sched.kv.pool.num_pinned == cap
    assert "conv7" in pins.convs and "conv0" not in pins.convs  # the oldest went first
    # One turn larger than the cap pins its leading blocks only (a hit needs the start).
    big = [rng.randrange(10, VOCAB) for _ in range(120)]
    _turn(sched, runner, "big", big, 2, conv="big")
    assert list(pins.convs) == ["big"] and len(pins.convs["big"].blocks) == cap
    assert pins.convs["big"].blocks[0].block_hash == _hashes(big)[0]
    assert_all_free(sched, runner)


def _hashes(prompt: list[int]) -> list[bytes]:
    r = _req("h", prompt, 1)[0]
    r.update_block_hashes(BS)
    return r.block_hashes


def test_next_turn_replaces_ttl_expires_release_drops():
    sched, runner, clock = _sched(ttl=30.0)
    rng = random.Random(3)
    p1 = [rng.randrange(10, VOCAB) for _ in range(18)]
    out1, _ = _turn(sched, runner, "t1", p1, 6, conv="k")
    first = list(sched.kv.pins.convs["k"].blocks)
    p2 = p1 + out1 + [rng.randrange(10, VOCAB) for _ in range(9)]
    _turn(sched, runner, "t2", p2, 6, conv="k")
    second = sched.kv.pins.convs["k"].blocks
    assert len(sched.kv.pins.convs) == 1 and len(second) > len(first)
    assert second[: len(first)] == first  # turn 2 hit turn 1's blocks and pins them on
    assert sched.kv.pool.num_pinned == len(second)
    # Another conversation, pinned later, outlives the first past its TTL.
    _turn(sched, runner, "o1", [rng.randrange(10, VOCAB) for _ in range(12)], 2, conv="other")
    clock.now += 20
    _turn(sched, runner, "x", [1, 2, 3], 1)
    assert set(sched.kv.pins.convs) == {"k", "other"}
    sched.kv.pins.convs["other"].expires = clock.now + 30
    clock.now += 15
    _turn(sched, runner, "y", [4, 5, 6], 1)
    assert set(sched.kv.pins.convs) == {"other"}
    sched.kv.pins.unpin("other")  # what a closed WebSocket sends
    assert sched.kv.pool.num_pinned == 0 and not sched.kv.pool.pinned_queue.size
    assert_all_free(sched, runner)


def test_pinned_blocks_are_evicted_when_nothing_else_is_left():
    """Pins are a preference: a request that needs every block still runs, and the pins it
    took lose their tail first (the chain past an evicted block cannot be hit)."""
    sched, runner, _ = _sched(blocks=32, fraction=0.5)
    rng = random.Random(4)
    prompt = [rng.randrange(10, VOCAB) for _ in range(40)]
    _turn(sched, runner, "p", prompt, 4, conv="c")
    held = len(sched.kv.pins.convs["c"].blocks)
    big = [rng.randrange(10, VOCAB) for _ in range(32 * BS - 8)]
    _turn(sched, runner, "big", big, 4)
    pins = sched.kv.pins
    kept = len(pins.convs["c"].blocks) if "c" in pins.convs else 0
    assert kept < held and pins.stats.evicted_blocks >= held - kept
    assert sched.kv.pool.num_pinned == kept
    hashes = _hashes(prompt)
    assert [b.block_hash for b in pins.convs["c"].blocks] == hashes[:kept] if kept else True
    assert_all_free(sched, runner)


def _steps(sched, runner, n: int, fail: str | None = None) -> None:
    for i in range(n):
        so = sched.schedule()
        mo = runner.execute_model(so)
        if fail is not None and i == n - 1:
            mo.errors[fail] = "the runner failed this request"
        sched.update_from_output(so, mo)


def test_failed_turn_pins_nothing_and_aborted_turn_does():
    sched, runner, _ = _sched()
    sched.add_request(_req("f", list(range(10, 30)), 50, conv="c"))
    _steps(sched, runner, 6, fail="f")
    assert "f" not in sched.requests and not sched.kv.pins.convs
    sched.add_request(_req("g", list(range(10, 30)), 50, conv="c"))
    _steps(sched, runner, 6)
    sched.abort("g")
    assert len(sched.kv.pins.convs["c"].blocks) == 25 // BS  # 20 prompt + 5 outputs computed
    runner.execute_model(sched.schedule())
    assert_all_free(sched, runner)
