"""FP8 W8A8 projections against bf16 at the Llama-3.1-8B shape: `python -m bench.fp8_gemm`.

A device check for `--quantization fp8` (gpu/quant_linear.py Fp8Linear): one decoder
layer's four projections (qkv, o, gate_up, down at hidden 4096, intermediate 14336, 8 KV
heads of 128), times 32 layers, at 1 and 64 rows: the bf16 product (F.linear) against
Fp8Linear (per-token activation quantization + torch._scaled_mm), each beside the time
of reading its weight bytes at the device's copy bandwidth.  Batch-1 decode of an 8B model
is these reads, so the bf16/fp8 ratio of the summed projections is the ceiling on the
issue's batch-1 decode bar (>= 1.6x), before attention, norms, the lm_head and host time.

CUDA timings with CUDA graphs off, median of events over `--iters` calls after a warm-up.
`--device cpu --small` is a dry run of the script (numbers meaningless).  Writes a markdown
table to $OUT/fp8_gemm.md when $OUT is set, and prints it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu.quant_linear import Fp8Linear, quantize_fp8

SHAPES_8B = {  # name: (N, K) of one layer's fused projection
    "qkv": (4096 + 2 * 1024, 4096),
    "o": (4096, 4096),
    "gate_up": (2 * 14336, 4096),
    "down": (4096, 14336),
}
SHAPES_SMALL = {"qkv": (512, 256), "o": (256, 256), "gate_up": (1024, 256), "down": (256, 512)}


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of one call."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def _copy_gbs(device: torch.device, iters: int) -> float:
    n = (1 << 28) if device.type == "cuda" else (1 << 22)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = _time(lambda: b.copy_(a), device, iters)
    return 2 * n / ms / 1e6  # read + write, GB/s


def run(device: torch.device, small: bool, iters: int) -> str:
    shapes = SHAPES_SMALL if small else SHAPES_8B
    gbs = _copy_gbs(device, iters)
    g = torch.Generator(device="cpu").manual_seed(0)
    lines = [
        f"FP8 W8A8 vs bf16 projections ({'small' if small else 'Llama-3.1-8B'} shape, "
        f"{device}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"copy bandwidth {gbs:.0f} GB/s)",
        "",
        "| rows | projection | bf16 ms | fp8 ms | fp8 speedup | bf16 / fp8 % of weight-read roofline |",
        "|---|---|---|---|---|---|",
    ]
    for rows in (1, 64):
        tot_b = tot_f = 0.0
        for name, (n, k) in shapes.items():
            w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
            q, s = quantize_fp8(w)
            layer = Fp8Linear(q, s, None, torch.bfloat16)
            x = torch.randn(rows, k, generator=g).to(device, torch.bfloat16)
            tb = _time(lambda w=w, x=x: F.linear(x, w), device, iters)
            tf = _time(lambda layer=layer, x=x: layer(x), device, iters)
            roof_b = n * k * 2 / gbs / 1e6  # ms to read the bf16 weight once
            path = "_scaled_mm" if layer.mm_out is not None else "fallback"
            lines.append(
                f"| {rows} | {name} [{n}x{k}] ({path}) | {tb:.4f} | {tf:.4f} | {tb / tf:.2f}x | "
                f"{100 * roof_b / tb:.0f}% / {100 * roof_b / 2 / tf:.0f}% |"
            )
            tot_b, tot_f = tot_b + tb, tot_f + tf
            del w, q, layer
        lines.append(
            f"| {rows} | **32 layers** | {32 * tot_b:.3f} | {32 * tot_f:.3f} | "
            f"**{tot_b / tot_f:.2f}x** | |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy shapes (a dry run)")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    table = run(torch.device(a.device), a.small, a.iters)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_gemm.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
