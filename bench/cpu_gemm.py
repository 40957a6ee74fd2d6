"""CPU projection GEMMs: a model's projections in sequence, this tree against a git revision,
or (--ceilings) each projection against the machine's memory and compute ceilings.

    python -m bench.cpu_gemm --baseline REV [--kernel amx|dpbf16|sgemm512|sgemm|sgemm_w16]
                             [--preset mid] [--rows 16,38,64] [--rounds 15] [--no-lm-head]
                             [--threads 2]
    python -m bench.cpu_gemm --ceilings [--preset llama1b] [--rows 1,16,64,512]
    python -m bench.cpu_gemm --vs-onednn [--kernel amx] [--preset llama1b] [--rows 512,2048]

--ceilings: per kind of projection (qkv, o, gate_up, down, lm_head; every layer's, in
sequence, so the weights stream from memory as in a step) the median time, the weight
bytes read per second as a fraction of a STREAM-like copy's bandwidth, and GFLOP/s as a
fraction of a register FMA loop's (bench/cpu_ceilings.py).  Decode-size rows are bound by
the first, prefill-size rows by the second.

One step's projections, as the model runs them: per layer qkv, o, the gated gate_up
(SiLU·up as its epilogue) and down, then the lm_head, each layer with weights of its own,
so the weights stream from memory as they do in a decode step (the `mid` preset's bf16
weights are ~250 MB).  The two libraries, this tree's kernel source and REV's (each with
its own revision's headers, compiled with the library's flags), run the same packed weights
in alternated rounds, the order flipped every round; the table gives the median time of a
sequence, its GFLOP/s and the ratio, and checks that both give the same bits (a layout or
numerics change shows as "no").  REV must pack weights as this tree does and have the same
entry points.  For prefill sizes (--rows 512,2048) pass --no-lm-head: a step computes logits
for the last rows only.

--vs-onednn: the kernel against oneDNN's packed product (what `PackedLinear` runs where no
kernel of ours is chosen; a gated gate_up as oneDNN's two fused products, `gated_linear`)
over the same projections, alternated round by round: the measurement behind a routing
choice (PAGESTREAM_PREFILL_GEMM=onednn on AMX), to be taken on the machine at hand.

The shared 2-core machines are noisy: a ratio means something over many rounds, and a
whole-run check (`make bench`'s offline section) still decides.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bench.kernel_rev import compile_revision
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu import linear as cpu_linear
from modelkit.make_model import PRESETS


class Kernel(NamedTuple):
    source: str  # in gpu/cpu_kernels
    dtype: torch.dtype
    available: Callable[[], bool]  # built on this CPU
    symbol: str = ""  # the product's entry point, ps_<symbol> (default: the kernel's name)

    def product(self, name: str) -> str:
        return f"ps_{self.symbol or name}"

    def gated(self, name: str) -> str:
        return f"ps_{(self.symbol or name).removesuffix('_gemm')}_silu"


# AMX first: where the CPU has it, the model's decode-sized bf16 products run on it.
KERNELS = {
    "amx": Kernel("amx_gemm.cpp", torch.bfloat16, cpu_kernels.amx_available, "amx_gemm"),
    "dpbf16": Kernel("dpbf16_gemm.cpp", torch.bfloat16, cpu_kernels.dpbf16_available),
    "sgemm512": Kernel("dpbf16_gemm.cpp", torch.float32, cpu_kernels.sgemm512_available),
    "sgemm": Kernel("sgemm.cpp", torch.float32, cpu_kernels.sgemm_available),
    # The same kernel over float32 weights held in bf16 (a bf16 checkpoint run in float32).
    "sgemm_w16": Kernel("sgemm.cpp", torch.float32, cpu_kernels.sgemm_available),
}


def _bind(lib: ctypes.CDLL, kernel: str) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    spec = KERNELS[kernel]
    getattr(lib, spec.product(kernel)).argtypes = [p, i64, i64, i64, p, i64, p, p, i64, i32]
    getattr(lib, spec.product(kernel)).restype = None
    getattr(lib, spec.gated(kernel)).argtypes = [p, i64, i64, i64, p, i64, p, i64, i32]
    getattr(lib, spec.gated(kernel)).restype = i32


def build_revision(rev: str, kernel: str) -> ctypes.CDLL:
    """REV's source of the kernel, with REV's headers, compiled as the library is."""
    out = compile_revision(rev, KERNELS[kernel].source)
    lib = ctypes.CDLL(str(out))
    _bind(lib, kernel)
    return lib


@dataclass
class Proj:
    n: int  # output features (gated: 2 x inter, written as inter)
    k: int
    gated: bool
    packed: torch.Tensor
    kind: str = ""
    onednn: tuple[torch.Tensor, ...] = ()  # oneDNN's packed weight (gated: gate, up halves)


def projections(kernel: str, preset: str, lm_head: bool, onednn: bool = False) -> list[Proj]:
    cfg = PRESETS[preset]
    dtype = KERNELS[kernel].dtype
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = []
    for _ in range(cfg.num_layers):
        shapes += [(qkv, h, False, "qkv"), (cfg.num_heads * cfg.head_dim, h, False, "o")]
        shapes += [(2 * inter, h, True, "gate_up"), (h, inter, False, "down")]
    if lm_head:
        shapes.append((cfg.vocab_size, h, False, "lm_head"))
    pack = getattr(cpu_kernels, f"{kernel}_pack")
    gated_pack = (
        cpu_kernels.amx_gated_pack if kernel == "amx" else cpu_kernels.gated_kernel(kernel).pack
    )
    out = []
    for n, k, gated, kind in shapes:
        # bf16 values, as a checkpoint's: every kernel takes them, sgemm_w16 needs them.
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16).to(dtype)
        pr = Proj(n, k, gated, gated_pack(w, n // 2) if gated else pack(w), kind)
        if onednn:
            halves = (w[: n // 2], w[n // 2 :]) if gated else (w,)
            pr.onednn = tuple(cpu_linear.pack_weight(h.contiguous()) for h in halves)
        out.append(pr)
    return out


def run_onednn(projs: list[Proj], xs) -> None:
    for pr, x in zip(projs, xs, strict=True):
        if pr.gated:
            cpu_linear.gated_linear(x, *pr.onednn)
        else:
            cpu_linear.packed_linear(x, pr.onednn[0], None)


def vs_onednn(args: argparse.Namespace) -> None:
    kernel = args.kernel
    lib = cpu_kernels.load()
    assert lib is not None
    _bind(lib, kernel)
    projs = projections(kernel, args.preset, not args.no_lm_head, onednn=True)
    dtype = KERNELS[kernel].dtype
    print(
        f"\n{kernel} vs oneDNN ({dtype}), preset {args.preset}: {len(projs)} projections in "
        f"sequence, {args.threads} threads, median of {args.rounds} alternated rounds\n"
    )
    print("| rows | oneDNN ms (GFLOP/s) | kernel ms (GFLOP/s) | speed-up |")
    print("|---|---|---|---|")
    flops_per_row = sum(2 * p.n * p.k for p in projs)
    for m in args.rows:
        xs = [torch.randn(m, p.k).to(dtype) for p in projs]
        ys = [torch.empty(m, p.n // 2 if p.gated else p.n, dtype=dtype) for p in projs]
        runs = {
            "onednn": functools.partial(run_onednn, projs, xs),
            "kernel": functools.partial(run_sequence, lib, kernel, projs, xs, ys, args.threads),
        }
        for fn in runs.values():  # warm-up (oneDNN builds its kernel per shape)
            fn()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in ("onednn", "kernel") if r % 2 == 0 else ("kernel", "onednn"):
                t = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t)
        o, k = (statistics.median(times[n]) for n in ("onednn", "kernel"))
        gf = flops_per_row * m / 1e9
        print(f"| {m} | {o * 1e3:.2f} ({gf / o:.0f}) | {k * 1e3:.2f} ({gf / k:.0f}) | {o / k:.3f}x |",
              flush=True)  # fmt: skip


def run_sequence(lib: ctypes.CDLL, kernel: str, projs: list[Proj], xs, ys, threads: int):
    for pr, x, y in zip(projs, xs, ys, strict=True):
        m = x.shape[0]
        if pr.gated:
            ok = getattr(lib, KERNELS[kernel].gated(kernel))(
                x.data_ptr(), x.stride(0), m, pr.k, pr.packed.data_ptr(), pr.n, y.data_ptr(),
                y.stride(0), threads,
            )  # fmt: skip
            assert ok, f"{kernel}_silu refused the shape"
        else:
            getattr(lib, KERNELS[kernel].product(kernel))(
                x.data_ptr(), x.stride(0), m, pr.k, pr.packed.data_ptr(), pr.n, None,
                y.data_ptr(), y.stride(0), threads,
            )  # fmt: skip


def bench(args: argparse.Namespace) -> None:
    kernel = args.kernel
    here = cpu_kernels.load()
    assert here is not None
    _bind(here, kernel)
    base = build_revision(args.baseline, kernel)
    projs = projections(kernel, args.preset, not args.no_lm_head)
    dtype = KERNELS[kernel].dtype
    flops_per_row = sum(2 * p.n * p.k for p in projs)
    print(
        f"\n{kernel} ({dtype}), preset {args.preset}: {len(projs)} projections in sequence, "
        f"{sum(p.packed.numel() * p.packed.element_size() for p in projs) / 1e6:.0f} MB of "
        f"packed weights, {args.threads} threads, median of {args.rounds} alternated rounds; "
        f"baseline {args.baseline}\n"
    )
    print("| rows | baseline ms (GFLOP/s) | this tree ms (GFLOP/s) | speed-up | same bits |")
    print("|---|---|---|---|---|")
    libs = {"base": base, "here": here}
    for m in args.rows:
        xs = [torch.randn(m, p.k).to(dtype) for p in projs]
        outs = {
            name: [torch.empty(m, p.n // 2 if p.gated else p.n, dtype=dtype) for p in projs]
            for name in libs
        }
        times: dict[str, list[float]] = {name: [] for name in libs}
        for name, lib in libs.items():  # warm-up
            run_sequence(lib, kernel, projs, xs, outs[name], args.threads)
        same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs["here"], strict=True))
        for r in range(args.rounds):
            for name in ("base", "here") if r % 2 == 0 else ("here", "base"):
                t = time.perf_counter()
                run_sequence(libs[name], kernel, projs, xs, outs[name], args.threads)
                times[name].append(time.perf_counter() - t)
        b, h = (statistics.median(times[n]) for n in ("base", "here"))
        gf = flops_per_row * m / 1e9
        print(
            f"| {m} | {b * 1e3:.2f} ({gf / b:.0f}) | {h * 1e3:.2f} ({gf / h:.0f}) | "
            f"{b / h:.3f}x | {'yes' if same else 'no'} |",
            flush=True,
        )


def ceilings(args: argparse.Namespace) -> None:
    from bench import cpu_ceilings

    kernel, dtype = args.kernel, KERNELS[args.kernel].dtype
    lib = cpu_kernels.load()
    assert lib is not None
    _bind(lib, kernel)
    copy = cpu_ceilings.copy_bandwidth(args.threads)
    read = cpu_ceilings.read_bandwidth(args.threads)
    fma = cpu_ceilings.peak_flops(args.threads)
    assert fma is not None
    # The bf16 kernel against its own instruction's loop (its rate is not always twice
    # the FMA's); the others against the fp32 FMA loop (AMX tiles: no loop of their own).
    dot = cpu_ceilings.peak_flops(args.threads, kind="dpbf16") if kernel == "dpbf16" else None
    peak, peak_name = (dot, "vdpbf16ps") if dot else (fma, "FMA")
    loops = f"FMA loop {fma / 1e9:.0f} GFLOP/s (fp32)"
    if dot:
        loops += f", vdpbf16ps loop {dot / 1e9:.0f} GFLOP/s"
    print(
        f"\n{kernel} ({dtype}), preset {args.preset}, {args.threads} threads, median of "
        f"{args.rounds}; ceilings: STREAM copy {copy / 1e9:.1f} GB/s, read {read / 1e9:.1f} "
        f"GB/s, {loops}\n"
    )
    print("| projection | rows | ms (all layers) | weights GB/s | of copy | of read | "
          f"GFLOP/s | of {peak_name} peak |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    projs = projections(kernel, args.preset, not args.no_lm_head)
    for kind in dict.fromkeys(p.kind for p in projs):
        group = [p for p in projs if p.kind == kind]
        nbytes = sum(p.packed.numel() * p.packed.element_size() for p in group)
        for m in args.rows:
            xs = [torch.randn(m, p.k).to(dtype) for p in group]
            ys = [torch.empty(m, p.n // 2 if p.gated else p.n, dtype=dtype) for p in group]
            run_sequence(lib, kernel, group, xs, ys, args.threads)
            times = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                run_sequence(lib, kernel, group, xs, ys, args.threads)
                times.append(time.perf_counter() - t)
            t = statistics.median(times)
            flops = sum(2 * p.n * p.k for p in group) * m
            print(
                f"| {kind} | {m} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | "
                f"{nbytes / t / copy:.0%} | {nbytes / t / read:.0%} | {flops / t / 1e9:.0f} | "
                f"{flops / t / peak:.0%} |",
                flush=True,
            )


def default_kernel() -> str:
    return next((name for name, k in KERNELS.items() if k.available()), "sgemm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="git revision to time")
    ap.add_argument("--ceilings", action="store_true", help="vs the machine's ceilings")
    ap.add_argument("--vs-onednn", action="store_true", help="vs oneDNN's packed product")
    ap.add_argument(
        "--kernel", choices=sorted(KERNELS), help="default: the widest built (amx where it runs)"
    )
    ap.add_argument("--preset", default="mid", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="16,38,64", help="rows per product, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-lm-head", action="store_true", help="leave the lm_head out")
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are unavailable (no C++ compiler?)")
    args.kernel = args.kernel or default_kernel()
    if not KERNELS[args.kernel].available():
        raise SystemExit(f"{args.kernel} is not built on this CPU")
    if args.ceilings:
        ceilings(args)
    elif args.vs_onednn:
        vs_onednn(args)
    elif args.baseline:
        bench(args)
    else:
        ap.error("give --baseline REV, --ceilings or --vs-onednn")


if __name__ == "__main__":
    main()
