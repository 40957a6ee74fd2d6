"""bench.cpu_gemm builds a git revision's GEMM kernel beside this tree's and times both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu import cpu_kernels

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
        ["git", "diff", "--quiet", "HEAD", "--", "gpu/cpu_kernels"], cwd=ROOT
    ).returncode
    if not kernels_changed:  # the same source on both sides: the same bits
        assert all(ln.rstrip().endswith("| yes |") for ln in rows), rows
