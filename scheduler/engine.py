"""The engine actor: inbox of add/abort; loop schedule -> executor -> update -> streams."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import RequestRejected, RequestUpdate, Scheduler
from scheduler.stream import RequestStream

log = logging.getLogger(__name__)


class Executor(Protocol):
    async def execute(self, so: SchedulerOutput) -> ModelOutput: ...


class EngineDeadError(RuntimeError):
    """The engine stopped after an executor failure; no request can be served."""


@dataclass
class AddRequest:
    group: list[Request]
    stream: RequestStream


@dataclass
class AbortRequest:
    group_id: str


@dataclass
class FinishSequence:
    """A sequence ended outside the engine (a stop string matched in the detokenizer)."""

    req_id: str


@dataclass
class StepInfo:
    so: SchedulerOutput
    mo: ModelOutput
    seconds: float


class _Stop:
    pass


Message = AddRequest | AbortRequest | FinishSequence | _Stop


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.on_step = on_step
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.streams: dict[str, RequestStream] = {}
        self.dead: BaseException | None = None
        self.idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0

    # ---------------------------------------------------------------- control
    def start(self) -> asyncio.Task[None]:
        assert self._task is None
        self._task = asyncio.create_task(self._run(), name="pagestream-engine")
        return self._task

    async def stop(self) -> None:
        if self._task is None:
            return
        self.inbox.put_nowait(_Stop())
        try:
            await self._task
        finally:
            self._task = None

    def validate(self, group: list[Request]) -> None:
        """The checks that need no engine state, so callers can reject synchronously."""
        max_len = self.scheduler.config.max_model_len
        p = group[0]
        if p.prompt_len == 0:
            raise RequestRejected("the prompt is empty")
        if p.prompt_len >= max_len:
            raise RequestRejected(
                f"the prompt has {p.prompt_len} tokens; max_model_len is {max_len}, which "
                "must leave room for at least one generated token"
            )
        if len(group) > self.scheduler.config.max_num_seqs:
            raise RequestRejected(
                f"n={len(group)} is more than max_num_seqs ({self.scheduler.config.max_num_seqs})"
            )

    def add(self, group: list[Request]) -> RequestStream:
        """Queue a request (all n samples) and return its output stream."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        self.validate(group)
        stream = RequestStream(group[0].group_id, len(group))
        self.inbox.put_nowait(AddRequest(group, stream))
        return stream

    def abort(self, group_id: str) -> None:
        self.inbox.put_nowait(AbortRequest(group_id))

    def finish_sequence(self, req_id: str) -> None:
        self.inbox.put_nowait(FinishSequence(req_id))

    # ---------------------------------------------------------------- loop
    def _handle(self, msg: Message) -> bool:
        sched = self.scheduler
        if isinstance(msg, AddRequest):
            gid = msg.group[0].group_id
            if gid in self.streams:
                msg.stream.fail(RequestRejected(f"request id {gid!r} is already in use"))
                return True
            try:
                sched.add_request(msg.group)
            except RequestRejected as e:
                msg.stream.fail(e)
                return True
            self.streams[gid] = msg.stream
        elif isinstance(msg, AbortRequest):
            self._dispatch(sched.abort(msg.group_id))
        elif isinstance(msg, FinishSequence):
            u = sched.finish_external(msg.req_id, RequestStatus.FINISHED_STOPPED)
            if u is not None:
                self._dispatch([u])
        elif isinstance(msg, _Stop):
            return False
        return True

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        by_group: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            by_group.setdefault(u.group_id, []).append(u)
        for gid, us in by_group.items():
            stream = self.streams.get(gid)
            if stream is None:
                continue
            stream.put(us)
            if stream.finished:
                del self.streams[gid]

    async def _run(self) -> None:
        sched = self.scheduler
        try:
            while True:
                if not sched.has_unfinished():
                    self.idle.set()
                    msg = await self.inbox.get()
                    self.idle.clear()
                    if not self._handle(msg):
                        return
                while not self.inbox.empty():
                    if not self._handle(self.inbox.get_nowait()):
                        return
                if not sched.has_unfinished() and not sched.finished_req_ids:
                    continue
                so = sched.schedule()
                if so.is_empty and not so.finished_req_ids:
                    # Nothing runnable right now (e.g. waiting on a prefix look-up):
                    # sleep until a message arrives or a short tick passes.
                    await self._wait_inbox(0.005)
                    continue
                t0 = time.perf_counter()
                mo = await self.executor.execute(so)
                updates = sched.update_from_output(so, mo)
                self.num_steps += 1
                self._dispatch(updates)
                if self.on_step is not None:
                    self.on_step(StepInfo(so, mo, time.perf_counter() - t0))
        except Exception as e:
            self.dead = e
            log.error("engine stopped: %s", e)
            err = EngineDeadError(f"engine stopped: {e}")
            for stream in self.streams.values():
                stream.fail(err)
            self.streams.clear()
            raise
        finally:
            self.idle.set()

    async def _wait_inbox(self, timeout: float) -> None:
        try:
            msg = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return
        # Put it back at the front of the line by handling it now.
        if not self._handle(msg):
            self.inbox.put_nowait(_Stop())
