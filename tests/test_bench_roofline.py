"""bench/roofline.py: the offline workload's FLOP count, checked against a hand count."""

from __future__ import annotations

import torch

from bench.roofline import floor_row, gemm_rate, workload_bytes, workload_flops
from bench.workloads import Item
from gpu.config import ModelConfig


def _cfg() -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
        }
    )


def test_flops_by_hand() -> None:
    cfg = _cfg()  # head_dim 16: q 64, kv 32
    work = [Item(prompt=[1, 2, 3], max_tokens=2), Item(prompt=[4], max_tokens=1)]
    f = workload_flops(cfg, work)
    # Fed tokens: 3 + 1 and 1 + 0 (the last sampled token never runs) = 5; in the last
    # layer the first prompt's positions 0 and 1 need only K and V.
    per_token = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    kv_only = 2 * 64 * 2 * 32
    assert f.projections == per_token * 5 * 2 - (per_token - kv_only) * 2
    assert f.lm_head == 2 * 64 * 100 * 3
    # Keys seen: positions 0..3 of the first (1+2+3+4) and position 0 of the second (1),
    # in both layers but for positions 0 and 1 of the first in the last (1+2).
    assert f.attention == 2 * 2 * 4 * 16 * ((10 + 1) * 2 - 3)
    assert f.total == f.projections + f.lm_head + f.attention


def test_floor_row_is_consistent() -> None:
    cfg = _cfg()
    work = [Item(prompt=list(range(10)), max_tokens=5)] * 4
    assert gemm_rate(cfg, torch.float32, 1, reps=3) > 0
    row, note = floor_row(cfg, work, torch.float32, 1, 5)
    assert len(row) == 5 and row[0].startswith("ceiling")
    seconds, tok_s = float(row[1]), float(row[2])
    assert seconds >= 0 and tok_s > 0 and "GFLOP/s" in note and "GB/s" in note


def test_bytes_by_hand() -> None:
    cfg = _cfg()  # q 64, kv 32, 2 layers
    work = [Item(prompt=[1, 2, 3], max_tokens=3), Item(prompt=[4], max_tokens=1)]
    b = workload_bytes(cfg, work, torch.bfloat16)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    # 3 steps at the least (the longest output), each reading every weight in 2 bytes.
    assert b.weights == (per_layer * 2 + 100 * 64) * 2 * 3
    # The first item feeds 2 generated tokens, at positions 3 and 4: 3 + 4 positions read;
    # the second feeds none.  K and V, 32 values each, 2 layers, 2 bytes.
    assert b.kv == (3 + 4) * 2 * 32 * 2 * 2
    assert b.steps == 3
    assert b.total == b.weights + b.kv
