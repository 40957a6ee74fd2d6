"""The executor actor: runs the model runner off the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from scheduler.contract import PLACEHOLDER, DecodeColumns, ModelOutput, SchedulerOutput

log = logging.getLogger(__name__)

T = TypeVar("T")


class Runner(Protocol):
    def execute_model(self, so: SchedulerOutput) -> ModelOutput: ...


class ExecutorError(RuntimeError):
    """The model runner raised: the engine cannot go on."""


def describe_step(so: SchedulerOutput) -> str:
    scheduled = so.all_scheduled()
    reqs = ", ".join(
        f"{r.req_id}[pos {r.start_pos}+{len(r.input_ids)}, blocks {r.num_kept_blocks}"
        f"+{len(r.new_block_ids)}]"
        for r in scheduled[:16]
    )
    more = f" (+{len(scheduled) - 16} more)" if len(scheduled) > 16 else ""
    return (
        f"step {so.step}: {len(scheduled)} requests, {so.num_scheduled_tokens} tokens, "
        f"{len(so.new_requests)} new, {len(so.copy_blocks)} block copies, "
        f"{len(so.load_kv)} KV loads: {reqs}{more}"
    )


def resolve_placeholders(d: DecodeColumns, prev: ModelOutput | None) -> None:
    """A step scheduled ahead (scheduler/ahead.py): its decode rows' tokens are the ones
    the previous step sampled at its output rows `d.prev_rows`.  A row whose token is
    missing (the previous step failed it, mo.errors) keeps PLACEHOLDER, which the runner
    refuses; the scheduler has already ended that request and discards the row."""
    rows, d.prev_rows = d.prev_rows, []
    if prev is None:
        return
    toks, ids = prev.sampled_token_ids, prev.req_ids
    n = len(ids)
    if all(j < n for j in rows) and [ids[j] for j in rows] == d.req_ids:
        d.token_ids = [toks[j] for j in rows]
        return
    at = {rid: i for i, rid in enumerate(ids)}
    d.token_ids = [toks[at[rid]] if rid in at else PLACEHOLDER for rid in d.req_ids]


class ThreadExecutor:
    """One dedicated worker thread: torch releases the GIL inside its kernels, so the
    event loop keeps serving sockets while a step computes.

    Pass `factory` to build the runner on that same thread.  On CPU this matters a lot:
    OpenMP keeps one spinning thread team per thread that ever ran a parallel region, so
    loading the model on one thread and stepping on another leaves two teams fighting
    for the cores (a decode step ran markedly slower that way)."""

    def __init__(
        self, runner: Runner | None = None, factory: Callable[[], Runner] | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagestream-exec")
        if factory is not None:
            try:
                runner = self._pool.submit(factory).result()
            except BaseException:
                self._pool.shutdown(wait=False)
                raise
        assert runner is not None, "give a runner or a factory"
        self.runner = runner
        # The last step's output, on the worker thread: the next step's placeholders
        # are filled from it (steps run one at a time, in the order they were given).
        self._last: ModelOutput | None = None

    # The engine may queue step N+1 behind step N (async scheduling): steps run on one
    # thread in order, and _step fills N+1's placeholder tokens from N's output.
    supports_async_scheduling = True

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the executor thread and wait (for set-up work outside the step loop)."""
        return self._pool.submit(fn).result()

    async def call_between_steps(self, fn: Callable[[], T]) -> T:
        """Run fn on the executor thread, after the steps queued before it and before any
        queued after (a change to the runner no step may see half made); from any loop."""
        return await asyncio.wrap_future(self._pool.submit(fn))

    async def execute(self, so: SchedulerOutput) -> ModelOutput:
        return await self.join(self.launch(so), so)

    def launch(self, so: SchedulerOutput) -> asyncio.Future[ModelOutput]:
        """Queue a step on the worker now (behind any step still running); `join` it."""
        return asyncio.get_running_loop().run_in_executor(self._pool, self._step, so)

    async def join(self, fut: asyncio.Future[ModelOutput], so: SchedulerOutput) -> ModelOutput:
        try:
            return await fut
        except Exception as e:
            log.exception("model runner failed at %s", describe_step(so))
            raise ExecutorError(f"model runner failed at step {so.step}: {e!r}") from e

    def execute_sync(self, so: SchedulerOutput) -> ModelOutput:
        return self._step(so)

    def _step(self, so: SchedulerOutput) -> ModelOutput:
        if so.decodes.prev_rows:
            resolve_placeholders(so.decodes, self._last)
        self._last = None  # a failing step leaves no output to resolve from
        mo = self._last = self.runner.execute_model(so)
        return mo

    def shutdown(self, wait: bool = True) -> None:
        """`wait=False` after an engine failure: a step stuck in a broken device must not
        keep the process from exiting (the worker is a daemon-like pool thread)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if wait:  # the worker has exited: nothing steps any more
            self._release_runner()

    def _release_runner(self) -> None:
        """Gives the runner's device memory back (ModelRunner.release) after a clean stop."""
        release = getattr(self.runner, "release", None)
        if release is not None:
            release()
