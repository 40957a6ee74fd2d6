"""Medusa's parts: the public checkpoint layout, the static tree, tree verification (greedy
follows the argmax child; sampling along the tree keeps the target's distribution, which
plausible wrong rules do not), and the KV compaction of an accepted path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gpu import medusa
from gpu.config import ModelLoadError
from gpu.medusa import WEIGHTS, MedusaHeads, compact_kv, verify_tree
from gpu.sampler import RequestSamplingState, Sampler
from scheduler.medusa_tree import (
    MAX_TREE_ROWS,
    TREE,
    Tree,
    build_tree,
    tree_depth,
    tree_paths,
    tree_size,
)
from scheduler.sampling_params import SamplingParams

V = 6
N = 3000
CHI2_5_P1E3 = 20.52  # chi-square, 5 degrees of freedom: a right rule exceeds it 1 in 1,000
CHI2_5_P1E6 = 35.89  # a wrong one stays below it 1 in 1,000,000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- checkpoint layout
def _public_checkpoint(path, hidden=8, vocab=12, heads=2, layers=2, seed=0):
    """Tensors named as FasterDecoding/Medusa's medusa_lm_head.safetensors names them."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(heads):
        for j in range(layers):
            sd[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.3
            sd[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.3
        sd[f"{i}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / WEIGHTS))
    (path / "config.json").write_text(
        json.dumps(
            {
                "medusa_num_heads": heads,
                "medusa_num_layers": layers,
                "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
                "transformers_version": "4.33.0",
            }
        )
    )
    return sd


def test_loads_the_public_layout_and_computes_resblocks(tmp_path):
    sd = _public_checkpoint(tmp_path, vocab=12)
    # A target vocabulary smaller than the checkpoint's (padded) one keeps its first rows.
    heads = MedusaHeads.load(tmp_path, 8, 10, torch.float32, torch.device("cpu"))
    assert (heads.num_heads, heads.num_layers) == (2, 2)
    h = torch.randn(3, 8)
    got = heads(h)
    assert got.shape == (2, 3, 10)
    for i in range(2):
        x = h
        for j in range(2):
            w, b = sd[f"{i}.{j}.linear.weight"], sd[f"{i}.{j}.linear.bias"]
            x = x + torch.nn.functional.silu(x @ w.T + b)
        want = x @ sd[f"{i}.2.weight"][:10].T
        torch.testing.assert_close(got[i], want)


def test_save_round_trips_in_the_public_layout(tmp_path):
    heads = MedusaHeads(8, 10, 3, 1)
    heads.save(tmp_path / "h", "base")
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "h" / WEIGHTS)))
    assert names == {f"{i}.0.linear.{p}" for i in range(3) for p in ("weight", "bias")} | {
        f"{i}.1.weight" for i in range(3)
    }
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    again = MedusaHeads.load(tmp_path / "h", 8, 10, torch.float32, torch.device("cpu"))
    h = torch.randn(2, 8)
    torch.testing.assert_close(again(h), heads(h))


@pytest.mark.parametrize(
    ("hidden", "vocab", "match"),
    [(16, 10, "do not fit"), (8, 20, "do not fit")],
)
def test_heads_that_do_not_fit_the_target_are_refused(tmp_path, hidden, vocab, match):
    _public_checkpoint(tmp_path, vocab=12)
    with pytest.raises(ModelLoadError, match=match):
        MedusaHeads.load(tmp_path, hidden, vocab, torch.float32, torch.device("cpu"))


def test_not_a_medusa_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="not a Medusa checkpoint"):
        MedusaHeads.load(tmp_path, 8, 10, torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------- the tree
def test_every_prefix_of_the_tree_is_a_tree():
    topk = [[10 * d + r for r in range(4)] for d in range(6)]
    full = tree_paths(6)
    assert len(full) == tree_size(6) < MAX_TREE_ROWS
    for n in range(1, len(full) + 1):
        t = build_tree(topk, n)
        assert t.size == n
        assert all(p < i for i, p in enumerate(t.parents))  # parents first
        assert all(
            t.depths[i] == (t.depths[p] + 1 if p >= 0 else 1) for i, p in enumerate(t.parents)
        )
        # Siblings carry distinct tokens (distinct ranks of one head).
        for kids in t.children():
            assert len({t.tokens[c] for c in kids}) == len(kids)
        assert tree_depth(n) == max(t.depths)
    # Depth k holds TREE's paths down to k (4 levels), then the top-1 chain.
    assert tree_size(4) == len(TREE)
    assert tree_size(6) == len(TREE) + 2


def test_tree_bits_name_the_root_the_ancestors_and_self():
    t = Tree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    assert t.offsets() == [0, 1, 1, 2, 3]
    assert t.bits() == [0b1, 0b11, 0b101, 0b1011, 0b11011]


# ---------------------------------------------------------------- verification
def _dist(seed: int, sharp: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, generator=g), -1)


P = [_dist(1), _dist(2), _dist(3), _dist(4)]  # target at the root and at each node
# Root's children: its likeliest tokens A (rank 0) and B (rank 1); under A, token C.
A, B = (int(t) for t in P[0].argsort(descending=True)[:2])
C = int(P[1].argmax())
TREE3 = Tree(tokens=[A, B, C], parents=[-1, -1, 0], depths=[1, 1, 2])


def _state(temperature: float = 1.0) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(temperature=temperature), 1, [0], None)


def _run(n: int = N):
    """Counts of the first emitted token, and of the second after each accepted child."""
    sampler = Sampler(V, [], torch.device("cpu"), seed=7)
    logits = torch.log(torch.stack(P))  # softmax(log p) = p at temperature 1
    first = torch.zeros(V)
    after = {A: torch.zeros(V), B: torch.zeros(V)}
    for _ in range(n):
        ((res, path),) = verify_tree(sampler, logits, [_state()], [TREE3])
        toks = [*res.accepted, res.bonus]
        assert len(path) == len(res.accepted) + 1
        first[toks[0]] += 1
        if res.accepted:
            after[toks[0]][toks[1]] += 1
    return first, after


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_along_the_tree_follows_the_target():
    first, after = _run()
    assert _chi2(first, P[0]) < CHI2_5_P1E3
    # After A the text continues from A's row; after B, from B's.
    assert after[A].sum() > 200 and after[B].sum() > 200
    assert _chi2(after[A], P[1]) < CHI2_5_P1E3
    assert _chi2(after[B], P[2]) < CHI2_5_P1E3


def _residual_ignored(p, kids, tokens, gen):
    """Wrong: every child against the untouched p, and a rejection draws from p."""
    u = torch.rand(len(kids) + 1, generator=gen).tolist()
    for j, c in enumerate(kids):
        if u[j] < float(p[tokens[c]]):
            return c, tokens[c]
    return None, medusa._draw(p, u[-1])


def _draw_from_p(p, kids, tokens, gen):
    """Wrong: the right acceptance tests, but the last draw from p, not the residual."""
    q = p.clone()
    u = torch.rand(len(kids) + 1, generator=gen).tolist()
    for j, c in enumerate(kids):
        if u[j] * float(q.sum()) < float(q[tokens[c]]):
            return c, tokens[c]
        q[tokens[c]] = 0.0
    return None, medusa._draw(p, u[-1])


@pytest.mark.parametrize("rule", [_residual_ignored, _draw_from_p])
def test_wrong_rules_fail_the_same_check(monkeypatch, rule):
    monkeypatch.setattr(medusa, "_sample_children", rule)
    first, _ = _run()
    assert _chi2(first, P[0]) > CHI2_5_P1E6


def test_greedy_follows_the_argmax_child():
    sampler = Sampler(V, [], torch.device("cpu"))
    tree = Tree(tokens=[2, 4, 1], parents=[-1, -1, 0], depths=[1, 1, 2])
    logits = torch.full((4, V), -5.0)
    logits[0, 2] = 3.0  # root: 2, node 0's token -> accepted
    logits[1, 1] = 3.0  # node 0 (2): 1, node 2's token -> accepted
    logits[3, 5] = 3.0  # node 2 (1): 5, no child -> the bonus
    logits[2, 0] = 3.0  # node 1 (4) is off the path
    ((res, path),) = verify_tree(sampler, logits, [_state(0.0)], [tree])
    assert (res.accepted, res.bonus, path) == ([2, 1], 5, [0, 1, 3])
    logits[0] = -5.0
    logits[0, 3] = 3.0  # no child carries 3: nothing accepted, 3 is the bonus
    ((res, path),) = verify_tree(sampler, logits, [_state(0.0)], [tree])
    assert (res.accepted, res.bonus, path) == ([], 3, [0])


def test_logprobs_along_the_accepted_path():
    sampler = Sampler(V, [], torch.device("cpu"))
    logits = torch.log(torch.stack(P))
    logits[0, B] = 5.0  # root: B (node 1), whose row P[2] then gives the bonus
    st = RequestSamplingState(SamplingParams(temperature=0.0, logprobs=1), 1, [0], None)
    ((res, path),) = verify_tree(sampler, logits, [st], [TREE3])
    assert res.accepted == [B] and path == [0, 2]
    assert res.logprobs is not None and len(res.logprobs) == 2
    want = torch.log_softmax(logits[2], -1)[res.bonus]
    assert res.logprobs[1].logprob == pytest.approx(float(want), abs=1e-5)


def test_compaction_moves_the_path_down_to_consecutive_positions():
    bs = 4
    k = torch.arange(6 * bs * 2, dtype=torch.float32).view(6, bs, 1, 2)
    v = -k.clone()
    table = [3, 1, 5]
    before = k.clone()

    def at(t, p):
        return t[table[p // bs], p % bs]

    # Root at position 2; the path's nodes sit at slots 5 and 8 -> positions 3 and 4.
    want_k, want_v = at(k, 5).clone(), at(k, 8).clone()
    compact_kv([(k, v)], table, bs, [(5, 3), (8, 4)])
    torch.testing.assert_close(at(k, 3), want_k)
    torch.testing.assert_close(at(k, 4), want_v)
    torch.testing.assert_close(at(v, 3), -want_k)
    # Nothing else moved.
    changed = (k != before).flatten(2).any(-1)
    assert int(changed.sum()) == 2


@pytest.mark.parametrize(
    ("extra", "why"),
    [([], "no config.json"), (["--steps", "0"], "--steps must be >= 1")],
)
def test_train_medusa_refuses_bad_arguments(tmp_path, capsys, extra, why):
    from service.cli import main

    model = tmp_path / "model"
    model.mkdir()
    if extra:
        (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["train-medusa", str(model), str(tmp_path / "out"), *extra])
    assert e.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
