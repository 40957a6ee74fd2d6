"""`make bench --sections scheduler`: the scheduler's own cost per step, with a no-op
executor, at 1,024 running requests: short (128-token) prompts, long (2k-4k token)
contexts decoding, and long contexts decoding while new 4k-token prompts are prefilled
in chunks beside them.

What a step costs the engine actor here is `schedule` + `update_from_output`; the no-op
executor answers instantly.  Steady decodes travel as `DecodeColumns` (three flat lists,
table deltas only at block edges) and come back as bare tokens, so a row costs a few
list-comprehension slots, not objects.  What is left per row is the work at block edges:
a row starting a block gets one, a row filling one hashes it for the prefix cache.  The
128-token row's prompts are all the same length, so its rows reach their edges on the
same step (1 in 16) and its median step has none; the long rows' lengths are staggered,
so every step has 2 in 16 rows at an edge.  That, not the context length, is most of
the gap between the rows in the "CPU vs 128-token row" column.  A step that re-sent every block table (or looped over every
token or block of every request) would grow with the contexts; the long rows show it
does not.  The msgpack column is the SchedulerOutput's size on the wire, for an executor
in another process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 16
BUDGET = 2048
# Filling 1,024 long prompts 2,048 tokens at a time would take a few thousand steps; the
# warm-up fills them with a big budget, then the timed steps run at BUDGET.
WARM_BUDGET = 1 << 16


class NoopRunner:
    """Samples token 1 for every sampling request, instantly."""

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        ids = list(so.decodes.req_ids)  # the columnar decodes sample first, in order
        for r in so.scheduled:
            if r.sample:
                ids.append(r.req_id)
                ids += r.fork_ids
        return ModelOutput(req_ids=ids, sampled_token_ids=[1] * len(ids))


def _prompt(i: int, n: int) -> list[int]:
    # Distinct per request (no prefix hits between them), cheap to build.
    return [16 + (i * 7919 + j) % 30000 for j in range(n)]


def _decoders(n: int, lo: int, hi: int) -> list[Request]:
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    span = hi - lo
    return [
        Request(f"d{i}", _prompt(i, lo + (i * 613) % (span + 1)), params, max_tokens=7000)
        for i in range(n)
    ]


def _build(n: int, reqs: list[Request], extra_seqs: int, extra_blocks: int, steps: int):
    """A scheduler holding `reqs` all at steady decode (prompts computed)."""
    # Room for the timed steps plus what the early admissions decode during the warm-up.
    blocks = sum(-(-(r.num_tokens + steps + 256) // BLOCK) for r in reqs) + extra_blocks
    cfg = SchedulerConfig(
        num_kv_blocks=blocks,
        block_size=BLOCK,
        max_num_batched_tokens=WARM_BUDGET,
        max_num_seqs=n + extra_seqs,
        max_model_len=8192,
    )
    sched = Scheduler(cfg)
    runner = NoopRunner()
    for r in reqs:
        sched.add_request([r])
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    cfg.max_num_batched_tokens = BUDGET
    return sched, runner


def _time_steps(
    sched: Scheduler, runner: NoopRunner, steps: int, before: Callable[[], None] | None = None
) -> tuple[Timings, int]:
    times, cpu, sizes, prefill_steps = [], [], [], 0
    for _ in range(steps):
        if before is not None:
            before()
        c, t = time.thread_time(), time.perf_counter()
        so = sched.schedule()
        mo = runner.execute_model(so)
        sched.update_from_output(so, mo)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        sizes.append(len(msgspec.msgpack.encode(so)))
        if any(len(r.input_ids) > 1 for r in so.scheduled):
            prefill_steps += 1
    return Timings(times, cpu, sizes), prefill_steps


class Timings(NamedTuple):
    wall: list[float]  # seconds per step
    cpu: list[float]  # this thread's CPU seconds per step (steadier on a shared machine)
    sizes: list[int]  # msgpack bytes per step


def _med(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _row(label: str, n: int, ctx: str, t: Timings, base: Timings | None = None) -> list[str]:
    wall, cpu = _med(t.wall) * 1e3, _med(t.cpu) * 1e3
    p90 = sorted(t.wall)[int(len(t.wall) * 0.9)] * 1e3
    kb = _med(t.sizes) / 1024
    ratio = f"{_med(t.cpu) / _med(base.cpu):.2f}x" if base is not None else "1.00x"
    return [
        label, str(n), ctx, f"{cpu:.3f}", ratio, f"{wall:.3f}", f"{p90:.3f}",
        f"{cpu * 1e3 / n:.2f}", f"{kb:.1f}",
    ]  # fmt: skip


def decode_case(n: int, lo: int, hi: int, steps: int) -> Timings:
    sched, runner = _build(n, _decoders(n, lo, hi), 0, 0, steps)
    timings, _ = _time_steps(sched, runner, steps)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)
    assert len(sched.running) == n
    return timings


def mixed_case(n: int, lo: int, hi: int, steps: int, prompt: int) -> Timings:
    """n requests decoding while prompts of `prompt` tokens (max_tokens 1, so each ends
    when its prefill does) stream in, chunked into what the decodes leave of the budget."""
    reserve = 4 * -(-prompt // BLOCK)
    sched, runner = _build(n, _decoders(n, lo, hi), 4, reserve, steps)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    count = [0]

    def top_up() -> None:
        while len(sched.waiting) < 2:
            count[0] += 1
            i = count[0]
            sched.add_request([Request(f"p{i}", _prompt(10_000 + i, prompt), params, max_tokens=1)])

    timings, prefill_steps = _time_steps(sched, runner, steps, top_up)
    assert prefill_steps == steps, "every timed step should carry a prefill chunk"
    return timings


def run(args: argparse.Namespace, print_table: Callable[..., str]) -> str:
    steps = args.sched_steps
    n = 1024
    # The 128-token row is the baseline: a step that is O(changed) costs about the same
    # at 2k-4k tokens of context per request.
    short = decode_case(n, 128, 128, steps)
    rows = [
        _row("decode", n, "128", short),
        _row("decode", n, "2048-4096", decode_case(n, 2048, 4096, steps), short),
        _row(
            "decode + 4096-token prefill chunks",
            n,
            "2048-4096",
            mixed_case(n, 2048, 4096, steps, 4096),
            short,
        ),
    ]
    title = (
        f"Scheduler per step, no-op executor ({steps} timed steps each, budget {BUDGET} "
        f"tokens, block {BLOCK}; target <= 1.5 ms at 1,024 long-context requests)"
    )
    header = [
        "steps",
        "running",
        "context tokens",
        "median CPU ms/step",
        "CPU vs 128-token row",
        "median wall ms/step",
        "p90 wall ms/step",
        "CPU us per request",
        "msgpack KB/step",
    ]
    return print_table(title, header, rows)
