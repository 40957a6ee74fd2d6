"""Shared test set-up.

TRITON_INTERPRET must be set before any module that defines a @triton.jit kernel is
imported (triton reads it at decoration time), so it is set here, at conftest import.
PAGESTREAM_CPU_WARMUP=0: the engines tests build (hundreds, servers included) skip
building oneDNN's kernels for every step size at start (~1.5 s each for a tiny float32
model); tests/gpu/test_cpu_linear.py turns it back on where it tests the warm-up.
PAGESTREAM_CPU_KVCACHE_SPACE=0.25: their KV caches at 256 MiB, not the 2 GiB default,
which every engine faulted in on huge pages at start (~2-3 s each on a 2-core VM, memory a
previous engine gave back included); 131,072 tokens of the tiny models.
"""

from __future__ import annotations

import os

os.environ.setdefault("PAGESTREAM_CPU_WARMUP", "0")
os.environ.setdefault("PAGESTREAM_CPU_KVCACHE_SPACE", "0.25")

if not os.environ.get("PAGESTREAM_NO_TRITON_INTERPRET"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
