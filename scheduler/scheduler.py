"""Continuous batching with chunked prefill: which tokens of which requests run each step.

There are no prefill/decode phases.  Every request has `num_computed_tokens` chasing
`num_tokens`; a step gives each running request what it needs (a decode needs 1) and
fills the rest of the token budget with prompt chunks.  Chunked prefill, prefix-cache
hits and recompute after preemption all follow from that one rule.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.ahead import AheadScheduling
from scheduler.block_pool import BlockEvent
from scheduler.columnar import ColumnarDecodes
from scheduler.contract import (
    DecodeColumns,
    KVBlockPayload,
    ModelOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.fair_queue import FairQueue, LatencyFirst, TenantShares, split_budget
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.pins import ConversationSupport
from scheduler.request import FINISH_REASONS, Request, RequestStatus
from scheduler.scheduler_types import (
    RequestRejected,
    RequestUpdate,
    SchedulerConfig,
    SchedulerStats,
    StepUpdates,
    request_update,
)
from scheduler.spec import SpecDecoder
from scheduler.structured import GrammarMatcher, bitmasks
from scheduler.tier_support import PrefixTierSupport, PublishPolicy


@dataclass
class _StepPlan:
    """What one call of Scheduler.schedule builds up, passed between its phases."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    load_kv: list[KVBlockPayload] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    preempted: bool = False
    decodes: DecodeColumns | None = None  # the columnar rows (scheduler/columnar.py)
    decode_ids: set[str] | None = None  # their ids, built only if a preemption asks
    # Fair shares inside the step, when more than one tenant has work (else None): each
    # tenant's prompt tokens left this step and the tenants admission passes over.
    fair: TenantShares | None = None
    early: list[Request] = field(default_factory=list)  # admitted before the running pass
    # Latency first (fair_queue.LatencyFirst), while a sparse tenant shares the server with
    # backlogged ones: the tokens each backlogged tenant may still take this step.
    limit: dict[str | None, int] | None = None
    present: set[str | None] = field(default_factory=set)  # tenants LatencyFirst weighed
    # Per tenant with running requests: (prompt tokens their chunks have left, decodes).
    held: dict[str | None, tuple[int, int]] = field(default_factory=dict)


def _seeded_sampling(req: Request) -> bool:
    return req.params.seed is not None and req.params.temperature > 0


class DraftWalk:
    """A constrained request's matcher walked through its drafts one at a time, for a
    verify chunk's masks: one per row (the position before each draft, then the token after
    the last one taken), joined.  A row the matcher leaves free (a reasoning model's
    thinking) gets an all-allowed mask.  `finish` rolls the matcher back.  A draft model
    walks it while it drafts (its drafts then always fit the grammar); n-gram drafts are
    walked after the fact (_draft_masks)."""

    def __init__(self, grammar: GrammarMatcher) -> None:
        self.grammar = grammar
        self.rows: list[bytes | None] = []
        self.taken = 0
        self.failed = False  # the matcher failed: its request ends on update, with the reason

    def mask(self) -> bytes | None:
        """The next row's mask (None: free); appended to the chunk's rows."""
        m = self.grammar.bitmask()
        if m is None and self.grammar.error() is not None:
            self.failed = True
        self.rows.append(m)
        return m

    def take(self, tok: int) -> bool:
        """The draft at the row `mask` just gave, if the grammar takes it; False ends the
        chunk (that row samples the bonus token)."""
        m = self.rows[-1]
        if self.failed or (m is not None and not (m[tok // 8] >> (tok % 8)) & 1):
            return False
        if self.grammar.terminated:
            # Complete: the request stops at the token that completed it, so no draft
            # past it can count (and a matcher that took its end-of-text cannot be
            # rolled back past it).
            return False
        if not self.grammar.accept(tok):
            self.failed = True
            return False
        self.taken += 1
        return True

    def finish(self) -> tuple[bytes | None, int]:
        """(the rows' masks joined, or None where the matcher failed; drafts taken), with
        the matcher rolled back.  The row after the last draft taken is walked here when
        the drafting did not end on a refused one."""
        try:
            if not self.failed and len(self.rows) == self.taken:
                self.mask()
            return (None, 0) if self.failed else (_join_rows(self.rows), self.taken)
        finally:
            if self.taken:
                self.grammar.rollback(self.taken)


def _draft_masks(grammar: GrammarMatcher, drafts: list[int]) -> tuple[bytes | None, int]:
    """n-gram drafts walked through a DraftWalk: the chunk's masks, and how many drafts
    the grammar takes in a row (the chunk is cut there); (None, 0) where the matcher
    fails on the way."""
    walk = DraftWalk(grammar)
    for tok in drafts:
        walk.mask()
        if not walk.take(tok):
            break
    return walk.finish()


class _MatcherFailed(Exception):
    pass


def tree_masks(grammar: GrammarMatcher, tokens: list[int], parents: list[int]) -> bytes | None:
    """A Medusa verify chunk's masks, one per row (the root's, then each node's: the
    grammar's mask after the node's path), joined.  A node the grammar refuses at its
    parent is never accepted, so the rows under it are left all-allowed, as are the rows
    past a node that completes the grammar (the request ends there).  The matcher is walked
    depth first and ends where it was.  None where it fails: its request ends on update."""
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    rows: list[bytes | None] = [None] * (len(tokens) + 1)

    def visit(row: int) -> None:
        m = grammar.bitmask()
        if m is None and grammar.error() is not None:
            raise _MatcherFailed
        rows[row] = m
        if grammar.terminated:
            return
        for node in kids[row]:
            tok = tokens[node]
            if m is not None and not (m[tok // 8] >> (tok % 8)) & 1:
                continue
            if not grammar.accept(tok):
                raise _MatcherFailed
            try:
                visit(node + 1)
            finally:
                grammar.rollback(1)

    try:
        visit(0)
    except _MatcherFailed:
        return None
    return _join_rows(rows)


def _join_rows(rows: list[bytes | None]) -> bytes:
    size = next((len(r) for r in rows if r is not None), 0)
    if not size:
        return b""
    free = b"\xff" * size
    return b"".join(free if r is None else r for r in rows)


def check_group(group: list[Request], max_len: int, max_num_seqs: int) -> None:
    """Scheduler.check_group from the two limits it reads (also where the scheduler is
    another process's: service/engine_proc.py)."""
    p = group[0]
    if p.prompt_len == 0:
        raise RequestRejected("the prompt is empty")
    # An embedding's pass reads the sampled token's logits and never its KV: its prompt
    # may fill max_model_len (vLLM's limit for pooling).
    if p.prompt_len > max_len or (p.prompt_len == max_len and not p.params.embed):
        raise RequestRejected(
            f"the prompt has {p.prompt_len} tokens; max_model_len is {max_len}, which "
            "must leave room for at least one generated token"
        )
    if len(group) > max_num_seqs:
        raise RequestRejected(f"n={len(group)} is more than max_num_seqs ({max_num_seqs})")


class Scheduler(ColumnarDecodes, PrefixTierSupport, ConversationSupport, AheadScheduling):
    def __init__(
        self,
        config: SchedulerConfig,
        on_block_event: Callable[[BlockEvent], None] | None = None,
        tier: PublishPolicy | None = None,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        # An executor that walks this scheduler's matchers through its own drafts
        # (draft_walk, draft_tree: it shares this process): a constrained request may draft
        # with a draft model or Medusa.
        self.executor_masks = False
        self.block_size = config.block_size
        self.kv = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_event=on_block_event,
            max_pinned_blocks=int(config.pinned_kv_fraction * config.num_kv_blocks),
            session_ttl=config.session_ttl,
        )
        self.waiting = FairQueue(config.tenant_weights, fair=config.scheduling_policy == "fair")
        self.running: list[Request] = []
        self.tenant_seqs: dict[str | None, int] = {}  # running sequences per tenant
        self.num_fair_preemptions = 0  # preempted to make room for a tenant under its share
        self.latency = LatencyFirst(quantum=self.waiting.quantum)
        self._step_tokens = 0  # of the step last scheduled, for latency.cost
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}
        self.finished_req_ids: list[str] = []  # to tell the runner next step
        self.num_preemptions = 0
        self.step_id = 0
        self._constrained: list[Request] = []  # sampling rows with a grammar, this step
        self._timed: tuple[int, bool] | None = None  # (decode rows, speculated) of a pure step
        self._admitted = False  # the last step admitted a prompt from the queue
        self._init_tier(tier)
        self._init_ahead()

    # ---------------------------------------------------------------- intake
    def check_group(self, group: list[Request]) -> None:
        """The checks that need no queue state (callers run them synchronously, before
        the engine actor sees the request)."""
        check_group(group, self.config.max_model_len, self.config.max_num_seqs)

    def add_request(self, group: list[Request]) -> None:
        """Queue a request (group[0]) and, for n > 1, its other samples, which are forked
        from it once its prompt is computed."""
        parent = group[0]
        self.check_group(group)
        if parent.group_id in self.groups:
            raise RequestRejected(f"request id {parent.group_id!r} is already in use")
        for r in group:
            if r.req_id in self.requests:
                raise RequestRejected(f"request id {r.req_id!r} is already in use")
        parent.fork_ids = [r.req_id for r in group[1:]]
        for child in group[1:]:
            child.status = RequestStatus.WAITING_FOR_PARENT
        limit = self.config.max_model_len
        for r in group:
            self.requests[r.req_id] = r
            r.length_limit = min(r.prompt_len + r.max_tokens, limit)
        self.groups[parent.group_id] = group
        if self.waiting.fair:
            self.latency.busy(parent.tenant)
        self.waiting.append(parent)

    def abort(self, group_id: str) -> list[RequestUpdate]:
        """End every live sequence of a request; frees their blocks now."""
        group = self.groups.get(group_id)
        if not group:
            return []
        updates = []
        for r in group:
            if r.status.finished:
                continue
            self._unqueue(r)
            self._finish(r, RequestStatus.FINISHED_ABORTED)
            updates.append(self._update(r, []))
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_pending)

    def _unqueue(self, r: Request) -> None:
        if r.status == RequestStatus.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(r)
        elif r.status == RequestStatus.WAITING_FOR_REMOTE:
            self.remote_pending.pop(r.req_id, None)

    # ---------------------------------------------------------------- schedule
    def schedule(self, *, defer_masks: bool = False) -> SchedulerOutput:
        """One step: running requests first (decodes, then partly computed prompts), then
        admissions from the waiting queue, all inside one token budget.  defer_masks:
        leave the grammar masks to `fill_masks` (the engine runs it off the event loop)."""
        self._constrained = []
        self.kv.pins.expire()
        step = self._plan_step(latency_first=True)
        ran = step.scheduled or (step.decodes is not None and step.decodes.req_ids)
        if step.limit is not None and not ran and (self.running or self.waiting):
            # The latency-first limits left nothing to run (the sparse tenant's request
            # cannot get a seat the backlogged ones hold, and they may not decode): a step
            # without them, or the engine would wait for work that never comes.
            step = self._plan_step(latency_first=False)
        so = self._step_output(step)
        if self.waiting.fair:
            if step.present:
                self._note_use(step.present, so)
            self._step_tokens = so.num_scheduled_tokens
        if not defer_masks:
            self.fill_masks(so)
        return so

    @property
    def needs_masks(self) -> bool:
        """The step just scheduled has constrained rows whose masks are not filled yet."""
        return bool(self._constrained)

    def fill_masks(self, so: SchedulerOutput) -> None:
        """The grammar masks of the step just scheduled.  Reads only those requests'
        matchers, which nothing else touches until the step's update, so it may run on
        another thread while the engine task waits for it."""
        constrained, self._constrained = self._constrained, []
        if not constrained:
            return
        drafted = {sr.req_id: sr for sr in so.scheduled if sr.draft_ids}
        # A draft model's or Medusa's chunks get theirs in the executor once drafted
        # (draft_walk, draft_tree).
        later = {sr.req_id for sr in so.scheduled if sr.num_draft and not sr.draft_ids}
        plain = [r for r in constrained if r.req_id not in drafted and r.req_id not in later]
        masks = bitmasks([r.grammar for r in plain])  # type: ignore[misc]
        # No mask for a matcher in error: its request ends on update with the reason.
        so.grammar_bitmasks.update(
            (r.req_id, m) for r, m in zip(plain, masks, strict=True) if m is not None
        )
        for r in constrained:
            if (sr := drafted.get(r.req_id)) is None:
                continue
            m, keep = _draft_masks(r.grammar, sr.draft_ids)  # type: ignore[arg-type]
            if m is None:
                continue
            if m:  # (b"": the grammar leaves every row free)
                so.grammar_bitmasks[r.req_id] = m
            if keep < sr.num_draft:
                # A draft the grammar refuses can never be accepted: none past it is
                # verified (its KV slots are trimmed on update, as rejected drafts' are).
                sr.draft_ids, sr.num_draft = sr.draft_ids[:keep], keep

    def _plan_step(self, latency_first: bool) -> _StepPlan:
        """What one step runs: fair shares and (latency_first) their limits first, then
        running requests, then admissions."""
        step = _StepPlan(budget=self.config.max_num_batched_tokens)
        if self.waiting.fair:
            self._fair_plan(step, latency_first)
            if step.fair is not None and step.fair.starved(self.waiting.tenants()):
                # A tenant under its share of the running set gets in first, within its
                # share of the step's prompt tokens, taking room from over-share tenants.
                self._admit_waiting(step, early=True)
        self._schedule_running(step)
        if step.early:
            self.running += step.early
            self._timed = None
        # No admissions in a step that preempted: the pool is already short.
        self._admitted = False
        if not step.preempted:
            left = step.budget
            self._admit_waiting(step)
            if step.budget != left:
                self._timed = None  # a prompt chunk rides along: not a pure decode step
                self._admitted = True
        return step

    def _schedule_running(self, step: _StepPlan) -> None:
        plans = self._plan_drafts(step.budget)
        rest = self.running if step.limit is None else self._limited_rows(step.limit)
        # Plain decodes in bulk first (a speculating step proposes drafts for each).
        if not plans and (taken := self._schedule_columnar(step.budget, rest)) is not None:
            step.decodes, rest = taken
            step.budget -= len(step.decodes.req_ids)
            if step.limit is not None:
                self._charge_limits(step.limit)
        # Decodes first, then partly computed prompts: a long prompt never delays a decode.
        order: list[Request] = []
        chunks: list[Request] = []
        for r in rest:
            (order if len(r.token_ids) - r.num_computed_tokens == 1 else chunks).append(r)
        order += chunks
        allocate = self.kv.allocate_slots
        running = RequestStatus.RUNNING
        copies, scheduled, new_reqs, done = step.copies, step.scheduled, step.new_reqs, step.done
        fair, limit = step.fair, step.limit
        for req in order:
            if step.budget <= 0:
                break
            if req.status != running:
                continue  # preempted earlier in this pass
            n = self._running_tokens(req, step)
            if n <= 0:
                continue
            drafts: list[int] | None = None
            num_draft = 0
            if (plan := plans.get(req.req_id)) is not None and n == 1:
                # Planned against the whole budget; what is left of it caps the drafts.
                room = self._spec_room(req, step.budget)
                if limit is not None and req.tenant in limit:
                    room = min(room, limit[req.tenant] - 1)
                num_draft = max(0, min(plan[1], room))
                drafts = plan[0][:num_draft]
            while allocate(req, n + num_draft, copies) is None:
                victim = self._newest_unscheduled(step, req)
                self._preempt(victim)
                step.preempted = True
                if victim is req:
                    break
            if req.status != running:
                continue
            self._schedule(req, n, scheduled, new_reqs, drafts, num_draft)
            done.add(req.req_id)
            step.budget -= n + num_draft
            if fair is not None and n > 1:
                fair.tokens[req.tenant] -= n
            if limit is not None and req.tenant in limit:
                limit[req.tenant] -= n + num_draft

    def _running_tokens(self, req: Request, step: _StepPlan) -> int:
        """Tokens a running request takes this step: what it has left, within the budget,
        its tenant's share of the prompt tokens (a chunk) and its tenant's latency-first
        limit (0: none this step)."""
        n = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
        if step.fair is not None and n > 1:
            n = min(n, step.fair.tokens[req.tenant])
        if step.limit is not None and req.tenant in step.limit:
            n = min(n, step.limit[req.tenant])
        return n

    def _plan_drafts(self, budget: int) -> dict[str, tuple[list[int], int]]:
        """Each speculating decode's (drafts, slots), or none when this step should not
        speculate (spec.StepCostPolicy weighs its measured cost against the tokens the
        rows' acceptance rates promise).  Also notes what the step is, for its timing."""
        spec = self.spec
        self._timed = None
        if spec is None or not spec.enabled_for_step(len(self.running) + len(self.waiting)):
            return {}
        decodes = [r for r in self.running if len(r.token_ids) - r.num_computed_tokens == 1]
        # A step with a prompt chunk in it is not timed (observe_step_time): a running
        # prompt, or one admitted from the queue after this plan (likely while the last
        # step admitted one; a queue held back by the KV pool admits none).
        timed = len(decodes) == len(self.running) and not (self.waiting and self._admitted)
        if decodes and spec.policy.plain_for_sure(len(decodes), 1.0 + spec.k, timed):
            if len(decodes) == len(self.running):
                self._timed = (len(decodes), False)
            return {}
        wanted: list[tuple[Request, int]] = []
        expected = float(len(decodes))
        worst = 1.0 + spec.k  # the fewest tokens a row is expected to emit
        for req in decodes:
            # A constrained request drafts only where the scheduler proposes the tokens
            # (n-gram) and its matcher's masks cover every position (`drafts`):
            # `fill_masks` walks it through the drafts for a mask at every verify row.
            # A seeded sampling request never drafts: how many uniforms a verify draws
            # depends on its drafts, and whether a step speculates depends on measured
            # time, so its output must not (it equals the output without speculation,
            # under any load).
            k = 0
            if (
                not req.fork_ids
                and not _seeded_sampling(req)
                and (req.grammar is None or self._drafts_constrained(req.grammar))
            ):
                k = spec.wanted(req, self._spec_room(req, budget))
            gain = spec.expected_accepted(req, k) if k else 0.0
            if k:
                wanted.append((req, k))
                expected += gain
            worst = min(worst, 1.0 + gain)
        # Decided before any proposing: a plain step must not pay for n-gram look-ups.
        speculate = bool(wanted) and spec.policy.choose(len(decodes), expected, worst, timed)
        plans: dict[str, tuple[list[int], int]] = {}
        if speculate:
            for req, k in wanted:
                drafts, num_draft = spec.propose(req, k)
                if num_draft:
                    plans[req.req_id] = (drafts, num_draft)
        if decodes and len(decodes) == len(self.running):
            self._timed = (len(decodes), bool(plans))  # a pure decode step: comparable
        return plans

    def observe_step_time(self, seconds: float) -> None:
        """The last scheduled step took `seconds` (execute and update): the speculation
        policy learns from pure decode steps (a prefill chunk would blur the figure); under
        fair shares the step cost model learns from every step."""
        if self.waiting.fair and self._step_tokens:
            self.latency.cost.observe(self._step_tokens, seconds)
        if self.spec is not None and self._timed is not None:
            self.spec.policy.observe(*self._timed, seconds)
            self._timed = None

    def _admit_waiting(self, step: _StepPlan, early: bool = False) -> None:
        """Admissions from the waiting queue into what is left of the step's budget.
        Under fair shares (step.fair) each tenant takes at most its share of the prompt
        tokens, and while a tenant under its share of the running set waits, tenants
        past theirs are passed over.  `early`: only tenants under their share, before the
        running pass, preempting an over-share tenant's newest request when one does not
        fit (vLLM's priority preemption, with the share as the priority)."""
        loras = self._running_loras(step)
        passed: list[Request] = []  # another adapter's, past max_loras: back in line after
        try:
            self._admit_from_queue(step, early, loras, passed)
        finally:
            for req in reversed(passed):
                self.waiting.appendleft(req)

    def _running_loras(self, step: _StepPlan) -> set[str] | None:
        """Under max_loras, the adapters the running requests use (None: unbounded)."""
        if self.config.max_loras is None:
            return None
        return {
            lora
            for r in itertools.chain(self.running, step.early)
            if (lora := r.params.lora) is not None
        }

    def _admit_from_queue(
        self, step: _StepPlan, early: bool, loras: set[str] | None, passed: list[Request]
    ) -> None:
        bs = self.block_size
        q, fair = self.waiting, step.fair
        later: set[str | None] = set()  # early: passed over until the running pass is done
        while q and step.budget > 0:
            if fair is None:
                skip: set | frozenset = frozenset()
                req = q.peek()
            else:
                skip = fair.done | fair.over | later if early else fair.skip(q.tenants())
                if (req := q.peek(skip)) is None:
                    break
            lora = req.params.lora
            if (
                loras is not None
                and lora is not None
                and lora not in loras
                and len(loras) >= self.config.max_loras
            ):
                # vLLM's rule: it waits, and the requests behind it go on.
                q.remove(req)
                passed.append(req)
                continue
            cap = step.budget if fair is None else min(step.budget, fair.tokens[req.tenant])
            if step.limit is not None and req.tenant in step.limit:
                cap = min(cap, step.limit[req.tenant])
            if early and fair is not None:
                # Only what the tenant's own running requests leave of its share: a new
                # request started ahead of them would take their tokens, and under tight
                # latency-first limits every step then began one more prompt of that
                # tenant and finished none.
                chunks, decodes = step.held.get(req.tenant, (0, 0))
                cap = min(cap, fair.tokens[req.tenant] - chunks)
                if step.limit is not None and req.tenant in step.limit:
                    cap = min(cap, step.limit[req.tenant] - chunks - decodes)
                if cap <= 0:
                    later.add(req.tenant)
                    continue
            seqs = 1 + len(req.fork_ids)
            if cap <= 0 or len(self.running) + len(step.early) + seqs > self.config.max_num_seqs:
                if fair is None:
                    break
                if cap > 0 and early and self._fair_preempt(fair, req.tenant, True):
                    continue
                fair.done.add(req.tenant)
                continue
            # Prompt logprobs and pooling over positions need every prompt position
            # computed: no prefix hits.
            hits = [] if req.params.reads_every_position else self.kv.get_computed_blocks(req)
            local, remote = len(hits), 0
            if req.remote_payloads:
                # Blocks the shared tier holds, contiguous with the local hits.
                end = min(req.remote_start + len(req.remote_payloads), (req.num_tokens - 1) // bs)
                if req.remote_start <= local < end:
                    remote = end - local
            num_hit = (local + remote) * bs
            n = min(req.num_tokens - num_hit, cap)
            fresh = self.kv.allocate_slots(
                req, n, step.copies, hits, num_external_tokens=remote * bs
            )
            if fresh is None:
                if fair is None:
                    break
                if not (early and self._fair_preempt(fair, req.tenant, False)):
                    fair.done.add(req.tenant)
                continue
            popped = q.popleft(skip)
            assert popped is req
            for i in range(remote):
                payload = req.remote_payloads[local - req.remote_start + i]
                step.load_kv.append(KVBlockPayload(block_id=fresh[i].block_id, data=payload))
            req.remote_payloads = []
            self.kv.record_prefix_lookup(req.num_tokens, local * bs)
            self.prefix_hits_remote += remote * bs
            self._note_hits(req, hits)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            (step.early if early else self.running).append(req)
            self._count_running(req, 1)
            if loras is not None and lora is not None:
                loras.add(lora)
            if fair is not None:
                fair.admitted(req.tenant, seqs, len(self.kv.blocks_of(req.req_id)), n)
            if step.limit is not None and req.tenant in step.limit:
                step.limit[req.tenant] -= n
            if q.fair:
                self.latency.admitted(req.tenant, req.num_tokens - num_hit)
            self._schedule(req, n, step.scheduled, step.new_reqs)
            step.done.add(req.req_id)
            step.budget -= n

    # ---------------------------------------------------------------- fair shares
    def _count_running(self, req: Request, d: int) -> None:
        seqs = self.tenant_seqs
        n = seqs.get(req.tenant, 0) + d
        if n:
            seqs[req.tenant] = n
        else:
            del seqs[req.tenant]

    def _fair_plan(self, step: _StepPlan, latency_first: bool = True) -> None:
        """Fair shares for this step (step.fair, when two or more tenants have work) and
        the latency-first limits (step.limit, when a sparse tenant, with work or between
        requests, shares the server with a backlogged one)."""
        work = set(self.tenant_seqs)
        work.update(self.waiting.tenants())
        between = self.latency.lingering()
        if len(work | between) < 2:
            return
        load = self._tenant_load(work)
        q, budget = self.waiting, step.budget
        _, _, chunks, decodes = load
        weights = {t: q.weight(t) for t in work | between}
        # Counted past the budget, up to where a backlog cannot pass for a quantum.
        cap = budget + int(q.quantum * max(weights.values())) + 1
        asks = {t: decodes[t] + chunks[t] + q.demand(t, cap) for t in work}
        asks.update((t, 0) for t in between if t not in work)
        step.present = set(asks)
        step.held = {t: (chunks[t], decodes[t]) for t in work}
        sparse = self.latency.sparse(asks, weights)
        need = {t: min(budget, n) for t, n in asks.items()}
        limit = self.latency.limits(sparse, need, weights, budget) if latency_first else None
        step.limit = limit
        if len(work) > 1:
            if limit is not None:  # the decodes the limits leave out free prompt tokens
                decodes = {t: min(d, limit.get(t, d)) for t, d in decodes.items()}
            step.fair = self._tenant_shares(budget, work, (*load[:3], decodes))

    def _tenant_load(self, tenants: set[str | None]) -> tuple[dict, dict, dict, dict]:
        """Per tenant with work: (running sequences, blocks they hold, prompt tokens their
        running chunks have left, their decodes)."""
        seats = dict.fromkeys(tenants, 0)
        blocks = dict.fromkeys(tenants, 0)
        chunks = dict.fromkeys(tenants, 0)
        decodes = dict.fromkeys(tenants, 0)
        table = self.kv.req_block_ids
        for r in self.running:
            t = r.tenant
            seats[t] += 1
            blocks[t] += len(table.get(r.req_id, ()))
            left = len(r.token_ids) - r.num_computed_tokens
            if left > 1:
                chunks[t] += left
            else:
                decodes[t] += 1
        return seats, blocks, chunks, decodes

    def _tenant_shares(
        self, budget: int, tenants: set[str | None], load: tuple[dict, dict, dict, dict]
    ) -> TenantShares:
        """This step's shares: the prompt tokens (the budget after the decodes) split by
        weight across what each tenant's prompt chunks and waiting requests could use, and
        what each holds of the running set."""
        q = self.waiting
        seats, blocks, chunks, decodes = load
        prefill = max(budget - sum(decodes.values()), 0)
        weights = {t: q.weight(t) for t in tenants}
        demand = {t: chunks[t] + q.demand(t, prefill) for t in tenants}
        return TenantShares.build(
            weights,
            split_budget(prefill, demand, weights),
            dict(seats),
            blocks,
            self.config.max_num_seqs,
            self.kv.pool.num_blocks,
        )

    def _limited_rows(self, limit: dict[str | None, int]) -> list[Request]:
        """The running requests a latency-first step may take: every row of a tenant
        without a limit, the oldest rows of a limited tenant up to its limit (each takes
        at least a token)."""
        left = dict(limit)
        rows = []
        for r in self.running:
            t = r.tenant
            if t in left:
                if left[t] <= 0:
                    continue
                left[t] -= 1
            rows.append(r)
        return rows

    def _charge_limits(self, limit: dict[str | None, int]) -> None:
        """The columnar rows just taken count against their tenants' limits."""
        for r in self._col_rows[self.step_id + 1]:
            if r.tenant in limit:
                limit[r.tenant] -= 1

    def _note_use(self, present: set[str | None], so: SchedulerOutput) -> None:
        """What this step gives each tenant counts toward its quantum (LatencyFirst)."""
        use = dict.fromkeys(present, 0)
        if so.decodes.req_ids:
            for r in self._col_rows[so.step]:
                if r.tenant in use:
                    use[r.tenant] += 1
        requests = self.requests
        for sr in so.scheduled:
            if (r := requests.get(sr.req_id)) is not None and r.tenant in use:
                use[r.tenant] += len(sr.input_ids) + sr.num_draft
        for t, n in use.items():
            if n:
                self.latency.served(t, n)

    def _note_group_done(self, req: Request) -> None:
        """A request group ended: its tenant, if now without work, lingers (LatencyFirst)."""
        t = req.tenant
        if t not in self.tenant_seqs and not self.waiting.count(t):
            self.latency.went_idle(t)

    def _fair_preempt(self, fair: TenantShares, t: str | None, short_of_seats: bool) -> bool:
        """Preempt a running request of the tenant most past its share of the seats (or
        the blocks), to make room for tenant `t`: its lowest `priority`, newest first, as
        vLLM's priority policy picks; False when no tenant is past its share."""
        v = fair.victim_tenant(t, short_of_seats)
        theirs = (r for r in self.running if r.tenant == v)
        victim = max(theirs, key=lambda r: (r.priority, r.arrival_time), default=None)
        if v is None or victim is None:  # (none of v's admitted before the running pass)
            return False
        fair.preempted(v, len(self.kv.blocks_of(victim.req_id)))
        self._preempt(victim)
        self.num_fair_preemptions += 1
        return True

    def _step_output(self, step: _StepPlan) -> SchedulerOutput:
        finished, self.finished_req_ids = self.finished_req_ids, []
        self.step_id += 1
        return SchedulerOutput(
            step=self.step_id,
            new_requests=step.new_reqs,
            scheduled=step.scheduled,
            decodes=step.decodes or DecodeColumns(),
            finished_req_ids=finished,
            copy_blocks=step.copies,
            load_kv=step.load_kv,
            save_kv_blocks=self._blocks_to_save(),
            grammar_bitmasks={},
        )

    def _drafts_constrained(self, grammar: GrammarMatcher) -> bool:
        """A constrained request may draft: its drafts are the scheduler's (n-gram), or a
        draft model's or Medusa tree's in an executor that walks the grammar through them
        (executor_masks)."""
        spec = self.spec
        return (
            spec is not None
            and (not spec.in_executor or self.executor_masks)
            and getattr(grammar, "drafts", False)
        )

    def draft_tree(self, req_id: str, tokens: list[int], parents: list[int]) -> bytes | None:
        """For Medusa in the executor: a constrained request's masks for its candidate
        tree's verify rows (tree_masks), or None (no grammar, or a matcher that failed).
        Walked on the executor's thread while this step runs, as draft_walk."""
        req = self.requests.get(req_id)
        if req is None or req.grammar is None:
            return None
        return tree_masks(req.grammar, tokens, parents)

    def draft_walk(self, req_id: str) -> DraftWalk | None:
        """For a draft model in the executor: a constrained request's matcher to draft
        under (its verify rows' masks come out of the walk), or None for a request without
        a grammar.  Walked on the executor's thread while this step runs, which is when
        nothing else touches the step's matchers."""
        req = self.requests.get(req_id)
        if req is None or req.grammar is None:
            return None
        return DraftWalk(req.grammar)

    def _spec_room(self, req: Request, budget: int) -> int:
        """Most draft tokens a decoding request can verify this step: the token budget
        after its one sure token, and room for every draft plus the bonus token within
        max_tokens and max_model_len."""
        return min(
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )

    def _schedule(
        self,
        req: Request,
        n: int,
        scheduled: list[ScheduledRequest],
        new_reqs: list[NewRequestData],
        drafts: list[int] | None = None,
        num_draft: int = 0,
    ) -> None:
        # Runs for every scheduled request of every step: the rare cases (forks, drafts,
        # registration, grammars) are each behind one cheap test.
        s = req.num_computed_tokens
        sample = s + n == len(req.token_ids)
        kept, new_blocks = self.kv.take_table_delta(req.req_id)
        sr = ScheduledRequest(
            req_id=req.req_id,
            input_ids=req.token_ids[s : s + n],
            start_pos=s,
            new_block_ids=new_blocks,
            num_kept_blocks=kept,
            sample=sample,
        )
        scheduled.append(sr)
        # From the next step on it can take the columnar path: a plain decode whose last
        # block (just allocated, or copied on write) is its own.
        req.columnar = (
            sample and n == 1 and req.plain and not num_draft and not req.fork_ids
            and s >= req.prompt_len
        )  # fmt: skip
        if num_draft:
            sr.draft_ids, sr.num_draft = drafts or [], num_draft
        if req.publish_prefix and s < req.prompt_len:
            self._note_registration(req, s + n)
        if not req.registered:
            new_reqs.append(self._new_request_data(req))
        if not sample:
            return
        if req.grammar is not None:
            self._constrained.append(req)
        if req.fork_ids:
            sr.fork_ids = list(req.fork_ids)
            for cid in req.fork_ids:
                child = self.requests[cid]
                if not child.registered:
                    new_reqs.append(self._new_request_data(child))
                if child.grammar is not None:
                    self._constrained.append(child)

    @staticmethod
    def _new_request_data(req: Request) -> NewRequestData:
        req.registered = True
        return NewRequestData(
            req_id=req.req_id,
            prompt_len=req.prompt_len,
            token_ids=list(req.token_ids),
            sampling=req.params,
            sample_index=req.sample_index,
        )

    def _newest_unscheduled(self, step: _StepPlan, for_req: Request | None = None) -> Request:
        done = step.done
        if step.decodes is not None and step.decode_ids is None:
            step.decode_ids = set(step.decodes.req_ids)
        cols = step.decode_ids or ()
        if (fair := step.fair) is not None and for_req is not None:
            # An over-share tenant's request goes first, unless it is the one short of room.
            over = fair.over - {for_req.tenant}
            for r in reversed(self.running):
                if r.tenant in over and r.req_id not in done and r.req_id not in cols:
                    return r
        for r in reversed(self.running):
            if r.req_id not in done and r.req_id not in cols:
                return r
        raise AssertionError("nothing left to preempt")  # pragma: no cover

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it recomputes later (prefix hits permitting)."""
        self.running.remove(req)
        self._count_running(req, -1)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.columnar = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- update
    def update_from_output(self, so: SchedulerOutput, mo: ModelOutput) -> StepUpdates:
        """Advance every scheduled request by what the step computed and sampled."""
        toks, logprobs, prompt_lps = mo.sampled_token_ids, mo.logprobs, mo.prompt_logprobs
        requests, running = self.requests, RequestStatus.RUNNING
        updates: list[RequestUpdate] = []
        for rid, why in mo.errors.items():
            # A failure the runner pinned on one request ends that request alone.
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                self._fail(req, why, updates)
        go_reqs: list[Request] = []
        go_toks: list[int] = []
        if so.decodes.req_ids:
            go_reqs, go_toks, sampled = self._update_columnar(so, mo, updates)
            sampled = sampled or {}
        else:
            sampled = {rid: i for i, rid in enumerate(mo.req_ids)}
        for sr in so.scheduled:
            req = requests.get(sr.req_id)
            if req is None or req.status != running:
                continue  # aborted or preempted while the step ran
            req.num_computed_tokens += len(sr.input_ids)
            if prompt_lps and (plp := prompt_lps.get(req.req_id)) and not req.prompt_logprobs_sent:
                # A recompute after preemption sends them again: keep the first copy.
                room = req.prompt_len - 1 - len(req.prompt_logprobs)
                req.prompt_logprobs += plp[: max(room, 0)]
            if not sr.sample:
                continue
            if sr.num_draft:
                i = sampled[req.req_id]
                lp = logprobs[i] if logprobs else None
                updates.append(self._apply_verified(req, sr, mo, mo.sampled_token_ids[i], lp))
                continue
            if sr.fork_ids:
                # Fork before the parent can finish and free the shared prompt blocks.
                self._fork_children(req, sr, mo, sampled, updates)
            i = sampled[req.req_id]
            update = self._append_token(req, toks[i], logprobs and logprobs[i])
            if mo.embeddings:
                update.embedding = mo.embeddings.get(req.req_id)
            updates.append(update)
        self._settle_ahead(so.step + 1)
        return StepUpdates(updates, go_reqs, go_toks)

    def _fork_children(
        self,
        req: Request,
        sr: ScheduledRequest,
        mo: ModelOutput,
        sampled: dict[str, int],
        updates: list[RequestUpdate],
    ) -> None:
        logprobs = mo.logprobs
        for cid in sr.fork_ids:
            child = self.requests.get(cid)
            if child is None or child.status != RequestStatus.WAITING_FOR_PARENT:
                continue
            self.kv.fork(req, child)
            child.num_computed_tokens = req.num_computed_tokens
            child.first_scheduled_time = req.first_scheduled_time
            child.num_cached_tokens = req.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._count_running(child, 1)
            i = sampled[cid]
            updates.append(
                self._append_token(child, mo.sampled_token_ids[i], logprobs and logprobs[i])
            )
        req.fork_ids = []

    def _append_token(self, req: Request, tok: int, lp: TokenLogprobs | None) -> RequestUpdate:
        grammar, params = req.grammar, req.params
        if grammar is not None and (why := self._grammar_refuses(grammar, tok)):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            update = self._update(req, [], error=why)
            update.client_error = True
        else:
            self._push_token(req, tok)
            update = self._update(req, [tok], [lp] if params.logprobs is not None else None)
        if params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            update.prompt_logprobs = req.prompt_logprobs
        return update

    def _apply_verified(
        self,
        req: Request,
        sr: ScheduledRequest,
        mo: ModelOutput,
        bonus: int,
        bonus_lp: TokenLogprobs | None,
    ) -> RequestUpdate:
        """A verify chunk came back: keep the accepted drafts and the bonus token, roll
        the rest back (their KV slots are reused; blocks holding only them are freed)."""
        accepted = mo.spec_accepted.get(req.req_id, [])
        assert len(accepted) <= sr.num_draft
        assert self.spec is not None
        self.spec.observe(req, sr.num_draft, len(accepted))
        if req.prediction is not None:
            req.prediction.settle(sr.num_draft, len(accepted))
        # The accepted drafts' KV was computed in this step; the bonus token's is not.
        req.num_computed_tokens += len(accepted)
        lps = [*mo.spec_logprobs.get(req.req_id, [None] * len(accepted)), bonus_lp]
        toks: list[int] = []
        out_lps: list[TokenLogprobs | None] = []
        grammar = req.grammar
        for tok, lp in zip([*accepted, bonus], lps, strict=True):
            if grammar is not None and (why := self._grammar_refuses(grammar, tok)):
                self._finish(req, RequestStatus.FINISHED_ERROR)
                lps_kept = out_lps if req.params.logprobs is not None else None
                update = self._update(req, toks, lps_kept, error=why)
                update.client_error = True
                return update
            toks.append(tok)
            out_lps.append(lp)
            if self._push_token(req, tok) is not None:
                break  # a stop token or the length limit: the rest is discarded
        if not req.status.finished:
            req.columnar = False  # the runner's table loses its rejected drafts' blocks
            self.kv.trim(req, req.num_computed_tokens)
        return self._update(req, toks, out_lps if req.params.logprobs is not None else None)

    def _push_token(self, req: Request, tok: int) -> RequestStatus | None:
        """Append one generated token; finish the request if it ends here."""
        req.token_ids.append(tok)
        return self._check_end(req, tok)

    def _check_end(self, req: Request, tok: int) -> RequestStatus | None:
        """Finish the request if its last token, `tok`, ends it."""
        grammar = req.grammar
        n_out = len(req.token_ids) - req.prompt_len
        status = None
        if grammar is not None and grammar.terminated:
            # The grammar is complete (e.g. the JSON closed): stop now rather than spend a
            # step on the end-of-text token, which is all it would allow (min_tokens and
            # ignore_eos cannot extend a finished grammar).
            status = RequestStatus.FINISHED_STOPPED
            if tok in req.stop_ids:
                req.stop_token_id = tok
        elif tok in req.stop_ids and n_out >= req.params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_token_id = tok
        elif n_out >= req.max_tokens or len(req.token_ids) >= self.config.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)
        return status

    @staticmethod
    def _grammar_refuses(grammar: GrammarMatcher, tok: int) -> str | None:
        """Why a constrained request cannot take `tok` (a dead end), or None."""
        err = grammar.error()
        if err is None and not grammar.accept(tok):
            err = grammar.error() or f"token {tok} is not allowed here"
        return None if err is None else f"structured output: the grammar cannot go on ({err})"

    def _update(
        self,
        req: Request,
        toks: list[int],
        lps: list[TokenLogprobs | None] | None = None,
        error: str | None = None,
    ) -> RequestUpdate:
        return request_update(req, toks, lps, error)

    def _fail(self, req: Request, why: str, updates: list[RequestUpdate]) -> None:
        """End a request with an error; children still waiting for it (n > 1) end too,
        since they would fork from a prompt that never sampled."""
        self._unqueue(req)
        self._finish(req, RequestStatus.FINISHED_ERROR, drop_private=True)
        updates.append(self._update(req, [], error=why))
        for cid in req.fork_ids:
            child = self.requests.get(cid)
            if child is not None and child.status == RequestStatus.WAITING_FOR_PARENT:
                self._finish(child, RequestStatus.FINISHED_ERROR)
                updates.append(self._update(child, [], error=f"its parent failed: {why}"))
        req.fork_ids = []

    def finish_external(self, req_id: str, status: RequestStatus) -> RequestUpdate | None:
        """End one sequence for a reason found outside the engine (e.g. a stop string)."""
        req = self.requests.get(req_id)
        if req is None or req.status.finished:
            return None
        self._unqueue(req)
        self._finish(req, status)
        return self._update(req, [])

    def _finish(self, req: Request, status: RequestStatus, drop_private: bool = False) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._count_running(req, -1)
        if req.conversation is not None:
            self._end_turn(req, status)
        self.kv.free(req, drop_private=drop_private)
        req.status = status
        req.finish_reason = FINISH_REASONS[status]
        if req.registered:
            self.finished_req_ids.append(req.req_id)
        del self.requests[req.req_id]
        group = self.groups.get(req.group_id)
        if group is not None and all(r.status.finished for r in group):
            del self.groups[req.group_id]
            if self.waiting.fair:
                self._note_group_done(req)

    # ---------------------------------------------------------------- stats
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            prefix_hits_remote=self.prefix_hits_remote,
            spec=self.spec.stats if self.spec is not None else None,
            pins=self.kv.pins.snapshot(),
        )
