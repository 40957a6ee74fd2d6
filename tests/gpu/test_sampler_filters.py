"""Tests for gpu/sampler.py's sampling filters: temperature, top-k, top-p and min-p, by
sample statistics and against straightforward references.

Statistical checks draw thousands of samples in one call (rows sharing the same logits) with
fixed seeds, so they are deterministic; each also checks that it would reject a wrong answer.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu.sampler import Sampler, _min_p_, _quantized, _top_k_, _top_p_
from tests.gpu.test_sampler import CPU, make_state


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (closed forms for integer df)."""
    y = stat / 2.0
    if df % 2 == 0:
        return math.exp(-y) * sum(y**i / math.factorial(i) for i in range(df // 2))
    return math.erfc(math.sqrt(y)) + math.exp(-y) * sum(
        y ** (i + 0.5) / math.gamma(i + 1.5) for i in range(df // 2)
    )


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to probs over probs' support (tokens off it must be absent)."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    n = counts.sum().item()
    expected = probs[support].double() / probs[support].sum() * n
    observed = counts[support].double()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((observed - expected) ** 2 / expected).sum().item()
    return chi2_sf(stat, int(support.sum()) - 1)


def draw(logits_row: torch.Tensor, n: int, seed: int = 0, **params: object) -> torch.Tensor:
    """Counts per token of n samples of one unseeded request's distribution, in one call."""
    sampler = Sampler(logits_row.shape[0], [], CPU, seed=seed)
    state = make_state(**params)
    out = sampler(logits_row.expand(n, -1), [state] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[0])


def test_chi2_sf_matches_known_critical_values() -> None:
    # 0.001 critical values from standard tables.
    for df, crit in [(1, 10.828), (2, 13.816), (3, 16.266), (5, 20.515), (7, 24.322)]:
        assert chi2_sf(crit, df) == pytest.approx(1e-3, rel=1e-3)


# -- temperature / top-k / top-p / min-p: statistics ---------------------------------------------

LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
# Six tokens with chosen probabilities, in shuffled positions.
PROBS6 = torch.tensor([0.06, 0.25, 0.04, 0.4, 0.1, 0.15])
LOGITS6 = PROBS6.log() + 0.3  # an offset must not matter


def keep(probs: torch.Tensor, kept: list[float]) -> torch.Tensor:
    """probs restricted to the tokens whose PROBS6 probability is in `kept`."""
    mask = torch.zeros_like(probs, dtype=torch.bool)
    for p in kept:
        mask |= torch.isclose(PROBS6, torch.tensor(p))
    return torch.where(mask, probs, 0.0)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_temperature_frequencies(temperature: float) -> None:
    counts = draw(LOGITS8, 20000, temperature=temperature)
    assert chi2_pvalue(counts, torch.softmax(LOGITS8 / temperature, -1)) > 1e-3
    # The same check rejects the untempered (or wrongly tempered) distribution.
    wrong = torch.softmax(LOGITS8 / (temperature * 1.25), -1)
    assert chi2_pvalue(counts, wrong) < 1e-6


def test_top_k_frequencies() -> None:
    counts = draw(LOGITS8, 20000, temperature=0.9, top_k=3)
    probs = torch.softmax(LOGITS8 / 0.9, -1)
    kth = LOGITS8.topk(3).values[-1]
    top3 = torch.where(kth <= LOGITS8, probs, 0.0)
    assert chi2_pvalue(counts, top3) > 1e-3
    assert counts.nonzero().flatten().tolist() == sorted(LOGITS8.topk(3).indices.tolist())
    # top_k >= vocabulary is no filter at all.
    counts = draw(LOGITS8, 20000, seed=1, top_k=8)
    assert chi2_pvalue(counts, torch.softmax(LOGITS8, -1)) > 1e-3


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        # Nucleus: mass above 0.15 is 0.65 < 0.7, above 0.1 is 0.8: keep three.
        (dict(top_p=0.7), [0.4, 0.25, 0.15]),
        # min_p: 0.2 * 0.4 = 0.08: keep four.
        (dict(min_p=0.2), [0.4, 0.25, 0.15, 0.1]),
        # top-k first, then top-p on the renormalised top 3 (0.5, 0.3125, 0.1875): keep two.
        # (top-p on the full distribution would keep three.)
        (dict(top_k=3, top_p=0.75), [0.4, 0.25]),
        # Temperature first: T=0.5 squares the probs (0.615, 0.240, 0.087, ...): keep two.
        (dict(temperature=0.5, top_p=0.7), [0.4, 0.25]),
        # top-p keeps four (mass above 0.1 is 0.8 < 0.9), then min_p 0.3 (0.12) drops 0.1.
        (dict(top_p=0.9, min_p=0.3), [0.4, 0.25, 0.15]),
    ],
)
def test_filter_frequencies(params: dict[str, object], kept: list[float]) -> None:
    counts = draw(LOGITS6, 20000, **params)
    temperature = float(params.get("temperature", 1.0))  # type: ignore[arg-type]
    probs = torch.softmax(LOGITS6 / temperature, -1)
    expected = keep(probs, kept)
    assert expected.count_nonzero() == len(kept)
    assert chi2_pvalue(counts, expected) > 1e-3
    # Power: the unfiltered distribution is rejected (it puts mass where none was drawn).
    assert chi2_pvalue(counts, probs) < 1e-6


def test_chi2_rejects_a_slightly_wrong_distribution() -> None:
    counts = draw(LOGITS6, 20000, top_p=0.7)
    wrong = torch.tensor([0.0, 0.30, 0.0, 0.5, 0.0, 0.20])  # true: 0.3125, 0.5, 0.1875
    assert chi2_pvalue(counts, wrong) < 1e-3


# -- the filters against straightforward references ---------------------------------------------


def top_p_reference(probs: torch.Tensor, p: float) -> torch.Tensor:
    """vLLM's top-p: sort ascending, drop tokens whose cumulative mass <= 1 - p."""
    probs = probs / probs.sum(-1, keepdim=True)
    asc, idx = probs.double().sort(-1)
    drop = asc.cumsum(-1) <= 1 - p
    drop[:, -1] = False
    mask = torch.zeros_like(drop).scatter_(-1, idx, drop)
    return probs.masked_fill(mask, 0.0)


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.3])  # peaky (nucleus < 256) to flat (> 4096)
def test_top_p_matches_vllm_reference(scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(6, 20000, generator=g) * scale, -1)
    top_p = [0.5, 0.9, 0.95, 0.8, 0.99, 0.3]
    got = probs.clone()
    _top_p_(got, top_p)
    for i, p in enumerate(top_p):
        ref = top_p_reference(probs[i : i + 1], p)[0]
        kept, ref_kept = got[i] > 0, ref > 0
        # Float summation (vLLM) vs exact mass in 2**-30 units: a token at most.
        assert (kept ^ ref_kept).sum() <= 1
        assert kept.sum() >= 1
    sizes = (got > 0).sum(-1)
    if scale == 0.3:
        assert sizes.min() > 256  # every row took the histogram path
    if scale == 8.0:
        assert sizes.max() < 256  # every row took the top-256 window


def top_p_full_sort(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Top-p by sorting each whole row: keep a token while the (exact) mass strictly above
    it is below top_p of the row's mass; ties with the last kept token are kept too."""
    out = probs.clone()
    for i, p in enumerate(top_p):
        desc = probs[i].sort(descending=True).values
        q = _quantized(desc).long()
        limit = p * int(q.sum())
        n_keep = int(((q.cumsum(0) - q) < limit).sum())
        out[i].masked_fill_(probs[i] < desc[n_keep - 1], 0.0)
    return out


def _flat_ties(vocab: int) -> torch.Tensor:
    """Probabilities in a few large groups of exact ties (the cut lands inside a group)."""
    levels = torch.tensor([8.0, 4.0, 2.0, 1.0]).repeat_interleave(vocab // 4)
    return levels[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))] / levels.sum()


@pytest.mark.parametrize("kind", ["peaked", "medium", "flat", "uniform", "ties", "after_top_k"])
def test_top_p_equals_full_sort_exactly(kind: str) -> None:
    """Window, histograms or sort: the same tokens kept, bit for bit, in a batch of mixed
    top_p (so rows of one batch take different paths)."""
    vocab, rows = 32000, 6
    g = torch.Generator().manual_seed(len(kind))
    scale = {"peaked": 8.0, "medium": 2.0, "flat": 0.3, "after_top_k": 0.3}.get(kind, 0.0)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, -1)
    if kind == "ties":
        probs = torch.stack([_flat_ties(vocab)] * rows)
    if kind == "after_top_k":  # zeros where top-k cut (the mass is then < 1)
        _top_k_(probs, [5000, 300, 20000, 31000, 1000, 12000])
    top_p = [0.5, 0.9, 0.95, 0.7, 0.99, 0.3]
    got = probs.clone()
    _top_p_(got, top_p)
    assert torch.equal(got, top_p_full_sort(probs, top_p))
    if kind == "ties":  # whole groups: they hold 8/15, 4/15, 2/15 and 1/15 of the mass
        assert (got > 0).sum(-1).tolist() == [8000, 24000, 32000, 16000, 32000, 8000]


def test_top_k_and_min_p_masks() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 1000, generator=g) * 2, -1)
    got = probs.clone()
    _top_k_(got, [1, 5, 50, 999])
    assert (got > 0).sum(-1).tolist() == [1, 5, 50, 999]
    for i in range(4):
        assert torch.equal(
            got[i].nonzero().flatten().sort().values,
            probs[i].topk((got[i] > 0).sum()).indices.sort().values,
        )
    got = probs.clone()
    _min_p_(got, [0.0, 0.1, 0.5, 1.0])
    for i, m in enumerate([0.0, 0.1, 0.5, 1.0]):
        assert torch.equal(got[i] > 0, probs[i] >= m * probs[i].max())
