"""The scheduler's side of constrained decoding, with a scripted matcher (no grammar
library, no torch): masks ride in the step for constrained sampling rows only, accepted
tokens advance the matcher, a finished grammar stops the request, a dead end ends it
with the reason."""

from __future__ import annotations

from scheduler.contract import ModelOutput
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig


class ScriptedMatcher:
    """Allows exactly `script` in order, then is terminated."""

    def __init__(self, script: list[int], vocab: int = 64) -> None:
        self.script, self.pos, self.vocab = script, 0, vocab
        self.accepted: list[int] = []
        self.err: str | None = None

    def bitmask(self) -> bytes | None:
        if self.err is not None:
            return None
        words = [0] * ((self.vocab + 31) // 32)
        t = self.script[self.pos]
        words[t // 32] |= 1 << (t % 32)
        return b"".join(w.to_bytes(4, "little") for w in words)

    def accept(self, token_id: int) -> bool:
        if self.pos >= len(self.script) or token_id != self.script[self.pos]:
            self.err = f"token {token_id} not allowed"
            return False
        self.pos += 1
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.pos -= num_tokens
        del self.accepted[len(self.accepted) - num_tokens :]

    @property
    def terminated(self) -> bool:
        return self.pos == len(self.script)

    def error(self) -> str | None:
        return self.err


def sched() -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256))


def req(rid: str, grammar=None, max_tokens: int = 10) -> Request:
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [1, 2, 3], p, eos_token_ids=(0,), max_tokens=max_tokens, grammar=grammar)


def step(s: Scheduler, tokens: dict[str, int]):
    so = s.schedule()
    ids = [r.req_id for r in so.all_scheduled() if r.sample]
    mo = ModelOutput(req_ids=ids, sampled_token_ids=[tokens[i] for i in ids])
    return so, list(s.update_from_output(so, mo))


def test_masks_only_for_constrained_rows_and_grammar_stop():
    s = sched()
    m = ScriptedMatcher([5, 9, 40])
    s.add_request([req("c", m)])
    s.add_request([req("u")])
    for expect in (5, 9, 40):
        so, ups = step(s, {"c": expect, "u": 11})
        assert set(so.grammar_bitmasks) == {"c"}
        mask = int.from_bytes(so.grammar_bitmasks["c"][4 * (expect // 32) :][:4], "little")
        assert mask == 1 << (expect % 32)
    assert m.accepted == [5, 9, 40]
    done = {u.req_id: u for u in ups}
    assert done["c"].finish_reason == "stop" and done["c"].stop_token_id is None
    assert done["u"].finish_reason is None
    so, _ = step(s, {"u": 11})
    assert so.grammar_bitmasks == {}


def test_dead_end_finishes_with_error_and_reason():
    s = sched()
    s.add_request([req("c", ScriptedMatcher([5, 9]))])
    step(s, {"c": 5})
    _, ups = step(s, {"c": 8})  # a token the grammar refuses
    (u,) = ups
    assert u.finish_reason == "error" and u.new_token_ids == []
    assert "cannot go on" in u.error and "token 8" in u.error
    assert not s.has_unfinished() and s.kv.usage == 0


def test_erroring_matcher_sends_no_mask_and_ends_the_request():
    s = sched()
    m = ScriptedMatcher([5, 9])
    m.err = "lexer too complex"
    s.add_request([req("c", m)])
    so, ups = step(s, {"c": 5})
    assert so.grammar_bitmasks == {}
    assert ups[0].finish_reason == "error" and "lexer too complex" in ups[0].error


def test_preemption_keeps_the_matcher_in_step():
    # Recompute after preemption replays known tokens; the matcher must not see them twice.
    s = Scheduler(SchedulerConfig(num_kv_blocks=6, block_size=4, max_model_len=24))
    script = list(range(10, 22))
    m = ScriptedMatcher(script)
    s.add_request([req("c", m, max_tokens=12)])
    s.add_request([Request("u", [1] * 9, SamplingParams(max_tokens=12, ignore_eos=True),
                           eos_token_ids=(0,), max_tokens=12)])  # fmt: skip
    out: list[int] = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        _, ups = step(s, {"c": script[len(out)] if len(out) < len(script) else 0, "u": 3})
        out += [t for u in ups if u.req_id == "c" for t in u.new_token_ids]
    assert s.num_preemptions > 0
    assert out == script == m.accepted
    assert s.requests.get("c") is None or s.requests["c"].status == RequestStatus.FINISHED_STOPPED


def test_many_matchers_of_one_class_go_to_its_batch_hook():
    from scheduler.structured import bitmasks

    calls = []

    class Batched(ScriptedMatcher):
        @classmethod
        def batch_bitmasks(cls, ms):
            calls.append(len(ms))
            return [m.bitmask() for m in ms]

    broken = Batched([1])
    broken.err = "x"
    ms = [Batched([3]), ScriptedMatcher([4]), Batched([5]), broken]
    out = bitmasks(ms)
    assert calls == [3]
    assert out[3] is None and out[1] == ScriptedMatcher([4]).bitmask()
    assert out[0] == Batched([3]).bitmask() and out[2] == Batched([5]).bitmask()
