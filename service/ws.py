"""WebSocket transport: many concurrent generations multiplexed on one socket.

Client frames (JSON, `type`-tagged): `generate` {id, messages | prompt, params},
`cancel` {id}, `ping`, `resume` {id, resume, after}.  Server frames: `delta` {id, index,
text, token_ids, and `reasoning` under --reasoning-parser}, `done` {id, finish_reason, finish_reasons, usage}, `error` {id, code,
message, param}, `pong`.  A frame that does not parse gets an `error` frame; the socket
stays usable.  Closing the socket aborts every generation it started, except resumable
ones (`--resume-grace` > 0: frames also carry `seq`, deltas a `resume` token), which run
on for the grace period for a `resume` frame on another socket (service/resume.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any

import msgspec
import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from scheduler.engine_core import EngineDeadError, EngineOverloaded
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import MaxTokensTooLarge, RequestFailed
from service.http_util import (
    TENANT_SALT,
    error_response,
    limit_send_buffer,
    salted,
    wait_drained,
    write_cannot_wait,
)
from service.openai_chat import Thinking
from service.protocol import BadRequest, check_messages
from service.protocol_ws import WSCancel, WSGenerate, WSPing, WSResume, decode_ws
from service.request_ids import TENANT, conversation_key
from service.resume import StreamLog, resume_ws, ws_detach, ws_log
from service.security import check_origin
from service.state import STATE, ServerState
from service.structured import GrammarError

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 20.0


class WSSession:
    def __init__(
        self,
        ws: web.WebSocketResponse,
        state: ServerState,
        conn_id: str,
        request: web.Request | None = None,
        tenant_salt: str | None = None,
    ) -> None:
        self.ws = ws
        self.tenant_salt = tenant_salt  # the API key's prefix-cache salt (see app.py)
        # The API key's tenant id (its share of the shared prefix tier).  Generation ids
        # are this socket's own: `cancel` only looks in self.tasks, and each engine id is
        # unique (request_ids.LiveRequestIds.engine_id), so no socket reaches another's.
        self.tenant = request.get(TENANT) if request is not None else None
        # The socket is one conversation: each generation's KV stays pinned for the next
        # (scheduler/pins.py) until the socket closes.  \x1e keeps it apart from any
        # client-given conversation id (those are printable).
        self.conversation = conversation_key(self.tenant, f"\x1ews{conn_id}")
        self.state = state
        self.conn_id = conn_id
        self.request = request
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.attached: dict[str, Any] = {}  # id -> resume.WSSink of generations it holds
        # Recently finished ids, so a cancel that crossed its `done` is not an error.
        self.finished: collections.deque[str] = collections.deque(maxlen=256)
        # One writer drains this queue, so concurrent generations never interleave frames.
        # What waits for the client (this queue plus the socket's write buffer) is bounded
        # in bytes: a reader that falls further behind than that (or lets one frame wait
        # longer than the send timeout) has its generations aborted and the socket closed
        # with 1008, rather than the server buffering without end.
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.outbox_bytes = 0
        self.max_buffered = state.config.max_buffered_bytes
        self.send_timeout = state.config.send_timeout
        self.closing = False
        self._writer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    def send(self, frame: dict[str, Any]) -> None:
        if not self.closing:
            self.send_data(orjson.dumps(frame))

    def send_data(self, data: bytes) -> None:
        if self.closing:
            return
        self.outbox_bytes += len(data)
        if self.outbox_bytes + self._transport_buffered() > self.max_buffered:
            self.too_slow(f"more than {self.max_buffered} bytes are waiting for it")
            return
        self.outbox.put_nowait(data)

    def release_conversation(self) -> None:
        if self.state.engine is not None and self.conversation is not None:
            self.state.engine.core.release_conversation(self.conversation)

    def _transport_buffered(self) -> int:
        transport = self.request.transport if self.request is not None else None
        return transport.get_write_buffer_size() if transport is not None else 0

    def error(
        self,
        gen_id: str | None,
        code: int,
        message: str,
        param: str | None = None,
        stream: StreamLog | None = None,
    ) -> None:
        frame = {"type": "error", "id": gen_id, "code": code, "message": message, "param": param}
        self.emit(stream, frame)

    def emit(self, stream: StreamLog | None, frame: dict[str, Any]) -> None:
        """A generation's frame: through its resume log when it has one (numbered, kept,
        sent on whichever socket holds the generation now), else on this socket."""
        if stream is None:
            self.send(frame)
        else:
            stream.put_frame(frame)

    def too_slow(self, why: str) -> None:
        """The client does not read: abort its generations (their KV blocks are freed at
        the next step) and close the socket with 1008 and the reason."""
        if self.closing:
            return
        self.closing = True
        log.warning("websocket %s: client too slow (%s); closing it", self.conn_id, why)
        if self.state.metrics is not None:
            self.state.metrics.slow_clients.labels(self.state.metrics.model_name, "ws").inc()
        for t in self.tasks.values():
            t.cancel()
        self._closer = asyncio.create_task(self._close_slow(why))

    async def _close_slow(self, why: str) -> None:
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()
        reason = f"client too slow: {why}"[:120].encode()
        try:
            async with asyncio.timeout(self.send_timeout):
                await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=reason)
        except (TimeoutError, ConnectionError, RuntimeError):
            pass
        finally:
            # The close frame could not even be sent: drop the connection and its buffer.
            transport = self.request.transport if self.request is not None else None
            if transport is not None and not transport.is_closing():
                transport.abort()

    async def writer(self) -> None:
        while (data := await self.outbox.get()) is not None:
            self.outbox_bytes -= len(data)
            if self.ws.closed or self.closing:
                return
            try:
                # Frames are JSON text already encoded: sent as they are (send_str would
                # encode a decoded copy), and with no timer while the write cannot wait.
                if self.request is not None and write_cannot_wait(
                    self.request, len(data), self.max_buffered // 2
                ):
                    await self.ws.send_frame(data, WSMsgType.TEXT)
                    continue
                async with asyncio.timeout(self.send_timeout):
                    await self.ws.send_frame(data, WSMsgType.TEXT)
                    transport = self.request.transport if self.request is not None else None
                    await wait_drained(transport, self.max_buffered // 2)
            except TimeoutError:
                self.too_slow(f"a frame waited more than {self.send_timeout:g} s to be sent")
                return
            except (ConnectionError, RuntimeError):
                return

    async def run(self) -> None:
        writer = self._writer = asyncio.create_task(self.writer())
        try:
            async for msg in self.ws:
                if self.closing:
                    continue
                if msg.type == WSMsgType.TEXT:
                    self.handle(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    self.error(None, 400, "binary frames are not supported; send JSON text")
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            # Resumable generations run on for the grace period (service/resume.py); each
            # unpins the socket's conversation again as it ends (it pinned its own KV).
            ended = []
            for gid, t in self.tasks.items():
                if ws_detach(self, gid):
                    t.add_done_callback(lambda _: self.release_conversation())
                else:
                    ended.append(t)
            for t in ended:
                t.cancel()
            aborted = asyncio.gather(*ended, return_exceptions=True)
            # After the aborts its generations queued (the last one pins nothing then),
            # and even when this handler is cancelled while it waits for them: the peer's
            # connection lost after its close frame cancels the handler here, and a
            # release skipped leaves the socket's pinned KV held until its TTL.
            aborted.add_done_callback(lambda _: self.release_conversation())
            await aborted
            if self._closer is not None:
                await asyncio.gather(self._closer, writer, return_exceptions=True)
            else:
                self.outbox.put_nowait(None)
                try:
                    await asyncio.wait_for(writer, 5.0)
                except (Exception, asyncio.CancelledError):
                    writer.cancel()
                    raise

    def handle(self, data: str) -> None:
        try:
            frame = decode_ws(data)
        except BadRequest as e:
            self.error(_frame_id(data), 400, e.message, e.param)
            return
        if isinstance(frame, WSPing):
            self.send({"type": "pong"})
        elif isinstance(frame, WSCancel):
            task = self.tasks.get(frame.id)
            if task is not None:
                task.cancel()
            elif frame.id not in self.finished:
                self.error(frame.id, 404, f"no generation with id {frame.id!r} is running")
            # else: the cancel crossed the `done` on the wire; nothing left to stop.
        elif isinstance(frame, WSResume):
            resume_ws(self, frame.id, frame.resume, frame.after)
        elif isinstance(frame, WSGenerate):
            if frame.id in self.tasks:
                self.error(
                    frame.id, 409, f"a generation with id {frame.id!r} is already running", "id"
                )
            elif self.state.draining:
                self.error(frame.id, 503, "the server is shutting down")
            elif len(self.tasks) >= (limit := self.state.config.limits.max_ws_generations):
                self.error(
                    frame.id,
                    429,
                    f"{limit} generations are already running on this socket (the limit)",
                )
            elif self.state.engine is None or self.state.prep is None:
                self.error(frame.id, 503, "the model is still loading")
            else:
                self.tasks[frame.id] = asyncio.create_task(self.generate(frame))

    async def generate(self, frame: WSGenerate) -> None:
        """One generation: its deltas and `done` frame, or an `error` frame; a cancel
        (frame or closed socket) ends it with finish reason `abort`."""
        assert self.state.engine is not None and self.state.prep is not None
        gid = frame.id
        stream = ws_log(self, gid)  # None when --resume-grace is 0
        self.state.inflight_inc()
        try:
            try:
                ids, params, thinking = await self._prepare(frame)
                await self._stream(frame, ids, params, stream, thinking)
            except BadRequest as e:
                self.error(gid, e.status, e.message, e.param, stream)
            except RequestRejected as e:  # (too long for the window, say)
                where = "messages" if frame.messages is not None else "prompt"
                self.error(gid, 400, str(e), where, stream)
            except EngineOverloaded as e:
                if self.state.metrics is not None:
                    self.state.metrics.on_rejected("overloaded")
                self.error(gid, 429, str(e), stream=stream)
            except RequestFailed as e:
                spec = frame.params.structured() if e.status < 500 else None
                self.error(gid, e.status, str(e), f"params.{spec[1]}" if spec else None, stream)
            except EngineDeadError as e:
                self.error(gid, 503, str(e), stream=stream)
            except asyncio.CancelledError:
                if stream is not None or not self.ws.closed:
                    self.emit(
                        stream,
                        {
                            "type": "done",
                            "id": gid,
                            "finish_reason": "abort",
                            "finish_reasons": ["abort"],
                            "usage": None,
                        },
                    )
                raise
            except Exception as e:
                log.exception("generation %s failed", gid)
                self.error(gid, 500, f"generation failed: {e}", stream=stream)
        finally:
            if self.tasks.get(gid) is asyncio.current_task():  # not if resumed elsewhere
                del self.tasks[gid]
            self.finished.append(gid)
            self.state.inflight_dec()
            if stream is not None:
                stream.finish()
                if (sink := self.attached.get(gid)) is not None and sink.stream is stream:
                    del self.attached[gid]

    async def _prepare(
        self, frame: WSGenerate
    ) -> tuple[list[int], SamplingParams, Thinking | None]:
        """Validate the frame, compile its grammar, and tokenize its prompt; a chat's
        reasoning (--reasoning-parser) is split from its answer."""
        engine, prep = self.state.engine, self.state.prep
        assert engine is not None and prep is not None
        serving = self.state.serving
        assert serving is not None
        params = serving.with_lora(
            frame.params.to_sampling_params(serving.defaults), serving.check_model(frame.model)
        )
        prep.limits.check_sampling(params, prefix="params.")
        prep.check_vocab_ids(params, "params.")
        params = await prep.with_bad_words(params, "params.bad_words")
        spec = frame.params.structured()
        try:
            await engine.compile_grammar(params)
        except GrammarError as e:
            raise BadRequest(str(e), spec[1] if spec else None) from e
        if (frame.messages is None) == (frame.prompt is None):
            raise BadRequest("give exactly one of messages or prompt", "messages")
        if frame.truncation == "auto" and frame.messages is None:
            raise BadRequest('truncation "auto" drops turns: it takes messages', "truncation")
        if frame.messages is not None:
            check_messages(frame.messages)
            messages = [m.as_template_dict() for m in frame.messages]
            if frame.truncation == "auto":
                cap = serving.defaults.cap(frame.params.max_tokens)
                ids = await prep.chat_ids_auto(messages, cap)
            else:
                ids = await prep.chat_ids(messages)
        else:
            (ids,) = await prep.prompt_ids([frame.prompt])  # type: ignore[list-item]
        thinking = serving.thinking(ids) if frame.messages is not None else None
        if thinking is not None and params.structured_outputs is not None:
            so = thinking.parser.constrain(params.structured_outputs, thinking.opening)
            params = msgspec.structs.replace(params, structured_outputs=so)
        return ids, params, thinking

    async def _stream(
        self,
        frame: WSGenerate,
        ids: list[int],
        params: SamplingParams,
        stream: StreamLog | None,
        thinking: Thinking | None = None,
    ) -> None:
        """Queue the request, send a `delta` frame per step and choice, then `done`."""
        engine, gid = self.state.engine, frame.id
        assert engine is not None
        rid = self.state.request_ids.engine_id(f"ws-{self.conn_id}-{gid}")
        salt = salted(self.tenant_salt, frame.cache_salt)
        try:
            sub = engine.submit(
                ids, params, rid, salt, tenant=self.tenant, conversation=self.conversation
            )
        except MaxTokensTooLarge as e:
            raise BadRequest(str(e), "params.max_tokens") from e
        gen = engine.generate("", submitted=sub)
        last = None
        thoughts = [thinking.streams() for _ in range(params.n)] if thinking else []
        async with contextlib.aclosing(gen):
            async for out in gen:
                last = out
                for o in out.outputs:
                    text, reasoning = o.delta_text, ""
                    if thoughts:
                        split_, count = thoughts[o.index]
                        count.feed(o.delta_token_ids)
                        reasoning, text = split_.take(text, o.finish_reason is not None)
                    if text or reasoning or o.delta_token_ids:
                        frame_: dict[str, Any] = {
                            "type": "delta",
                            "id": gid,
                            "index": o.index,
                            "text": text,
                            "token_ids": o.delta_token_ids,
                        }
                        if reasoning:
                            frame_["reasoning"] = reasoning
                        self.emit(stream, frame_)
        assert last is not None
        completion = sum(len(o.token_ids) for o in last.outputs)
        reasons = [o.finish_reason for o in last.outputs]
        usage: dict[str, Any] = {
            "prompt_tokens": len(ids),
            "completion_tokens": completion,
            "total_tokens": len(ids) + completion,
        }
        if thoughts:
            usage["reasoning_tokens"] = sum(count.count for _, count in thoughts)
        self.emit(
            stream,
            {
                "type": "done",
                "id": gid,
                "finish_reason": reasons[0],
                "finish_reasons": reasons,
                "usage": usage,
            },
        )


def _frame_id(data: str) -> str | None:
    """The `id` of a frame that failed validation, so the error names its generation."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    gid = obj.get("id") if isinstance(obj, dict) else None
    return gid if isinstance(gid, str) else None


async def websocket_handler(request: web.Request) -> web.StreamResponse:

    state = request.app[STATE]
    if not check_origin(
        request, state.config.allowed_origins, state.trusted_proxies, state.allowed_hosts
    ):
        return web.Response(status=403, text="cross-origin WebSocket refused")
    limits = state.config.limits
    # Sockets still in their handshake count too, so concurrent upgrades cannot overshoot.
    if len(state.websockets) + state.ws_opening >= limits.max_websockets:
        if state.metrics is not None:
            state.metrics.on_rejected("websockets")
        return error_response(
            f"{limits.max_websockets} WebSockets are already open (the server's limit)",
            429,
            headers={"Retry-After": "1"},
        )
    # A frame over the limit closes the socket with 1009 (message too big): the protocol's
    # own answer, since the frame cannot be parsed to say which generation it was.
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_SECONDS, max_msg_size=limits.max_ws_frame_bytes)
    limit_send_buffer(request, state.config.socket_send_buffer)
    state.ws_opening += 1
    try:
        await ws.prepare(request)
    finally:
        state.ws_opening -= 1
    state.websockets.add(ws)
    session = WSSession(ws, state, state.next_conn_id(), request, request.get(TENANT_SALT))
    try:
        await session.run()
    finally:
        state.websockets.discard(ws)
        if not ws.closed:
            # Bounded: a client that stopped reading must not hold the handler open.
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(state.config.send_timeout):
                    await ws.close(
                        code=WSCloseCode.GOING_AWAY if state.draining else WSCloseCode.OK
                    )
    return ws
