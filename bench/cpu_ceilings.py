"""The machine's two ceilings for the CPU projection kernels (bench.cpu_gemm --ceilings):

- memory: a STREAM-like copy (b = a over buffers far larger than the last-level cache;
  bytes read + written, as STREAM counts them) and a read-only sweep (a sum: what a decode
  GEMM does to its weights);
- compute: a loop of independent fused multiply-adds on registers, as wide as the CPU's
  vectors, on every thread: the most FLOP/s any GEMM can reach here.

A decode-size product reads each weight once for a few rows, so its bound is the memory
one; a prefill-size product does thousands of FLOPs per weight byte, so its bound is the
compute one.  Each is the best of several runs: what the CPU can do, not what a
neighbour left of it.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gpu.cpu import kernels as cpu_kernels

# Twelve independent accumulators: enough to cover the FMA latency (4-5 cycles) on two
# pipes on every x86 core these machines have, so the loop runs at the issue rate.
_FMA_SOURCE = r"""
#include <omp.h>
#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
typedef float vec __attribute__((vector_size(W * 4)));
extern "C" double ps_peak_fma(long iters, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    vec a[12], m, c;
    for (int j = 0; j < W; j++) { m[j] = 0.999f; c[j] = 1e-3f; }
    for (int i = 0; i < 12; i++) a[i] = c * (float)(i + omp_get_thread_num());
    for (long it = 0; it < iters; it++)
      for (int i = 0; i < 12; i++) a[i] = a[i] * m + c;
    float s = 0;
    for (int i = 0; i < 12; i++) for (int j = 0; j < W; j++) s += a[i][j];
    total += s;
  }
  return total;
}
extern "C" int ps_peak_width() { return W; }
#if defined(__AVX512BF16__)
#include <immintrin.h>
// The same loop on vdpbf16ps (16 float32 lanes, each two bf16 products a cycle's issue):
// the bf16 kernels' own ceiling, which the fp32 loop's twice only where the core issues it
// at the FMA's rate (measured, not assumed).
extern "C" double ps_peak_dpbf16(long iters, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 a[12];
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0
    const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3a83);  // ~1e-3
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)(i + omp_get_thread_num()));
    for (long it = 0; it < iters; it++)
      for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], x, y);
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
    total += s;
  }
  return total;
}
extern "C" int ps_has_dpbf16() { return 1; }
#else
extern "C" double ps_peak_dpbf16(long, int) { return 0; }
extern "C" int ps_has_dpbf16() { return 0; }
#endif
"""


def _fma_lib() -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp(prefix="pagestream-peak-"))
    src = tmp / "peak_fma.cpp"
    src.write_text(_FMA_SOURCE)
    out = tmp / "peak_fma.so"
    cxx = shutil.which("c++") or shutil.which("g++") or "c++"
    # The library's own flags, but strict maths: -ffast-math may fold the loop away.
    flags = [f for f in cpu_kernels._flags() if f != "-ffast-math"]
    cpu_kernels.compile_shared(cxx, flags, [src], out)
    lib = ctypes.CDLL(str(out))
    shutil.rmtree(tmp)  # loaded: the mapping outlives the file
    lib.ps_peak_fma.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.ps_peak_fma.restype = ctypes.c_double
    lib.ps_peak_width.restype = ctypes.c_int
    lib.ps_peak_dpbf16.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.ps_peak_dpbf16.restype = ctypes.c_double
    lib.ps_has_dpbf16.restype = ctypes.c_int
    return lib


def peak_flops(
    threads: int, reps: int = 5, iters: int = 20_000_000, kind: str = "fma"
) -> float | None:
    """Best FLOP/s of a register loop on `threads` threads: fp32 FMAs (`fma`), or
    vdpbf16ps (`dpbf16`; None where the CPU or the build has no AVX512-BF16)."""
    lib = _fma_lib()
    if kind == "dpbf16":
        if not lib.ps_has_dpbf16():
            return None
        fn, flops_a_lane = lib.ps_peak_dpbf16, 4  # two products, two adds
        width = 16
    else:
        fn, flops_a_lane = lib.ps_peak_fma, 2
        width = lib.ps_peak_width()
    fn(iters // 20, threads)  # wake the cores up to their clock
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(iters, threads)
        best = min(best, time.perf_counter() - t)
    return flops_a_lane * 12 * width * iters * threads / best


def copy_bandwidth(threads: int, nbytes: float = 1 << 30, reps: int = 5) -> float:
    """Best STREAM-copy bytes/s (read + write) over two buffers of `nbytes` each."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(int(nbytes) // 4)
        b = torch.empty_like(a)
        b.copy_(a)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t)
        return 2 * a.numel() * 4 / best
    finally:
        torch.set_num_threads(old)


def read_bandwidth(threads: int, nbytes: float = 1 << 30) -> float:
    from bench.roofline import read_rate

    return read_rate(threads, nbytes)
