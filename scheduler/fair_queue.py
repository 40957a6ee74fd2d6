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

Preempted requests (and those sent back for recompute) go to a front line served before
any tenant: they were admitted, and charged, once already.  With `fair=False` every
request is one tenant's: first come, first served, priority still honoured.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request

QUANTUM_TOKENS = 256


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
        """A preempted request: first in line, before every tenant."""
        self.front.appendleft(r)
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

    # ---------------------------------------------------------------- admission
    def peek(self) -> Request:
        """The request admission should take next (the same one until it is popped)."""
        if self.front:
            return self.front[0]
        return self.queues[self._turn()][0]

    def popleft(self) -> Request:
        """Take the request `peek` named, charging its tenant its prompt tokens."""
        self._size -= 1
        if self.front:
            return self.front.popleft()
        t = self._turn()
        q = self.queues[t]
        r = q.pop(0)
        if len(self.ring) > 1:  # alone, a tenant owes no one: it joins the next round even
            self.deficit[t] -= r.num_tokens
        if not q:
            self._leave(t)
        return r

    def _turn(self) -> str | None:
        """The tenant whose head request its deficit covers, giving the next tenants
        their quantum in turn until one is found."""
        ring, deficit, queues = self.ring, self.deficit, self.queues
        if len(ring) == 1:
            return ring[0]  # no one to be fair to
        for attempt in range(2):
            for _ in range(len(ring)):
                t = ring[0]
                if deficit[t] >= queues[t][0].num_tokens:
                    return t
                ring.rotate(-1)
                deficit[ring[0]] += self._share(ring[0])
            if attempt == 0:
                self._skip_rounds()
        raise AssertionError("deficit round robin found no tenant")  # pragma: no cover

    def _skip_rounds(self) -> None:
        """A whole round served no one (every head costs more than a quantum): add the
        rounds that would pass likewise at once, so the next round serves someone."""
        need = min(
            -(-(self.queues[t][0].num_tokens - self.deficit[t]) // self._share(t))
            for t in self.ring
        )
        if need > 1:
            for t in self.ring:
                self.deficit[t] += (need - 1) * self._share(t)
