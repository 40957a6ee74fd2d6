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
    num_seqs = len(query_lens)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Shuffled physical blocks: a sequence's blocks are scattered and out of order.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + extra_table_cols
    rows: list[list[int]] = []
    pos = 0
    for nb in blocks_per_seq:
        rows.append(perm[pos : pos + nb] + [0] * (max_blocks - nb))  # padded with 0
        pos += nb
    tables = torch.tensor(rows, dtype=torch.int32).view(num_seqs, max_blocks)

    def slots(i: int, start: int, end: int) -> torch.Tensor:  # [end - start] int64
        p = torch.arange(start, end)
        return tables[i].long()[p // block_size] * block_size + p % block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=dgen, device=device).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, poison, dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, poison, dtype=dtype, device=device)
    ctx_idx = torch.cat([slots(i, 0, context_lens[i]) for i in range(num_seqs)] or [slots(0, 0, 0)])
    if ctx_idx.numel():
        n = ctx_idx.numel()
        idx = ctx_idx.to(device)
        k_cache.view(-1, num_kv_heads, head_dim)[idx] = randn(n, num_kv_heads, head_dim)
        v_cache.view(-1, num_kv_heads, head_dim)[idx] = randn(n, num_kv_heads, head_dim)

    num_tokens = sum(query_lens)
    new_idx = [slots(i, context_lens[i], seq_lens[i]) for i in range(num_seqs)]
    slot_mapping = torch.cat(new_idx) if new_idx else torch.zeros(0, dtype=torch.int64)
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < num_seqs and query_lens[num_decodes] == 1:
            num_decodes += 1

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_decodes=num_decodes,
        query_start_loc=dev(torch.tensor(qsl, dtype=torch.int32)),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=dev(tables),
        slot_mapping=dev(slot_mapping),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
    )
