"""The waiting queue: weighted fair shares across tenants (API keys), priority within one.

First come, first served across keys lets one key that queues hundreds of long requests
make every other key wait behind all of them.  Here each tenant has its own queue,
ordered by (`priority`, arrival) as vLLM orders its priority policy (lower first), and
admission picks between tenants by deficit round robin on tokens: a tenant's turn adds
`quantum x weight` tokens to its deficit, and it is served while its deficit covers its
next request's prompt tokens.  Over time each backlogged tenant gets prompt tokens in
proportion to its weight, whatever the size or number of its requests, and a tenant
with one short request waits at most about one turn of the others.  A tenant whose
queue empties leaves the round and loses its deficit (no credit is banked while idle).

A preempted request goes back to the head of its own tenant's line (with `fair=False`,
the one line's: first come, first served, priority still honoured): it is its tenant's
oldest work, but the recompute costs tokens again, so it waits for its tenant's turn
like any other request.  Otherwise preempting an over-share tenant's request to make
room for another tenant would hand the room straight back to it.

Admission order alone is not a fair share once requests run: `split_budget` splits a
step's prompt tokens across tenants (scheduler/scheduler.py applies it, and preempts an
over-share tenant's newest request when another tenant under its share cannot get in).
Nor is it low latency for a key that sends one short request at a time: `LatencyFirst`
sizes every step for such a *sparse* key while it shares the server with a backlogged
one, from the step cost the engine measures (`StepCost`).
"""

from __future__ import annotations

import bisect
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from scheduler.request import Request

QUANTUM_TOKENS = 256
# How long a key that goes idle keeps its sparse claim on short steps: about a chat
# user's pause between turns (LatencyFirst).
LINGER_S = 10.0
# StepCost: a step timed past this many times the fit's figure counts as this many.
OUTLIER = 3.0
_NONE = object()  # _turn: every waiting tenant is skipped


def _order(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival_time


class FairQueue:
    def __init__(
        self,
        weights: dict[str, float] | None = None,
        fair: bool = True,
        quantum: int = QUANTUM_TOKENS,
    ) -> None:
        self.weights = dict(weights or {})
        self.fair = fair
        self.quantum = quantum
        self.front: deque[Request] = deque()
        self.queues: dict[str | None, list[Request]] = {}
        self.ring: deque[str | None] = deque()  # tenants with requests, in turn order
        self.deficit: dict[str | None, float] = {}
        self._size = 0

    def _tenant(self, r: Request) -> str | None:
        return r.tenant if self.fair else None

    def _share(self, t: str | None) -> float:
        return self.quantum * (self.weights.get(t, 1.0) if t is not None else 1.0)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        yield from self.front
        for q in self.queues.values():
            yield from q

    def count(self, tenant: str | None) -> int:
        """Requests of `tenant` waiting (the front line included)."""
        if self.fair:
            return sum(1 for r in self.front if r.tenant == tenant) + len(
                self.queues.get(tenant, ())
            )
        return sum(1 for r in self if r.tenant == tenant)

    # ---------------------------------------------------------------- queueing
    def append(self, r: Request) -> None:
        """Queue a new request (or one back from a prefix look-up) in its tenant's line."""
        t = self._tenant(r)
        q = self.queues.get(t)
        if q is None:
            q = self.queues[t] = []
            self.ring.append(t)
            self.deficit[t] = 0.0
        if not q or _order(q[-1]) <= _order(r):
            q.append(r)
        else:
            bisect.insort_right(q, r, key=_order)
        self._size += 1

    def appendleft(self, r: Request) -> None:
        """A preempted request: first in its tenant's line (fair), or first of all."""
        if not self.fair:
            self.front.appendleft(r)
            self._size += 1
            return
        t = self._tenant(r)
        if t not in self.queues:
            self.append(r)
            return
        self.queues[t].insert(0, r)
        self._size += 1

    def remove(self, r: Request) -> None:
        """Take a request out wherever it waits (ValueError if it does not)."""
        try:
            self.front.remove(r)
        except ValueError:
            t = self._tenant(r)
            q = self.queues.get(t)
            if q is None:
                raise
            q.remove(r)
            if not q:
                self._leave(t)
        self._size -= 1

    def _leave(self, t: str | None) -> None:
        del self.queues[t]
        del self.deficit[t]
        self.ring.remove(t)

    def weight(self, t: str | None) -> float:
        return self.weights.get(t, 1.0) if t is not None else 1.0

    def tenants(self) -> list[str | None]:
        """The tenants with requests waiting (fair; with fcfs the one line, None)."""
        return list(self.ring)

    def demand(self, t: str | None, cap: int) -> int:
        """Prompt tokens `t`'s waiting requests hold, counted up to `cap`."""
        total = 0
        for r in self.queues.get(t, ()):
            total += r.num_tokens - r.num_computed_tokens
            if total >= cap:
                return cap
        return total

    # ---------------------------------------------------------------- admission
    def peek(self, skip: set | frozenset = frozenset()) -> Request | None:
        """The request admission should take next (the same one until it is popped),
        passing over the tenants in `skip`; None when only they wait."""
        if self.front:
            return self.front[0]
        t = self._turn(skip)
        return None if t is _NONE else self.queues[t][0]

    def popleft(self, skip: set | frozenset = frozenset()) -> Request:
        """Take the request `peek(skip)` named, charging its tenant its prompt tokens."""
        if self.front:
            self._size -= 1
            return self.front.popleft()
        t = self._turn(skip)
        assert t is not _NONE, "nothing to pop"
        self._size -= 1
        q = self.queues[t]
        r = q.pop(0)
        if len(self.ring) > 1:  # alone, a tenant owes no one: it joins the next round even
            self.deficit[t] -= r.num_tokens
        if not q:
            self._leave(t)
        return r

    def _turn(self, skip: set | frozenset = frozenset()) -> str | object | None:
        """The tenant whose head request its deficit covers, giving the next tenants
        their quantum in turn until one is found; tenants in `skip` are passed over and
        get no quantum.  _NONE when every waiting tenant is skipped."""
        ring, deficit, queues = self.ring, self.deficit, self.queues
        if not skip or not any(t in skip for t in ring):
            if len(ring) == 1:
                return ring[0]  # no one to be fair to
            skip = frozenset()
        else:
            live = [t for t in ring if t not in skip]
            if len(live) <= 1:
                return live[0] if live else _NONE
        for attempt in range(2):
            # The second pass goes one turn further: the head it starts at had its quantum
            # before `_skip_rounds` counted, so it is served only after its next one.
            for _ in range(len(ring) + attempt):
                t = ring[0]
                if t not in skip and deficit[t] >= queues[t][0].num_tokens:
                    return t
                ring.rotate(-1)
                if ring[0] not in skip:
                    deficit[ring[0]] += self._share(ring[0])
            if attempt == 0:
                self._skip_rounds(skip)
        raise AssertionError("deficit round robin found no tenant")  # pragma: no cover

    def _skip_rounds(self, skip: set | frozenset) -> None:
        """A whole round served no one (every head costs more than a quantum): add the
        rounds that would pass likewise at once, so the next round serves someone."""
        live = [t for t in self.ring if t not in skip]
        need = min(
            -(-(self.queues[t][0].num_tokens - self.deficit[t]) // self._share(t)) for t in live
        )
        if need > 1:
            for t in live:
                self.deficit[t] += (need - 1) * self._share(t)


def split_budget(
    budget: int, demands: dict[str | None, int], weights: dict[str | None, float]
) -> dict[str | None, int]:
    """Weighted max-min fair split of `budget` tokens: each tenant gets its weight's
    share, a tenant that needs less gets what it needs and the rest goes to the others by
    weight (work-conserving: a tenant alone gets all it can use).  Whole tokens; every
    tenant with demand gets at least one while the budget lasts."""
    out = {t: 0 for t in demands}
    left = budget
    active = {t for t, d in demands.items() if d > 0}
    while left > 0 and active:
        total = sum(weights[t] for t in active)
        fair = {t: left * weights[t] / total for t in active}
        sated = [t for t in active if demands[t] - out[t] <= fair[t]]
        if sated:
            for t in sated:
                left -= demands[t] - out[t]
                out[t] = demands[t]
                active.discard(t)
            continue
        # Everyone wants more than its share: floor the shares, then hand out the tokens
        # the flooring left over one each, heaviest weight first.
        given = 0
        for t in active:
            g = int(fair[t])
            out[t] += g
            given += g
        rest = left - given
        for t in sorted(active, key=lambda t: -weights[t])[:rest]:
            out[t] += 1
        left = 0
    return out


@dataclass
class TenantShares:
    """One step's fair shares across the tenants with work (scheduler/scheduler.py).

    `tokens`: the prompt tokens (prefill chunks and admissions) each tenant may still take
    this step, from `split_budget`.  `seats` / `blocks`: the running sequences and KV
    blocks each holds, against its weight's share of `max_num_seqs` and of the pool;
    `over` are those at or past either share.  While a tenant under its shares waits,
    the over-share tenants are passed over at admission and their newest requests are
    the ones preempted to make room.
    """

    tokens: dict[str | None, int]
    seats: dict[str | None, int]
    blocks: dict[str | None, int]
    seat_share: dict[str | None, float]
    block_share: dict[str | None, float]
    over: set[str | None] = field(default_factory=set)
    done: set[str | None] = field(default_factory=set)  # passed over for the rest of the step

    @classmethod
    def build(
        cls,
        tenants: dict[str | None, float],
        tokens: dict[str | None, int],
        seats: dict[str | None, int],
        blocks: dict[str | None, int],
        max_seqs: int,
        num_blocks: int,
    ) -> TenantShares:
        """`tenants`: weight of each tenant with work; the rest as the fields."""
        total = sum(tenants.values())
        sh = cls(
            tokens=tokens,
            seats=seats,
            blocks=blocks,
            seat_share={t: max(1.0, max_seqs * w / total) for t, w in tenants.items()},
            block_share={t: num_blocks * w / total for t, w in tenants.items()},
        )
        sh.over = {t for t in tenants if sh._over(t)}
        return sh

    def _over(self, t: str | None) -> bool:
        return self.seats[t] >= self.seat_share[t] or self.blocks[t] >= self.block_share[t]

    def starved(self, waiting: Iterable[str | None]) -> bool:
        """Some waiting tenant is under its shares."""
        return any(t not in self.over for t in waiting)

    def skip(self, waiting: Iterable[str | None]) -> set[str | None]:
        """The tenants admission passes over now."""
        return self.done | self.over if self.starved(waiting) else set(self.done)

    def admitted(self, t: str | None, seqs: int, blocks: int, tokens: int) -> None:
        self.seats[t] += seqs
        self.blocks[t] += blocks
        self.tokens[t] -= tokens
        if self._over(t):
            self.over.add(t)

    def victim_tenant(self, t: str | None, short_of_seats: bool) -> str | None:
        """The tenant other than `t` most past its share of what is short, if any is."""
        held, share = (
            (self.seats, self.seat_share) if short_of_seats else (self.blocks, self.block_share)
        )
        best, worst = None, 1.0
        for v in self.seats:
            if v != t and (r := held[v] / share[v]) > worst:
                best, worst = v, r
        return best

    def preempted(self, v: str | None, blocks: int) -> None:
        self.seats[v] -= 1
        self.blocks[v] -= blocks


class StepCost:
    """What a step costs, fitted as `seconds = fixed + per_token x tokens` by least squares
    over the steps the engine timed, older steps weighing less (`memory` a step), so the
    fit follows the load.  The fit is kept only while the steps it rests on vary enough in
    size to tell the two terms apart; until then, and whenever they do not, the last one
    that did stands."""

    def __init__(self, memory: float = 0.99) -> None:
        self.memory = memory
        self._sums = [0.0] * 5  # weight, x, y, xx, xy (x tokens, y seconds)
        self.fixed: float | None = None
        self.per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if self.per_token is not None and self.fixed is not None:
            # A step far slower than the fit says was interrupted (the process descheduled
            # on a busy machine, stopped, swapping): its time says nothing about its size,
            # and one such step at a short size would lift the floor for many steps after.
            # Clipped, not dropped, so a machine that really got slower moves the fit.
            seconds = min(seconds, OUTLIER * (self.fixed + self.per_token * tokens))
        m = self.memory
        s = self._sums
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            s[i] = s[i] * m + v
        w, x, y, xx, xy = s
        var = xx / w - (x / w) ** 2
        # A spread of a tenth of the mean size: below it the slope is mostly noise.
        if var <= 0 or var < (0.1 * x / w) ** 2:
            return
        # No slope: the steps cost what they cost whatever their size (a host-bound or
        # crowded machine), so a short step buys no latency (min_tokens: no floor but
        # the budget's).
        slope = max(0.0, (xy / w - (x / w) * (y / w)) / var)
        self.per_token = slope
        self.fixed = max(0.0, y / w - slope * x / w)

    def min_tokens(self) -> int:
        """The fewest tokens a step should carry for its fixed cost to be at most half of
        it (then the tokens still get at least half the throughput a long step gives
        them); 1 while nothing is fitted (a server whose steps all filled the budget: the
        first short steps give the fit the sizes it needs)."""
        if self.per_token is None or self.fixed is None:
            return 1
        if self.per_token <= 0:
            return sys.maxsize
        return max(1, math.ceil(self.fixed / self.per_token - 1e-6))  # not float noise


@dataclass
class LatencyFirst:
    """Sparse tenants first inside the step (FQ-CoDel's new-flow priority, in tokens).

    Deficit round robin orders admissions, but a step is one batch: a key whose short
    prompt arrives while another key's flood runs waits for the step in flight and then
    rides one as long as the flood makes it.  A tenant is *sparse* while what it has
    been served since it last went idle, plus what it asks now (its prompt, at least),
    stays within one quantum of its weight: a chat key sending one short request at a
    time stays sparse, a flood does not, and a sparse tenant that keeps asking stops
    being one after a quantum, so the priority cannot starve anyone.  While a sparse
    tenant shares the server with backlogged ones, every step is sized for it: as many
    tokens as the largest sparse prompt (the last one each sent), never fewer than
    `StepCost.min_tokens`; the sparse tenants take what they need and the backlogged
    ones split what is left by weight.  A step in flight when a sparse prompt arrives,
    and the step that runs it, then each cost about what that prompt costs alone.  The
    step in flight is the one no policy can shorten after the fact, so a tenant stays
    present for `linger_s` seconds after its last request ends (a chat user's pause
    between turns): its next request finds short steps too, half its last prompt while
    no sparse tenant has work (the step a next prompt waits for).
    """

    quantum: int = QUANTUM_TOKENS
    linger_s: float = LINGER_S
    clock: Callable[[], float] = time.monotonic
    cost: StepCost = field(default_factory=StepCost)
    used: dict[str | None, int] = field(default_factory=dict)  # served this busy period
    prompt: dict[str | None, int] = field(default_factory=dict)  # its last one, uncached
    linger: dict[str | None, float] = field(default_factory=dict)  # present until (clock)

    def lingering(self) -> set[str | None]:
        """Tenants idle between requests, still present."""
        now = self.clock()
        for t in [t for t, until in self.linger.items() if until <= now]:
            del self.linger[t]
            self.prompt.pop(t, None)
        return set(self.linger)

    def admitted(self, t: str | None, prompt: int) -> None:
        """Tenant `t` had a request admitted with `prompt` tokens to compute."""
        self.prompt[t] = max(1, prompt)

    def went_idle(self, t: str | None) -> None:
        """Tenant `t`'s last request ended; it has no other."""
        self.used.pop(t, None)
        if self.linger_s > 0:
            self.linger[t] = self.clock() + self.linger_s
        else:
            self.prompt.pop(t, None)

    def busy(self, t: str | None) -> None:
        self.linger.pop(t, None)

    def served(self, t: str | None, tokens: int) -> None:
        self.used[t] = self.used.get(t, 0) + tokens

    def _want(self, t: str | None, need: int) -> int:
        return max(need, self.prompt.get(t, 0))

    def sparse(self, need: dict[str | None, int], weights: dict[str | None, float]) -> set:
        """The sparse tenants among the present ones.  `need`: tokens each could use this
        step (decodes, prompt chunks, waiting prompts; 0 for one between requests)."""
        quantum, used = self.quantum, self.used
        return {
            t for t, n in need.items() if used.get(t, 0) + self._want(t, n) <= quantum * weights[t]
        }

    def limits(
        self,
        sparse: set[str | None],
        need: dict[str | None, int],
        weights: dict[str | None, float],
        budget: int,
    ) -> dict[str | None, int] | None:
        """The tokens each backlogged tenant may take this step (decodes and prompt tokens
        together), or None when no sparse tenant shares the step with a backlogged one."""
        backlog = {t: n for t, n in need.items() if t not in sparse and n > 0}
        if not sparse or not backlog:
            return None
        want = max(self._want(t, need[t]) for t in sparse)
        if any(need[t] for t in sparse):
            size = min(budget, max(self.cost.min_tokens(), want))
        else:
            # Every sparse tenant is between requests: this step is the one a next prompt
            # would wait for, and then it rides a step of its own as long.  A backlogged
            # tenant's tokens, deep into long prompts beside decodes, cost more each than
            # a fresh prompt's, so a full-sized step here took longer than the prompt's
            # own and the two together past twice its step alone; half the size keeps
            # them under it.  The floor does not apply: no sparse work rides along.
            size = min(budget, max(1, want // 2))
        room = max(0, size - sum(need[t] for t in sparse))
        return split_budget(room, backlog, weights)
