"""Resumable streams (issue 51): a dropped connection does not lose the answer.

Every event of a stream (an SSE event of /v1/chat/completions or /v1/completions, a
`delta` / `done` / `error` frame of a WebSocket generation) is numbered (SSE `id:` lines,
the frames' `seq`) and kept in the stream's `StreamLog`: its newest events, up to
`--resume-buffer-bytes`.  The generation writes into its log, never into a connection;
the connection that holds the log (its `owner`) is handed each event as it comes, so a
connection that drops costs the generation nothing:

- The generation runs on through the gap rather than pausing: a gap is seconds, the
  request holds its KV blocks either way (a paused one would too, or recompute its whole
  context on resume), and running on lets the client that comes back catch up at once.
  What runs on is bounded: the events made while no connection holds the log must fit in
  the buffer; past it the generation is aborted at once (KV freed) and a resume gets 410.
- A connection that comes back within `--resume-grace` seconds with the last position it
  saw (SSE: `GET /v1/streams/{response id}` with `Last-Event-ID`; WebSocket: a `resume`
  frame with the generation's token) gets the events after it, then the live tail.  The
  last replayed event and going live happen with no await between them, and the
  generation's writes are sequential, so no event is missed or sent twice.
- A resume takes the log over from a connection that still holds it: the server may not
  know yet that it is dead (a phone that changed networks leaves it open until a write
  times out).  That connection's response ends there.
- What all detached streams (no connection holds them) buffer together is bounded too,
  by `--resume-buffer-total-bytes`: past it the streams detached longest are aborted
  (their KV freed) and their logs emptied (a resume gets 410), oldest first, so a wave
  of dropped connections cannot hold the server's memory for a grace period each.
- With no connection for the grace period the generation is aborted (its KV freed) and
  the log dropped.  A finished stream's log is kept for the grace period as well (its
  last events may have died with the connection that carried them), then dropped.
- Logs are per tenant (API key), as request ids are: another key's resume finds nothing
  (404).  A client's own X-Request-Id stays claimed while its generation runs, also
  through a gap (409 for a new request with it, as before); once it ended, a new request
  may take the id, and with it the address of the finished stream's log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import orjson
from aiohttp import web

from service.http_util import error_body
from service.protocol import BadRequest
from service.request_ids import LiveRequestIds

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0
DEFAULT_BUFFER_BYTES = 1 << 20
# Across all detached streams: 64 full per-stream buffers (a typical answer's events are
# far smaller, so many more streams fit).
DEFAULT_TOTAL_BUFFER_BYTES = 64 << 20
MAX_POSITION_DIGITS = 18  # a Last-Event-ID / `after` longer than this is not ours


class Sink(Protocol):
    """A connection holding a log: told when another takes it over or the stream ends."""

    def displaced(self) -> None: ...

    def finished(self) -> None: ...


class StreamLog:
    """One stream's numbered events (the newest, up to the registry's byte cap), the
    connection holding it, and the task generating it."""

    def __init__(self, registry: StreamRegistry, key: tuple[str | None, str, str]) -> None:
        self.registry = registry
        self.key = key  # (tenant, "sse" | "ws", response id | resume token)
        self.gid: str | None = None  # a WebSocket generation's id (its frames carry it)
        self.events: deque[tuple[int, bytes]] = deque()
        self.nbytes = 0
        self.last = 0  # position of the newest event
        self.written = 0  # newest position handed to any connection
        self.owner: Any = None
        self.live = False  # the owner has caught up: new events go straight to it
        self.done = False
        self.lost = False  # events no connection got were dropped: no resume can work
        self.lost_why = ""  # "buffer" (this stream's cap) or "memory" (the total cap)
        self.detached = False  # in registry.detached: no connection holds it
        self.counted = 0  # bytes of it in registry.detached_bytes
        self.taken = False  # some connection held it once: the next to take it resumes
        self.producer: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.claim: tuple[str | None, str] | None = None  # request_ids claim to release
        # A background response's stream (service/responses_background.py): its
        # generation runs to its end whoever reads it; a resume may still find it gone.
        self.background = False
        # Where its events are relayed for other replicas (service/stream_relay.py).
        self.relay: Any = None

    @property
    def token(self) -> str:
        return self.key[2]

    @property
    def first(self) -> int:
        return self.events[0][0] if self.events else self.last + 1

    # ------------------------------------------------------------ the producer's side
    async def put(self, data: bytes) -> None:
        """An SSE event: numbered, kept, and written to the connection holding the log
        (the write's back-pressure pauses the generation, as without resume)."""
        pending = self.offer(data)
        if pending is not None:
            await pending

    def offer(self, data: bytes) -> Awaitable[None] | None:
        """`put` without a coroutine when the connection holding the log takes the event
        at once (`SSESink.deliver_now`); else the write to await, in order, before the
        next event."""
        seq = self.last + 1
        data = b"id: %d\n%s" % (seq, data)
        self._store(data)
        if self.live and not self.lost:
            owner = self.owner
            if not owner.deliver_now(self, seq, data):
                return owner.deliver(self, seq, data)  # type: ignore[no-any-return]
        return None

    def put_frame(self, frame: dict[str, Any]) -> None:
        """A WebSocket generation's frame: numbered (`seq`; a `delta` also carries the
        `resume` token), kept, and queued on the socket holding the log."""
        seq = frame["seq"] = self.last + 1
        if frame["type"] == "delta":
            frame["resume"] = self.token
        data = orjson.dumps(frame)
        self._store(data)
        if self.live and not self.lost:
            self.owner.deliver(self, seq, data)

    async def write_eof(self) -> None:
        """The producer's end of the stream (it writes to the log as to a response)."""
        self.finish()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            if self.relay is not None:
                self.relay.close()
            if self.owner is not None:
                self.owner.finished()
            self.registry.release_claim(self)  # the request is over: its id is free
            self.registry.arm(self)

    def _store(self, data: bytes) -> None:
        if self.relay is not None:
            self.relay.add(data)  # (it numbers on where this log lost its events)
        if self.lost:
            return
        self.last += 1
        self.events.append((self.last, data))
        self.nbytes += len(data)
        while self.nbytes > self.registry.cap and len(self.events) > 1:
            seq, old = self.events.popleft()
            self.nbytes -= len(old)
            if seq > self.written:  # no connection ever got it: no resume can succeed
                self._lose("buffer")
                return
        if self.detached:
            self.registry.recount(self)
            self.registry.enforce_total()

    def _lose(self, why: str) -> None:
        registry = self.registry
        registry.undetach(self)
        running = self.producer is not None and not self.producer.done()
        if running or why == "buffer" or self.written < self.last:
            registry.expired[why] += 1  # (a finished stream fully delivered loses nothing)
        self.lost, self.lost_why = True, why
        self.events.clear()
        self.nbytes = 0
        cap = registry.cap if why == "buffer" else registry.total_cap
        log.info("stream %s: over %d bytes buffered with no reader (%s); %s",
                 self.key[2], cap, why,
                 "its events dropped (a background response runs on)" if self.background
                 else "aborted")  # fmt: skip
        if running and not self.background:
            self.producer.cancel()  # aborts the request: its KV blocks are freed

    # ------------------------------------------------------------ the readers' side
    def since(self, after: int) -> list[tuple[int, bytes]]:
        """The events after position `after`; ResumeGone when some are no longer kept."""
        if self.lost or after < self.first - 1:
            raise ResumeGone(self)
        if after >= self.last:
            return []
        return list(itertools.islice(self.events, after - self.first + 1, None))

    def check(self, after: int, param: str) -> None:
        """A resume from `after` can be served: 400 past the end, 410 when gone."""
        if after > self.last:
            raise BadRequest(
                f"{param} {after} is past this stream's last event ({self.last})", param
            )
        try:
            self.since(after)
        except ResumeGone as e:
            raise BadRequest(str(e), param, status=410) from None

    def take(self, sink: Sink) -> None:
        """`sink` holds the log from now (not live until it has caught up)."""
        old, self.owner, self.live = self.owner, sink, False
        if old is not None and old is not sink:
            old.displaced()
        if self.taken:
            self.registry.resumed += 1
        self.taken = True
        self.registry.undetach(self)
        self.registry.disarm(self)  # release() arms it again

    def go_live(self, sink: Sink) -> None:
        if self.owner is sink:
            self.live = True

    def release(self, sink: Sink) -> None:
        """`sink`'s connection is gone: the grace period starts."""
        if self.owner is sink:
            self.owner, self.live = None, False
            self.registry.arm(self)
            self.registry.detach(self)


class ResumeGone(Exception):
    def __init__(self, stream: StreamLog) -> None:
        if stream.lost and stream.lost_why == "memory":
            why = (
                "the detached streams together held more than --resume-buffer-total-bytes "
                f"({stream.registry.total_cap}) and this one was detached longest; it was "
                "aborted"
            )
        elif stream.lost:
            why = (
                f"more than {stream.registry.cap} bytes of events were made while no "
                "connection held this stream; it was aborted"
            )
        else:
            why = f"only the events after {stream.first - 1} are still kept"
        super().__init__(f"this stream cannot be resumed from there: {why}")


class SSESink:
    """An HTTP response following a log; `write` is the bounded SSE write."""

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[None]],
        write_now: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.write = write
        # The same write when it cannot wait, done at once (True) or refused (False).
        self.write_now = write_now
        self.pos = 0
        self.ended = asyncio.Event()

    def deliver_now(self, stream: StreamLog, seq: int, data: bytes) -> bool:
        """`deliver` when the write cannot wait; False: nothing written, await `deliver`."""
        if self.write_now is None or not self.write_now(data):
            return False
        self.pos = seq
        if seq > stream.written:
            stream.written = seq
        return True

    async def deliver(self, stream: StreamLog, seq: int, data: bytes) -> None:
        try:
            await self.write(data)
        except ConnectionError:  # reset, or too slow (SlowClient): the stream goes on
            stream.release(self)
            self.ended.set()
            return
        self.pos = seq
        stream.written = max(stream.written, seq)

    def displaced(self) -> None:
        self.ended.set()

    def finished(self) -> None:
        self.ended.set()


async def follow(stream: StreamLog, sink: SSESink, after: int) -> bool:
    """Hold `stream` for this connection: the events after `after`, then the live tail
    until the stream ends (True: all of it written here), another connection takes it
    over or this one fails (False).  Leaving, for any reason, starts the grace period."""
    stream.take(sink)
    pos = sink.pos = after
    try:
        while stream.owner is sink:
            try:
                batch = stream.since(pos)
            except ResumeGone as e:  # the replay fell behind the buffer's window
                await sink.write(b"data: " + error_body(str(e), 410) + b"\n\n")
                return False
            if not batch:
                if stream.done:
                    return True
                stream.go_live(sink)  # no await since `since`: nothing slips between
                await sink.ended.wait()
                return stream.done and stream.owner is sink and sink.pos == stream.last
            for seq, data in batch:
                await sink.write(data)
                pos = sink.pos = seq
                stream.written = max(stream.written, seq)
                if stream.owner is not sink:
                    break
        return False
    except ConnectionError:
        return False
    finally:
        stream.release(sink)


class WSSink:
    """A WebSocket session (service/ws.py's WSSession) following one generation's log."""

    def __init__(self, session: Any, gid: str, stream: StreamLog) -> None:
        self.session = session
        self.gid = gid
        self.stream = stream
        self.pos = 0

    def deliver(self, stream: StreamLog, seq: int, data: bytes) -> None:
        self.session.send_data(data)
        self.pos = seq
        stream.written = max(stream.written, seq)

    def displaced(self) -> None:
        # Another socket holds the generation now: this one's `cancel` and close no
        # longer reach it.
        s = self.session
        if s.attached.get(self.gid) is self:
            del s.attached[self.gid]
            if s.tasks.get(self.gid) is self.stream.producer:
                del s.tasks[self.gid]

    def finished(self) -> None:
        self.stream.release(self)  # a socket does not wait for the end: the grace starts


class StreamRegistry:
    """Every resumable stream's log, per tenant; owned by the event loop thread."""

    def __init__(
        self,
        grace: float = DEFAULT_GRACE_S,
        cap: int = DEFAULT_BUFFER_BYTES,
        ids: LiveRequestIds | None = None,
        busy: tuple[Callable[[], None], Callable[[], None]] | None = None,
        total_cap: int = DEFAULT_TOTAL_BUFFER_BYTES,
    ) -> None:
        self.grace = grace
        self.cap = cap
        self.total_cap = total_cap
        # Streams no connection holds, longest detached first, and the bytes they buffer.
        self.detached: dict[tuple[str | None, str, str], StreamLog] = {}
        self.detached_bytes = 0
        self.resumed = 0  # logs taken over by a resuming connection
        # Streams given up with something the client never got, by why: grace (nobody
        # came back in time), buffer (its own cap), memory (the total cap).
        self.expired: dict[str, int] = dict.fromkeys(("grace", "buffer", "memory"), 0)
        self.ids = ids  # the claims of client-chosen ids are released with their logs
        self.busy = busy  # (hold, unhold): a running generation keeps SIGTERM waiting
        self.logs: dict[tuple[str | None, str, str], StreamLog] = {}

    @property
    def enabled(self) -> bool:
        return self.grace > 0

    def open(self, tenant: str | None, kind: str, name: str | None = None) -> StreamLog | None:
        """A new log (name: an SSE response id; a fresh token for a WebSocket), or None
        when resume is off or the name is taken (then the stream is not resumable)."""
        if not self.enabled:
            return None
        key = (tenant, kind, name or secrets.token_urlsafe(16))
        old = self.logs.get(key)
        if old is not None:
            if not old.done:  # cannot be: a live stream's id stays claimed
                return None
            self.drop(old)  # a finished one's id was reused: the new stream has it
        stream = self.logs[key] = StreamLog(self, key)
        return stream

    def find(self, tenant: str | None, kind: str, name: str) -> StreamLog | None:
        return self.logs.get((tenant, kind, name))

    def run(
        self, stream: StreamLog, produce: Coroutine[Any, Any, Any], on_exit: Callable[[], None]
    ) -> None:
        """Run a stream's producer as its own task, so it outlives its connection."""

        async def producer() -> None:
            try:
                await produce
            except Exception:
                log.exception("stream %s failed", stream.token)
            finally:
                on_exit()
                stream.finish()
                if self.busy is not None:
                    self.busy[1]()

        if self.busy is not None:
            self.busy[0]()
        stream.producer = asyncio.create_task(producer())

    def arm(self, stream: StreamLog) -> None:
        if stream.timer is None and self.logs.get(stream.key) is stream:
            loop = asyncio.get_running_loop()
            stream.timer = loop.call_later(self.grace, self._expire, stream)

    def disarm(self, stream: StreamLog) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    def _expire(self, stream: StreamLog) -> None:
        stream.timer = None
        if stream.owner is not None:
            return  # held again (take() disarms; kept for safety): release() re-arms
        running = stream.producer is not None and not stream.producer.done()
        if running and stream.background:
            return  # it runs on, resumable; its end arms the grace period again
        if not stream.lost and (running or stream.written < stream.last):
            self.expired["grace"] += 1
        if running:
            stream.producer.cancel()  # nobody came back: abort, freeing its KV blocks
        self.drop(stream)

    def detach(self, stream: StreamLog) -> None:
        """No connection holds `stream` now: its bytes count against the total cap."""
        if stream.detached or stream.lost or self.logs.get(stream.key) is not stream:
            return
        stream.detached = True
        self.detached[stream.key] = stream
        self.recount(stream)
        self.enforce_total()

    def recount(self, stream: StreamLog) -> None:
        self.detached_bytes += stream.nbytes - stream.counted
        stream.counted = stream.nbytes

    def undetach(self, stream: StreamLog) -> None:
        if stream.detached:
            stream.detached = False
            del self.detached[stream.key]
            self.detached_bytes -= stream.counted
            stream.counted = 0

    def enforce_total(self) -> None:
        """Over the total cap: abort the streams detached longest until under it."""
        while self.detached_bytes > self.total_cap and self.detached:
            next(iter(self.detached.values()))._lose("memory")

    def drop(self, stream: StreamLog) -> None:
        self.undetach(stream)
        self.disarm(stream)
        if self.logs.get(stream.key) is stream:
            del self.logs[stream.key]
        stream.events.clear()
        stream.nbytes = 0
        self.release_claim(stream)

    def release_claim(self, stream: StreamLog) -> None:
        if stream.claim is not None and self.ids is not None:
            self.ids.release(*stream.claim)
            stream.claim = None

    def retry_field(self) -> bytes:
        """SSE `retry:` for a resumed stream: EventSource reconnects well within grace."""
        return b"retry: %d\n\n" % max(100, min(1000, int(self.grace * 250)))

    def lookup_sse(self, request: web.Request, tenant: str | None) -> tuple[StreamLog, int]:
        """The log and position `GET /v1/streams/{id}` resumes from: `Last-Event-ID`
        (EventSource sends it when it reconnects), else `?last_event_id=` (a new
        EventSource cannot set headers), else from the start."""
        name = request.match_info["id"]
        param = "Last-Event-ID"
        raw = request.headers.get(param)
        if raw is None:
            param = "last_event_id"
            raw = request.query.get(param)
        after = parse_position(raw, param)
        stream = self.find(tenant, "sse", name)
        if stream is None:
            raise BadRequest(
                f"no resumable stream {name[:300]!r}: it ended more than --resume-grace "
                "seconds ago, was never started, or belongs to another API key",
                "id",
                status=404,
            )
        stream.check(after, param)
        return stream, after


def parse_position(raw: str | None, param: str) -> int:
    if raw is None:
        return 0
    raw = raw.strip()
    if not (raw.isdigit() and raw.isascii() and len(raw) <= MAX_POSITION_DIGITS):
        raise BadRequest(f"{param} must be an event position (a non-negative integer)", param)
    return int(raw)


def resume_ws(session: Any, gid: str, token: str, after: int) -> None:
    """A WebSocket `resume` frame: replay the generation's frames after `after` on this
    socket, then follow it here (its `cancel` and this socket's close now reach it).
    Synchronous, so nothing can slip in between the replay and going live."""
    streams: StreamRegistry = session.state.streams
    try:
        if gid in session.tasks:
            raise BadRequest(f"a generation with id {gid!r} is already running", "id", 409)
        stream = streams.find(session.tenant, "ws", token)
        if stream is None or stream.gid != gid:
            raise BadRequest(
                "no resumable generation with this id and token: it ended more than "
                "--resume-grace seconds ago, never existed, or belongs to another API key",
                "resume",
                status=404,
            )
        stream.check(after, "after")
    except BadRequest as e:
        session.error(gid, e.status, e.message, e.param)
        return
    sink = WSSink(session, gid, stream)
    stream.take(sink)
    for seq, data in stream.since(after):
        sink.deliver(stream, seq, data)
    if stream.done or stream.producer is None:
        stream.release(sink)
        return
    stream.go_live(sink)
    task = stream.producer
    session.tasks[gid] = task
    session.attached[gid] = sink
    task.add_done_callback(lambda _: sink.displaced())


def ws_log(session: Any, gid: str) -> StreamLog | None:
    """A new WebSocket generation's log, held by `session` (None when resume is off)."""
    stream: StreamLog | None = session.state.streams.open(session.tenant, "ws")
    if stream is None:
        return None
    stream.gid = gid
    stream.producer = asyncio.current_task()
    sink = WSSink(session, gid, stream)
    session.attached[gid] = sink
    stream.take(sink)
    stream.go_live(sink)
    return stream


def ws_detach(session: Any, gid: str) -> bool:
    """The socket closed: a resumable generation it holds runs on for the grace period
    (True); anything else is for the caller to cancel (False)."""
    sink = session.attached.get(gid)
    if sink is None or sink.stream.done:
        return False
    sink.stream.release(sink)
    return True


STREAM_LOG = web.RequestKey("pagestream_stream_log", StreamLog)
