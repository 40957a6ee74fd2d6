"""Tests for gpu/sampler.py: greedy, penalties, the sampling filters, seeds, min_tokens, logprobs.

Statistical checks draw thousands of samples in one call (rows sharing the same logits) with
fixed seeds, so they are deterministic; each also checks that it would reject a wrong answer.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu.sampler import (
    RequestSamplingState,
    Sampler,
    SamplerOutput,
    _min_p_,
    _quantized,
    _top_k_,
    _top_p_,
    apply_penalties,
)
from scheduler.contract import NewRequestData
from scheduler.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 0


def make_state(
    prompt: list[int] | None = None,
    outputs: list[int] | None = None,
    sample_index: int = 0,
    **params: object,
) -> RequestSamplingState:
    prompt = [5, 6, 7] if prompt is None else prompt
    data = NewRequestData(
        req_id="r",
        prompt_len=len(prompt),
        token_ids=prompt + (outputs or []),
        sampling=SamplingParams(**params),
        sample_index=sample_index,
    )
    return RequestSamplingState.create(data, CPU)


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


# -- greedy -----------------------------------------------------------------------------------


def test_greedy_batch_is_argmax() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = Sampler(1000, [EOS], CPU)(logits, [make_state(temperature=0.0) for _ in range(16)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_greedy_batch_in_bf16_takes_the_float32_argmax() -> None:
    # The runner hands a plain-greedy batch its logits in the model dtype; bf16 rows full
    # of ties (few distinct values) must still pick the first maximum, as in float32.
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 1000, generator=g) * 2).round().to(torch.bfloat16)
    rows = [make_state(temperature=0.0) for _ in range(16)]
    out = Sampler(1000, [EOS], CPU)(logits, rows)
    assert out.token_ids == Sampler(1000, [EOS], CPU)(logits.float(), rows).token_ids
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_empty_batch_and_shape_check() -> None:
    sampler = Sampler(10, [EOS], CPU)
    assert sampler(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [make_state()])


def test_padded_vocab_columns_are_never_sampled() -> None:
    vocab = 50
    logits = torch.zeros(64, vocab + 14)
    logits[:, vocab:] = 100.0  # padding of the lm_head: must be ignored
    rows = [make_state(temperature=0.0)] * 32 + [make_state(temperature=1.0)] * 32
    out = Sampler(vocab, [EOS], CPU)(logits, rows)
    assert max(out.token_ids) < vocab


def test_mixed_batch_greedy_rows_and_input_untouched() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g)
    before = logits.clone()
    rows = [
        make_state(temperature=0.0),
        make_state(temperature=1.0, top_p=0.5),
        make_state(temperature=0.0, logprobs=2),
        make_state(temperature=0.7, seed=3, min_tokens=4),
        make_state(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0),
        make_state(temperature=1.2, repetition_penalty=1.3, outputs=[1, 2]),
    ]
    out = Sampler(300, [EOS], CPU)(logits, rows)
    expected = logits.argmax(-1)
    for i in (0, 2, 4):
        assert out.token_ids[i] == expected[i]
    assert torch.equal(logits, before), "the caller's logits must not be written"


# -- penalties (vLLM's formulas, hand-computed) ------------------------------------------------


def greedy_token(logits: list[float], **kw: object) -> int:
    row = torch.tensor([logits])
    return Sampler(len(logits), [], CPU)(row, [make_state(temperature=0.0, **kw)]).token_ids[0]


def penalised(logits: list[float], **kw: object) -> list[float]:
    return apply_penalties(torch.tensor([logits]), [make_state(**kw)])[0].tolist()


def test_repetition_penalty_prompt_and_output() -> None:
    logits = [2.0, 1.5, -1.0, -0.8, 0.5]
    kw = dict(prompt=[0, 2], outputs=[4], repetition_penalty=2.0)
    # seen tokens 0, 2 (prompt) and 4 (output): positive / 2, negative * 2.
    assert penalised(logits, **kw) == pytest.approx([1.0, 1.5, -2.0, -0.8, 0.25])
    assert greedy_token(logits, prompt=[0, 2], outputs=[4]) == 0
    assert greedy_token(logits, **kw) == 1


def test_frequency_penalty_counts_outputs_only() -> None:
    logits = [3.0, 2.5, 0.0, 0.0]
    # Token 1 fills the prompt: frequency ignores it (else 2.5 - 0.6 * 4 = 0.1).
    kw = dict(prompt=[1, 1, 1], outputs=[0, 0, 1], frequency_penalty=0.6)
    assert penalised(logits, **kw) == pytest.approx([3.0 - 1.2, 2.5 - 0.6, 0.0, 0.0])
    assert greedy_token(logits, prompt=[1, 1, 1], outputs=[0, 0, 1]) == 0
    assert greedy_token(logits, **kw) == 1


def test_presence_penalty_once_per_token() -> None:
    logits = [3.0, 2.5, 0.0, 0.0]
    kw = dict(prompt=[1], outputs=[0, 0, 0], presence_penalty=0.6)
    assert penalised(logits, **kw) == pytest.approx([2.4, 2.5, 0.0, 0.0])
    assert greedy_token(logits, **kw) == 1
    # A negative presence penalty encourages repeats.
    assert greedy_token([2.0, 2.5], prompt=[], outputs=[0], presence_penalty=-1.0) == 0


def test_penalties_combined_in_vllm_order() -> None:
    # Repetition first (scaling), then frequency and presence (subtraction).
    kw = dict(
        prompt=[2],
        outputs=[0, 0, 1],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    assert penalised([2.0, -1.0, 1.0], **kw) == [-0.25, -2.75, 0.5]
    assert greedy_token([2.0, -1.0, 1.0], **kw) == 2


def vllm_penalties_reference(logits: torch.Tensor, rows: list[RequestSamplingState]) -> None:
    """vLLM's dense apply_penalties, transcribed (bin counts over the whole vocabulary)."""
    num, vocab = logits.shape
    prompt_mask = torch.zeros(num, vocab, dtype=torch.bool)
    counts = torch.zeros(num, vocab)
    for i, r in enumerate(rows):
        for t in r.token_ids[: r.prompt_len]:
            prompt_mask[i, t] = True
        for t in r.token_ids[r.prompt_len :]:
            counts[i, t] += 1
    output_mask = counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows]).unsqueeze(1).repeat(1, vocab)
    penalties = torch.where(prompt_mask | output_mask, rep, 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= torch.tensor([r.params.frequency_penalty for r in rows]).unsqueeze(1) * counts
    logits -= torch.tensor([r.params.presence_penalty for r in rows]).unsqueeze(1) * output_mask


def test_penalties_match_dense_vllm_reference() -> None:
    g = torch.Generator().manual_seed(7)
    vocab = 64
    rows = []
    for i in range(12):
        prompt = torch.randint(
            0, vocab, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g
        )
        outputs = torch.randint(
            0, vocab, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g
        )
        rows.append(
            make_state(
                prompt=prompt.tolist(),
                outputs=outputs.tolist(),
                repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                frequency_penalty=[0.0, 0.4, -0.3, 1.1][i % 4],
                presence_penalty=[0.0, 0.5, -0.2][(i // 3) % 3],
            )
        )
    logits = torch.randn(12, vocab, generator=g) * 3
    expected = logits.clone()
    vllm_penalties_reference(expected, rows)
    assert torch.equal(apply_penalties(logits.clone(), rows), expected)


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]] * 3)
    rows = [
        make_state(temperature=0.0, outputs=[0, 0, 0]),
        make_state(temperature=0.0, outputs=[0, 0, 0], frequency_penalty=0.5),
        make_state(temperature=0.0, outputs=[0, 0, 0]),
    ]
    assert Sampler(3, [], CPU)(logits, rows).token_ids == [0, 1, 0]


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


# -- seeds ---------------------------------------------------------------------------------------

VOCAB = 5000


def step_logits(step: int) -> torch.Tensor:
    """The target request's logits at a step: fixed content, whatever the batch."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 2


def run_target(
    target: dict[str, object],
    others: list[dict[str, object]],
    position: int,
    steps: int = 6,
    sampler_seed: int = 0,
) -> list[int]:
    """Run `steps` steps with the target request at `position` among `others`; its tokens."""
    sampler = Sampler(VOCAB, [EOS], CPU, seed=sampler_seed)
    state = make_state(**target)
    batch = [make_state(**o) for o in others]
    noise = torch.Generator().manual_seed(99)
    tokens = []
    for step in range(steps):
        rows = [*batch[:position], state, *batch[position:]]
        logits = torch.randn(len(rows), VOCAB, generator=noise) * 2
        logits[position] = step_logits(step)
        out = sampler(logits, rows)
        for r, t in zip(rows, out.token_ids, strict=True):
            r.append(t)
        tokens.append(out.token_ids[position])
    return tokens


OTHERS: list[dict[str, object]] = [
    dict(temperature=1.0),
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, seed=5),
    dict(temperature=1.3, top_k=20, logprobs=3),
    dict(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=3),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=1.0, seed=77, top_p=0.5),
]


@pytest.mark.parametrize(
    "target",
    [
        dict(temperature=1.0, seed=1234),
        dict(temperature=0.9, top_p=0.95, top_k=50, seed=42),
        dict(temperature=1.1, min_p=0.05, repetition_penalty=1.3, seed=9, prompt=[1, 2, 3]),
        dict(temperature=4.0, top_p=0.9, seed=7),  # flat: the histogram path
    ],
)
def test_seeded_request_ignores_batch_composition(target: dict[str, object]) -> None:
    alone = run_target(target, [], 0)
    assert run_target(target, [], 0) == alone  # run to run
    assert run_target(target, OTHERS, 3) == alone
    assert run_target(target, OTHERS[:2], 2) == alone  # at the end
    assert run_target(target, OTHERS[::-1], 0) == alone
    assert run_target(target, OTHERS, 5, sampler_seed=17) == alone
    assert len(set(alone)) > 1


def test_seeds_and_sample_index_change_the_stream() -> None:
    base = dict(temperature=1.0)
    s1 = run_target({**base, "seed": 1}, [], 0)
    assert run_target({**base, "seed": 2}, [], 0) != s1
    assert run_target({**base, "seed": 1, "sample_index": 1}, [], 0) != s1
    # The n samples of a request draw from seed + sample_index.
    assert run_target({**base, "seed": 1, "sample_index": 1}, [], 0) == run_target(
        {**base, "seed": 2}, [], 0
    )


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    target = dict(temperature=1.0)
    a = run_target(target, OTHERS, 2, sampler_seed=0)
    assert run_target(target, OTHERS, 2, sampler_seed=0) == a
    assert run_target(target, OTHERS, 2, sampler_seed=1) != a


def test_huge_and_negative_seeds() -> None:
    for seed in (-1, 2**64 + 5, 2**63):
        tokens = run_target(dict(temperature=1.0, seed=seed), [], 0, steps=3)
        assert tokens == run_target(dict(temperature=1.0, seed=seed), OTHERS, 1, steps=3)


# -- min_tokens ----------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[10.0, 9.0, 8.0, 0.0, 0.0]])
    sampler = Sampler(5, [EOS, 4], CPU)

    def pick(**kw: object) -> int:
        return sampler(logits, [make_state(temperature=0.0, **kw)]).token_ids[0]

    assert pick() == EOS
    assert pick(min_tokens=2) == 1
    assert pick(min_tokens=2, outputs=[3]) == 1
    assert pick(min_tokens=2, outputs=[3, 3]) == EOS  # reached: eos allowed again
    assert pick(min_tokens=2, stop_token_ids=[1]) == 2
    assert pick(min_tokens=2, stop_token_ids=[1, 99]) == 2  # out-of-vocab stop id is ignored
    # vLLM masks the model's eos under min_tokens even when ignore_eos is set.
    assert pick(min_tokens=2, ignore_eos=True) == 1
    # Every eos id of the model is masked.
    second_eos = torch.tensor([[0.0, 9.0, 8.0, 0.0, 10.0]])
    state = make_state(temperature=0.0, min_tokens=1)
    assert sampler(second_eos, [state]).token_ids[0] == 1


def test_min_tokens_random_rows_never_sample_eos() -> None:
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0]]).expand(4000, -1)
    sampler = Sampler(4, [EOS], CPU)
    masked = sampler(logits, [make_state(min_tokens=1)] * 4000).token_ids
    assert EOS not in masked
    free = sampler(logits, [make_state()] * 4000).token_ids
    assert free.count(EOS) > 3900


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 200, generator=g) * 3
    rows = [
        make_state(temperature=0.0, logprobs=3, repetition_penalty=1.5, outputs=[1, 2]),
        make_state(temperature=0.5, logprobs=5, top_k=10, frequency_penalty=1.0, outputs=[4]),
        make_state(temperature=1.0),  # no logprobs
        make_state(temperature=1.0, logprobs=0, min_tokens=5),
        make_state(temperature=0.8, logprobs=20, seed=3),
    ]
    out = Sampler(200, [EOS], CPU)(logits, rows)
    assert out.logprobs is not None
    assert out.logprobs[2] is None
    raw = torch.log_softmax(logits, -1)
    for i, n in [(0, 3), (1, 5), (3, 0), (4, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        top = raw[i].topk(n)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert len(lp.top_token_ids) == n


def test_greedy_logprobs_only_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    out = Sampler(50, [EOS], CPU)(logits, [make_state(temperature=0.0, logprobs=1)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is not None
    for i, lp in enumerate(out.logprobs):
        assert lp is not None
        assert lp.top_token_ids == [out.token_ids[i]]
        assert lp.logprob == pytest.approx(torch.log_softmax(logits[i], -1).max().item())


# -- state ---------------------------------------------------------------------------------------


def test_state_create_and_append() -> None:
    state = make_state(prompt=[1, 2], outputs=[3], seed=4)
    assert state.prompt_len == 2
    assert state.output_token_ids == [3]
    state.append(9)
    assert state.token_ids == [1, 2, 3, 9]
    assert state.num_output_tokens == 2
    assert state.generator is not None
    assert make_state().generator is None


# ----------------------------------------------------------------------------- grammar masks
def _mask(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little", signed=False) for w in words)


def test_token_bitmask_touches_only_constrained_rows():
    from gpu.sampler import apply_token_bitmask_

    vocab = 100
    logits = torch.randn(4, vocab + 28)  # a padded head: columns past the mask are forbidden
    before = logits.clone()
    apply_token_bitmask_(logits, [1, 3], [_mask([0, 33, 99], vocab), _mask([64], vocab)])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite1 = torch.isfinite(logits[1]).nonzero().squeeze(1).tolist()
    assert finite1 == [0, 33, 99]
    assert torch.equal(logits[1, [0, 33, 99]], before[1, [0, 33, 99]])
    assert torch.isfinite(logits[3]).nonzero().squeeze(1).tolist() == [64]
    # A mask that allows nothing is left unapplied (the scheduler ends that request).
    apply_token_bitmask_(logits, [0], [_mask([], vocab)])
    assert torch.equal(logits[0], before[0])


def test_masked_rows_sample_only_allowed_tokens():
    from gpu.sampler import apply_token_bitmask_

    vocab = 64
    allowed = [3, 17, 40]
    rows = [make_state(temperature=1.0) for _ in range(512)]
    logits = torch.randn(512, vocab)
    apply_token_bitmask_(logits, list(range(512)), [_mask(allowed, vocab)] * 512)
    out = Sampler(vocab, [EOS], CPU, seed=1)(logits, rows)
    assert set(out.token_ids) == set(allowed)


def test_logit_bias_shifts_only_its_rows():
    vocab = 32
    logits = torch.zeros(3, vocab)
    logits[:, 5] = 1.0
    rows = [
        make_state(temperature=0.0, logit_bias={9: 5.0}),
        make_state(temperature=0.0),
        make_state(temperature=1.0, logit_bias={5: -100.0, 12: 50.0}, seed=3),
    ]
    out = Sampler(vocab, [EOS], CPU)(logits, rows)
    assert out.token_ids == [9, 5, 12]
    assert not rows[0].plain_greedy and rows[1].plain_greedy
    assert torch.all(logits[:, 5] == 1.0)  # the caller's logits are not written
