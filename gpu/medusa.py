"""Medusa heads: the target's own last hidden state proposes a tree of candidates.

A Medusa checkpoint (FasterDecoding/Medusa's layout, which vLLM and TGI also load) is a
directory with a `config.json` holding `medusa_num_heads`, `medusa_num_layers` and
`base_model_name_or_path`, and `medusa_lm_head.safetensors`: head i is
`medusa_num_layers` ResBlocks (`{i}.{j}.linear.weight` / `.bias`, hidden -> hidden;
x + SiLU(W x + b)) then a bias-free hidden -> vocab linear (`{i}.{L}.weight`).  Head i,
applied to the hidden state that sampled token t_n, predicts t_{n+2+i}: the target's own
LM head already gave t_{n+1}, the token the next step feeds.

Candidates: a static tree (TREE, paths of top-k ranks, one rank per head down the path),
its nodes sorted by depth so that any prefix of the list is itself a tree.  A verify chunk
is the last known token (the root) then the tree's nodes; node i sits at position
root + depth(i) but in cache slot root + 1 + i, and attends to the context, the root and
its own ancestors only (a per-token bitmask over the chunk, `tree_bits`, which every
attention path applies on top of its causal mask).  After verification the accepted
path's K/V is copied down to consecutive slots (root + 1, root + 2, ...), where a chain's
would have been; the scheduler then rolls back the rest as for any verify chunk.

Verification along the tree is exact:
- greedy: from the root, follow the child whose token is the target's argmax, as long as
  there is one; the first argmax without a matching child is the bonus token.  The tokens
  are the ones decoding without speculation would have produced.
- sampling: at each node, try its children in rank order; child c is accepted with
  probability p(c) (the candidates are deterministic, their q one-hot, so min(1, p/q) is
  p(c)); a rejected child's token is taken out of p, which is renormalised (the residual
  max(0, p - q)), and the next child tried against it; when none is accepted the token is
  drawn from what is left.  This is sampling without replacement from p, so each emitted
  token follows p exactly (SpecInfer's multi-candidate rule with one-hot drafts).
"""

from __future__ import annotations

import json
from itertools import repeat
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gpu.config import ModelLoadError
from gpu.sampler import RequestSamplingState, Sampler, apply_token_bitmask_
from gpu.spec_decode import TargetRunner, Verified, _draw, _mask_verify_rows, _view, row_targets
from scheduler.contract import ScheduledRequest
from scheduler.medusa_tree import Tree, build_tree, tree_depth, tree_paths

WEIGHTS = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The heads, as nn.Sequential(ResBlock * num_layers, Linear(hidden, vocab)) each, so
    state_dict keys are the public checkpoints' ({i}.{j}.linear.weight, {i}.{L}.weight)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden) for _ in range(num_layers)],
                nn.Linear(hidden, vocab, bias=False),
            )
            for _ in range(num_heads)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [heads, R, vocab]
        return torch.stack([head(h) for head in self.heads])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def save(self, out: Path, base_model: str, extra: dict | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.hf_state_dict().items()}
        save_file(tensors, str(out / WEIGHTS))
        cfg = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": base_model,
            "hidden_size": self.heads[0][-1].in_features,
            "vocab_size": self.heads[0][-1].out_features,
            **(extra or {}),
        }
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def load(
        cls, path: str | Path, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device
    ) -> MedusaHeads:
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
            num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg["medusa_num_layers"])
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: not a Medusa checkpoint (config.json: {e})") from e
        files = (
            [path / WEIGHTS] if (path / WEIGHTS).is_file() else sorted(path.glob("*.safetensors"))
        )
        if not files:
            raise ModelLoadError(f"{path}: no {WEIGHTS}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        heads = cls(hidden, vocab, num_heads, num_layers)
        # The vocabulary may be padded past the tokenizer's in a public checkpoint.
        out_w = sd.get(f"0.{num_layers}.weight")
        if out_w is None or out_w.shape[1] != hidden or out_w.shape[0] < vocab:
            got = None if out_w is None else tuple(out_w.shape)
            raise ModelLoadError(
                f"{path}: Medusa heads of shape {got} do not fit the target "
                f"(hidden {hidden}, vocabulary {vocab})"
            )
        for i in range(num_heads):
            k = f"{i}.{num_layers}.weight"
            sd[k] = sd[k][:vocab]
        try:
            heads.heads.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ModelLoadError(f"{path}: Medusa weights do not match its config: {e}") from e
        return heads.to(device=device, dtype=dtype).eval()


def compact_kv(
    kv_caches: list[tuple[torch.Tensor, ...]],
    table: list[int],
    block_size: int,
    moves: list[tuple[int, int]],  # (from position, to position)
) -> None:
    """Copy the accepted path's K/V (and scales) from their tree slots down to consecutive
    positions; every source is read before any destination is written."""
    if not moves:
        return
    dev = kv_caches[0][0].device

    def slot(p: int) -> int:
        return table[p // block_size] * block_size + p % block_size

    src = torch.tensor([slot(a) for a, _ in moves], dtype=torch.int64, device=dev)
    dst = torch.tensor([slot(b) for _, b in moves], dtype=torch.int64, device=dev)
    for layer in kv_caches:
        for t in layer:
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))


def verify_tree(
    sampler: Sampler,
    logits: torch.Tensor,  # [sum(size_i + 1), V]: each request's root row, then its nodes'
    states: list[RequestSamplingState],
    trees: list[Tree],
) -> list[tuple[Verified, list[int]]]:
    """Each request's accepted path and next token (module docstring), with the chunk rows
    of its path (the root's, then each accepted node's)."""
    logits = logits[:, : sampler.vocab_size]
    views: list[RequestSamplingState] = []
    for st, tr in zip(states, trees, strict=True):
        paths: list[list[int]] = [[]]  # per chunk row: the tokens after st.token_ids
        for i, par in enumerate(tr.parents):
            paths.append([*paths[par + 1], tr.tokens[i]])
        views += [_view(st, p) for p in paths]
    argmax, probs = row_targets(sampler, logits, views)
    out: list[tuple[Verified, list[int]]] = []
    row = 0
    for st, tr in zip(states, trees, strict=True):
        kids = tr.children()
        cur, path, acc = 0, [0], []
        gen = st.generator or sampler.generator
        while True:
            if st.greedy:
                tok = argmax[row + cur]
                nxt = next((c for c in kids[cur] if tr.tokens[c] == tok), None)
            else:
                nxt, tok = _sample_children(probs[row + cur], kids[cur], tr.tokens, gen)
            if nxt is None:
                bonus = tok
                break
            acc.append(tr.tokens[nxt])
            cur = nxt + 1
            path.append(cur)
        lps = None
        if st.params.logprobs is not None:
            rows = [row + r for r in path]
            toks = torch.tensor([*acc, bonus], device=logits.device)
            lps = Sampler._logprobs(
                logits[rows], toks, [views[r] for r in rows], list(range(len(rows)))
            )
        out.append((Verified(acc, bonus, lps), path))
        row += tr.size + 1
    return out


def _sample_children(
    p: torch.Tensor, kids: list[int], tokens: list[int], gen: torch.Generator
) -> tuple[int | None, int]:
    """(accepted child or None, its token or the token drawn from the residual): each
    child in turn against what is left of p, as the module docstring says."""
    p = p.clone()
    u = torch.rand(len(kids) + 1, generator=gen, device=p.device).tolist()
    for j, c in enumerate(kids):
        tok = tokens[c]
        total = float(p.sum())
        pc = float(p[tok])
        if total > 0.0 and u[j] * total < pc:
            return c, tok
        p[tok] = 0.0
    if float(p.sum()) <= 0.0:  # the children held all of p up to rounding
        p = torch.ones_like(p)
    return None, _draw(p, u[-1])


class MedusaProposer:
    """The heads over the target's hidden states: trees for this step's verify chunks."""

    def __init__(self, path: str | Path, target: TargetRunner) -> None:
        cfg = target.config
        self.heads = MedusaHeads.load(
            path, cfg.hidden_size, cfg.vocab_size, target.dtype, target.device
        )
        self.num_heads = self.heads.num_heads
        # Tensor parallelism: rank 0's candidates and accepted paths are every rank's (one
        # broadcast each), so every rank verifies the same tree and moves the same K/V.
        self.tp = getattr(target, "tp", None)
        # Per request: the hidden state of the row that sampled its last token, as (a
        # step's rows, its row there): every step remembers its rows, and a view per row
        # cost a visible share of a plain step on a small model.
        self.hidden: dict[str, tuple[torch.Tensor, int]] = {}
        self.trees: dict[str, Tree] = {}  # this step's, by request

    def remember(self, ids: list[str], rows: torch.Tensor) -> None:
        rows = rows.detach().clone()  # (a step's hidden buffer may be reused)
        self.hidden.update(zip(ids, zip(repeat(rows), range(len(ids)))))

    def drop(self, req_id: str) -> None:
        self.hidden.pop(req_id, None)
        self.trees.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest], roots: dict[str, bytes] | None = None) -> None:
        """Fill each request's num_draft slots with the first nodes of the static tree.
        roots: a constrained request's grammar mask at the root, so its first level's
        candidates are tokens the grammar allows (deeper levels are walked later)."""
        depth = min(self.num_heads, max(tree_depth(sr.num_draft) for sr in reqs))
        paths = tree_paths(depth)
        ranks = [1 + max(p[d] for p in paths if len(p) > d) for d in range(depth)]
        guesses = (
            self._candidates(reqs, depth, ranks, roots or {})
            if self.tp is None or self.tp.rank == 0
            else None
        )
        if self.tp is not None:
            guesses = self._shared(guesses, len(reqs), ranks)
        assert guesses is not None
        for sr, guess in zip(reqs, guesses, strict=True):
            tree = build_tree(guess, sr.num_draft)
            sr.draft_ids = tree.tokens
            self.trees[sr.req_id] = tree

    def _shared(
        self, guesses: list[list[list[int]]] | None, n: int, ranks: list[int]
    ) -> list[list[list[int]]]:
        """Rank 0's candidates on every rank: each request's top-k lists, flattened."""
        assert self.tp is not None
        width = sum(ranks)
        flat = None if guesses is None else [t for g in guesses for per in g for t in per]
        got = self.tp.broadcast_ints(flat, n * width)
        out = []
        for i in range(n):
            at, guess = i * width, []
            for r in ranks:
                guess.append(got[at : at + r])
                at += r
            out.append(guess)
        return out

    def _candidates(
        self,
        reqs: list[ScheduledRequest],
        depth: int,
        ranks: list[int],
        roots: dict[str, bytes],
    ) -> list[list[list[int]]]:
        """Each request's top-k tokens per head (ranks[d] of head d); head 0's among the
        tokens the root's grammar mask allows, where it has one."""
        known = [sr for sr in reqs if sr.req_id in self.hidden]
        topk: dict[str, list[list[int]]] = {}
        if known:
            h = torch.stack([buf[i] for buf, i in (self.hidden[sr.req_id] for sr in known)])
            w = self.heads.heads[0][-1].weight
            logits = torch.stack(
                [self.heads.heads[d](h.to(w.dtype)) for d in range(depth)]
            )  # [depth, R, V]
            masked = [j for j, sr in enumerate(known) if sr.req_id in roots]
            if masked:
                first = logits[0]
                apply_token_bitmask_(first, masked, [roots[known[j].req_id] for j in masked])
            per_head = [logits[d].topk(ranks[d], dim=-1).indices.tolist() for d in range(depth)]
            for j, sr in enumerate(known):
                topk[sr.req_id] = [per_head[d][j] for d in range(depth)]
        # A request whose hidden state this runner never saw (none should be) guesses its
        # last token again: still a tree, verified like any other.
        return [topk.get(sr.req_id) or [[sr.input_ids[-1]] * r for r in ranks] for sr in reqs]

    def _shared_paths(self, paths: list[list[int]], slots: list[int]) -> list[list[int]]:
        """Rank 0's accepted paths on every rank (each in its tree's row count, its length
        first): a rank that moved other K/V would hold another sequence's cache."""
        assert self.tp is not None
        return self.tp.broadcast_lists(paths if self.tp.rank == 0 else None, slots)

    def layout(self, req_id: str) -> tuple[list[int], list[int]] | None:
        tree = self.trees.get(req_id)
        return None if tree is None else (tree.offsets(), tree.bits())

    def verify(
        self,
        runner: TargetRunner,
        hidden: torch.Tensor,  # [T, hidden]
        verify: list[tuple[ScheduledRequest, int]],
        masks: dict[str, bytes] | None = None,
    ) -> list[Verified]:
        """Verify the trees, move each accepted path's K/V to consecutive positions, and
        keep the hidden state that sampled each request's new last token.  masks: a
        constrained request's grammar mask for each of its tree's rows, joined
        (Scheduler.draft_tree)."""
        rows: list[int] = []
        for sr, row in verify:
            rows += range(row, row + sr.num_draft + 1)
        idx = torch.tensor(rows, device=hidden.device)
        logits = runner.model.compute_logits(hidden.index_select(0, idx))
        if masks:
            _mask_verify_rows(logits, verify, masks)
        trees = [self.trees.pop(sr.req_id) for sr, _ in verify]
        states = [runner.requests[sr.req_id] for sr, _ in verify]
        results = verify_tree(runner.sampler, logits, states, trees)
        paths = [path for _, path in results]
        if self.tp is not None:
            paths = self._shared_paths(paths, [tr.size + 1 for tr in trees])
        last_rows = []
        for (sr, row), path in zip(verify, paths, strict=True):
            root = sr.start_pos  # the root token's position (a verify chunk feeds one)
            moves = [(root + r, root + j) for j, r in enumerate(path) if r != j]
            compact_kv(runner.kv_caches, runner.block_tables[sr.req_id], runner.block_size, moves)
            last_rows.append(row + path[-1])
        self.remember(
            [sr.req_id for sr, _ in verify],
            hidden.index_select(0, torch.tensor(last_rows, device=hidden.device)),
        )
        return [res for res, _ in results]
