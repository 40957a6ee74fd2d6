"""The kernels' own tests again, on the AddressSanitizer + UndefinedBehaviorSanitizer build
(cpu_kernels.use_sanitizers(): its own library name, never the product's): an
out-of-bounds read or write of a tensor, a use after free, a signed overflow, a misaligned
access or a bad shift in any kernel those tests reach aborts the run with the report.

The host is Python, so the sanitizer runtime must be the first library loaded: a
subprocess runs pytest under LD_PRELOAD of the compiler's libasan (part of g++ on Debian,
which CI installs for the kernels anyway).  Leak checking is off: CPython and torch keep
allocations to exit by design."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")

# The kernels' tests it runs: the attention kernels (float32, bf16, quantized caches), the
# step ops, the elementwise chain, and the packed GEMMs at small sizes.
TESTS = [
    "tests/gpu/test_cpu_kernels.py",
    "tests/gpu/test_cpu_step_ops.py",
    "tests/gpu/test_cpu_fused.py",
]

# Not the slow ones: they rebuild the library for other ISA levels.
PYTEST_ARGS = ["-q", "-x", "-m", "not slow", "-p", "no:cacheprovider"]

RUNNER = """
import sys
from gpu.cpu import kernels as cpu_kernels
cpu_kernels.use_sanitizers()
assert cpu_kernels.load() is not None, "the sanitized build failed"
assert "_sanitized-" in cpu_kernels.load()._name
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def _runtime(name: str) -> str | None:
    path = subprocess.run(
        [CXX, f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
def test_kernel_tests_pass_under_asan_and_ubsan():
    runtimes = [_runtime("libasan.so"), _runtime("libubsan.so")] if CXX else [None]
    if None in runtimes:
        if os.environ.get("CI") == "true":
            pytest.fail("CI needs g++ with its libasan/libubsan for the sanitizer build")
        pytest.skip("no compiler sanitizer runtimes here")
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    env.pop("PAGESTREAM_CPU_KERNELS", None)
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, *PYTEST_ARGS, *TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, (r.stdout[-6000:], r.stderr[-6000:])
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-6000:]
