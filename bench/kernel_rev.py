"""A git revision's CPU kernel source, built beside this tree's for an A/B
(bench.cpu_attention, bench.cpu_gemm)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from gpu.cpu import kernels as cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
# Where the kernels' sources lived, newest first (revisions before the CPU backend got its
# own package kept them in gpu/cpu_kernels/).
KERNEL_FOLDERS = ("gpu/cpu/kernels/", "gpu/cpu_kernels/")


def compile_revision(rev: str, source: str) -> Path:
    """gpu/cpu/kernels/`source` of git revision `rev`, with every header of that revision,
    compiled as the library is; returns the shared library's path."""
    tmp = Path(tempfile.mkdtemp(prefix="pagestream-rev-"))
    for folder in KERNEL_FOLDERS:
        listing = subprocess.run(
            ["git", "ls-tree", "--name-only", rev, folder],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        if folder + source in listing:
            break
    else:
        raise SystemExit(f"{rev} has no {source} in {' or '.join(KERNEL_FOLDERS)}")
    for path in listing:
        if path.endswith(".h") or path.endswith("/" + source):
            text = subprocess.run(
                ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                text=True,
            ).stdout  # fmt: skip
            (tmp / Path(path).name).write_text(text)
    cxx = shutil.which("c++") or shutil.which("g++") or "c++"
    out = tmp / f"{Path(source).stem}.so"
    cpu_kernels.compile_shared(cxx, cpu_kernels._flags(), [tmp / source], out)
    return out
