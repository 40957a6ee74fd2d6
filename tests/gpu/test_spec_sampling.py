"""Speculative sampling keeps the target's distribution (rejection sampling, random rows).

Small vocabulary, fixed target distributions p_1..p_{k+1} and draft distributions q, many
seeded draws: the first emitted token must follow p_1 and, when the first draft was
accepted, the second must follow p_2 (chi-square).  The same test run against plausible
wrong rules (accept whenever p >= q, or resample from p instead of the residual) must fail,
so the test has teeth.  Also: greedy rows, the n-gram one-hot case, seeds, min_tokens and
penalties applied per draft position, logprobs of every emitted token.
"""

from __future__ import annotations

import pytest
import torch

from gpu import spec_decode
from gpu.sampler import RequestSamplingState, Sampler
from gpu.spec_decode import verify_drafts
from scheduler.sampling_params import SamplingParams

V = 6
K = 2
N = 3000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dist(seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, generator=g), -1)


P = [_dist(1), _dist(2), _dist(3)]  # target at rows 1..K+1
Q = [_dist(4), _dist(5)]  # draft at rows 1..K


def _state(seed: int, **kw) -> RequestSamplingState:
    params = SamplingParams(temperature=1.0, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed)
    return RequestSamplingState(params, 1, [0], gen)


def _run(one_hot: bool, n: int = N) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first emitted token, of the second (when the first draft passed),
    and how many draws had a second."""
    sampler = Sampler(V, [], torch.device("cpu"))
    logits = torch.log(torch.stack(P))  # softmax(log p) = p, at temperature 1
    first = torch.zeros(V)
    second = torch.zeros(V)
    g = torch.Generator().manual_seed(123)
    for i in range(n):
        if one_hot:
            drafts = [2, 4]  # fixed guesses (prompt lookup): q is one-hot
            q = None
        else:
            drafts = [int(torch.multinomial(Q[j], 1, generator=g)) for j in range(K)]
            q = torch.stack(Q)
        (res,) = verify_drafts(sampler, logits, [_state(i)], [drafts], [q])
        toks = [*res.accepted, res.bonus]
        first[toks[0]] += 1
        if res.accepted:
            second[toks[1]] += 1
    return first, second, int(second.sum())


# Chi-square quantiles with V - 1 = 5 degrees of freedom: a right rule exceeds the first
# once in a thousand runs; a wrong one stays below the second once in a million.
CHI2_5_P1E3 = 20.52
CHI2_5_P1E6 = 35.89


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "ngram-one-hot"])
def test_emitted_tokens_follow_the_target(one_hot):
    first, second, n2 = _run(one_hot)
    assert _chi2(first, P[0]) < CHI2_5_P1E3
    assert n2 > 200
    assert _chi2(second, P[1]) < CHI2_5_P1E3


def _accept_if_p_at_least_q(p, d, q, gen):
    """Wrong: deterministic acceptance, and a draw from p on rejection."""
    k = len(d)
    u = torch.rand(k + 1, generator=gen).tolist()
    for j in range(k):
        qj = 1.0 if q is None else float(q[j, d[j]])
        if float(p[j][d[j]]) < qj:
            return j, spec_decode._draw(p[j], u[k])
    return k, spec_decode._draw(p[k], u[k])


def _resample_from_p(p, d, q, gen):
    """Wrong: the right acceptance test, but a draw from p instead of the residual."""
    k = len(d)
    u = torch.rand(k + 1, generator=gen).tolist()
    for j in range(k):
        qj = 1.0 if q is None else float(q[j, d[j]])
        if u[j] * qj >= float(p[j][d[j]]):
            return j, spec_decode._draw(p[j], u[k])
    return k, spec_decode._draw(p[k], u[k])


@pytest.mark.parametrize("rule", [_accept_if_p_at_least_q, _resample_from_p])
def test_wrong_rules_fail_the_same_check(monkeypatch, rule):
    monkeypatch.setattr(spec_decode, "_rejection_sample", rule)
    first, _, _ = _run(False)
    assert _chi2(first, P[0]) > CHI2_5_P1E6


def test_seeded_rows_repeat():
    sampler = Sampler(V, [], torch.device("cpu"))
    logits = torch.log(torch.stack(P))
    outs = []
    for _ in range(2):
        got = [
            verify_drafts(sampler, logits, [_state(s)], [[1, 3]], [torch.stack(Q)])[0]
            for s in range(50)
        ]
        outs.append([(r.accepted, r.bonus) for r in got])
    assert outs[0] == outs[1]
    assert len({o for _, o in outs[0]}) > 1


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    sampler = Sampler(V, [], torch.device("cpu"))
    logits = torch.log(torch.stack(P))
    top = [int(p.argmax()) for p in P]
    st = RequestSamplingState(SamplingParams(temperature=0), 1, [0])
    (all_ok,) = verify_drafts(sampler, logits, [st], [top[:2]], [None])
    assert all_ok.accepted == top[:2] and all_ok.bonus == top[2]
    wrong = (top[1] + 1) % V
    (half,) = verify_drafts(sampler, logits, [st], [[top[0], wrong]], [None])
    assert half.accepted == [top[0]] and half.bonus == top[1]


def test_min_tokens_and_penalties_apply_at_each_draft_position():
    """Row j is processed as if the drafts before it were sampled: with min_tokens=2 the
    eos (token 0) is masked at rows 1 and 2 (0 and 1 outputs so far) but not at row 3;
    a repetition penalty sees the earlier drafts."""
    sampler = Sampler(V, [0], torch.device("cpu"))
    logits = torch.full((3, V), -5.0)
    logits[:, 0] = 5.0  # eos is everyone's favourite
    logits[:, 3] = 4.0
    st = RequestSamplingState(SamplingParams(temperature=0, min_tokens=2), 1, [5])
    (r,) = verify_drafts(sampler, logits, [st], [[3, 3]], [None])
    assert r.accepted == [3, 3] and r.bonus == 0
    # Repetition penalty: after drafting 3 once, row 2 penalises 3 (4.0 / 3) below 2.
    logits = torch.full((2, V), -5.0)
    logits[:, 3] = 4.0
    logits[:, 2] = 2.0
    st = RequestSamplingState(SamplingParams(temperature=0, repetition_penalty=3.0), 1, [5])
    (r,) = verify_drafts(sampler, logits, [st], [[3]], [None])
    assert r.accepted == [3] and r.bonus == 2


def test_logprobs_for_every_emitted_token():
    sampler = Sampler(V, [], torch.device("cpu"))
    logits = torch.log(torch.stack(P))
    top = [int(p.argmax()) for p in P]
    st = RequestSamplingState(SamplingParams(temperature=0, logprobs=2), 1, [0])
    (r,) = verify_drafts(sampler, logits, [st], [top[:2]], [None])
    assert r.logprobs is not None and len(r.logprobs) == 3
    for j, lp in enumerate(r.logprobs):
        assert lp.token_id == top[j]
        assert lp.logprob == pytest.approx(float(torch.log(P[j][top[j]])), abs=1e-5)
        assert len(lp.top_token_ids) == 2
