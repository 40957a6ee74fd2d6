"""CPU attention: the compiled paged kernels, prefill and decode.

    python -m bench.cpu_attention [--threads 2] [--repeats 7] [--quick]
                                  [--only prefill|decode] [--baseline REV]

Prefill: one layer's prefill attention for one request, a chunk of L query tokens after
ctx cached tokens, K/V in a paged cache with a scattered block table.  "sdpa" is exactly
what `TorchAttentionBackend._prefill` does without the kernel (SDPA over the fresh K/V
when ctx == 0, else gather the context and SDPA with a mask); "kernel" is
`cpu_kernels.prefill_attention`.  GFLOP/s count only unmasked work: 4 * D * Hq flops per
(query, visible key) pair.

Decode: one layer's decode attention for a batch, `cpu_kernels.decode_attention`, in
milliseconds and GB/s of K/V read (each sequence's K and V rows, once).  "hot": every call
reads the same blocks (as far as they fit, from the caches); "cold": the blocks sit in a
~1 GB cache (on huge pages, as the engine's) and every call reads a different set of them,
as a model's layers do (its other layers' K/V evict each one's between steps).  --baseline
REV also builds the decode kernel of git revision REV (same flags) and times it alongside.

Times are the median of several repeats (shared machines are noisy); everything runs on
this one Python thread so only one OpenMP team exists.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time

import torch

from bench.kernel_rev import compile_revision
from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu import kernels as cpu_kernels


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
        block_tables=table,
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


# ---- decode ---------------------------------------------------------------------------

# name, batch, context range, Hq, Hkv, D
DECODE_CASES = [
    ("GQA", 64, (300, 768), 9, 3, 64),
    ("MHA", 64, (300, 768), 8, 8, 64),
    ("MQA", 64, (300, 768), 8, 1, 128),
    ("GQA", 32, (300, 768), 32, 8, 128),
    ("GQA", 64, (32, 160), 9, 3, 64),
    ("GQA", 2, (3000, 4096), 9, 3, 64),
    ("GQA", 1, (4096, 4096), 32, 8, 128),
]
COLD_BYTES = 1 << 30  # K + V cache for the cold runs: well past any L3


class DecodeCase:
    """A batch's decode inputs, its blocks scattered over a cache; for cold runs, many
    disjoint block tables over a ~1 GB cache, one per call in turn."""

    def __init__(self, batch, ctx, hq, hkv, d, bs, dtype, cold: bool, seed: int = 0):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.lens = [rng.randint(*ctx) for _ in range(batch)]
        nb = [-(-n // bs) for n in self.lens]
        need = sum(nb)
        block_bytes = bs * hkv * d * torch.empty(0, dtype=dtype).element_size()
        num_blocks = max(need + 8, COLD_BYTES // (2 * block_bytes)) if cold else need + 8
        # On huge pages, as the engine allocates its cache (ModelRunner._allocate_kv).
        shape = (num_blocks, bs, hkv, d)
        self.kc = cpu_kernels.huge_zeros(shape, dtype).normal_(generator=g)
        self.vc = cpu_kernels.huge_zeros(shape, dtype).normal_(generator=g)
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        self.tables = []
        for first in range(0, num_blocks - need + 1, need):
            t = torch.zeros(batch, max(nb), dtype=torch.int32)
            i = first
            for r, n in enumerate(nb):
                t[r, :n] = torch.tensor(perm[i : i + n])
                i += n
            self.tables.append(t)
        self.q = torch.randn(batch, hq, d, generator=g).to(dtype)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32)
        self.scale = d**-0.5
        self.calls = 0
        self.kv_bytes = sum(self.lens) * 2 * hkv * d * self.kc.element_size()

    def next_table(self) -> torch.Tensor:
        self.calls += 1
        return self.tables[self.calls % len(self.tables)]


def build_baseline(rev: str) -> ctypes.CDLL:
    """The decode kernel of git revision `rev` (with the headers of that revision),
    compiled as the library is.  `rev` must have the current entry point: q and out at
    token strides (qs, os)."""
    out = compile_revision(rev, "paged_decode.cpp")
    lib = ctypes.CDLL(str(out))
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for name in ("ps_decode_f32", "ps_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, p, p, i64, p, p, i64, i32, i32, i32, i32, i32, f32, i32]
        fn.restype = None
    return lib


def decode_runner(case: DecodeCase, lib: ctypes.CDLL | None, threads: int, cold: bool):
    out = torch.empty_like(case.q)
    b, hq, d = case.q.shape

    def kernel():
        t = case.next_table() if cold else case.tables[0]
        cpu_kernels.decode_attention(
            case.q, case.kc, case.vc, t, case.seq_lens, case.scale, num_threads=threads
        )

    def baseline():
        t = case.next_table() if cold else case.tables[0]
        fn = lib.ps_decode_bf16 if case.q.dtype == torch.bfloat16 else lib.ps_decode_f32
        fn(
            case.q.data_ptr(), case.q.stride(0), case.kc.data_ptr(), case.vc.data_ptr(),
            t.data_ptr(), t.stride(0), case.seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
            b, hq, case.kc.shape[2], d, case.kc.shape[1], case.scale, threads,
        )  # fmt: skip

    return kernel if lib is None else baseline


def bench_decode(args, baseline: ctypes.CDLL | None) -> None:
    dot = bool(cpu_kernels.load().ps_decode_bf16_dot())
    print(
        f"\ndecode, threads={args.threads}  bf16 path: {'AVX-512 BF16 dot' if dot else 'fp32 FMA'}"
    )
    cols = ["dtype", "case", "B", "ctx", "D", "K/V MB"]
    for mode in ("hot", "cold"):
        if baseline is not None:
            cols += [f"base {mode} ms"]
        cols += [f"{mode} ms", f"{mode} GB/s"]
        if baseline is not None:
            cols += [f"{mode} speedup"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    cases = DECODE_CASES[:1] + DECODE_CASES[4:6] if args.quick else DECODE_CASES
    for dtype in (torch.bfloat16, torch.float32):
        for name, batch, ctx, hq, hkv, d in cases:
            row = [str(dtype).removeprefix("torch."), f"{name} {hq}/{hkv}", str(batch)]
            row += [f"{ctx[0]}-{ctx[1]}" if ctx[0] != ctx[1] else str(ctx[0]), str(d)]
            for cold in (False, True):
                case = DecodeCase(batch, ctx, hq, hkv, d, args.block_size, dtype, cold)
                if not cold:
                    row.append(f"{case.kv_bytes / 1e6:.1f}")
                tk = timeit(decode_runner(case, None, args.threads, cold), args.repeats)
                if baseline is not None:
                    tb = timeit(decode_runner(case, baseline, args.threads, cold), args.repeats)
                    row.append(f"{tb * 1e3:.3f}")
                row += [f"{tk * 1e3:.3f}", f"{case.kv_bytes / tk / 1e9:.1f}"]
                if baseline is not None:
                    row.append(f"{tb / tk:.2f}x")
                del case
            print("| " + " | ".join(row) + " |", flush=True)


# ---- prefill ------------------------------------------------------------------------------


def bench_prefill(args) -> None:
    dot = bool(cpu_kernels.load().ps_prefill_bf16_dot())
    print(
        f"prefill, threads={args.threads}  bf16 path: {'AVX-512 BF16 dot' if dot else 'fp32 FMA'}"
    )
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hq", type=int, default=9, help="prefill query heads")
    ap.add_argument("--hkv", type=int, default=3, help="prefill kv heads")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few cases only")
    ap.add_argument("--only", choices=["prefill", "decode"])
    ap.add_argument("--baseline", metavar="REV", help="also time the decode kernel of git REV")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernel is unavailable (no C++ compiler?)")
    if args.only != "decode":
        bench_prefill(args)
    if args.only != "prefill":
        bench_decode(args, build_baseline(args.baseline) if args.baseline else None)


if __name__ == "__main__":
    main()
