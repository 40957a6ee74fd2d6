"""vLLM's max_loras: at most that many distinct LoRA adapters among the running requests
(so in any one step).  A request of another adapter waits, and the requests behind it (the
base model's, or an adapter's already running) go on; every request still finishes with
its output unchanged."""

from __future__ import annotations

import pytest

from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import EOS, assert_all_free, drive

# (request, adapter, tenant): x, y and z are three adapters; None the base model.
WORK = [("a", "x", "k1"), ("b", "y", "k2"), ("c", "z", "k1"), ("d", None, "k2"),
        ("e", "x", "k1"), ("f", "z", "k2"), ("g", None, "k1")]  # fmt: skip


def _group(rid: str, lora: str | None, tenant: str, max_tokens: int) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=lora)
    prompt = [3 + ord(rid) % 50, 4, 5, 6, 7]
    return [Request(rid, prompt, params, eos_token_ids=(EOS,), max_tokens=max_tokens,
                    tenant=tenant)]  # fmt: skip


def _run(max_loras: int | None, policy: str):
    cfg = SchedulerConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=64,
                          max_num_seqs=16, max_model_len=128, scheduling_policy=policy,
                          max_loras=max_loras)  # fmt: skip
    sched, runner = Scheduler(cfg), FakeRunner(128, 4)
    admitted: dict[str, int] = {}
    seen: list[set[str]] = []

    def watch(so) -> float:
        running = {r.req_id: r.params.lora for r in sched.running}
        for rid in running:
            admitted.setdefault(rid, len(seen))
        seen.append({lo for lo in running.values() if lo is not None})
        return 0.001

    # a runs long; b a little less: z's requests wait for an adapter to leave.
    lens = {"a": 30, "b": 12}
    arrivals = {0: [_group(r, lo, t, lens.get(r, 4)) for r, lo, t in WORK]}
    run = drive(sched, runner, arrivals, step_seconds=watch)
    for rid, _lo, _t in WORK:
        prompt = [3 + ord(rid) % 50, 4, 5, 6, 7]
        want = reference_generate(prompt, lens.get(rid, 4), runner.vocab, EOS)
        assert run.outputs[rid] == want, rid
    assert_all_free(sched, runner)
    return admitted, seen


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_no_step_runs_more_adapters_than_max_loras(policy):
    admitted, seen = _run(2, policy)
    assert max(len(s) for s in seen) == 2
    # The third adapter's requests wait until one of the first two leaves; the base
    # model's, and those of the two adapters already running, behind them do not.
    (third,) = {"x", "y", "z"} - seen[0]
    for rid, lora, _t in WORK:
        if lora == third:
            assert admitted[rid] > 0 and len(seen[admitted[rid] - 1]) < 2, rid
        else:
            assert admitted[rid] == 0, rid


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_unbounded_admits_every_adapter_at_once(policy):
    admitted, seen = _run(None, policy)
    assert set(admitted.values()) == {0} and max(len(s) for s in seen) == 3


def test_max_loras_must_be_positive():
    from scheduler.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="max_loras"):
        EngineConfig.from_kwargs(model="m", max_loras=0)
