"""Tests for gpu/sampler.py: greedy, penalties, seeds, min_tokens, logprobs, state, grammar masks
(the sampling filters are in test_sampler_filters.py)."""

from __future__ import annotations

import pytest
import torch

from gpu.sampler import (
    RequestSamplingState,
    Sampler,
    SamplerOutput,
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


def test_allowed_token_ids_confine_greedy_and_random_rows_and_keep_raw_logprobs():
    vocab = 64
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=gen)
    logits[:, 40] = 10.0  # the favourite, forbidden to the confined rows
    allowed = [3, 17, 60]
    rows = [
        make_state(temperature=0.0, allowed_token_ids=allowed, logprobs=2),
        make_state(temperature=0.0),
        make_state(temperature=1.5, allowed_token_ids=allowed, seed=4),
    ]
    assert not rows[0].plain_greedy and rows[1].plain_greedy
    sampler = Sampler(vocab, [EOS], CPU)
    out = sampler(logits, rows)
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[:2] == [best, 40]
    # Logprobs are the raw distribution's (vLLM's default), as for logit_bias and grammars.
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].logprob == pytest.approx(raw[best].item(), abs=1e-5)
    assert out.logprobs[0].top_token_ids[0] == 40
    draws = {sampler(logits[2:], [make_state(temperature=1.5, allowed_token_ids=allowed, seed=s)])
             .token_ids[0] for s in range(40)}  # fmt: skip
    assert draws <= set(allowed) and len(draws) > 1
    assert out.token_ids[2] in allowed
    assert torch.all(logits[:, 40] == 10.0)  # the caller's logits are not written


def test_allowed_token_ids_with_a_bias_and_held_back_ids_still_pick_an_allowed_token():
    vocab = 32
    logits = torch.zeros(1, vocab)
    logits[0, 7] = 3.0
    st = make_state(temperature=0.0, allowed_token_ids=[EOS, 7, 9], logit_bias={9: 5.0},
                    min_tokens=1, stop_token_ids=[9])  # fmt: skip
    # min_tokens holds back eos and 9; the bias on 9 cannot bring it back; 7 is left.
    assert Sampler(vocab, [EOS], CPU)(logits, [st]).token_ids == [7]
    # The mask is built once for a request's samples, and ids past the vocabulary stay out.
    params = SamplingParams(allowed_token_ids=[2, 5, 1_000])
    a, b = (RequestSamplingState(params, 1, [0]).allowed_mask(vocab, CPU) for _ in range(2))
    assert a is b and (~a).nonzero().flatten().tolist() == [2, 5]


def test_bad_words_ban_single_tokens_always_and_a_sequences_last_token_after_its_prefix():
    vocab = 32
    logits = torch.zeros(1, vocab)
    logits[0, 9] = 5.0  # favourite
    logits[0, 4] = 4.0  # runner-up
    logits[0, 6] = 3.0
    seqs = [[4], [7, 8, 9], [3, 9]]
    sampler = Sampler(vocab, [EOS], CPU)

    def greedy(outputs: list[int]) -> int:
        st = make_state(outputs=outputs, temperature=0.0, bad_words_token_ids=seqs)
        assert not st.plain_greedy
        return sampler(logits, [st]).token_ids[0]

    assert greedy([]) == 9  # no sequence's prefix matched; 4 banned but not the favourite
    assert greedy([7, 8]) == 6  # [7, 8] -> 9 banned; 4 banned outright
    assert greedy([3]) == 6  # [3] -> 9 banned
    assert greedy([8]) == 9  # half a prefix bans nothing
    # Only output tokens count: a prompt ending in the prefix bans nothing.
    st = make_state(prompt=[5, 7, 8], outputs=[], temperature=0.0, bad_words_token_ids=seqs)
    assert sampler(logits, [st]).token_ids == [9]
    # Speculation's views (a request's state plus drafted tokens) see the drafts.
    base = make_state(outputs=[7], temperature=0.0, bad_words_token_ids=seqs)
    view = RequestSamplingState(base.params, base.prompt_len, [*base.token_ids, 8])
    assert sampler.processed_logits(logits, [view])[0, 9] == -torch.inf


def test_bad_words_sequences_must_be_nonempty_ids():
    for bad in ([[]], [[1, -2]]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words_token_ids=bad)


def test_allowed_token_ids_must_be_a_nonempty_list_of_ids():
    for bad in ([], [3, -1]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_output_tensor_follows_the_tokens_through_growth_and_a_shorter_rebuild():
    """Penalties read each row's output ids as a tensor kept up to date incrementally."""
    st = make_state(outputs=[9], repetition_penalty=1.2)
    assert st.output_tensor().tolist() == [9]
    for t in range(40):  # past the first capacities
        st.append(t)
        assert st.output_tensor().tolist() == [9, *range(t + 1)]
    del st.token_ids[-5:]  # a state whose list was cut back (a rebuilt one)
    st.append(99)
    assert st.output_tensor().tolist() == [9, *range(35), 99]
    assert st.output_tensor().dtype == torch.long


def test_penalties_equal_the_list_built_reference_after_many_steps():
    a = make_state(outputs=[], repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2)  # fmt: skip
    b = make_state(prompt=[1, 2], outputs=[], frequency_penalty=0.7)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        for st in (a, b):
            st.append(int(torch.randint(3, 40, (1,), generator=gen)))
        logits = torch.randn(2, 48, generator=gen)
        got = apply_penalties(logits.clone(), [a, b])
        want = logits.clone()
        for i, st in enumerate((a, b)):
            p = st.params
            seen = set(st.token_ids)
            for tok in seen if p.repetition_penalty != 1.0 else ():
                v = want[i, tok]
                want[i, tok] = v * (1 / p.repetition_penalty) if v > 0 else v * p.repetition_penalty
            out = st.token_ids[st.prompt_len :]
            for tok in set(out):
                want[i, tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
        torch.testing.assert_close(got, want)


def test_a_requests_samples_share_their_bias_and_held_back_ids_tensors():
    """n samples hold one params object: the tensors made from it are made once."""
    params = SamplingParams(logit_bias={3: 1.0, 4: -2.0, 10_000: 5.0}, min_tokens=2,
                            stop_token_ids=[7, 8])  # fmt: skip
    states = [
        RequestSamplingState(params, 3, [5, 6, 7]),
        RequestSamplingState(params, 3, [5, 6, 7]),
    ]
    (ia, va), (ib, vb) = (st.bias_tensors(100, CPU) for st in states)
    assert ia is ib and va is vb and ia.tolist() == [3, 4] and va.tolist() == [1.0, -2.0]
    ma, mb = (st.min_tokens_mask([EOS], 100, CPU) for st in states)
    assert ma is mb and ma.tolist() == [EOS, 7, 8]
    other = RequestSamplingState(SamplingParams(logit_bias={3: 1.0, 4: -2.0}), 3, [5, 6, 7])
    assert other.bias_tensors(100, CPU)[0] is not ia  # equal params, another request
