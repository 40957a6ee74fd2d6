"""Shared test set-up.

TRITON_INTERPRET must be set before any module that defines a @triton.jit kernel is
imported (triton reads it at decoration time), so it is set here, at conftest import.
"""

from __future__ import annotations

import os

if not os.environ.get("PAGESTREAM_NO_TRITON_INTERPRET"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
