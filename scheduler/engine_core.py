"""The engine actor: inbox of add/abort; loop schedule -> executor -> update -> streams.

It runs on the caller's event loop, or (`own_thread=True`) on a thread of its own with its
own loop, so the HTTP loop never waits on scheduling, update or grammar work and a step
never waits on HTTP.  Then what crosses between the two loops is: messages into the inbox
(`call_soon_threadsafe`), and once per step one batch of every stream's outputs back to the
consumers' loop (`_flush`), so each stream is woken at most once a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.block_pool import BlockHash
from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import RequestRejected, RequestUpdate, Scheduler
from scheduler.scheduler_types import StepUpdates
from scheduler.stream import RequestStream

log = logging.getLogger(__name__)


class Executor(Protocol):
    async def execute(self, so: SchedulerOutput) -> ModelOutput: ...


class EngineDeadError(RuntimeError):
    """The engine stopped after an executor failure; no request can be served."""


class DuplicateRequestId(RequestRejected):
    """A request id that is still in use by a live request (HTTP 409).  The live request
    is never touched: the new one is refused before it is queued."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class AddRequest:
    group: list[Request]
    stream: RequestStream


@dataclass
class AbortRequest:
    group_id: str
    # The stream of the request to abort: the abort only acts while that stream is still
    # the one registered under group_id, so a consumer that never got its id (a duplicate)
    # or whose request already ended can never abort a newer request under the same id.
    stream: RequestStream | None = None


@dataclass
class FinishSequence:
    """A sequence ended outside the engine (a stop string matched in the detokenizer)."""

    req_id: str


@dataclass
class RemoteLookupDone:
    """The shared prefix tier answered a request's look-up."""

    req_id: str
    start: int
    payloads: list[bytes]


@dataclass
class ReleaseConversation:
    """Drop a conversation's KV pin now (its WebSocket closed)."""

    key: str


@dataclass
class StepInfo:
    so: SchedulerOutput | None  # None: a step of an engine in another process
    mo: ModelOutput
    seconds: float
    # The scheduler's stats after the step, where the scheduler is not this process's
    # (service/engine_proc.py); None: read them from the scheduler.
    stats: Any = None


class _Stop:
    pass


@dataclass
class _Flight:
    """A step handed to the executor and not yet joined."""

    so: SchedulerOutput
    begun: float  # when its scheduling began
    handed: float  # when it was handed to the executor (grammar masks filled)
    # Async scheduling: the executor's future (launched at once, so a step scheduled
    # ahead queues behind it); None: the step is executed when joined.
    fut: asyncio.Future[ModelOutput] | None


def _consume(fut: asyncio.Future[Any]) -> None:
    """A dropped step's outcome is no one's: read it so asyncio does not log it."""
    if not fut.cancelled():
        fut.exception()


@dataclass
class ExecutorFailed:
    """The executor found out between steps that it cannot go on (a tensor-parallel rank
    exited while the engine idled): the engine dies as if a step had raised."""

    error: BaseException


Message = (
    AddRequest
    | AbortRequest
    | FinishSequence
    | RemoteLookupDone
    | ReleaseConversation
    | ExecutorFailed
    | _Stop
)


_TOKEN, _UPDATES, _FAIL = 0, 1, 2  # what an outbox entry carries


def _deliver(batch: list[tuple[RequestStream, int, Any]]) -> None:
    """On the consumers' loop: one step's outputs into their streams."""
    for stream, kind, item in batch:
        if kind == _TOKEN:
            stream.put_token(*item)
        elif kind == _UPDATES:
            stream.put(item)
        else:
            stream.fail(item)


class Tier(Protocol):
    """The part of scheduler.prefix_tier.PrefixTier the engine drives."""

    stats: Any

    @property
    def available(self) -> bool: ...
    async def lookup(self, hashes: list[BlockHash]) -> list[bytes]: ...
    def publish(self, items: list[tuple[BlockHash, bytes, str | None]]) -> None: ...


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        on_step: Callable[[StepInfo], None] | None = None,
        tier: Tier | None = None,
        max_waiting_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        max_waiting_per_tenant: int | None = None,
        own_thread: bool = False,
        async_scheduling: bool = False,
    ) -> None:
        self.scheduler = scheduler
        # Schedule step N+1 while step N runs (scheduler/ahead.py); only with an executor
        # that queues steps in order and fills their placeholder tokens (ThreadExecutor).
        self.async_scheduling = async_scheduling and getattr(
            executor, "supports_async_scheduling", False
        )
        self._last_output_at = 0.0  # when the last step's output arrived
        # own_thread: run on thread `pagestream-engine` with its own event loop (see the
        # module docstring); else on the loop that calls start().
        self.own_thread = own_thread
        # Outputs batched a step (the outbox, _flush) and admission read from a snapshot:
        # with the engine on its own thread, or in a child process whose _flush sends the
        # batch to the parent (service/engine_proc.py).
        self._batched = own_thread
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop _run runs on
        self._loop_thread: int | None = None  # that loop's thread id
        self._client_loop: asyncio.AbstractEventLoop | None = None  # the consumers' loop
        self._thread: threading.Thread | None = None
        # own_thread: outputs of this step for the consumers' loop, sent by _flush.
        self._outbox: list[tuple[RequestStream, int, Any]] = []
        # own_thread: admission reads the scheduler's queue through this snapshot (taken
        # on the engine thread under _lock), never the scheduler itself.
        self._lock = threading.Lock()
        self._snap_seqs = 0
        self._snap_tokens = 0
        self._snap_tenants: Counter[str | None] = Counter()
        # Admission bound: sequences (and prompt tokens) queued but not yet running.  The
        # one place that says 429, so every transport answers an overload the same way.
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self._inbox_seqs = 0  # added but not yet handed to the scheduler
        self._inbox_tokens = 0
        # One tenant's (API key's) own bound, below the global one, so a key that floods
        # meets its 429s while the queue still has room for every other key.
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self._inbox_tenants: dict[str | None, int] = {}
        self.num_rejected = 0
        self.tier = tier
        self._lookups: set[asyncio.Task[None]] = set()
        self.executor = executor
        self.on_step = on_step
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.streams: dict[str, RequestStream] = {}
        self._adding: set[str] = set()  # group ids of adds still in the inbox
        self.dead: BaseException | None = None
        self.idle = asyncio.Event()
        self._task: asyncio.Future[None] | None = None
        self.num_steps = 0
        self.tokens_computed = 0  # tokens fed through the model (prefill chunks + decodes)
        self.hook_errors: dict[str, int] = {}  # failures of guarded hooks, by hook
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pagestream-masks")

    # ---------------------------------------------------------------- control
    def start(self) -> asyncio.Future[None]:
        """Start the loop; the returned future (on the caller's loop) ends when it does."""
        assert self._task is None
        if not self.own_thread:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._task = asyncio.create_task(self._run(), name="pagestream-engine")
            return self._task
        self._client_loop = asyncio.get_running_loop()
        loop = self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            self._loop_thread = threading.get_ident()
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name="pagestream-engine", daemon=True)
        self._thread.start()
        ready.wait()
        self._task = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._run(), loop))
        return self._task

    def call_in_loop(self, fn: Callable[[], Any]) -> Any:
        """An awaitable of fn() run on the engine's loop (what must live there: the
        prefix tier's tasks and connections); on the caller's before the engine starts."""

        async def run() -> Any:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r

        if self._thread is None or self._loop is None:  # inline, or no engine thread yet
            return run()
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    async def stop(self, finally_in_loop: Callable[[], Any] | None = None) -> None:
        """Stop the loop; then finally_in_loop() (awaited if a coroutine) on the engine's
        loop before its thread ends (closing what lives there: the prefix tier)."""
        if self._task is None:  # never started
            if finally_in_loop is not None:
                await self.call_in_loop(finally_in_loop)
            return
        self.post(_Stop())
        try:
            await self._task
        except Exception:
            if self.dead is None:
                raise  # a failure in stopping itself; a death was logged when it happened
        finally:
            self._task = None
            self._mask_thread.shutdown(wait=False)
            if finally_in_loop is not None:
                await self.call_in_loop(finally_in_loop)
            if self._thread is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                await asyncio.to_thread(self._thread.join, 10)
                self._thread = None

    def post(self, msg: Message) -> None:
        """Put a message in the inbox, from any thread."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self.inbox.put_nowait(msg)
        else:
            # RuntimeError: the engine's loop has closed, nothing reads the inbox any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.inbox.put_nowait, msg)

    def validate(self, group: list[Request]) -> None:
        """Reject a request synchronously, before it reaches the actor: also an id that a
        live request (or one still in the inbox) holds, as DuplicateRequestId."""
        gid = group[0].group_id
        if gid in self.streams or gid in self._adding:
            raise DuplicateRequestId(f"request id {gid!r} is already in use")
        self.scheduler.check_group(group)

    def queued(self) -> tuple[int, int]:
        """(sequences, prompt tokens) waiting for their first step: the scheduler's queue,
        requests parked on a prefix look-up, and adds still in the inbox."""
        if self._batched:  # the scheduler belongs to the engine thread: its snapshot
            with self._lock:
                return (
                    self._snap_seqs + self._inbox_seqs,
                    self._snap_tokens + self._inbox_tokens,
                )
        sched = self.scheduler
        seqs = len(sched.waiting) + len(sched.remote_pending) + self._inbox_seqs
        tokens = self._inbox_tokens
        if self.max_waiting_tokens is not None:
            tokens += sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
            tokens += sum(r.num_tokens for r in sched.remote_pending.values())
        return seqs, tokens

    def _snapshot(self) -> None:
        """own_thread: the scheduler's queue as admission sees it (engine thread only).
        Token and per-tenant counts cost a pass over the queue, so only when bounded."""
        if not self._batched:
            return
        sched = self.scheduler
        seqs = len(sched.waiting) + len(sched.remote_pending)
        tokens = 0
        if self.max_waiting_tokens is not None:
            tokens += sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
            tokens += sum(r.num_tokens for r in sched.remote_pending.values())
        tenants: Counter[str | None] = Counter()
        if self.max_waiting_per_tenant is not None:
            tenants.update(r.tenant for r in sched.waiting)
            tenants.update(r.tenant for r in sched.remote_pending.values())
        with self._lock:
            self._snap_seqs, self._snap_tokens, self._snap_tenants = seqs, tokens, tenants

    def admit(self, groups: list[list[Request]]) -> None:
        """Raise EngineOverloaded if queueing all these groups would pass the waiting bound
        (checked as one, so a multi-prompt request is taken whole or not at all)."""
        self._admit_tenant(groups)
        if self.max_waiting_requests is None and self.max_waiting_tokens is None:
            return
        seqs, tokens = self.queued()
        new_seqs = sum(len(g) for g in groups)
        new_tokens = sum(g[0].prompt_len for g in groups)
        if self.max_waiting_requests is not None and seqs + new_seqs > self.max_waiting_requests:
            self.num_rejected += 1
            raise EngineOverloaded(
                f"the server is overloaded: {seqs} sequences are waiting (limit "
                f"{self.max_waiting_requests}); retry later"
            )
        if self.max_waiting_tokens is not None and tokens + new_tokens > self.max_waiting_tokens:
            self.num_rejected += 1
            raise EngineOverloaded(
                f"the server is overloaded: {tokens} prompt tokens are waiting (limit "
                f"{self.max_waiting_tokens}); retry later"
            )

    def tenant_queued(self, tenant: str) -> int:
        """Requests of one tenant waiting for their first step (inbox and look-ups too)."""
        if self._batched:
            with self._lock:
                return self._snap_tenants[tenant] + self._inbox_tenants.get(tenant, 0)
        sched = self.scheduler
        parked = sum(1 for r in sched.remote_pending.values() if r.tenant == tenant)
        return sched.waiting.count(tenant) + parked + self._inbox_tenants.get(tenant, 0)

    def _admit_tenant(self, groups: list[list[Request]]) -> None:
        limit, tenant = self.max_waiting_per_tenant, groups[0][0].tenant if groups else None
        if limit is None or tenant is None:
            return
        waiting = self.tenant_queued(tenant)
        if waiting + len(groups) > limit:
            self.num_rejected += 1
            raise EngineOverloaded(
                f"this API key has {waiting} requests waiting (its limit is {limit}); retry later"
            )

    def release_conversation(self, key: str) -> None:
        self.post(ReleaseConversation(key))

    def add(self, group: list[Request], wake_on_tokens: bool = True) -> RequestStream:
        """Queue a request (all n samples) and return its output stream.  Raises
        RequestRejected (bad request), EngineOverloaded (queue full), EngineDeadError.
        wake_on_tokens: see RequestStream."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        self.validate(group)
        self.admit([group])
        stream = RequestStream(group[0].group_id, len(group), wake_on_tokens)
        tenant = group[0].tenant
        with self._lock:
            self._inbox_seqs += len(group)
            self._inbox_tokens += group[0].prompt_len
            self._inbox_tenants[tenant] = self._inbox_tenants.get(tenant, 0) + 1
        self._adding.add(group[0].group_id)
        self.post(AddRequest(group, stream))
        if self.dead is not None:  # it died (and drained its inbox) while this was posted
            stream.fail(EngineDeadError(f"engine is dead: {self.dead}"))
        return stream

    def abort(self, group_id: str, stream: RequestStream | None = None) -> None:
        """Abort a request; with `stream`, only if that is still its live stream (see
        AbortRequest): what a request's own consumer passes."""
        self.post(AbortRequest(group_id, stream))

    def finish_sequence(self, req_id: str) -> None:
        self.post(FinishSequence(req_id))

    # ---------------------------------------------------------------- loop
    def _handle(self, msg: Message) -> bool:
        sched = self.scheduler
        if isinstance(msg, AddRequest):
            group = msg.group
            with self._lock:  # out of the inbox and into the snapshot at once
                self._inbox_seqs -= len(group)
                self._inbox_tokens -= group[0].prompt_len
                self._inbox_left(group[0].tenant)
                if self._batched:
                    self._snap_seqs += len(group)
                    self._snap_tokens += group[0].prompt_len
                    self._snap_tenants[group[0].tenant] += 1
            gid = group[0].group_id
            if gid in self.streams:
                self._adding.discard(gid)
                self._fail(msg.stream, RequestRejected(f"request id {gid!r} is already in use"))
                return True
            try:
                sched.add_request(group)
            except RequestRejected as e:
                self._adding.discard(gid)
                self._fail(msg.stream, e)
                return True
            # In streams before out of _adding: validate() on another thread always sees
            # the id in one of them.
            self.streams[gid] = msg.stream
            self._adding.discard(gid)
            if self.tier is not None and self.tier.available:
                self._start_lookup(msg.group[0])
        elif isinstance(msg, RemoteLookupDone):
            sched.remote_lookup_done(msg.req_id, msg.start, msg.payloads)
        elif isinstance(msg, AbortRequest):
            if msg.stream is None or self.streams.get(msg.group_id) is msg.stream:
                self._dispatch(sched.abort(msg.group_id))
        elif isinstance(msg, FinishSequence):
            u = sched.finish_external(msg.req_id, RequestStatus.FINISHED_STOPPED)
            if u is not None:
                self._dispatch([u])
        elif isinstance(msg, ReleaseConversation):
            sched.kv.pins.unpin(msg.key)
        elif isinstance(msg, ExecutorFailed):
            raise msg.error
        elif isinstance(msg, _Stop):
            return False
        return True

    def _inbox_left(self, tenant: str | None) -> None:
        n = self._inbox_tenants[tenant] - 1
        if n:
            self._inbox_tenants[tenant] = n
        else:
            del self._inbox_tenants[tenant]

    def _start_lookup(self, req: Request) -> None:
        """Ask the shared tier for the prompt blocks we lack; the request waits, parked,
        and everyone else keeps stepping.  The answer comes back as a message."""
        plan = self.scheduler.remote_lookup_plan(req)
        if plan is None:
            return
        start, hashes = plan
        self.scheduler.park_for_remote(req)
        tier = self.tier
        assert tier is not None

        async def run() -> None:
            payloads: list[bytes] = []
            try:
                payloads = await tier.lookup(hashes)
            finally:
                self.post(RemoteLookupDone(req.req_id, start, payloads))

        task = asyncio.create_task(run())
        self._lookups.add(task)
        task.add_done_callback(self._lookups.discard)

    def _dispatch(self, updates: list[RequestUpdate] | StepUpdates) -> None:
        streams = self.streams
        outbox = self._outbox if self._batched else None
        if isinstance(updates, StepUpdates):
            # Decode rows that took a token and go on: a token each, no update object.
            for req, tok in zip(updates.decode_reqs, updates.decode_tokens, strict=True):
                stream = streams.get(req.group_id)
                if stream is None:
                    continue
                if outbox is None:
                    stream.put_token(req.req_id, tok)
                else:
                    outbox.append((stream, _TOKEN, (req.req_id, tok)))
            updates = updates.updates
        by_group: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            by_group.setdefault(u.group_id, []).append(u)
        for gid, us in by_group.items():
            stream = self.streams.get(gid)
            if stream is None:
                continue
            if outbox is None:
                stream.put(us)
            else:
                outbox.append((stream, _UPDATES, us))
            # Counted here, on the engine's side: the consumer's copy may lag a step.
            stream.engine_live -= sum(1 for u in us if u.finish_reason is not None)
            if stream.engine_live <= 0:
                del self.streams[gid]
        self._flush()

    def _fail(self, stream: RequestStream, error: BaseException) -> None:
        if self._batched:
            self._outbox.append((stream, _FAIL, error))
            self._flush()
        else:
            stream.fail(error)

    def _flush(self) -> None:
        """own_thread: hand this step's outputs to the consumers' loop in one callback."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        assert self._client_loop is not None
        # RuntimeError: the consumers' loop has closed, no one is reading.
        with contextlib.suppress(RuntimeError):
            self._client_loop.call_soon_threadsafe(_deliver, batch)

    async def _run(self) -> None:
        sched = self.scheduler
        flight: _Flight | None = None  # the step launched and not yet joined
        nxt: _Flight | None = None  # async scheduling: the step queued behind it
        try:
            while True:
                if flight is None and not sched.has_unfinished() and not sched.finished_req_ids:
                    self.idle.set()
                    msg = await self.inbox.get()
                    self.idle.clear()
                    if not self._handle(msg):
                        return
                # With a step scheduled ahead running, these are handled while it runs
                # (scheduler/ahead.py says why an abort or a finish then is safe).
                while not self.inbox.empty():
                    if not self._handle(self.inbox.get_nowait()):
                        return
                if flight is None and (flight := await self._schedule_step()) is None:
                    continue
                nxt = self._schedule_ahead(flight)
                await self._join(flight)
                flight, nxt = nxt, None
        except Exception as e:
            self._die(e)
            raise
        finally:
            # A clean stop waits for steps still queued; a death or a cancellation not.
            await self._drop_flights(flight, nxt, wait=sys.exc_info()[1] is None)
            for t in self._lookups:
                t.cancel()
            self.idle.set()

    async def _schedule_step(self) -> _Flight | None:
        """Schedule a step after the last one's update and launch it (None: nothing to
        run now)."""
        sched = self.scheduler
        if not sched.has_unfinished() and not sched.finished_req_ids:
            self._snapshot()
            return None
        begun = time.perf_counter()
        so = sched.schedule(defer_masks=True)
        self._snapshot()
        if sched.needs_masks:
            # Grammar masks off the event loop (llguidance releases the GIL): a costly
            # grammar delays this step, never the sockets.
            await asyncio.get_running_loop().run_in_executor(
                self._mask_thread, sched.fill_masks, so
            )
        if so.is_empty and not so.finished_req_ids:
            # Nothing runnable right now (requests parked on a prefix look-up, which
            # answers by message): wait for the next message.
            await self._wait_inbox(0.05)
            return None
        fut = self.executor.launch(so) if self.async_scheduling else None  # type: ignore[attr-defined]
        return _Flight(so, begun, time.perf_counter(), fut)

    def _schedule_ahead(self, flight: _Flight) -> _Flight | None:
        """Async scheduling: the next step, scheduled and queued on the executor while
        `flight` runs, when the scheduler can tell it without flight's tokens."""
        if not self.async_scheduling:
            return None
        begun = time.perf_counter()
        so = self.scheduler.schedule_ahead(flight.so)
        if so is None:
            return None
        fut = self.executor.launch(so)  # type: ignore[attr-defined]
        return _Flight(so, begun, time.perf_counter(), fut)

    async def _join(self, flight: _Flight) -> None:
        """Wait for a step's output and apply it: update, the tier, the streams, hooks."""
        sched, so, ex = self.scheduler, flight.so, self.executor
        if flight.fut is None:
            mo = await ex.execute(so)
        else:
            mo = await ex.join(flight.fut, so)  # type: ignore[attr-defined]
        # The device time of a step queued behind another starts when that one ended.
        start, self._last_output_at = max(flight.handed, self._last_output_at), time.perf_counter()
        updates = sched.update_from_output(so, mo)
        if self.tier is not None:
            self._feed_tier(so, mo)
        self.num_steps += 1
        self.tokens_computed += so.num_scheduled_tokens
        self._dispatch(updates)
        now = time.perf_counter()
        # The whole step, scheduling included: proposing drafts and laying out verify
        # rows are host work a speculating step adds.
        sched.observe_step_time(now - flight.begun)
        if self.on_step is not None:
            self.run_guarded("on_step hook", self.on_step, StepInfo(so, mo, now - start))

    async def _drop_flights(self, *flights: _Flight | None, wait: bool) -> None:
        """The engine stops with steps still queued on the executor: `wait` for them (a
        clean stop: the runner is released after), or leave them to finish alone."""
        for flight in flights:
            if flight is None or flight.fut is None:
                continue
            if wait:
                with contextlib.suppress(Exception):
                    await flight.fut
            else:
                flight.fut.add_done_callback(_consume)

    def _die(self, e: Exception) -> None:
        self.dead = e
        log.error("engine stopped: %s", e)
        err = EngineDeadError(f"engine stopped: {e}")
        for stream in self.streams.values():
            self._fail(stream, err)
        self.streams.clear()
        while not self.inbox.empty():  # requests that arrived as the engine died
            msg = self.inbox.get_nowait()
            if isinstance(msg, AddRequest):
                self._fail(msg.stream, err)

    def _feed_tier(self, so: SchedulerOutput, mo: ModelOutput) -> None:
        tier = self.tier
        assert tier is not None
        if so.save_kv_blocks:

            def publish() -> None:
                tier.publish(self.scheduler.take_saved(so, mo))

            self.run_guarded("prefix tier publish", publish)
        if so.load_kv:
            tier.stats.blocks_loaded += len(so.load_kv)
            tier.stats.bytes_loaded += sum(len(p.data) for p in so.load_kv)

    def run_guarded(self, what: str, fn: Callable[..., object], *args: object) -> None:
        """Hooks beside the step (metrics, the shared tier) can fail; the step loop must
        not.  The first failure of each is logged with its traceback, later ones counted."""
        try:
            fn(*args)
        except Exception:
            n = self.hook_errors.get(what, 0)
            self.hook_errors[what] = n + 1
            if n == 0 or (n + 1) % 1000 == 0:
                log.exception("%s failed (%d times so far); the engine goes on", what, n + 1)

    async def _wait_inbox(self, timeout: float) -> None:
        try:
            msg = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return
        # Put it back at the front of the line by handling it now.
        if not self._handle(msg):
            self.inbox.put_nowait(_Stop())
