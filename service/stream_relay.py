"""A background response's stream, relayed through the shared store (Redis) so that any
replica resumes it: `GET /v1/responses/{id}?stream=true&starting_after=n` may reach
another replica than the one running the turn (a fleet behind a load balancer).

The running replica's StreamLog hands each event to an EventRelay, which appends it, in
order and batched, to a Redis stream under the tenant's namespace (entry id 0-seq: the
log's own position, so a reader asks for what follows its position and nothing is
numbered twice).  The stream's end is an `end` entry; a relay that had to stop (more than
--resume-buffer-bytes relayed, or the store did not answer) writes `lost` where it
stopped, and a reader reaching that point gets the 410 a local resume would.  The stream
key lives while events come (RELAY_TTL_S from the last one) and, after the end,
--resume-grace or RELAY_TTL_S, whichever is longer.

A reader on another replica replays what the stream holds after its position, then waits
on it (XREAD BLOCK) for the live tail until `end`.  Relaying never holds the generation:
the relay's writes are its own task's, and the producer only appends to a list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from service.response_store import RELAY_EVENT, StoreUnavailable

log = logging.getLogger(__name__)

# A running relay's key outlives its last event by this long: a turn whose replica died
# leaves nothing behind for longer (its stored response reads failed by then).
RELAY_TTL_S = 60.0
BLOCK_MS = 1000  # one XREAD's wait (below the client's 2 s socket timeout)
# Relayed streams one replica follows at once (each holds a store connection meanwhile).
MAX_RELAY_READERS = 256

DATA, END, LOST = RELAY_EVENT, b"end", b"lost"


class EventRelay:
    """One stream's events on their way to the shared store."""

    def __init__(
        self,
        store: Any,
        tenant: str | None,
        rid: str,
        cap: int,
        grace: float,
        kept: Sequence[tuple[int, bytes]] = (),
    ) -> None:
        """`kept`: the log's events so far, relayed first (their positions go on)."""
        self.store, self.tenant, self.rid = store, tenant, rid
        self.cap, self.grace = cap, grace
        self.seq = kept[0][0] - 1 if kept else 0  # the newest position taken
        self.pending: list[tuple[int, bytes, bytes]] = []  # (seq, kind, data)
        self.nbytes = 0
        self.stopped = False  # lost or ended: nothing more is taken
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._run())

        for _seq, data in kept:
            self.add(data)

    def add(self, data: bytes) -> None:
        """The stream's next event."""
        self.seq += 1
        if self.stopped:
            return
        self.nbytes += len(data)
        if self.nbytes > self.cap:
            self._stop(self.seq, LOST)
            return
        self.pending.append((self.seq, DATA, data))
        self.wake.set()

    def close(self) -> None:
        """The stream ended after its last event."""
        if not self.stopped:
            self._stop(self.seq + 1, END)

    def _stop(self, seq: int, kind: bytes) -> None:
        self.stopped = True
        self.pending.append((seq, kind, b""))
        self.wake.set()

    async def _run(self) -> None:
        failed = False
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, []
            if failed:
                continue  # (what it holds stops at a `lost` entry, or at a gap)
            ended = bool(batch) and batch[-1][1] != DATA
            # Ended: kept --resume-grace, and a minute at least (a client told to retry
            # comes back later than one whose connection blinked; the stream is capped).
            ttl = max(self.grace, RELAY_TTL_S) if ended else RELAY_TTL_S
            try:
                await self.store.relay_events(self.tenant, self.rid, batch, ttl)
            except StoreUnavailable as e:
                log.warning("response %s: its stream is no longer relayed (%s)", self.rid, e)
                failed = True
                first = batch[0][0] if batch else 0
                with contextlib.suppress(StoreUnavailable):  # where it stops, for readers
                    await self.store.relay_events(self.tenant, self.rid, [(first, LOST, b"")], 1.0)
            if self.stopped and not self.pending:
                return


async def follow_relayed(
    store: Any,
    tenant: str | None,
    rid: str,
    after: int,
    write: Any,
    gone: Any,
) -> bool:
    """Write the relayed events after position `after`, then the live tail, to `write`;
    True when the stream's end was written.  `gone(message)` writes the 410 where the
    relay stopped short."""
    pos = after
    idle = 0.0
    while True:
        entries = await store.read_events(tenant, rid, pos, BLOCK_MS)
        if entries is None:  # the key expired: its replica went away mid-answer
            return False
        if not entries:
            idle += BLOCK_MS / 1000
            if idle >= RELAY_TTL_S:
                return False
            continue
        idle = 0.0
        for seq, kind, data in entries:
            if seq != pos + 1 or kind == LOST:
                await gone("this stream's events were not all relayed to the shared store")
                return False
            if kind == END:
                return True
            await write(data)
            pos = seq
