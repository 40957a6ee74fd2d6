"""Section `quant`: what quantization buys and costs, in one run on one model.

Rows: the model dtype (baseline), int8 KV, fp8 KV, int8 weights, AWQ INT4 weights (a
checkpoint written from the same model by modelkit.awq, group 64), GPTQ INT4 weights with
act-order (modelkit.gptq, group 64, symmetric: the same INT4 layers, each gathering its
input into its groups' order), and int8 KV + int8 weights.  Columns: KV bytes per token and KV blocks (= concurrent tokens) at the same KV
memory, projection weight bytes, batch-1 decode tokens/s (model forward + logits per
token; the ratio is against a baseline runner timed in alternating turns with the row), offline throughput (LLM.generate on a small mixed workload), and drift from the
baseline (teacher-forced logits: KL and top-1 agreement; greedy: share of identical
sequences and mean first divergence).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

CONFIGS = [  # label, kv_cache_dtype, quantization, the INT4 checkpoint to use (or None)
    ("baseline", "auto", None, None),
    ("int8 KV", "int8", None, None),
    ("fp8 KV", "fp8", None, None),
    ("int8 weights", "auto", "int8", None),
    ("AWQ int4 weights", "auto", None, "awq"),
    ("GPTQ int4 weights, act-order", "auto", None, "gptq"),
    ("int8 KV + int8 weights", "int8", "int8", None),
]
KV_MEMORY = 1 << 30  # the same KV budget for every row
DECODE_TURNS = 3


def _side_by_side(runner, base) -> tuple[float, float]:
    """(best decode tok/s of runner, of base), measured in alternating turns."""
    from gpu.quant_eval import decode_tokens_per_second

    mine, theirs = [], []
    for _ in range(DECODE_TURNS):
        theirs.append(decode_tokens_per_second(base, steps=32))
        mine.append(decode_tokens_per_second(runner, steps=32))
    return max(mine), max(theirs)


def _int4_dir(path: Path, kind: str) -> Path:
    from modelkit.awq import write_awq_checkpoint
    from modelkit.gptq import write_gptq_checkpoint

    out = path.parent / (path.name + f"-{kind}64")
    if not (out / "config.json").is_file():
        print(f"writing the {kind.upper()} copy of {path} to {out} ...", flush=True)
        if kind == "awq":
            write_awq_checkpoint(path, out, 64)
        else:
            write_gptq_checkpoint(path, out, 64, sym=True, act_order=True)
    return out


def _offline(
    args: argparse.Namespace, ckpt: Path, kv: str, wq: str | None, work: list, params: list
) -> tuple[list[list[int]], float]:
    """The offline batch through an LLM of this config: its greedy sequences and tok/s."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    llm = LLM(str(ckpt), dtype=args.dtype, threads=args.threads, kv_cache_dtype=kv,
              quantization=wq, max_num_batched_tokens=args.budget)  # fmt: skip
    llm.generate([w.prompt for w in work[:2]], SamplingParams(temperature=0, max_tokens=2))
    t = time.perf_counter()
    outs = llm.generate([w.prompt for w in work], params)
    secs = time.perf_counter() - t
    llm.shutdown()
    seqs = [o.outputs[0].token_ids for o in outs]
    return seqs, sum(len(s) for s in seqs) / secs


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    import torch

    from bench.workloads import mixed
    from gpu.config import ModelConfig
    from gpu.model_runner import ModelRunner
    from gpu.quant_eval import (
        greedy_agreement,
        logit_drift,
        teacher_forced_logits,
        weight_bytes,
    )
    from scheduler.sampling_params import SamplingParams

    path = model_dir(args)
    int4 = {kind: _int4_dir(path, kind) for kind in ("awq", "gptq")}
    cfg = ModelConfig.from_dir(path)
    work = mixed(args.quant_n, (32, 128), (16, 32), cfg.vocab_size, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in work]
    probe = [(11 * i + 5) % cfg.vocab_size for i in range(96)]
    rows, ref_logits, ref_seqs = [], None, None
    base_tput = None
    # Batch-1 decode is timed against a baseline runner kept alive for the whole run, the
    # two taking turns (best of DECODE_TURNS each): on a shared machine the load moves
    # between rows run a minute apart, so only a ratio measured side by side means much.
    base = ModelRunner(path, dtype=args.dtype, device="cpu", kv_cache_bytes=KV_MEMORY >> 4)
    for label, kv, wq, kind in CONFIGS:
        ckpt = int4[kind] if kind else path
        r = ModelRunner(ckpt, dtype=args.dtype, device="cpu", kv_cache_bytes=KV_MEMORY,
                        kv_cache_dtype=kv, quantization=wq)  # fmt: skip
        per_token = r.kv_bytes_per_block // r.block_size
        blocks = r.num_kv_blocks
        proj, other = weight_bytes(r.model)  # projections; embedding + lm_head + norms
        decode, base_decode = _side_by_side(r, base)
        logits = teacher_forced_logits(r, probe, 32)
        del r
        seqs, tput = _offline(args, ckpt, kv, wq, work, params)
        if ref_logits is None:
            ref_logits, ref_seqs, base_tput = logits, seqs, tput
        d = logit_drift(ref_logits, logits)
        g = greedy_agreement(ref_seqs, seqs)
        firsts = [f for f in g.first_divergence if f is not None]
        rows.append([
            label, str(per_token), str(blocks), f"{proj / 2**20:.1f} + {other / 2**20:.1f}",
            f"{decode:.1f} ({decode / base_decode:.2f}x)", f"{tput:.0f} ({tput / base_tput:.2f}x)",
            f"{d.mean_kl:.1e}", f"{d.argmax_agree:.1%}", f"{g.identical:.0%}",
            f"{statistics.mean(firsts):.0f}" if firsts else "-",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    title = (
        f"quantization ({path.name}, {args.dtype}, {torch.get_num_threads()} threads, "
        f"KV memory {KV_MEMORY >> 20} MiB, {len(work)} offline requests)"
    )
    header = [
        "config", "KV B/token", "KV blocks", "weights MiB (proj. + rest)", "batch-1 decode tok/s (vs base side by side)",
        "offline tok/s", "KL vs base", "top-1 agree", "greedy identical", "mean 1st diverg.",
    ]  # fmt: skip
    return table(title, header, rows)
