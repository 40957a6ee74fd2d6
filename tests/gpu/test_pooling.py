"""Pools folded in chunk by chunk equal the pools of the whole prompt at once
(sentence-transformers' definitions), and a prompt recomputed from position 0 starts over."""

from __future__ import annotations

import pytest
import torch

from gpu.pooling import RunningPool
from scheduler.sampling_params import SamplingParams


def whole(h: torch.Tensor, mode: str) -> torch.Tensor:
    n = h.shape[0]
    w = torch.arange(1, n + 1, dtype=h.dtype).unsqueeze(1)
    return {
        "cls": h[0],
        "max": h.amax(0),
        "mean": h.mean(0),
        "mean_sqrt_len": h.sum(0) / n**0.5,
        "weightedmean": (w * h).sum(0) / w.sum(),
        "last": h[-1],
    }[mode]


@pytest.mark.parametrize("cuts", [[50], [1, 49], [7, 13, 30], [16] * 3 + [2]])
def test_chunks_fold_into_the_whole_prompts_pools(cuts):
    torch.manual_seed(0)
    h = torch.randn(sum(cuts), 8, dtype=torch.float64)
    modes = ("weightedmean", "cls", "max", "mean", "mean_sqrt_len", "last")
    pool = RunningPool(modes)
    at = 0
    for n in cuts:
        pool.feed(h[at : at + n], at)
        at += n
    got = pool.vector()
    want = torch.cat([whole(h, m).float() for m in modes])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_recomputed_prompt_starts_over():
    torch.manual_seed(1)
    h = torch.randn(20, 4)
    pool = RunningPool(("mean", "cls"))
    pool.feed(torch.randn(12, 4), 0)  # preempted after this chunk: recomputed from 0
    pool.feed(h[:10], 0)
    pool.feed(h[10:], 10)
    torch.testing.assert_close(pool.vector(), torch.cat([h.mean(0), h[0]]))


@pytest.mark.parametrize("bad", [(), ("mean", "mean"), ("median",)])
def test_sampling_params_name_a_bad_pooling(bad):
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(embed=True, pooling=bad)


def test_only_pooling_over_positions_reads_every_position():
    assert not SamplingParams(embed=True).reads_every_position
    assert SamplingParams(embed=True, pooling=("mean",)).reads_every_position
    assert SamplingParams(prompt_logprobs=0).reads_every_position
