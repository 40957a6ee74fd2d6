"""oneDNN linear layers with weights reordered once at load (CPU only).

`F.linear` on CPU lays the weight out for the GEMM kernel on every call; reordering once
saves that work each step: on the 2-core test machine 15-25% per projection in bf16 at
decode batch sizes, and 2.5-4x in float32 (the default CPU dtype), where the packed path
also reaches oneDNN's faster kernels.  The ops are the ones torch's own CPU compiler
(inductor) emits for frozen linear layers; when they are missing or disagree with
`F.linear` on a probe, the model keeps plain `nn.Linear`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def _ops_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [None], "")


class PackedLinear(nn.Module):
    """A drop-in for nn.Linear whose weight is pre-reordered for oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Plain attributes, not parameters: the packed layout is an opaque oneDNN tensor
        # that state_dict() and .to() must not touch.
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Packed and plain linear agree on a random problem of this dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    x = torch.randn(5, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    try:
        got = packed_linear(x, pack_weight(w), b)
    except Exception as e:  # an op missing for this dtype / build
        log.info("packed oneDNN linear unavailable for %s: %s", dtype, e)
        return False
    ref = F.linear(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return got.shape == ref.shape and bool(
        torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    )


def packing_available(dtype: torch.dtype) -> bool:
    if os.environ.get("PAGESTREAM_PACK_LINEAR", "1") == "0":
        return False
    return dtype in (torch.float32, torch.bfloat16) and _ops_available() and _probe(dtype)


def pack_model_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every nn.Linear of a CPU model for a PackedLinear; returns how many.
    (Quantized layers are not nn.Linear and keep their own kernels.)"""
    if not packing_available(dtype):
        return 0
    return swap_linears(model, PackedLinear)


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain nn.Linear in `model` by `make(linear)`; returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
