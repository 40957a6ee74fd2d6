"""What the host CPU computes natively, read once from /proc/cpuinfo.

Three things depend on it: `--dtype auto` on CPU (bfloat16 only where the CPU has bf16
dot-product instructions; elsewhere a bf16 GEMM is emulated, several times slower than
float32), the compiled CPU kernels' cache key (a library built for one ISA must never be
loaded on another), and `make bench`'s header (figures mean little without the CPU).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# The instruction sets the dtype choice and the compiled kernels care about.
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    flags: frozenset[str]  # the subset of FLAGS_OF_INTEREST present
    # "family 26 model 2": VMs often name only the brand ("AMD EPYC"), which is the same
    # string for CPU generations whose figures differ severalfold.
    family: str = ""

    @property
    def native_bf16(self) -> bool:
        """bf16 matrix products in hardware (AVX512-BF16 dot products or AMX tiles)."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def isa(self) -> str:
        """The widest kernel path this CPU takes: the compiled kernels' variants."""
        if "avx512f" in self.flags:
            return "avx512-bf16" if "avx512_bf16" in self.flags else "avx512"
        return "avx2" if "avx2" in self.flags else "generic"

    def describe(self) -> str:
        have = [f for f in FLAGS_OF_INTEREST if f in self.flags]
        name = f"{self.model}, {self.family}" if self.family else self.model
        return f"{name} ({', '.join(have) or 'none of ' + '/'.join(FLAGS_OF_INTEREST)})"


def parse_cpuinfo(text: str) -> CpuFeatures:
    model, flags = "", frozenset[str]()
    ids: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in ids:
            ids[key] = value.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86 / arm64 spelling
            flags = frozenset(value.split()) & frozenset(FLAGS_OF_INTEREST)
    family = (
        f"family {ids['cpu family']} model {ids['model']}"
        if "cpu family" in ids and "model" in ids
        else ""
    )
    return CpuFeatures(model or platform.processor() or platform.machine(), flags, family)


@functools.cache
def detect() -> CpuFeatures:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:  # not Linux: no flags known, so nothing is assumed native
        return CpuFeatures(platform.processor() or platform.machine(), frozenset())


def l1d_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """cpu0's level-1 data cache, from sysfs (None where it is not there).  The compiled
    kernels' prefetch hints depend on it (cpu_kernels.wide_l1), so `make bench` names it."""
    for idx in sorted(cache_dir.glob("index*")):
        try:
            level, kind = (idx / "level").read_text().strip(), (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if level == "1" and kind == "Data" and size.endswith("K") and size[:-1].isdigit():
            return int(size[:-1]) * 1024
    return None
