"""CPU feature detection and what follows from it: the `auto` dtype on CPU and the
compiled kernels' cache key."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpu.config import resolve_dtype
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.features import CpuFeatures, detect, parse_cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni sha_ni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni sha_ni
"""


def cpu(*flags: str) -> CpuFeatures:
    return CpuFeatures("test CPU", frozenset(flags))


def test_parse_cpuinfo_keeps_model_and_flags_of_interest():
    f = parse_cpuinfo(CPUINFO)
    assert f.model == "AMD EPYC 9R14"
    assert f.flags == {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert f.native_bf16 and f.isa == "avx512-bf16"
    assert "avx512_bf16" in f.describe() and "AMD EPYC 9R14" in f.describe()
    # VMs may name only the brand: family and model tell a Zen 4 from a Zen 5.
    assert f.family == "family 25 model 17"
    assert f.describe().startswith("AMD EPYC 9R14, family 25 model 17 (avx2")
    assert parse_cpuinfo("model name\t: X\nflags\t: avx2\n").describe() == "X (avx2)"


def test_auto_dtype_on_cpu_is_what_the_cpu_computes_natively():
    dev = torch.device("cpu")
    assert resolve_dtype("auto", dev, cpu("avx2", "avx512f", "avx512_bf16")) == torch.bfloat16
    assert resolve_dtype("auto", dev, cpu("avx2", "avx512f", "amx_bf16")) == torch.bfloat16
    # AVX-512 without bf16 (e.g. Ice Lake / Skylake Xeons), AVX2 only, nothing known.
    assert resolve_dtype("auto", dev, cpu("avx2", "avx512f", "avx512_vnni")) == torch.float32
    assert resolve_dtype("auto", dev, cpu("avx2")) == torch.float32
    assert resolve_dtype("auto", dev, cpu()) == torch.float32
    # An explicit dtype is never second-guessed; CUDA's auto is bf16 whatever the host.
    assert resolve_dtype("float32", dev, cpu("avx512_bf16")) == torch.float32
    assert resolve_dtype("bfloat16", dev, cpu("avx2")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), cpu()) == torch.bfloat16
    native = torch.bfloat16 if detect().native_bf16 else torch.float32
    assert resolve_dtype("auto", dev) == native


def test_kernel_cache_key_differs_by_isa():
    flags = ["-O3", "-march=native"]
    keys = {
        c.isa: cpu_kernels.cache_key("c++", flags, c)
        for c in (
            cpu("avx2", "avx512f", "avx512_bf16"),
            cpu("avx2", "avx512f"),
            cpu("avx2"),
            cpu(),
        )
    }
    assert sorted(keys) == ["avx2", "avx512", "avx512-bf16", "generic"]
    assert len(set(keys.values())) == 4
    assert all(k.startswith(isa + "-") for isa, k in keys.items())
    # Same ISA set, another flag of interest (VNNI), or another -march: another build.
    base = cpu("avx2", "avx512f")
    assert cpu_kernels.cache_key("c++", flags, base) != cpu_kernels.cache_key(
        "c++", flags, cpu("avx2", "avx512f", "avx512_vnni")
    )
    pinned = cpu_kernels.cache_key("c++", ["-O3", "-march=x86-64-v3"], base)
    assert pinned.startswith("march-x86-64-v3-") and pinned != keys["avx512"]
    assert cpu_kernels.cache_key("c++", flags, base) == cpu_kernels.cache_key("c++", flags, base)


def test_loading_the_kernels_keeps_subnormals() -> None:
    """Linked with -ffast-math, the library's constructor would set flush-to-zero on the
    loading thread: torch's float32 ops would then flush subnormals (1e-39 * 1 -> 0). Checked
    in a fresh process, on the thread that loads it and on a thread started after."""
    code = """
import threading, torch
from gpu.cpu import kernels as cpu_kernels
x = torch.tensor([1e-39], dtype=torch.float32)
assert (x * 1.0).item() != 0.0
assert cpu_kernels.load() is not None
out = {}
t = threading.Thread(target=lambda: out.setdefault("v", (x * 1.0).item()))
t.start(); t.join()
print((x * 1.0).item(), out["v"])
"""
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler: the kernels are not built")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    here, thread = map(float, r.stdout.split())
    assert here != 0.0 and thread != 0.0, r.stdout


def test_l1d_bytes_reads_the_level_1_data_cache(tmp_path):
    from gpu.cpu.features import l1d_bytes

    for idx, (level, kind, size) in enumerate(
        [("1", "Instruction", "32K"), ("1", "Data", "48K"), ("2", "Unified", "1024K")]
    ):
        d = tmp_path / f"index{idx}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert l1d_bytes(tmp_path) == 48 * 1024
    assert l1d_bytes(tmp_path / "missing") is None
