"""Section `lora`: what serving LoRA adapters costs, on one model in one run.

Adapters of rank `--lora-rank` on every projection (modelkit.lora: PEFT's format, random
weights) are served beside the model, and the same offline batch (LLM.generate, greedy) is
timed as: the base alone with no adapter loaded (the baseline), the base with adapters
loaded (what loading them costs requests that use none), every request on one adapter,
and the requests spread over `--lora-adapters` adapters (each step then holds several).
Engines take turns, best of `--lora-reps` each, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path


def _adapters(path: Path, n: int, rank: int) -> dict[str, str]:
    from modelkit.lora import write_lora_adapter

    out = {}
    for i in range(n):
        d = path.parent / f"{path.name}-lora-r{rank}-{i}"
        if not (d / "adapter_model.safetensors").is_file():
            write_lora_adapter(path, d, rank=rank, seed=i)
        out[f"a{i}"] = str(d)
    return out


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    import torch

    from bench.workloads import mixed
    from gpu.config import ModelConfig
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    path = model_dir(args)
    cfg = ModelConfig.from_dir(path)
    adapters = _adapters(path, args.lora_adapters, args.lora_rank)
    work = mixed(args.lora_n, (32, 256), (16, 64), cfg.vocab_size, seed=5)
    names = list(adapters)

    def params(which: Callable[[int], str | None]) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True, lora=which(i))
            for i, w in enumerate(work)
        ]

    cases = [  # label, engine (with adapters?), each request's adapter
        ("base, no adapter loaded", False, params(lambda i: None)),
        (f"base, {len(names)} adapters loaded", True, params(lambda i: None)),
        ("every request on one adapter", True, params(lambda i: names[0])),
        (f"requests over {len(names)} adapters", True, params(lambda i: names[i % len(names)])),
    ]
    common = dict(dtype=args.dtype, threads=args.threads)
    engines = {
        False: LLM(str(path), **common),
        True: LLM(str(path), lora_modules=adapters, **common),
    }
    prompts = [w.prompt for w in work]
    tokens = sum(w.max_tokens for w in work)
    best: dict[str, float] = {}
    try:
        for _ in range(args.lora_reps):
            for label, loaded, ps in cases:
                t0 = time.perf_counter()
                engines[loaded].generate(prompts, ps)
                best[label] = min(best.get(label, 1e30), time.perf_counter() - t0)
    finally:
        for e in engines.values():
            e.shutdown()
    base = best[cases[0][0]]
    rows = [
        [label, f"{best[label]:.2f}", f"{tokens / best[label]:.0f}", f"{base / best[label]:.2f}x"]
        for label, _, _ in cases
    ]
    adapter_mib = (
        sum(Path(p, "adapter_model.safetensors").stat().st_size for p in adapters.values()) / 2**20
    )
    title = (
        f"LoRA adapters ({path.name}, {args.dtype}, {torch.get_num_threads()} threads; "
        f"rank {args.lora_rank} on every projection, {adapter_mib:.0f} MiB of adapters; "
        f"{len(work)} requests, best of {args.lora_reps} alternated runs)"
    )
    return table(title, ["case", "s", "output tok/s", "vs the base alone"], rows)
