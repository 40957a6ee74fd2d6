"""The attention seam: one backend object per model, chosen at start-up.

A step's tokens are flattened across requests: [num_tokens, heads, head_dim].  Requests
are ordered decodes first (query length 1), then prefill chunks, so a backend can treat the
two groups differently.  Each backend first writes the step's new K/V into their cache
slots, then attends each query over its request's paged context (the cached tokens plus
the new ones, causally).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch; built once per step, shared by all layers."""

    num_tokens: int
    num_seqs: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path can loop over prefills without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Split-context (flash-decoding) choice for this step: None lets the backend decide
    # from max_seq_len on the host; a captured CUDA graph pins 1, since its launch must
    # not depend on a host value that changes between replays.
    num_splits: int | None = None
    # Tree attention (Medusa verify chunks, gpu/medusa.py): per token, the rows of its own
    # chunk it may see, bit j for the chunk's j-th token, on top of the causal mask (keys
    # before the chunk stay visible; a chunk past 64 tokens sees its later keys causally).
    # -1 (every bit) for an ordinary token; None when the step has no tree.
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64


class AttentionBackend(ABC):
    """Writes K/V into the paged cache and computes attention for one layer."""

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, kv_heads]
        v_scale: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: `out` when given
        """Store k/v at meta.slot_mapping, then attend q over each request's context.
        With scales, the cache holds int8/fp8 values (see gpu.kv_quant): k/v are
        quantized as they are written and dequantized as the attention loads them."""

    @classmethod
    def check_supported(cls, head_dim: int, dtype: torch.dtype, block_size: int) -> None:
        """Raise ValueError with a clear message when this backend cannot run a model.
        The base accepts everything (the torch path runs any shape and dtype)."""
        return
