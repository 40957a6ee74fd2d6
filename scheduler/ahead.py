"""Async scheduling: step N+1 scheduled while step N runs (vLLM v1's async scheduling,
SGLang's overlap scheduler).

The engine (scheduler/engine_core.py) launches step N, and while the device computes it
asks `schedule_ahead` for step N+1 on the assumption that every decode row of N emits
one token and goes on.  N+1 is queued on the executor behind N, so the device never
waits for the host: N's update (stop checks, frees, stream outputs) and the scheduling
of N+2 run while N+1 computes.

What N+1 cannot know is N's sampled tokens.  Its rows carry `PLACEHOLDER` and the index
of their row in N's output (`DecodeColumns.prev_rows`); the executor fills the tokens in
from N's output on its own thread, right before N+1 runs (scheduler/executor.py).  The
prefix-cache entry of a block that N+1's token completes needs that token too, so it is
registered once N's update has appended it (`_settle_ahead`).

Only steps whose outcome N+1 can assume go ahead; every other step is scheduled after
its predecessor's update, as without async scheduling:

- a row that N ends by length is left out of N+1 (that is known in advance);
- a row that N ends by a stop token, or that an abort or a stop string ends meanwhile,
  runs in N+1 for nothing: its token is discarded at N+1's update (its status is no
  longer running) and its blocks were freed when it ended; the runner writes its slot
  in N+1 before any step that reuses the block runs, since steps run in order;
- synchronous: a step N with anything but columnar decode rows (prompt chunks, first
  samples and n > 1 forks, grammar rows, logprobs, drafts), a scheduler that
  speculates (its drafts are proposed from N's tokens), requests waiting for admission
  (admission and preemption decide on the state after N), and an N+1 whose new blocks
  do not fit (the general path preempts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler.contract import PLACEHOLDER, DecodeColumns, SchedulerOutput
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.fair_queue import FairQueue
    from scheduler.kv_cache_manager import KVCacheManager


class AheadScheduling:
    """Scheduler mixin (scheduler/scheduler.py)."""

    kv: KVCacheManager
    block_size: int
    running: list[Request]
    waiting: FairQueue
    spec: Any
    step_id: int
    finished_req_ids: list[str]
    _col_rows: dict[int, list[Request]]

    def _init_ahead(self) -> None:
        self._col_rows = {}
        # Per step scheduled ahead: (rows, positions, indices of the rows whose token
        # fills a block), registered in the prefix cache once that token is known.
        self._ahead_fills: dict[int, tuple[list[Request], list[int], list[int]]] = {}
        self.num_ahead_steps = 0

    def schedule_ahead(self, so: SchedulerOutput) -> SchedulerOutput | None:
        """Step so.step + 1, scheduled while `so` (the last step scheduled) runs and
        before its update; None when it must wait for that update (module docstring)."""
        prev = self._col_rows.get(so.step)
        if prev is None or not self._can_go_ahead(so):
            return None
        running = RequestStatus.RUNNING
        live = [i for i, r in enumerate(prev) if r.status is running]
        if len(live) != len(self.running):
            return None  # a running request that `so` did not carry: the general path
        # A row whose token of `so` reaches its length limit ends there.
        keep = [i for i in live if len(prev[i].token_ids) + 1 < prev[i].length_limit]
        if not keep:
            return None
        rows = [prev[i] for i in keep]
        positions = [r.num_computed_tokens + 1 for r in rows]
        cols = DecodeColumns(
            req_ids=[r.req_id for r in rows],
            token_ids=[PLACEHOLDER] * len(rows),
            positions=positions,
            prev_rows=keep,
        )
        bs = self.block_size
        starts = [i for i, p in enumerate(positions) if p % bs == 0]
        if starts and not self.kv.grow_decode_edges(rows, positions, starts, cols):
            return None  # short of blocks: the general path preempts
        self.step_id += 1
        self._note_col_rows(self.step_id, rows)
        if fills := [i for i, p in enumerate(positions) if (p + 1) % bs == 0]:
            self._ahead_fills[self.step_id] = (rows, positions, fills)
        self.num_ahead_steps += 1
        finished, self.finished_req_ids = self.finished_req_ids, []
        return SchedulerOutput(
            step=self.step_id,
            new_requests=[],
            scheduled=[],
            decodes=cols,
            finished_req_ids=finished,
            save_kv_blocks=self._blocks_to_save(),
            grammar_bitmasks={},
        )

    def _can_go_ahead(self, so: SchedulerOutput) -> bool:
        return (
            so.step == self.step_id  # nothing scheduled after it yet
            and not so.scheduled
            and bool(so.decodes.req_ids)
            and not so.grammar_bitmasks
            and self.spec is None
            and not self.waiting
            and self.block_size > 1  # a token that starts a block also fills one
        )

    def _settle_ahead(self, step: int) -> None:
        """After the update of step - 1: register the blocks that step's tokens fill,
        now that those tokens are appended (rows ended meanwhile have no blocks)."""
        pending = self._ahead_fills.pop(step, None)
        if pending is None:
            return
        rows, positions, fills = pending
        running = RequestStatus.RUNNING
        live = [i for i in fills if rows[i].status is running]
        if live:
            self.kv.grow_decode_edges(rows, positions, live, DecodeColumns())

    # Provided by the scheduler.
    def _note_col_rows(self, step: int, reqs: list[Request]) -> None:
        raise NotImplementedError

    def _blocks_to_save(self) -> list[int]:
        raise NotImplementedError
