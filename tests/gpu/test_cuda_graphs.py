"""The decode graphs' static inputs, filled from a step's rows: the buffers and copies a
GPU replays from, without the capture (on a GPU too, where the staging is pinned and the
copies asynchronous)."""

from __future__ import annotations

import pytest
import torch

from gpu.cuda_graphs import DecodeGraphs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_graphs(device: str) -> DecodeGraphs:
    return DecodeGraphs(
        lambda ids, pos, meta: ids.clone(),
        device=torch.device(device),
        max_model_len=256,
        block_size=16,
        sizes=[1, 4, 8],
        capture=False,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_rows_slots_lengths_and_tables_with_padding(device):
    g = make_graphs(device)
    # A wide step first, so the narrower one below must clear what it left.
    g.run([1] * 7, [200] * 7, [list(range(10, 23))] * 7)
    out = g.run([11, 12, 13], [0, 17, 40], [[5], [7, 9], [2, 3, 4]])
    assert out.tolist() == [11, 12, 13]
    b = 4  # the bucket of 3 rows: one padded row
    assert g.input_ids[:b].tolist() == [11, 12, 13, 0]
    assert g.positions[:b].tolist() == [0, 17, 40, 0]
    assert g.slots[:b].tolist() == [5 * 16, 9 * 16 + 1, 4 * 16 + 8, -1]  # pad writes nothing
    assert g.seq_lens[:b].tolist() == [1, 18, 41, 0]  # ...and reads nothing
    tables = g.tables[:b]
    assert tables[:, :3].tolist() == [[5, 0, 0], [7, 9, 0], [2, 3, 4], [0, 0, 0]]
    assert int(tables[:, 3:].abs().sum()) == 0  # the wide step's entries are gone
    assert g.replays == 2
