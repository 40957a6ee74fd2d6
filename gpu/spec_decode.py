"""Speculative decoding, executor side: the draft model and the lossless verification rule.

Verification (Leviathan et al. / Chen et al.): the target's distribution p_j at each of the
k + 1 rows of a verify chunk is computed exactly as the sampler would have computed it had
the drafts before it been sampled (same min_tokens masking, penalties over the tokens so
far, temperature, top-k/top-p/min-p).  Draft j is accepted with probability
min(1, p_j(d) / q_j(d)); at the first rejection a token is drawn from the normalised
residual max(0, p_j - q_j); when all k pass, a bonus token is drawn from p_{k+1}.  The
emitted tokens then follow p exactly.  n-gram drafts are deterministic, so their q is
one-hot.  Greedy rows accept while the draft equals the argmax, which is the token
non-speculative decoding would have produced.

The draft model is a second, much smaller checkpoint with the target's vocabulary.  Its
KV lives in its own tensors indexed by the target's block ids, so it follows the
target's block tables (prefix hits, copy-on-write, preemption) without any bookkeeping
of its own beyond how far each request's draft KV is valid.  It catches up lazily: a
request that did not speculate for a while, or a prompt the target prefilled in chunks,
is fed to the draft in one chunk the next time it proposes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from gpu.attention import create_attention_backend
from gpu.batch_layout import layout_batch
from gpu.config import ModelConfig, ModelLoadError
from gpu.cuda_graphs import DecodeGraphs
from gpu.loader import load_model
from gpu.sampler import (
    _MIN_TEMPERATURE,
    RequestSamplingState,
    Sampler,
    apply_token_bitmask_,
    argmax_rows,
)
from scheduler.contract import ModelOutput, ScheduledRequest, TokenLogprobs

if TYPE_CHECKING:
    from scheduler.scheduler import DraftWalk

log = logging.getLogger(__name__)


class TargetRunner(Protocol):
    """What speculation reads from the target's model runner (gpu/model_runner.py), named
    here so this module need not import it (the runner imports this one)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    requests: dict[str, RequestSamplingState]
    block_tables: dict[str, list[int]]
    sampler: Sampler
    model: torch.nn.Module
    graphs: DecodeGraphs | None
    kv_caches: list[tuple[torch.Tensor, ...]]


def _view(state: RequestSamplingState, extra: list[int]) -> RequestSamplingState:
    """The state a request would have after sampling `extra` (penalties, min_tokens)."""
    if not extra:
        return state
    return RequestSamplingState(
        state.params, state.prompt_len, state.token_ids + extra, state.generator
    )


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an unnormalised [V] distribution with uniform u in [0, 1)."""
    cdf = probs.cumsum(0)
    target = (1.0 - u) * cdf[-1]
    return int(torch.searchsorted(cdf, target.unsqueeze(0)).clamp_(max=probs.shape[0] - 1))


@dataclass
class Verified:
    accepted: list[int]
    bonus: int
    logprobs: list[TokenLogprobs | None] | None  # one per emitted token (accepted + bonus)


def row_targets(
    sampler: Sampler, logits: torch.Tensor, views: list[RequestSamplingState]
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Each verify row's greedy token, and the target distribution p (after the request's
    own processors and filters) of each row that samples."""
    x = sampler.processed_logits(logits, views)  # [rows, V]
    argmax = argmax_rows(x).tolist()
    rand_rows = [i for i, v in enumerate(views) if not v.greedy]
    probs: dict[int, torch.Tensor] = {}
    if rand_rows:
        idx = torch.tensor(rand_rows, device=x.device)
        p = sampler.filtered_probs(x.index_select(0, idx), [views[i] for i in rand_rows])
        p = p / p.sum(-1, keepdim=True)
        probs = {r: p[j] for j, r in enumerate(rand_rows)}
    return argmax, probs


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,  # [sum(k_i + 1), V] float32: each request's k_i + 1 verify rows
    states: list[RequestSamplingState],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],  # [k_i, V] q of each draft row; None = one-hot
) -> list[Verified]:
    """Accept or reject each request's drafts and draw the next token (module docstring)."""
    logits = logits[:, : sampler.vocab_size]
    views: list[RequestSamplingState] = []
    for st, d in zip(states, drafts, strict=True):
        views += [_view(st, d[:j]) for j in range(len(d) + 1)]
    argmax, probs = row_targets(sampler, logits, views)
    out: list[Verified] = []
    row = 0
    for st, d, q in zip(states, drafts, draft_probs, strict=True):
        k = len(d)
        if st.greedy:
            a = 0
            while a < k and d[a] == argmax[row + a]:
                a += 1
            bonus = argmax[row + a]
        else:
            a, bonus = _rejection_sample(
                [probs[row + j] for j in range(k + 1)], d, q, st.generator or sampler.generator
            )
        lps = None
        if st.params.logprobs is not None:
            toks = torch.tensor([*d[:a], bonus], device=logits.device)
            lps = Sampler._logprobs(
                logits[row : row + a + 1], toks, views[row : row + a + 1], list(range(a + 1))
            )
        out.append(Verified(d[:a], bonus, lps))
        row += k + 1
    return out


def _mask_draft_rows(logits: torch.Tensor, walks: list[DraftWalk | None]) -> None:
    """Each constrained row of a draft round under its grammar's mask at its position, in
    place (the walk records the mask as its verify row's)."""
    rows: list[int] = []
    masks: list[bytes] = []
    for j, walk in enumerate(walks):
        if walk is None:
            continue
        m = walk.mask()
        if m is not None and not walk.failed:
            rows.append(j)
            masks.append(m)
    if rows:
        apply_token_bitmask_(logits, rows, masks)


def _mask_verify_rows(
    logits: torch.Tensor, verify: list[tuple[ScheduledRequest, int]], masks: dict[str, bytes]
) -> None:
    """Each constrained request's rows under the grammar at their positions, in place: a
    draft the grammar forbids there is never accepted, and the token drawn after the
    accepted ones is one the grammar allows."""
    rows: list[int] = []
    row_masks: list[bytes] = []
    at = 0
    for sr, _ in verify:
        n = sr.num_draft + 1
        joined = masks.get(sr.req_id)
        if joined is not None:
            size = len(joined) // n
            rows += range(at, at + n)
            row_masks += [joined[i * size : (i + 1) * size] for i in range(n)]
        at += n
    if rows:
        apply_token_bitmask_(logits, rows, row_masks)


def _rejection_sample(
    p: list[torch.Tensor],  # k + 1 normalised target distributions [V]
    d: list[int],  # k drafts
    q: torch.Tensor | None,  # [k, V] draft distributions, None: one-hot on d
    gen: torch.Generator,
) -> tuple[int, int]:
    """(number accepted, next token).  Draws k + 1 uniforms from the request's generator
    whatever happens, so a seeded request's stream does not depend on where it stopped."""
    k = len(d)
    u = torch.rand(k + 1, generator=gen, device=p[0].device).tolist()
    for j in range(k):
        pj = float(p[j][d[j]])
        qj = 1.0 if q is None else float(q[j, d[j]])
        if u[j] * qj < pj:
            continue
        if q is None:
            residual = p[j].clone()
            residual[d[j]] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
            residual = p[j]
        return j, _draw(residual, u[k])
    return k, _draw(p[k], u[k])


class DraftModel:
    """A small checkpoint with the target's vocabulary, over KV that follows the target's
    block tables."""

    def __init__(self, model_dir: str | Path, target: TargetRunner, attention_backend: str):
        self.dir = Path(model_dir)
        cfg = ModelConfig.from_dir(self.dir)
        if cfg.vocab_size != target.config.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocabulary ({cfg.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}); they must share a tokenizer"
            )
        self.config = cfg
        self.device = target.device
        self.block_size = target.block_size
        backend = create_attention_backend(
            attention_backend,
            target.device,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
            target.dtype,
            target.block_size,
        )
        self.model = load_model(
            self.dir, cfg, backend, target.dtype, target.device, target.max_model_len
        )
        if self.device.type == "cpu":
            self.model.pack_for_cpu()
        shape = (target.num_kv_blocks, target.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=target.dtype, device=self.device),
                torch.zeros(shape, dtype=target.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        # Per request: positions [0, n) hold draft KV computed from its real tokens.
        self.valid: dict[str, int] = {}
        # The rounds after the first feed one token a request: the target's decode-graph
        # buckets over the draft model, where the target has them (on a GPU each draft
        # token is otherwise an eager forward, bound by its launches).
        self.graphs: DecodeGraphs | None = None
        tg = target.graphs
        if tg is not None and backend.name == "triton":
            self.graphs = DecodeGraphs(
                lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
                device=self.device,
                max_model_len=target.max_model_len,
                block_size=self.block_size,
                sizes=tg.sizes,
                capture=tg.capture,
            )
            self.graphs.capture_all()

    def propose(
        self,
        reqs: list[tuple[ScheduledRequest, RequestSamplingState]],
        sampler: Sampler,
        block_tables: dict[str, list[int]],
        walks: list[DraftWalk | None] | None = None,
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """k drafts per request (k = its num_draft), with their q rows for random ones.

        Round 0 feeds what the draft has not seen, up to the last known token; each later
        round feeds the previous draft.  Draft KV lands at the positions this step's
        verify chunk covers, inside the blocks the scheduler allocated for it.  A request
        with a walk (its grammar) drafts from the draft's logits under the grammar's mask
        at each position (q is that masked distribution, as the target's p is masked in
        verification), and stops where the grammar takes no draft (fewer than k)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        feeds: list[tuple[int, list[int], int]] = []  # (request index, tokens, start)
        for i, (sr, st) in enumerate(reqs):
            n = sr.start_pos + len(sr.input_ids)  # known tokens
            s = min(self.valid.get(sr.req_id, 0), n - 1)
            feeds.append((i, st.token_ids[s:n], s))
        for rnd in range(max(sr.num_draft for sr, _ in reqs)):
            feeds.sort(key=lambda f: len(f[1]) != 1)  # one-token queries first
            logits = self._forward(feeds, [block_tables[reqs[i][0].req_id] for i, _, _ in feeds])
            logits = logits[:, : sampler.vocab_size]
            if walks is not None:
                _mask_draft_rows(logits, [walks[i] for i, _, _ in feeds])
            # Every greedy row's token in one transfer (a sync per row otherwise).
            greedy = [reqs[i][1].greedy for i, _, _ in feeds]
            top = argmax_rows(logits).tolist() if any(greedy) else []
            nxt: list[tuple[int, list[int], int]] = []
            for j, (i, toks, s) in enumerate(feeds):
                sr, st = reqs[i]
                if rnd == 0:
                    self.valid[sr.req_id] = s + len(toks)
                walk = walks[i] if walks is not None else None
                if walk is not None and walk.failed:
                    continue  # the matcher failed: no draft
                tok, q = (top[j], None) if greedy[j] else self._sample(logits[j], st, sampler)
                if walk is not None and not walk.take(tok):
                    continue  # the grammar takes nothing here: the chunk ends
                drafts[i].append(tok)
                if q is not None:
                    qs[i].append(q)
                if len(drafts[i]) < sr.num_draft:
                    nxt.append((i, [tok], s + len(toks)))
            feeds = nxt
            if not feeds:
                break
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs, strict=True)]

    def _forward(
        self, feeds: list[tuple[int, list[int], int]], tables: list[list[int]]
    ) -> torch.Tensor:  # [len(feeds), V]: the logits after each feed's last token
        g = self.graphs
        if (
            g is not None
            and g.bucket(len(feeds)) is not None
            and all(len(toks) == 1 for _, toks, _ in feeds)
        ):
            hidden = g.run([toks[0] for _, toks, _ in feeds], [s for _, _, s in feeds], tables)
            return self.model.compute_logits(hidden)
        batch = layout_batch(
            [(toks, s, bt) for (_, toks, s), bt in zip(feeds, tables, strict=True)],
            self.block_size,
            self.device,
        )
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        last = [batch.query_start[j] + len(toks) - 1 for j, (_, toks, _) in enumerate(feeds)]
        return self.model.compute_logits(
            hidden.index_select(0, torch.tensor(last, device=self.device))
        )

    @staticmethod
    def _sample(
        logits: torch.Tensor, st: RequestSamplingState, sampler: Sampler
    ) -> tuple[int, torch.Tensor]:
        """A random row samples from softmax(logits / T), which is the q the acceptance
        test divides by (greedy rows take the argmax)."""
        t = max(st.params.temperature, _MIN_TEMPERATURE)
        q = torch.softmax(logits / t, dim=-1)
        u = float(torch.rand(1, generator=st.generator or sampler.generator, device=q.device))
        return _draw(q, u), q

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared blocks, as the target's cache does."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def verified(self, req_id: str, known: int, num_accepted: int, num_draft: int) -> None:
        """Drafts d_1..d_{k-1} were fed at positions known..known+k-2: the accepted ones'
        KV stays valid."""
        if req_id in self.valid:
            self.valid[req_id] = known + min(num_accepted, num_draft - 1)


class TreeProposer(Protocol):
    """Medusa's side of a step (gpu/medusa.MedusaProposer, which imports this module)."""

    def propose(self, reqs: list[ScheduledRequest]) -> None: ...
    def layout(self, req_id: str) -> tuple[list[int], list[int]] | None: ...
    def remember(self, ids: list[str], rows: torch.Tensor) -> None: ...
    def drop(self, req_id: str) -> None: ...
    def verify(
        self,
        runner: TargetRunner,
        hidden: torch.Tensor,
        verify: list[tuple[ScheduledRequest, int]],
        masks: dict[str, bytes] | None = None,
    ) -> list[Verified]: ...


class SpecRunner:
    """What the model runner does for speculative decoding."""

    def __init__(
        self,
        runner: TargetRunner,
        draft_dir: str | Path | None,
        attention_backend: str,
        medusa: TreeProposer | None = None,
    ) -> None:
        # Under tensor parallelism only the group's first rank runs the draft model (it
        # is small, and whole on that rank); the others take its drafts (before_step).
        tp = getattr(runner, "tp", None)
        self.proposes = tp is None or tp.rank == 0
        self.draft = (
            DraftModel(draft_dir, runner, attention_backend)
            if draft_dir is not None and self.proposes
            else None
        )
        self.drafts_shared = draft_dir is not None and tp is not None
        # The engine's Scheduler.draft_walk, where the scheduler shares this process: a
        # constrained request then drafts too, under its grammar (a DraftWalk; None for a
        # request without one).
        self.grammar_walk: Callable[[str], DraftWalk | None] | None = None
        # ... and Scheduler.draft_tree for Medusa: a constrained request's masks for its
        # tree's verify rows (None: no grammar, or a failed matcher).
        self.grammar_tree: Callable[[str, list[int], list[int]], bytes | None] | None = None
        # Medusa heads (gpu/medusa.py): tree-shaped verify chunks.
        self.medusa = medusa
        # q rows of this step's model drafts, between proposing and verifying.
        self._q: dict[str, torch.Tensor | None] = {}
        # This step's requests the draft model drafted (a predicted output's drafts come
        # from the scheduler: the draft model fed none of them, its KV stays where it was).
        self._drafted: set[str] = set()

    def drop(self, req_id: str) -> None:
        if self.draft is not None:
            self.draft.valid.pop(req_id, None)
        if self.medusa is not None:
            self.medusa.drop(req_id)

    def tree_layout(self, req_id: str) -> tuple[list[int], list[int]] | None:
        """A Medusa verify chunk's (position offsets, tree bits) for layout_batch."""
        return None if self.medusa is None else self.medusa.layout(req_id)

    def before_step(
        self,
        runner: TargetRunner,
        scheduled: list[ScheduledRequest],  # the step's requests the runner kept
        copy_blocks: list[tuple[int, int]],
        masks: dict[str, bytes] | None = None,  # the step's grammar masks (filled in here)
    ) -> None:
        """Fill the draft slots of this step's verify chunks with the draft model, and a
        constrained chunk's grammar masks (`grammar_masks`).

        The step's plain decodes (its columns) do not pass through here: a decode row's
        position is never below its draft KV's valid end (`verified` keeps that end at
        most the last token's position), so only a recomputed chunk can need the reset."""
        self._drafted.clear()
        if self.medusa is not None:
            todo_m = [sr for sr in scheduled if sr.num_draft and not sr.draft_ids]
            if todo_m:
                self.medusa.propose(todo_m, self._root_masks(todo_m))
                if self.grammar_tree is not None and masks is not None:
                    for sr in todo_m:
                        tree = self.medusa.trees[sr.req_id]
                        m = self.grammar_tree(sr.req_id, tree.tokens, tree.parents)
                        if m:  # (b"": every row free)
                            masks[sr.req_id] = m
        if self.drafts_shared:
            self._draft_everywhere(runner, scheduled, copy_blocks, masks)
            return
        self._draft(runner, scheduled, copy_blocks, masks)

    def _root_masks(self, reqs: list[ScheduledRequest]) -> dict[str, bytes]:
        """Each constrained request's grammar mask where its tree grows from (the matcher
        as it stands), for Medusa's first level."""
        out: dict[str, bytes] = {}
        if self.grammar_walk is None:
            return out
        for sr in reqs:
            walk = self.grammar_walk(sr.req_id)
            if walk is None:
                continue
            m = walk.mask()
            walk.finish()  # (nothing taken: the matcher is where it was)
            if m is not None and not walk.failed:
                out[sr.req_id] = m
        return out

    def _draft_everywhere(
        self,
        runner: TargetRunner,
        scheduled: list[ScheduledRequest],
        copy_blocks: list[tuple[int, int]],
        masks: dict[str, bytes],
    ) -> None:
        """Tensor parallelism: rank 0 drafts, and every rank verifies the same drafts (a
        rank that verified other tokens would add its share of another sum into the
        all-reduce).  One broadcast of the step's draft slots."""
        # The slots as scheduled (rank 0's grammar walk may cut a chunk shorter).
        todo = [(sr, sr.num_draft) for sr in scheduled if sr.num_draft and not sr.draft_ids]
        if self.proposes:
            self._draft(runner, scheduled, copy_blocks, masks)
        if not todo:
            return
        sent = [sr.draft_ids for sr, _ in todo] if self.proposes else None
        got = runner.tp.broadcast_lists(sent, [k for _, k in todo])  # type: ignore[attr-defined]
        for (sr, _), drafts in zip(todo, got, strict=True):
            sr.draft_ids, sr.num_draft = drafts, len(drafts)

    def _draft(
        self,
        runner: TargetRunner,
        scheduled: list[ScheduledRequest],
        copy_blocks: list[tuple[int, int]],
        masks: dict[str, bytes],
    ) -> None:
        draft = self.draft
        if draft is None:
            return
        if copy_blocks:
            draft.copy_blocks(copy_blocks)
        todo = []
        for sr in scheduled:
            # A request recomputing after preemption lands in other blocks.
            if sr.start_pos < draft.valid.get(sr.req_id, 0):
                draft.valid[sr.req_id] = 0
            if sr.num_draft and not sr.draft_ids:
                todo.append((sr, runner.requests[sr.req_id]))
        if todo:
            hook = self.grammar_walk
            walks = [hook(sr.req_id) for sr, _ in todo] if hook is not None else None
            drafted = draft.propose(todo, runner.sampler, runner.block_tables, walks)
            for k, ((sr, _), (d, q)) in enumerate(zip(todo, drafted, strict=True)):
                sr.draft_ids = d
                self._q[sr.req_id] = q
                self._drafted.add(sr.req_id)
                walk = walks[k] if walks is not None else None
                if walk is not None:
                    # Drafted under its grammar: every verify row gets the grammar's mask
                    # at its position; a chunk whose drafting stopped early is shorter.
                    m, _ = walk.finish()
                    if m:  # (None: the matcher failed, its request ends on update;
                        masks[sr.req_id] = m  # b"": every row free)
                    sr.num_draft = len(d)

    def verify(
        self,
        runner: TargetRunner,
        hidden: torch.Tensor,  # [T, hidden]
        verify: list[tuple[ScheduledRequest, int]],
        out: ModelOutput,
        masks: dict[str, bytes] | None = None,
    ) -> None:
        """masks: a constrained request's grammar mask for each of its verify rows, joined
        (Scheduler.fill_masks walks its matcher through the drafts)."""
        results: list[Verified] = []
        if self.medusa is not None:
            results = self.medusa.verify(runner, hidden, verify, masks)
        else:
            rows: list[int] = []
            for sr, row in verify:
                rows += range(row, row + sr.num_draft + 1)
            logits = runner.model.compute_logits(
                hidden.index_select(0, torch.tensor(rows, device=hidden.device))
            )
            if masks:
                _mask_verify_rows(logits, verify, masks)
            states = [runner.requests[sr.req_id] for sr, _ in verify]
            qs = [self._q.pop(sr.req_id, None) for sr, _ in verify]
            results = verify_drafts(
                runner.sampler, logits, states, [sr.draft_ids for sr, _ in verify], qs
            )
        states = [runner.requests[sr.req_id] for sr, _ in verify]
        any_lp = out.logprobs is not None or any(r.logprobs for r in results)
        if any_lp and out.logprobs is None:
            out.logprobs = [None] * len(out.req_ids)
        for (sr, _), st, res in zip(verify, states, results, strict=True):
            known = len(st.token_ids)
            for tok in (*res.accepted, res.bonus):
                st.append(tok)
            out.req_ids.append(sr.req_id)
            out.sampled_token_ids.append(res.bonus)
            out.spec_accepted[sr.req_id] = res.accepted
            if out.logprobs is not None:
                out.logprobs.append(res.logprobs[-1] if res.logprobs else None)
            if res.logprobs:
                out.spec_logprobs[sr.req_id] = res.logprobs[:-1]
            if self.draft is not None and sr.req_id in self._drafted:
                self.draft.verified(sr.req_id, known, len(res.accepted), sr.num_draft)
        self._drafted.clear()
