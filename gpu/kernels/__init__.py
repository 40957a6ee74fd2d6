"""Triton kernels with their Python wrappers and torch references.

Importing this package decorates the kernels: set TRITON_INTERPRET=1 before the first
import to run them on the CPU (tests), leave it unset on a CUDA machine.
"""

from __future__ import annotations

from gpu.kernels.attention import (
    AttentionKernelConfig,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)
from gpu.kernels.kv_cache import write_kv, write_kv_reference, write_kv_skip_reference
from gpu.kernels.norm_rope import (
    apply_rotary,
    rms_norm,
    rms_norm_reference,
    rotary_cos_sin_cache,
    rotary_reference,
)

__all__ = [
    "AttentionKernelConfig",
    "apply_rotary",
    "choose_num_splits",
    "paged_attention",
    "paged_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_cos_sin_cache",
    "rotary_reference",
    "write_kv",
    "write_kv_reference",
    "write_kv_skip_reference",
]
