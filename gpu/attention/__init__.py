"""Attention backends and the factory that picks one at start-up.

The Triton backend is imported lazily: importing it decorates the kernels, and Triton
decides at that moment whether they are compiled for a GPU or interpreted
(TRITON_INTERPRET=1), so nothing here should import it before the caller has chosen.
"""

from __future__ import annotations

import logging

import torch

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.attention import CpuAttentionBackend
from scheduler import envs

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "TorchAttentionBackend",
    "create_attention_backend",
]

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")


def _triton_backend_class() -> type[AttentionBackend]:
    try:
        from gpu.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:  # triton missing (non-Linux) or broken
        raise ValueError(f"attention backend 'triton' is unavailable: {e}") from e
    return TritonAttentionBackend


def create_attention_backend(
    name: str,
    device: torch.device | str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    dtype: torch.dtype,
    block_size: int,
) -> AttentionBackend:
    """The attention backend `name` ("auto", "cpu", "torch" or "triton") for a model on
    `device`.

    auto: Triton on CUDA when it supports the model (else torch, with a warning), the
    compiled CPU kernels (cpu) on a CPU.  torch: plain torch ops on any device (SDPA and a
    gathered decode; the portable path and the kernels' reference).  triton on CPU runs the kernels in Triton's interpreter, which needs
    TRITON_INTERPRET=1 set before the kernels are first imported (tests do this).
    Raises ValueError naming what is unsupported.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    args = (num_heads, num_kv_heads, head_dim, scale)

    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs a CPU device, not {device}")
        return CpuAttentionBackend(*args)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend(*args)

    if name == "auto":
        try:
            cls = _triton_backend_class()
            cls.check_supported(head_dim, dtype, block_size)
        except ValueError as e:
            logger.warning("attention: falling back to the torch backend: %s", e)
            return TorchAttentionBackend(*args)
        return cls(*args)

    # name == "triton"
    if device.type == "cpu":
        if not envs.TRITON_INTERPRET:
            raise ValueError(
                "attention backend 'triton' needs a CUDA device; on the CPU it only runs "
                "under Triton's interpreter (set TRITON_INTERPRET=1 before start-up; slow, "
                "for tests) — use 'cpu' or 'auto' instead"
            )
    elif device.type != "cuda":
        raise ValueError(f"attention backend 'triton' does not support device {device}")
    cls = _triton_backend_class()
    cls.check_supported(head_dim, dtype, block_size)
    if device.type == "cpu":
        from gpu.kernels._common import is_interpreted
        from gpu.kernels.attention import _paged_attention_kernel

        if not is_interpreted(_paged_attention_kernel):
            raise ValueError(
                "attention backend 'triton' on the CPU: TRITON_INTERPRET=1 was set after the "
                "kernels had been imported (compiled for a GPU); set it before start-up"
            )
    return cls(*args)
