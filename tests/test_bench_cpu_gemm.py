"""bench.cpu_gemm builds a git revision's GEMM kernel beside this tree's and times both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.cpu import kernels as cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not cpu_kernels.sgemm_available(), reason="needs the AVX2 sgemm")
def test_cpu_gemm_times_head_against_this_tree():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    r = subprocess.run(
        [sys.executable, "-m", "bench.cpu_gemm", "--baseline", "HEAD", "--kernel", "sgemm",
         "--preset", "tiny", "--rows", "3,7", "--rounds", "2", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 3 |") or ln.startswith("| 7 |")]
    assert len(rows) == 2, r.stdout
    kernels_changed = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "gpu/cpu/kernels"], cwd=ROOT
    ).returncode
    if not kernels_changed:  # the same source on both sides: the same bits
        assert all(ln.rstrip().endswith("| yes |") for ln in rows), rows


@pytest.mark.skipif(not cpu_kernels.sgemm_available(), reason="needs the AVX2 sgemm")
def test_cpu_gemm_ceilings_reports_each_projection_against_both_ceilings():
    r = subprocess.run(
        [sys.executable, "-m", "bench.cpu_gemm", "--ceilings", "--kernel", "sgemm",
         "--preset", "tiny", "--rows", "1,64", "--rounds", "2", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "STREAM copy" in r.stdout and "FMA loop" in r.stdout, r.stdout
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| ")]
    kinds = {c[0].strip() for c in rows[1:]}
    assert kinds == {"qkv", "o", "gate_up", "down", "lm_head"}, rows
    # Fractions of ceilings measured in the same run; on a machine busy with other work
    # the two sides see different shares of the cores, so only their form is checked.
    for cells in rows[1:]:
        assert float(cells[4].strip(" %")) > 0 and float(cells[7].strip(" %")) >= 0, cells


def test_peak_flops_loop_counts_what_it_runs():
    from bench.cpu_ceilings import peak_flops

    one = peak_flops(1, reps=2, iters=2_000_000)
    # Any x86-64 core with AVX2 does at least a few GFLOP/s and at most ~400 per core: two
    # 512-bit FMA pipes (16 lanes, 2 FLOP each) at 6 GHz.  A Zen 5 EPYC core reads ~267.
    assert 2e9 < one < 4e11


def test_the_bf16_dot_loop_runs_where_the_cpu_has_it():
    from bench.cpu_ceilings import peak_flops

    dot = peak_flops(1, reps=2, iters=2_000_000, kind="dpbf16")
    if not cpu_kernels.dpbf16_available():
        assert dot is None
        return
    fma = peak_flops(1, reps=2, iters=2_000_000)
    assert dot is not None and fma is not None
    # Two bf16 products and two adds a lane where an FMA does one of each: up to twice
    # the fp32 rate (Zen 4 issues it at the FMA's rate, so twice); on the AMX Xeons
    # (family 6 model 167) the loop reaches only ~0.49x the FMA loop's FLOP/s (two runs),
    # so a bound at 0.5x failed there.  Loose bounds for a machine running other work.
    assert 0.3 * fma < dot < 3 * fma, (dot, fma)


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason="needs AMX")
def test_cpu_gemm_runs_the_amx_kernel_both_ways():
    """The AMX kernel (what decode-sized bf16 products run on where the CPU has it) in both
    modes: against the ceilings, and against a revision's build of it with the same bits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--kernel", "amx", "--preset", "tiny", "--rounds", "2", "--threads", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "bench.cpu_gemm", "--ceilings", "--rows", "1,24", *common],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    kinds = {ln.split("|")[1].strip() for ln in r.stdout.splitlines() if ln.startswith("| ")}
    assert {"qkv", "o", "gate_up", "down", "lm_head"} <= kinds, r.stdout
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        return
    r = subprocess.run(
        [sys.executable, "-m", "bench.cpu_gemm", "--baseline", "HEAD", "--rows", "5", *common],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 5 |")]
    assert len(rows) == 1, r.stdout
    if not subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "gpu/cpu/kernels"], cwd=ROOT
    ).returncode:
        assert rows[0].rstrip().endswith("| yes |"), rows


def test_cpu_gemm_times_the_kernel_against_onednn():
    """--vs-onednn: the CPU's default kernel against oneDNN's packed product over the same
    projections (the gate_up as oneDNN's two fused products), one row a row count."""
    from bench.cpu_gemm import KERNELS, default_kernel
    from gpu.cpu import linear as cpu_linear

    kernel = default_kernel()
    if not KERNELS[kernel].available() or not cpu_linear.packing_available(KERNELS[kernel].dtype):
        pytest.skip("no built kernel with a packed oneDNN product beside it")
    r = subprocess.run(
        [sys.executable, "-m", "bench.cpu_gemm", "--vs-onednn", "--kernel", kernel,
         "--preset", "tiny", "--rows", "3,40", "--rounds", "2", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| 3 |")
            or ln.startswith("| 40 |")]  # fmt: skip
    assert len(rows) == 2, r.stdout
    assert all(float(c[3].strip(" x")) > 0 for c in rows), rows
