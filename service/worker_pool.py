"""Killable worker processes, shared by the render, tokenize and grammar pools.

Python cannot stop a thread, so work that may run away (a template, a huge tokenization,
a native compile that recurses) runs in a process that can be killed.  This module holds
what those pools have in common: start workers (forkserver) and wait until each says it
is ready, keep the idle ones in a queue, run one round trip at a time per worker on an
I/O thread under a deadline, and heal.  Every way out of a round trip either gives the
worker back (it answered, or refused before anything was sent, so it is known to be idle
and in step) or kills and replaces it (deadline, death, cancellation at close, anything
unforeseen: its state is unknown); a worker found dead while idle is replaced without
failing the job that drew it; a replacement that fails to start is retried with back-off
until one does, so the pool never shrinks.

What stays with each pool: its jobs and their wire format, its admission rules, its
deadlines, and how a timeout or a crash is told to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Generic, TypeVar

log = logging.getLogger(__name__)
START_TIMEOUT = 120.0
R = TypeVar("R")


class Worker:
    """One worker process and its pipe.  A subclass names `target(conn, *args)`, which
    must send one message once it is ready, then answer one message per message."""

    target: ClassVar[Callable[..., None]]
    name: ClassVar[str]  # the process name, "pagestream-..."

    def __init__(self, ctx: Any, *args: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=type(self).target, args=(child, *args), daemon=True, name=self.name
        )
        self.proc.start()
        child.close()
        # Start-up (a fresh interpreter importing its modules) is not job time: wait for
        # the worker to say it is ready before it takes jobs with a deadline.
        if not self.conn.poll(START_TIMEOUT):
            self.kill()
            raise RuntimeError(f"worker {self.name} did not start in {START_TIMEOUT} s")
        self.conn.recv()

    def roundtrip(self, msg: Any) -> Any:
        self.conn.send(msg)
        return self.conn.recv()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(Exception):
            self.proc.join(5)


W = TypeVar("W", bound=Worker)


class WorkerPool(Generic[W]):
    """`size` workers, made by `_start_worker()`.  A pool calls `_open()` on the loop,
    then `_take()` a worker and `_run()` one round trip on it; `close()` ends it all."""

    def __init__(self, size: int, name: str, what: str) -> None:
        self.size = size
        self.what = what  # for the log: "a ... worker"
        method = "forkserver" if sys.platform == "linux" else "spawn"
        self._ctx = multiprocessing.get_context(method)
        self._idle: asyncio.Queue[W] | None = None
        self._all: set[W] = set()
        self._io = ThreadPoolExecutor(max(1, size), thread_name_prefix=f"pagestream-{name}-io")
        self._tasks: set[asyncio.Task[Any]] = set()  # worker starts and round trips
        self._waiting = 0  # callers waiting in _take
        self._closed = False
        self.killed = 0  # workers killed and replaced (deadline, crash, death while idle)

    # Hooks, looked up on each start so a test can swap the worker class or back-off.
    def _start_worker(self) -> W:
        """A new, ready worker (runs on a thread; may raise)."""
        raise NotImplementedError

    def _respawn_backoff(self) -> tuple[float, float]:
        """The first and the longest wait before retrying a failed start."""
        return 1.0, 1.0

    @property
    def idle_workers(self) -> int:
        """Workers waiting for a job (all of them, when the pool is quiet and whole)."""
        return 0 if self._idle is None else self._idle.qsize()

    @property
    def live_workers(self) -> int:
        return len(self._all)

    def _open(self) -> asyncio.Queue[W]:
        if self._idle is None:
            self._idle = asyncio.Queue()
        return self._idle

    async def _start_one(self) -> None:
        """One attempt at a new worker (an error propagates)."""
        w = await asyncio.get_running_loop().run_in_executor(None, self._start_worker)
        if self._closed:  # the pool closed while this one started
            w.kill()
            return
        self._all.add(w)
        self._open().put_nowait(w)

    async def _spawn(self) -> None:
        """Start one worker, retrying with back-off until one starts or the pool closes."""
        delay, longest = self._respawn_backoff()
        failures = 0
        while not self._closed:
            try:
                await self._start_one()
                return
            except Exception as e:  # out of processes or memory, for now: try again
                failures += 1
                if failures == 1:
                    log.exception("%s did not start; retrying in %g s", self.what, delay)
                else:
                    log.warning("%s did not start again (%r); retrying in %g s",
                                self.what, e, delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)

    def _spawn_later(self) -> None:
        self._track(asyncio.create_task(self._spawn()))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away does not want it

    async def _take(self, deadline: float | None = None) -> W:
        """An idle, live worker; TimeoutError if none is free by `deadline` (monotonic)."""
        idle = self._open()
        self._waiting += 1
        try:
            while True:
                if deadline is None:
                    worker = await idle.get()
                else:
                    worker = await asyncio.wait_for(
                        idle.get(), max(0.0, deadline - time.monotonic())
                    )
                if worker.alive():
                    return worker
                # It died idle (a signal, the OOM killer): not this job's doing.
                self._discard(worker)
        finally:
            self._waiting -= 1

    async def _run(
        self,
        worker: W,
        call: Callable[[W], R],
        timeout: float,
        keeps: tuple[type[BaseException], ...] = (),
    ) -> R:
        """`call(worker)` on an I/O thread, at most `timeout` s.  It returns, or raises one
        of `keeps` (the worker answered, or nothing reached it): the worker goes back.
        Anything else (TimeoutError included) kills and replaces it, and is raised."""
        # Its own task: a caller that goes away mid-job (a client that left) leaves the
        # worker to finish, or be killed at the deadline, rather than killing it, so
        # cancels cannot be used to churn processes.
        task = asyncio.ensure_future(self._roundtrip(worker, call, timeout, keeps))
        self._track(task)
        return await asyncio.shield(task)

    async def _roundtrip(
        self,
        worker: W,
        call: Callable[[W], R],
        timeout: float,
        keeps: tuple[type[BaseException], ...],
    ) -> R:
        healthy = False
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._io, call, worker)
            try:
                out = await asyncio.wait_for(fut, timeout)
            except keeps:
                healthy = True
                raise
            healthy = True
            return out
        finally:
            if healthy and not self._closed:
                self._open().put_nowait(worker)
            else:
                self._discard(worker)

    def _discard(self, worker: W) -> None:
        self._all.discard(worker)
        with contextlib.suppress(Exception):
            worker.proc.kill()  # now; reaping it (a join) happens off the loop
        asyncio.get_running_loop().run_in_executor(None, worker.kill)
        if not self._closed:
            self.killed += 1
            self._spawn_later()

    def _shut_down(self) -> list[asyncio.Task[Any]]:
        """Kill every worker and cancel every start and round trip, without waiting."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for w in list(self._all):
            w.kill()
        self._all.clear()
        self._io.shutdown(wait=False, cancel_futures=True)
        return tasks

    async def close(self) -> None:
        await asyncio.gather(*self._shut_down(), return_exceptions=True)
