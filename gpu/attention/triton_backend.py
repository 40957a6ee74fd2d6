"""Attention through the Triton kernels: the CUDA path (and the CPU one under the interpreter)."""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.kernels._common import (
    SUPPORTED_DTYPES,
    check_block_size,
    check_head_dim,
)
from gpu.kernels.attention import AttentionKernelConfig, paged_attention
from gpu.kernels.kv_cache import write_kv


class TritonAttentionBackend(AttentionBackend):
    """KV write kernel, then one paged-attention launch for the whole step.

    Decode-only steps with few sequences and long contexts take the split-context
    (flash-decoding) path when `choose_num_splits` says so.  `num_splits` pins that choice
    for every step (1 never splits, > 1 always splits decodes that many ways); a step's
    `meta.num_splits` pins it for that step alone (CUDA graphs do).
    """

    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        num_splits: int | None = None,
        config: AttentionKernelConfig | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        check_head_dim("triton attention backend", head_dim)
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        self.config = config
        self._checked = False

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # The kernels' argument checks run on this backend's first call only: its shapes
        # and dtypes are the model's, fixed from then on, and the runner has checked the
        # step's rows.  On a GPU they were a third of an attention's host time, and in a
        # step run as piecewise CUDA graphs these launches are what is left on the host.
        check = not self._checked
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale, check=check)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            num_decodes=meta.num_decodes,
            scale=self.scale,
            num_splits=meta.num_splits if meta.num_splits is not None else self.num_splits,
            config=self.config,
            k_scale=k_scale,
            v_scale=v_scale,
            check=check,
            out=out,
            tree_bits=meta.tree_bits,
        )
        self._checked = True
        return out

    @classmethod
    def check_supported(cls, head_dim: int, dtype: torch.dtype, block_size: int) -> None:
        name = "triton attention backend"
        check_head_dim(name, head_dim)
        check_block_size(name, block_size)
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"{name}: dtype {dtype} is not supported (supported: {names})")
