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


def layout_batch(
    seqs: Sequence[tuple[list[int], int, list[int]]],  # (token ids, start position, blocks)
    block_size: int,
    device: torch.device,
) -> Batch:
    """Flatten sequences (decodes, i.e. one-token queries, must come first) into one step's
    tensors and attention metadata.  The target and the draft model share it."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    max_blocks = max(len(bt) for _, _, bt in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    num_decodes = 0
    for i, (ids, s, bt) in enumerate(seqs):
        n = len(ids)
        input_ids += ids
        if n == 1:
            num_decodes += 1
            positions.append(s)
            slots.append(bt[s // bs] * bs + s % bs)
        else:
            positions += range(s, s + n)
            slots += [bt[p // bs] * bs + p % bs for p in range(s, s + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(s + n)
        tables[i, : len(bt)] = bt
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seqs))]

    def t(x: list[int], dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=device)

    meta = AttentionMetadata(
        num_tokens=len(input_ids),
        num_seqs=len(seqs),
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
    )
    return Batch(t(input_ids, torch.int64), t(positions, torch.int64), meta, qsl[:-1])
