"""One step's tokens flattened into the tensors and attention metadata a forward pass takes.

The target model and the draft model (speculative decoding) lay out their batches the same
way, so both import this rather than each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention.base import AttentionMetadata


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    query_start: list[int]  # first row of each sequence


# A step's columnar decodes (scheduler/contract.py, DecodeColumns): one token each, at its
# position, through its block table; three parallel lists.
DecodeRows = tuple[list[int], list[int], list[list[int]]]


def layout_batch(
    seqs: Sequence[tuple[list[int], int, list[int]]],  # (token ids, start position, blocks)
    block_size: int,
    device: torch.device,
    decodes: DecodeRows | None = None,
    trees: Sequence[tuple[list[int], list[int]] | None] | None = None,
) -> Batch:
    """Flatten sequences into one step's tensors and attention metadata: `decodes` first
    (rows 0..), then `seqs`, whose decodes (one-token queries) must come first.  The
    target and the draft model share it.  `trees` (aligned with `seqs`): for a Medusa
    verify chunk, each token's position past the start and its visible chunk rows
    (gpu/medusa.py); its slots stay consecutive."""
    bs = block_size
    nd = 0
    if decodes is not None:
        d_ids, d_pos, d_tables = decodes
        nd = len(d_ids)
        # Decode rows in bulk: a comprehension each, no per-row branches.
        input_ids = list(d_ids)
        positions = list(d_pos)
        slots = [bt[p // bs] * bs + p % bs for p, bt in zip(d_pos, d_tables, strict=True)]
        seq_lens = [p + 1 for p in d_pos]
        qsl = list(range(nd + 1))
    else:
        input_ids, positions, slots, seq_lens, qsl, d_tables = [], [], [], [], [0], []
    max_blocks = max((len(bt) for bt in (*d_tables, *(bt for _, _, bt in seqs))), default=1)
    tables = np.zeros((nd + len(seqs), max_blocks), dtype=np.int32)
    for i, bt in enumerate(d_tables):
        tables[i, : len(bt)] = bt
    num_decodes = nd
    bits: list[int] | None = None
    if trees is not None and any(tr is not None for tr in trees):
        bits = [-1] * nd
    for i, (ids, s, bt) in enumerate(seqs, nd):
        n = len(ids)
        input_ids += ids
        tree = trees[i - nd] if bits is not None and trees is not None else None
        if bits is not None:
            bits += [-1] * n if tree is None else tree[1]
        if n == 1:
            num_decodes += 1
            positions.append(s)
            slots.append(bt[s // bs] * bs + s % bs)
        else:
            positions += range(s, s + n) if tree is None else [s + o for o in tree[0]]
            slots += [bt[p // bs] * bs + p % bs for p in range(s, s + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(s + n)
        tables[i, : len(bt)] = bt
    query_lens = [qsl[i + 1] - qsl[i] for i in range(nd + len(seqs))]

    def t(x: list[int], dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=device)

    meta = AttentionMetadata(
        num_tokens=len(input_ids),
        num_seqs=nd + len(seqs),
        num_decodes=num_decodes,
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=t(slots, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=bs,
        tree_bits=None if bits is None else t(bits, torch.int64),
    )
    return Batch(t(input_ids, torch.int64), t(positions, torch.int64), meta, qsl[:-1])
