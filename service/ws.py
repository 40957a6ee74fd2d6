"""WebSocket transport: many concurrent generations multiplexed on one socket.

Client frames (JSON, `type`-tagged): `generate` {id, messages | prompt, params},
`cancel` {id}, `ping`.  Server frames: `delta` {id, index, text, token_ids}, `done`
{id, finish_reason, finish_reasons, usage}, `error` {id, code, message, param}, `pong`.
A frame that does not parse gets an `error` frame; the socket stays usable.  Closing the
socket aborts every generation it started.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from scheduler.scheduler import RequestRejected
from service.openai_api import TENANT_SALT, salted
from service.protocol import BadRequest, WSCancel, WSGenerate, WSPing, decode_ws
from service.security import check_origin
from service.state import STATE, ServerState

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 20.0
MAX_FRAME_BYTES = 1 << 20
MAX_CONCURRENT_PER_SOCKET = 64


class WSSession:
    def __init__(
        self,
        ws: web.WebSocketResponse,
        state: ServerState,
        conn_id: str,
        tenant_salt: str | None = None,
    ) -> None:
        self.ws = ws
        self.tenant_salt = tenant_salt  # the API key's prefix-cache salt (see app.py)
        self.state = state
        self.conn_id = conn_id
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # Recently finished ids, so a cancel that crossed its `done` is not an error.
        self.finished: collections.deque[str] = collections.deque(maxlen=256)
        # One writer drains this queue, so concurrent generations never interleave frames
        # and a slow client applies back-pressure to the writer, not to the engine.
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def send(self, frame: dict[str, Any]) -> None:
        self.outbox.put_nowait(orjson.dumps(frame))

    def error(self, gen_id: str | None, code: int, message: str, param: str | None = None) -> None:
        self.send({"type": "error", "id": gen_id, "code": code, "message": message, "param": param})

    async def writer(self) -> None:
        while (data := await self.outbox.get()) is not None:
            if self.ws.closed:
                return
            try:
                await self.ws.send_str(data.decode())
            except (ConnectionError, RuntimeError):
                return

    async def run(self) -> None:
        writer = asyncio.create_task(self.writer())
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    self.handle(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    self.error(None, 400, "binary frames are not supported; send JSON text")
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            for t in self.tasks.values():
                t.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
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
        elif isinstance(frame, WSGenerate):
            if frame.id in self.tasks:
                self.error(
                    frame.id, 400, f"a generation with id {frame.id!r} is already running", "id"
                )
            elif self.state.draining:
                self.error(frame.id, 503, "the server is shutting down")
            elif len(self.tasks) >= MAX_CONCURRENT_PER_SOCKET:
                self.error(frame.id, 429, "too many concurrent generations on this socket")
            elif self.state.engine is None:
                self.error(frame.id, 503, "the model is still loading")
            else:
                self.tasks[frame.id] = asyncio.create_task(self.generate(frame))

    async def generate(self, frame: WSGenerate) -> None:
        engine = self.state.engine
        assert engine is not None
        gid = frame.id
        self.state.inflight_inc()
        try:
            try:
                params = frame.params.to_sampling_params()
                if (frame.messages is None) == (frame.prompt is None):
                    raise BadRequest("give exactly one of messages or prompt", "messages")
                if frame.messages is not None:
                    try:
                        ids = engine.render_chat([m.as_template_dict() for m in frame.messages])
                    except ValueError as e:
                        raise BadRequest(str(e), "messages") from e
                else:
                    ids = engine.encode_prompt(frame.prompt)  # type: ignore[arg-type]
                rid = f"ws-{self.conn_id}-{gid}"
                salt = salted(self.tenant_salt, frame.cache_salt)
                gen = engine.generate("", params, rid, prompt_token_ids=ids, cache_salt=salt)
                last = None
                async for out in gen:
                    last = out
                    for o in out.outputs:
                        if o.delta_text or o.delta_token_ids:
                            self.send(
                                {
                                    "type": "delta",
                                    "id": gid,
                                    "index": o.index,
                                    "text": o.delta_text,
                                    "token_ids": o.delta_token_ids,
                                }
                            )
                assert last is not None
                completion = sum(len(o.token_ids) for o in last.outputs)
                reasons = [o.finish_reason for o in last.outputs]
                self.send(
                    {
                        "type": "done",
                        "id": gid,
                        "finish_reason": reasons[0],
                        "finish_reasons": reasons,
                        "usage": {
                            "prompt_tokens": len(ids),
                            "completion_tokens": completion,
                            "total_tokens": len(ids) + completion,
                        },
                    }
                )
            except BadRequest as e:
                self.error(gid, e.status, e.message, e.param)
            except RequestRejected as e:
                self.error(gid, 400, str(e), "prompt")
            except asyncio.CancelledError:
                if not self.ws.closed:
                    self.send(
                        {
                            "type": "done",
                            "id": gid,
                            "finish_reason": "abort",
                            "finish_reasons": ["abort"],
                            "usage": None,
                        }
                    )
                raise
            except Exception as e:
                log.exception("generation %s failed", gid)
                self.error(gid, 500, f"generation failed: {e}")
        finally:
            self.tasks.pop(gid, None)
            self.finished.append(gid)
            self.state.inflight_dec()


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
    if not check_origin(request, state.config.allowed_origins, state.trusted_proxies):
        return web.Response(status=403, text="cross-origin WebSocket refused")
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_SECONDS, max_msg_size=MAX_FRAME_BYTES)
    await ws.prepare(request)
    state.websockets.add(ws)
    session = WSSession(ws, state, state.next_conn_id(), request.get(TENANT_SALT))
    try:
        await session.run()
    finally:
        state.websockets.discard(ws)
        if not ws.closed:
            await ws.close(code=WSCloseCode.GOING_AWAY if state.draining else WSCloseCode.OK)
    return ws
