"""The engine core in a child process (`serve --engine-process`), as vLLM v1's EngineCore
process: the child holds the model, the executor, the scheduler and grammar masks and runs
`EngineCore` inline on its own event loop; this (HTTP) process keeps tokenization,
detokenization, templates, HTTP and stream writes, and never loads the model.

Between the two, one socket pair carries length-prefixed msgspec msgpack frames:

- parent -> child: `Add` (what `AsyncEngine.build_group` needs to rebuild the request's
  samples; the child compiles its grammar from the spec), `Abort`, `Finish`, `Release`,
  `Query` (scheduler stats, debug counts), `Stop`;
- child -> parent: one `Frame` per event-loop turn of the child with every stream's
  outputs (the batches `EngineCore._flush` makes, in order), the adds it took, the
  admission snapshot, one `Step` per step for the step hooks (metrics), query replies,
  and, last, its death.

The start-up handshake (the config and the engine's builder down, the facts the parent
needs up: eos ids, vocabulary, max_model_len, KV blocks...) is pickled: it runs once and
carries a callable.  Requests are keyed by a per-add integer (`sid`), so an abort names the
exact request its consumer started, as `AbortRequest.stream` does in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec

from scheduler import envs
from scheduler.engine_core import (
    _FAIL,
    _TOKEN,
    _UPDATES,
    AddRequest,
    DuplicateRequestId,
    EngineCore,
    EngineDeadError,
    EngineOverloaded,
    Message,
    StepInfo,
)
from scheduler.prefix_tier import TierStats
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected, check_group
from scheduler.scheduler_types import RequestUpdate
from scheduler.stream import RequestStream

if TYPE_CHECKING:
    from scheduler.config import EngineConfig

# service.async_engine.AsyncEngine, which imports this module (its in_process): named, not
# imported, so the two do not import each other.
AsyncEngine = Any

log = logging.getLogger(__name__)

# How long the parent waits for the child to exit after a stop before it kills it.
STOP_TIMEOUT_S = 30.0
# How often the child checks that the server's process is still its parent.
PARENT_POLL_S = 0.2


# ----------------------------------------------------------------------------- wire
class Add(msgspec.Struct, tag=True, array_like=True):
    sid: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    publish_prefix: bool
    tenant: str | None
    conversation: str | None
    priority: int
    arrival_time: float
    grammar_share: int


class Abort(msgspec.Struct, tag=True, array_like=True):
    group_id: str
    sid: int  # -1: whichever request holds the id


class Finish(msgspec.Struct, tag=True, array_like=True):
    req_id: str


class Release(msgspec.Struct, tag=True, array_like=True):
    key: str


class Query(msgspec.Struct, tag=True, array_like=True):
    qid: int
    what: str  # an AsyncEngine method in QUERIES
    args: list[str | float] = msgspec.field(default_factory=list)


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


ToChild = Add | Abort | Finish | Release | Query | Stop

# What a Query may call on the child's engine (each returns picklable data).
QUERIES = ("stats_for_server", "debug_counts", "load_lora", "unload_lora")


class Batch(msgspec.Struct, array_like=True):
    """One `EngineCore._flush`: tokens, then full updates, then failures, as `_dispatch`
    and `_fail` put them in the outbox (a stream's first token is always a full update
    of an earlier batch)."""

    tokens: list[tuple[int, str, int]]  # (sid, req_id, token)
    updates: list[tuple[int, list[RequestUpdate]]]
    fails: list[tuple[int, str, str]]  # (sid, error kind, message)


class Step(msgspec.Struct, array_like=True):
    seconds: float
    generated: int  # tokens the step sampled (with accepted drafts)
    stats: bytes  # the scheduler's stats after it, pickled (a dataclass tree)


class Frame(msgspec.Struct, array_like=True):
    batches: list[Batch]
    handled: list[int]  # sids of the adds the child took from its inbox
    snapshot: tuple[int, int, list[tuple[str | None, int]]] | None
    steps: list[Step]
    replies: list[tuple[int, bytes]]  # (qid, pickled result or error)
    dead: str | None = None  # the engine stopped on this error; the child exits
    # The shared prefix tier's (TierStats fields, healthy), where it changed since the
    # last frame: a query's reply carries it, so a /metrics scrape reads it fresh.
    tier: tuple[list[int], bool] | None = None


_HDR = 4


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HDR, "little") + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = int.from_bytes(await reader.readexactly(_HDR), "little")
    return await reader.readexactly(n)


def _recv_blocking(sock: socket.socket, alive: Callable[[], bool] | None = None) -> bytes:
    """One frame from a blocking socket (the handshake); `alive` is polled while waiting
    so a child that dies while it loads is noticed."""

    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if alive is not None:
                while not select.select([sock], [], [], 0.5)[0]:
                    if not alive():
                        raise EOFError
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    n = int.from_bytes(exactly(_HDR), "little")
    return exactly(n)


_ERRORS: dict[str, type[BaseException]] = {
    "dead": EngineDeadError,
    "duplicate": DuplicateRequestId,
    "rejected": RequestRejected,
    "overloaded": EngineOverloaded,
}


def _encode_error(e: BaseException) -> tuple[str, str]:
    for kind, cls in _ERRORS.items():  # most specific first (DuplicateRequestId first)
        if isinstance(e, cls):
            return kind, str(e)
    return "error", str(e)


def _decode_error(kind: str, msg: str) -> BaseException:
    return _ERRORS.get(kind, RuntimeError)(msg)


class EngineProcessError(RuntimeError):
    """The engine's process stopped (its engine died, or it was killed)."""


# ----------------------------------------------------------------------------- parent
class _Generated:
    """What the metrics step hook reads of a ModelOutput in another process: the count
    of tokens sampled."""

    def __init__(self, n: int) -> None:
        self.generated_tokens = n
        self.req_ids = range(n)  # a hook counting rows counts the same tokens


class TierView:
    """What the server's process reads of the shared prefix tier, which lives in the
    engine's process (its connections and writer task on the child's loop): its name,
    counters and health as of the child's last frame."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TierStats()
        self.healthy = True

    def update(self, snap: tuple[list[int], bool]) -> None:
        values, self.healthy = snap
        self.stats = TierStats(*values)


class ProcessCore:
    """EngineCore's face to AsyncEngine and the server, with the engine in a child
    process: admission on a local copy of the child's queue counts, outputs delivered
    into the RequestStreams here from the child's frames."""

    own_thread = False
    tier = None
    # Borrowed: they read only the limits, queued(), tenant_queued(), num_rejected and
    # the inbox counts.
    admit = EngineCore.admit
    _admit_tenant = EngineCore._admit_tenant
    _inbox_left = EngineCore._inbox_left
    run_guarded = EngineCore.run_guarded

    def __init__(
        self, config: EngineConfig, proc: subprocess.Popen, sock: socket.socket, facts: dict
    ) -> None:
        self._proc = proc
        self._sock = sock
        self.facts = facts
        self.pid = proc.pid
        self.async_scheduling = bool(facts["async_scheduling"])
        s = config.scheduler
        self.max_waiting_requests = s.max_waiting_requests
        self.max_waiting_tokens = s.max_waiting_tokens
        self.max_waiting_per_tenant = s.max_waiting_per_key
        self.num_rejected = 0
        self.hook_errors: dict[str, int] = {}  # of hooks in this process
        self.child_hook_errors: dict[str, int] = {}  # the child's, as of the last query
        self.on_step: Callable[[StepInfo], None] | None = None
        self.streams: dict[str, RequestStream] = {}
        self._sid_of: dict[str, int] = {}  # group id -> sid of its live stream
        self._by_sid: dict[int, RequestStream] = {}
        self._sids = itertools.count()
        self._qids = itertools.count()
        self._queries: dict[int, asyncio.Future[Any]] = {}
        # Adds sent and not yet taken by the child: (seqs, tokens, tenant) by sid.
        self._inbox: dict[int, tuple[int, int, str | None]] = {}
        self._inbox_seqs = self._inbox_tokens = 0
        self._inbox_tenants: dict[str | None, int] = {}
        # The child's queue as its last frame gave it.
        self._snap_seqs = self._snap_tokens = 0
        self._snap_tenants: dict[str | None, int] = {}
        self.dead: BaseException | None = None
        self.tier = TierView(facts["tier"]) if facts.get("tier") else None
        self.idle = asyncio.Event()
        self.idle.set()
        self.num_steps = 0
        self._task: asyncio.Future[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the consumers' (set by start)
        self._loop_thread: int | None = None
        self._stopping = False
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Frame)

    # ------------------------------------------------------------ start-up
    @classmethod
    def spawn(
        cls, config: EngineConfig, builder: Callable[[EngineConfig], AsyncEngine]
    ) -> ProcessCore:
        """Start the child and wait until its engine is built (blocking: the model
        loads there).  `builder(config)` runs in the child and returns an AsyncEngine
        built inline (pickled: a module-level function or a partial of one)."""
        parent, child = socket.socketpair()
        root = str(Path(__file__).resolve().parent.parent)
        env = envs.with_import_root(root)
        cmd = [sys.executable, "-m", "service.engine_proc", str(child.fileno()), str(os.getpid())]
        proc = subprocess.Popen(cmd, pass_fds=(child.fileno(),), env=env, close_fds=True)
        child.close()
        try:
            level = logging.getLogger().getEffectiveLevel()
            parent.sendall(_frame(pickle.dumps((config, builder, level))))
            try:
                kind, value = pickle.loads(_recv_blocking(parent, lambda: proc.poll() is None))
            except EOFError:
                kind, value = "error", f"the engine process exited with code {proc.wait()}"
            if kind != "ready":
                raise EngineProcessError(f"the engine process failed to start: {value}")
        except BaseException:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            parent.close()
            raise
        log.info("engine process %d ready", proc.pid)
        return cls(config, proc, parent, value)

    def start(self) -> asyncio.Future[None]:
        """The future that ends when the child does; call `connect` right after."""
        assert self._task is None
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._task = loop.create_future()
        self.idle = asyncio.Event()
        self.idle.set()
        return self._task

    async def connect(self) -> None:
        self._sock.setblocking(False)
        reader, self._writer = await asyncio.open_connection(sock=self._sock)
        self._reader_task = asyncio.create_task(self._read(reader), name="pagestream-engine-io")

    def _send(self, msg: ToChild) -> None:
        """Write a message to the child, from any thread (as EngineCore.post)."""
        if threading.get_ident() != self._loop_thread and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: no child to tell
                self._loop.call_soon_threadsafe(self._send, msg)
            return
        w = self._writer
        if w is None or w.is_closing():
            return  # the child is gone; _read fails what waits on it
        w.write(_frame(self._enc.encode(msg)))

    # ------------------------------------------------------------ requests
    def validate(self, group: list[Request]) -> None:
        gid = group[0].group_id
        if gid in self.streams:
            raise DuplicateRequestId(f"request id {gid!r} is already in use")
        check_group(group, self.facts["max_model_len"], self.facts["max_num_seqs"])

    def queued(self) -> tuple[int, int]:
        return (self._snap_seqs + self._inbox_seqs, self._snap_tokens + self._inbox_tokens)

    def tenant_queued(self, tenant: str) -> int:
        return self._snap_tenants.get(tenant, 0) + self._inbox_tenants.get(tenant, 0)

    def add(self, group: list[Request], wake_on_tokens: bool = True) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        self.validate(group)
        self.admit([group])
        p = group[0]
        gid = p.group_id
        stream = RequestStream(gid, len(group), wake_on_tokens)
        sid = next(self._sids)
        self.streams[gid] = stream
        self._sid_of[gid] = sid
        self._by_sid[sid] = stream
        self._inbox[sid] = (len(group), p.prompt_len, p.tenant)
        self._inbox_seqs += len(group)
        self._inbox_tokens += p.prompt_len
        self._inbox_tenants[p.tenant] = self._inbox_tenants.get(p.tenant, 0) + 1
        self.idle.clear()
        self._send(
            Add(sid, gid, p.token_ids, p.params, p.cache_salt, p.publish_prefix, p.tenant,
                p.conversation, p.priority, p.arrival_time, p.grammar_share)
        )  # fmt: skip
        return stream

    def abort(self, group_id: str, stream: RequestStream | None = None) -> None:
        if stream is None:
            self._send(Abort(group_id, -1))
        elif self.streams.get(group_id) is stream:
            self._send(Abort(group_id, self._sid_of[group_id]))

    def finish_sequence(self, req_id: str) -> None:
        self._send(Finish(req_id))

    def release_conversation(self, key: str) -> None:
        self._send(Release(key))

    def post(self, msg: Message) -> None:
        raise NotImplementedError("the engine runs in another process")

    def call_in_loop(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r

        return run()

    async def query(self, what: str, *args: str | float) -> Any:
        """What the child's `AsyncEngine.<what>(*args)` returns (QUERIES)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        qid = next(self._qids)
        fut = self._queries[qid] = asyncio.get_running_loop().create_future()
        self._send(Query(qid, what, list(args)))
        ok, value = pickle.loads(await fut)
        if not ok:
            raise RuntimeError(value)
        return value

    # ------------------------------------------------------------ the child's frames
    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: str | None = None
        try:
            while error is None:
                frame = self._dec.decode(await _read_frame(reader))
                self._apply(frame)
                error = frame.dead
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as e:  # a frame this side cannot read: the pair cannot go on
            log.exception("engine process: bad frame")
            error = f"bad frame from the engine process: {e}"
        if error is not None:  # dead from now on, while the child exits
            self._die(EngineProcessError(error))
        code = await asyncio.to_thread(self._wait_child)
        if error is None and not (self._stopping and code == 0):
            why = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
            self._die(EngineProcessError(f"the engine process exited unexpectedly ({why})"))
        elif self._task is not None and not self._task.done():
            self._task.set_result(None)
        if self._writer is not None:
            self._writer.close()

    def _wait_child(self) -> int | None:
        try:
            return self._proc.wait(STOP_TIMEOUT_S if self._stopping else 5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def _apply(self, frame: Frame) -> None:
        by_sid = self._by_sid
        if frame.tier is not None and self.tier is not None:
            self.tier.update(frame.tier)  # before the step hooks and replies read it
        for b in frame.batches:
            for sid, rid, tok in b.tokens:
                s = by_sid.get(sid)
                if s is not None:
                    s.put_token(rid, tok)
            for sid, us in b.updates:
                s = by_sid.get(sid)
                if s is not None:
                    s.put(us)
                    if s._live <= 0:
                        self._forget(sid, s)
            for sid, kind, msg in b.fails:
                s = by_sid.get(sid)
                if s is not None:
                    s.fail(_decode_error(kind, msg))
                    self._forget(sid, s)
        for sid in frame.handled:
            taken = self._inbox.pop(sid, None)
            if taken is None:
                continue
            seqs, tokens, tenant = taken
            self._inbox_seqs -= seqs
            self._inbox_tokens -= tokens
            self._inbox_left(tenant)
        if frame.snapshot is not None:
            self._snap_seqs, self._snap_tokens, tenants = frame.snapshot
            self._snap_tenants = dict(tenants)
        for st in frame.steps:
            self.num_steps += 1
            if self.on_step is not None:
                info = StepInfo(None, _Generated(st.generated), st.seconds,  # type: ignore[arg-type]
                                pickle.loads(st.stats))  # fmt: skip
                self.run_guarded("on_step hook", self.on_step, info)
        for qid, payload in frame.replies:
            fut = self._queries.pop(qid, None)
            if fut is not None and not fut.done():
                fut.set_result(payload)
        if not self.streams:
            self.idle.set()

    def _forget(self, sid: int, stream: RequestStream) -> None:
        del self._by_sid[sid]
        gid = stream.group_id
        if self.streams.get(gid) is stream:
            del self.streams[gid]
            del self._sid_of[gid]

    def _die(self, e: BaseException) -> None:
        self.dead = e
        log.error("engine stopped: %s", e)
        err = EngineDeadError(f"engine stopped: {e}")
        for stream in self._by_sid.values():
            stream.fail(err)
        self._by_sid.clear()
        self.streams.clear()
        self._sid_of.clear()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"engine stopped: {e}"))
        self._queries.clear()
        self.idle.set()
        if self._task is not None and not self._task.done():
            self._task.set_exception(e)

    # ------------------------------------------------------------ shutdown
    async def stop(self, finally_in_loop: Callable[[], Any] | None = None) -> None:
        """Stop the child's engine and wait for the child to exit (killed past
        STOP_TIMEOUT_S); never leaves it behind."""
        self._stopping = True
        if self._reader_task is None:  # never connected
            await asyncio.to_thread(self._wait_child_after_close)
            return
        self._send(Stop())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._reader_task)
        if finally_in_loop is not None:
            await self.call_in_loop(finally_in_loop)

    def _wait_child_after_close(self) -> None:
        self._sock.close()  # EOF: the child exits
        self._wait_child()

    def kill(self) -> None:
        """The child, now (tests: an engine process that dies)."""
        self._proc.kill()


# ----------------------------------------------------------------------------- child


class _ChildStream(RequestStream):
    """A stream in the child: only the engine's bookkeeping (engine_live) and its sid
    are read; the outputs go to the parent."""

    def __init__(self, gid: str, n: int, sid: int) -> None:
        super().__init__(gid, n)
        self.sid = sid


class _AbortSid:
    """Abort `gid` if `sid` (-1: any) is still the request under it, checked when the
    engine handles it (after the add, which may still be in its inbox)."""

    def __init__(self, gid: str, sid: int) -> None:
        self.gid, self.sid = gid, sid


class ChildCore(EngineCore):
    """The engine loop in the child: `_flush` turns the outbox into a Batch, and every
    turn of the loop sends what gathered in one Frame."""

    def __init__(self, engine: AsyncEngine, writer: asyncio.StreamWriter) -> None:
        core = engine.core
        super().__init__(
            engine.scheduler,
            engine.executor,
            on_step=self._step_done,
            tier=engine.tier,
            max_waiting_requests=core.max_waiting_requests,
            max_waiting_tokens=core.max_waiting_tokens,
            max_waiting_per_tenant=core.max_waiting_per_tenant,
            async_scheduling=core.async_scheduling,
        )
        self._batched = True
        self._engine = engine
        self._writer = writer
        self._enc = msgspec.msgpack.Encoder()
        self._batches: list[Batch] = []
        self._handled: list[int] = []
        self._steps: list[Step] = []
        self._replies: list[tuple[int, bytes]] = []
        self._snap_dirty = False
        self._send_armed = False
        self._tier_sent: tuple[list[int], bool] | None = None

    def _tier_changed(self) -> tuple[list[int], bool] | None:
        t = self.tier
        if t is None:
            return None
        # Every send: the field values, without astuple's deep copy (they are ints).
        snap = (list(vars(t.stats).values()), t.healthy)  # type: ignore[attr-defined]
        if snap == self._tier_sent:
            return None
        self._tier_sent = snap
        return snap

    def _arm(self) -> None:
        if not self._send_armed:
            self._send_armed = True
            asyncio.get_running_loop().call_soon(self.send)

    def send(self, dead: str | None = None) -> None:
        self._send_armed = False
        snap = None
        if self._snap_dirty:
            self._snap_dirty = False
            with self._lock:
                snap = (self._snap_seqs, self._snap_tokens, list(self._snap_tenants.items()))
        frame = Frame(self._batches, self._handled, snap, self._steps, self._replies, dead,
                      self._tier_changed())  # fmt: skip
        self._batches, self._handled, self._steps, self._replies = [], [], [], []
        if not self._writer.is_closing():
            self._writer.write(_frame(self._enc.encode(frame)))

    def _flush(self) -> None:
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        tokens: list[tuple[int, str, int]] = []
        updates: list[tuple[int, list[RequestUpdate]]] = []
        fails: list[tuple[int, str, str]] = []
        for stream, kind, item in batch:
            sid = stream.sid  # type: ignore[attr-defined]
            if kind == _TOKEN:
                tokens.append((sid, item[0], item[1]))
            elif kind == _UPDATES:
                updates.append((sid, item))
            else:
                assert kind == _FAIL
                fails.append((sid, *_encode_error(item)))
        self._batches.append(Batch(tokens, updates, fails))
        self._arm()

    def _snapshot(self) -> None:
        super()._snapshot()
        self._snap_dirty = True
        self._arm()

    def _handle(self, msg: Message) -> bool:
        if isinstance(msg, AddRequest):
            self._handled.append(msg.stream.sid)  # type: ignore[attr-defined]
            self._snap_dirty = True
            self._arm()
        elif isinstance(msg, _AbortSid):
            s = self.streams.get(msg.gid)
            if s is not None and msg.sid in (-1, s.sid):  # type: ignore[attr-defined]
                self._dispatch(self.scheduler.abort(msg.gid))
            return True
        return super()._handle(msg)

    def _step_done(self, info: StepInfo) -> None:
        self._engine._on_step(info)  # the child's own hooks (a bench's busy host work)
        mo = info.mo
        generated = mo.generated_tokens
        stats = pickle.dumps(self.scheduler.stats())
        self._steps.append(Step(info.seconds, generated, stats))
        self._arm()

    def take_add(self, msg: Add) -> None:
        """An add from the parent: the samples rebuilt here, queued as `EngineCore.add`
        does after its admission (which the parent did)."""
        stream = _ChildStream(msg.request_id, msg.params.n, msg.sid)
        try:
            group = self._engine.build_group(
                msg.request_id, msg.prompt_ids, msg.params, msg.cache_salt, msg.publish_prefix,
                tenant=msg.tenant, conversation=msg.conversation, priority=msg.priority,
                grammar_share=msg.grammar_share,
            )  # fmt: skip
        except Exception as e:
            self._handled.append(msg.sid)
            self._outbox.append((stream, _FAIL, e))
            self._flush()
            return
        for r in group:
            r.arrival_time = msg.arrival_time  # CLOCK_MONOTONIC: the same in both processes
        with self._lock:
            self._inbox_seqs += len(group)
            self._inbox_tokens += group[0].prompt_len
            self._inbox_tenants[msg.tenant] = self._inbox_tenants.get(msg.tenant, 0) + 1
        self._adding.add(msg.request_id)
        self.post(AddRequest(group, stream))


async def _child_serve(engine: AsyncEngine, sock: socket.socket) -> int:
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    core = ChildCore(engine, writer)
    engine.core = core
    # As in one process: the prefix tier started on this loop, a TP/PP rank's exit
    # watched (it fails the engine, as a step's error does).
    await engine.start()
    task = core._task
    assert task is not None
    stopped = asyncio.Event()

    async def answer(q: Query) -> None:
        try:
            if q.what not in QUERIES:
                raise ValueError(f"unknown query {q.what!r}")
            r = getattr(engine, q.what)(*q.args)
            value = await r if asyncio.iscoroutine(r) else r
            payload = pickle.dumps((True, value))
        except Exception as e:
            payload = pickle.dumps((False, f"{type(e).__name__}: {e}"))
        core._replies.append((q.qid, payload))
        core._arm()

    # Adds whose grammar compiles, by group id: the last task of that request's chain
    # (its add, then the messages that came for it meanwhile) and its conversation.
    # A compile takes up to two COMPILE_TIMEOUT_S (the worker's check, then the compile);
    # every other request's messages go on past it, as in one process, where each
    # handler compiles its own.
    compiling: dict[str, tuple[asyncio.Task[None], str | None]] = {}
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Any) -> asyncio.Task[None]:
        t = asyncio.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        return t

    def chain(gid: str, conversation: str | None, coro: Any) -> None:
        t = spawn(coro)
        compiling[gid] = (t, conversation)

        def done(_: asyncio.Task[None]) -> None:
            if compiling.get(gid, (None,))[0] is t:
                del compiling[gid]

        t.add_done_callback(done)

    async def add_compiled(msg: Add) -> None:
        with contextlib.suppress(Exception):  # build_group says why, per request
            await engine.compile_grammar(msg.params)
        core.take_add(msg)

    async def after(waits: list[asyncio.Task[None]], fn: Callable[[], None]) -> None:
        await asyncio.gather(*waits, return_exceptions=True)
        fn()

    def abort(msg: Abort) -> None:
        core.post(_AbortSid(msg.group_id, msg.sid))  # type: ignore[arg-type]

    async def read() -> None:
        dec = msgspec.msgpack.Decoder(ToChild)
        while True:
            msg = dec.decode(await _read_frame(reader))
            if isinstance(msg, Add):
                if msg.params.structured_outputs is not None:
                    chain(msg.request_id, msg.conversation, add_compiled(msg))
                else:
                    core.take_add(msg)
            elif isinstance(msg, Abort):
                held = compiling.get(msg.group_id)
                if held is None:
                    abort(msg)
                else:  # after its add (the abort checks the sid then)
                    chain(msg.group_id, held[1], after([held[0]], lambda m=msg: abort(m)))
            elif isinstance(msg, Finish):
                core.finish_sequence(msg.req_id)  # its tokens came: the add was taken
            elif isinstance(msg, Release):
                # After the conversation's adds (and their aborts) still compiling: one
                # taken after the release would pin its KV with no release to come.
                held = [t for t, conv in compiling.values() if conv == msg.key]
                if held:
                    spawn(after(held, lambda k=msg.key: core.release_conversation(k)))
                else:
                    core.release_conversation(msg.key)
            elif isinstance(msg, Query):
                spawn(answer(msg))
            elif isinstance(msg, Stop):
                # The adds still compiling go in first, as they did in order before.
                await asyncio.gather(*tasks, return_exceptions=True)
                stopped.set()
                return

    reading = asyncio.create_task(read())
    await asyncio.wait({task, reading}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():  # the engine died (a step raised)
        e = None if task.cancelled() else task.exception()
        core.send(dead=str(e) if e is not None else "the engine's loop ended")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.drain(), 5)
        engine.executor.shutdown(wait=False)
        return 1
    if not stopped.is_set():  # the parent went away without a stop: nobody to serve
        log.warning("engine process: the server closed the connection; exiting")
        return 0
    await engine.shutdown()
    core.send()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.drain(), 5)
        writer.close()
    return 0


def _die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the server's process is gone, however it went (even SIGKILL, and
    while the model still loads).  Polled rather than PR_SET_PDEATHSIG, which fires when
    the *thread* that started this process ends (a worker thread of the server's)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="pagestream-parent-watch", daemon=True).start()


def child_main(fd: int, parent_pid: int) -> int:
    _die_with_parent(parent_pid)
    # The server owns this process's life: a Ctrl-C or a SIGTERM to the whole group
    # reaches the server, which drains and then stops the engine here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    try:
        config, builder, level = pickle.loads(_recv_blocking(sock))
        logging.basicConfig(
            level=level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
        )
        # Inline on the child's loop: this process is the engine's own (one data-parallel
        # rank's, where there are several).
        config = config.replace(engine_process=False, engine_thread=False, data_parallel_size=1)
        engine = builder(config)
        facts = {
            "eos_token_ids": tuple(engine.eos_token_ids),
            "vocab_size": engine.vocab_size,
            "embedding_only": engine.embedding_only,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.scheduler.config.max_num_seqs,
            "block_size": engine.scheduler.block_size,
            "model_dir": str(engine.model_dir),
            "async_scheduling": engine.core.async_scheduling,
            "device": str(getattr(engine.runner, "device", "cpu")),
            "kv_cache_dtype": str(getattr(engine.runner, "kv_cache_dtype", "auto")),
            "quantization": getattr(engine.runner, "quantization", None),
            "num_kv_blocks": int(getattr(engine.runner, "num_kv_blocks", 0)),
            "kv_bytes_per_block": int(getattr(engine.runner, "kv_bytes_per_block", 0)),
            "runner_block_size": int(getattr(engine.runner, "block_size", 1)),
            "tier": engine.tier.name if engine.tier is not None else None,
        }
    except BaseException as e:
        log.exception("engine process: the engine failed to build")
        with contextlib.suppress(OSError):
            sock.sendall(_frame(pickle.dumps(("error", f"{type(e).__name__}: {e}"))))
        return 1
    sock.sendall(_frame(pickle.dumps(("ready", facts))))
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_child_serve(engine, sock))
    finally:
        logging.shutdown()


def remote_runner(facts: dict) -> SimpleNamespace:
    """What the parent reads of the runner (AsyncEngine, metrics), from the child's
    facts."""
    return SimpleNamespace(
        eos_token_ids=facts["eos_token_ids"],
        config=SimpleNamespace(
            vocab_size=facts["vocab_size"], embedding_only=facts["embedding_only"]
        ),
        device=SimpleNamespace(type=facts["device"].split(":")[0]),
        max_model_len=facts["max_model_len"],
        kv_cache_dtype=facts["kv_cache_dtype"],
        quantization=facts["quantization"],
        num_kv_blocks=facts["num_kv_blocks"],
        kv_bytes_per_block=facts["kv_bytes_per_block"],
        block_size=facts["runner_block_size"],
    )


if __name__ == "__main__":
    code = child_main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    # The executor's worker thread is not a daemon: after a death, a step stuck in a
    # broken device would hold an ordinary exit.
    os._exit(code)
