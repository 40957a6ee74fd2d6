"""Random paged batches for the kernel tests and the GPU check (no kernels run here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], this step's new keys
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], context only
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    num_decodes: int | None = None,
    poison: float = float("nan"),
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
) -> PagedBatch:
    """A step's batch over a paged cache whose blocks are handed out in shuffled order.

    Sequence i has context_lens[i] tokens already cached and query_lens[i] new tokens.
    Cache slots that hold no context token are filled with `poison` (NaN by default), so
    a kernel that reads past a sequence's end shows up in its output.  New tokens' K/V are
    returned, not written: the caller writes them (kernel or reference).
    """
    assert len(query_lens) == len(context_lens)
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)  # block layout: host side
    # Values are drawn on the target device so large GPU batches are quick to build.
    dgen = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=dgen, device=device).to(dtype)

    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    tables = _shuffled_tables(blocks_per_seq, num_blocks, extra_table_cols, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, poison, dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, poison, dtype=dtype, device=device)
    ctx_idx = _slots(tables, block_size, [0] * len(seq_lens), list(context_lens))
    if ctx_idx.numel():
        n = ctx_idx.numel()
        idx = ctx_idx.to(device)
        k_cache.view(-1, num_kv_heads, head_dim)[idx] = randn(n, num_kv_heads, head_dim)
        v_cache.view(-1, num_kv_heads, head_dim)[idx] = randn(n, num_kv_heads, head_dim)

    slot_mapping = _slots(tables, block_size, list(context_lens), seq_lens)
    meta = _metadata(query_lens, seq_lens, tables, slot_mapping, num_decodes, block_size, device)
    num_tokens = meta.num_tokens
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
    )


def _shuffled_tables(
    blocks_per_seq: list[int], num_blocks: int, extra_cols: int, gen: torch.Generator
) -> torch.Tensor:
    """Block tables over shuffled physical blocks: a sequence's blocks are scattered and
    out of order; rows are padded with block 0."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + extra_cols
    rows: list[list[int]] = []
    pos = 0
    for nb in blocks_per_seq:
        rows.append(perm[pos : pos + nb] + [0] * (max_blocks - nb))
        pos += nb
    return torch.tensor(rows, dtype=torch.int32).view(len(blocks_per_seq), max_blocks)


def _slots(
    tables: torch.Tensor, block_size: int, starts: list[int], ends: list[int]
) -> torch.Tensor:
    """Flat cache slots (int64) of positions [starts[i], ends[i]) of every sequence i."""
    parts = []
    for i, (start, end) in enumerate(zip(starts, ends)):
        p = torch.arange(start, end)
        parts.append(tables[i].long()[p // block_size] * block_size + p % block_size)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _metadata(
    query_lens: Sequence[int],
    seq_lens: list[int],
    tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_decodes: int | None,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    if num_decodes is None:  # the leading run of one-token queries
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
    return AttentionMetadata(
        num_tokens=sum(query_lens),
        num_seqs=len(query_lens),
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
