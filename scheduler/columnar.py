"""The columnar decode path: plain decodes scheduled and advanced in bulk.

At a thousand running requests almost every one is a plain decode: one known token in,
one token out, its block table unchanged except once every `block_size` steps.  Building
a ScheduledRequest and a RequestUpdate for each, and walking the block manager for each,
was most of the scheduler's time a step.  Here a step takes a request flagged `columnar` (see
Request) with a few list comprehensions, touches the block manager only for the rows at
a block edge, and hands the engine one token per row instead of an update object.

Anything unusual leaves the path: a row whose block would not fit (the whole step then
goes the general way, which preempts), a step that speculates, a request with a grammar,
logprobs, a fork or a shared last block.  Each re-enters after one general step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.contract import DecodeColumns, ModelOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler_types import RequestUpdate

if TYPE_CHECKING:
    from scheduler.kv_cache_manager import KVCacheManager


class _Gone:
    """Stands for a row whose request is no longer known (never RUNNING)."""

    status = RequestStatus.FINISHED_ABORTED


_GONE: Request = _Gone()  # type: ignore[assignment]


class ColumnarDecodes:
    """Scheduler mixin (scheduler/scheduler.py holds the general path)."""

    kv: KVCacheManager
    block_size: int
    running: list[Request]
    requests: dict[str, Request]
    step_id: int
    # The Request of each decode row of the steps scheduled and not yet updated, by step
    # (two at most: with async scheduling the next step is scheduled before this one's
    # update), for their update.
    _col_rows: dict[int, list[Request]]

    def _schedule_columnar(
        self, budget: int, rows: list[Request] | None = None
    ) -> tuple[DecodeColumns, list[Request]] | None:
        """Take every columnar request as a decode row; returns the rows and the running
        requests left for the general path, or None when the rows would not all fit (the
        token budget, or the free blocks at their block edges): then the whole step goes
        the general way, which knows how to preempt.  `rows`: the running requests this
        step may take (fair shares' latency-first limits), when not all of them."""
        running = self.running if rows is None else rows
        reqs = [r for r in running if r.columnar]
        if not reqs:
            return None
        if len(reqs) > budget:
            return None
        bs = self.block_size
        positions = [r.num_computed_tokens for r in reqs]
        # Rows at a block edge: p % bs == 0 may need a new block, p % bs == bs - 1 fills
        # one (the prefix cache registers it).  Two rows in block_size, the others none.
        edge = [i for i, p in enumerate(positions) if (p + 1) % bs < 2]
        cols = DecodeColumns(
            req_ids=[r.req_id for r in reqs],
            token_ids=[r.token_ids[-1] for r in reqs],
            positions=positions,
        )
        if edge and not self.kv.grow_decode_edges(reqs, positions, edge, cols):
            return None
        self._note_col_rows(self.step_id + 1, reqs)
        rest = [r for r in running if not r.columnar] if len(reqs) < len(running) else []
        return cols, rest

    def _note_col_rows(self, step: int, reqs: list[Request]) -> None:
        rows = self._col_rows
        for old in [s for s in rows if s < step - 1]:  # a step never updated (tests)
            del rows[old]
        rows[step] = reqs

    def _update_columnar(
        self, so: SchedulerOutput, mo: ModelOutput, updates: list[RequestUpdate]
    ) -> tuple[list[Request], list[int], dict[str, int] | None]:
        """Advance the decode rows by their sampled tokens.  Returns the rows that took a
        token and go on (with the tokens), and the index of every other sampled request
        in `mo` (None when only decode rows sampled)."""
        d = so.decodes
        nd = len(d.req_ids)
        rids = mo.req_ids
        if (known := self._col_rows.pop(so.step, None)) is not None:
            reqs = known
        else:  # a step replayed out of band (tests): find the requests by id
            reqs = [self.requests.get(rid) or _GONE for rid in d.req_ids]
        if rids[:nd] == d.req_ids:
            toks: list[int | None] = mo.sampled_token_ids[:nd]  # type: ignore[assignment]
            rest = rids[nd:]
            sampled = {rid: nd + i for i, rid in enumerate(rest)} if rest else None
        else:  # a row failed in the runner (reported in mo.errors): look tokens up
            sampled = {rid: i for i, rid in enumerate(rids)}
            all_toks = mo.sampled_token_ids
            toks = [
                all_toks[i] if (i := sampled.get(rid)) is not None else None for rid in d.req_ids
            ]
        return (*self._advance_rows(reqs, toks, updates), sampled)

    def _advance_rows(
        self, reqs: list[Request], toks: list[int | None], updates: list[RequestUpdate]
    ) -> tuple[list[Request], list[int]]:
        running = RequestStatus.RUNNING
        odd: list[Request] = []  # rows that did not simply take their token
        for req, tok in zip(reqs, toks, strict=True):
            if req.status is not running:
                odd.append(req)  # aborted, preempted or failed while the step ran
                continue
            req.num_computed_tokens += 1
            ids = req.token_ids
            ids.append(tok)  # type: ignore[arg-type]  # a running row has its token
            if tok in req.stop_ids or len(ids) >= req.length_limit:
                # It may end here: the general rule decides (min_tokens and all).
                odd.append(req)
                self._check_end(req, tok)  # type: ignore[arg-type]
                updates.append(self._update(req, [tok]))  # type: ignore[list-item]
        if not odd:
            return reqs, toks  # type: ignore[return-value]
        skip = set(map(id, odd))
        keep = [i for i, r in enumerate(reqs) if id(r) not in skip]
        return [reqs[i] for i in keep], [toks[i] for i in keep]  # type: ignore[misc]

    # Provided by Scheduler.
    def _check_end(self, req: Request, tok: int) -> RequestStatus | None:
        raise NotImplementedError

    def _update(self, req: Request, toks: list[int]) -> RequestUpdate:
        raise NotImplementedError
