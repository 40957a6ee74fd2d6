"""CPU prefill attention: torch SDPA (the fallback path) against the compiled paged kernel.

    python -m bench.cpu_attention [--threads 2] [--repeats 7] [--quick]

Each case is one layer's prefill attention for one request: a chunk of L query tokens
after ctx cached tokens, K/V in a paged cache with a scattered block table.  "sdpa" is
exactly what `TorchAttentionBackend._prefill` does without the kernel (SDPA over the fresh
K/V when ctx == 0, else gather the context and SDPA with a mask); "kernel" is
`cpu_kernels.prefill_attention`.  GFLOP/s count only unmasked work: 4 * D * Hq flops per
(query, visible key) pair.  Times are the median of several repeats (shared machines are
noisy); everything runs on this one Python thread so only one OpenMP team exists.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from gpu import cpu_kernels
from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_backend import TorchAttentionBackend


def make_case(qlen: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq = ctx + qlen
    nb = -(-seq // bs)
    num_blocks = nb + 8
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    table = torch.tensor([perm[:nb]], dtype=torch.int32)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(qlen, hq, d, generator=g).to(dtype)
    # The chunk's own K/V, as they sit in the cache (the backend writes them first).
    pos = torch.arange(ctx, seq)
    slots = table[0, pos // bs].long() * bs + pos % bs
    k = kc.view(-1, hkv, d)[slots].clone()
    v = vc.view(-1, hkv, d)[slots].clone()
    meta = AttentionMetadata(
        num_tokens=qlen, num_seqs=1, num_decodes=0,
        query_start_loc=torch.tensor([0, qlen], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32), block_tables=table,
        slot_mapping=slots, max_query_len=qlen, max_seq_len=seq, query_lens_cpu=[qlen],
        seq_lens_cpu=[seq], block_size=bs,
    )  # fmt: skip
    return q, k, v, kc, vc, meta


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up (and the kernel's one-time build)
    n = 1
    while True:  # calls per sample: at least ~20 ms of work
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt > 0.02:
            break
        n *= 2
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def run_case(qlen, ctx, hq, hkv, d, bs, dtype, repeats) -> tuple[float, float]:
    """Seconds per call: (SDPA path, kernel)."""
    q, k, v, kc, vc, meta = make_case(qlen, ctx, hq, hkv, d, bs, dtype)
    be = TorchAttentionBackend(hq, hkv, d, d**-0.5)
    out = torch.empty_like(q)

    def sdpa():
        be._prefill(q, k, v, kc, vc, meta, 0)

    def kernel():
        cpu_kernels.prefill_attention(
            q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, be.scale, out
        )

    return timeit(sdpa, repeats), timeit(kernel, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hq", type=int, default=9)
    ap.add_argument("--hkv", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few cases only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernel is unavailable (no C++ compiler?)")
    dot = bool(cpu_kernels.load().ps_prefill_bf16_dot())
    print(f"threads={args.threads}  bf16 path: {'AVX-512 BF16 dot' if dot else 'fp32 FMA'}")
    hq, hkv, bs = args.hq, args.hkv, args.block_size
    cases = [
        (128, 0, 64), (256, 0, 64), (512, 0, 64), (1024, 0, 64), (2048, 0, 64),
        (512, 512, 64), (256, 1792, 64), (512, 0, 128), (512, 512, 128),
    ]  # fmt: skip
    if args.quick:
        cases = [(256, 0, 64), (512, 0, 64), (512, 512, 64)]
    header = (
        "| dtype | D | L | ctx | sdpa ms | kernel ms | sdpa GFLOP/s | kernel GFLOP/s | speedup |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dtype in (torch.bfloat16, torch.float32):
        for qlen, ctx, d in cases:
            ts, tk = run_case(qlen, ctx, hq, hkv, d, bs, dtype, args.repeats)
            pairs = qlen * ctx + qlen * (qlen + 1) // 2  # (query, visible key) pairs
            gf = 4 * d * hq * pairs / 1e9
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | {d} | {qlen} | {ctx} | {ts * 1e3:.2f} | {tk * 1e3:.2f} "
                f"| {gf / ts:.0f} | {gf / tk:.0f} | {ts / tk:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
