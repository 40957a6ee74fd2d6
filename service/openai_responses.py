"""/v1/responses (OpenAI's Responses API): a response is a chat turn (the request becomes
a chat request, `ResponsesRequest.to_chat`, and starts as one, `ChatServing.start_chat`),
answered as a `response` object or as the API's typed stream events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, ... `response.completed`).

Stored responses (`store`, on by default as OpenAI's) are kept per API key and bounded,
in memory or in Redis for a fleet (service/response_store.py): `GET /v1/responses/{id}`
returns one, `DELETE` drops it, and
`previous_response_id` continues its conversation (its input and output come before the
new input; its instructions do not).  A stored chain's KV is pinned between turns under
the chain's first id, as a `conversation_id` would pin it (scheduler/pins.py).
Background responses run on after their reply (service/responses_background.py)."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from service import openai_conversations as conversations
from service.http_util import error_body, json_response
from service.openai_chat import ChatServing, ChatStart
from service.openai_common import ChoiceDelta, StreamUsage, end_stream
from service.outputs import RequestOutput
from service.protocol import BadRequest, ChatMessage, FunctionCall, ToolCall
from service.protocol_openai import ChatCompletionRequest
from service.protocol_responses import (
    ResponsesRequest,
    decode_input_tokens,
    decode_responses,
    items_to_messages,
    normalize_item,
    responses_param,
)
from service.reasoning import ReasoningStream, ThinkingCount, split
from service.request_ids import LIVE_IDS, TENANT, take_claim
from service.response_store import (
    ResponseStore,
    ResponseStoreBase,
    StoreConflict,
    Stored,
    StoreUnavailable,
)
from service.responses_background import (
    HEARTBEAT_TTL_S,
    BackgroundResponses,
    orphan_checked,
    settled,
)
from service.resume import follow, parse_position
from service.stream_relay import MAX_RELAY_READERS, EventRelay, follow_relayed
from service.tool_calls import ToolStream, make_parser, parse_output

log = logging.getLogger(__name__)


_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def _status(finish: str | None) -> str:
    return _STATUS.get(finish or "", "failed")


def _message_item(mid: str, text: str, logprobs: list[Any] | None, status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    part["logprobs"] = logprobs or []
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (--reasoning-parser) as OpenAI's `reasoning` item:
    the text itself as a `reasoning_text` part (no summary; nothing is encrypted)."""
    return {
        "type": "reasoning",
        "id": rid,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(fid: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": fid,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing(ChatServing):
    # Replaced by the app with one sized by --max-stored-responses; this one stores nothing.
    store: ResponseStoreBase = ResponseStore(0, 0)
    relay_readers = 0  # streams _resume_relayed follows now

    async def _stored(self, tenant: str | None, rid: str, param: str) -> Stored | None:
        try:
            got = await self.store.get(tenant, rid)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", param, status=503) from e
        # (conversations share the store: an id of one is no response)
        if got is None or got.response.get("object") != "response":
            return None
        try:
            return await orphan_checked(self.store, tenant, rid, got)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", param, status=503) from e

    # ------------------------------------------------------------------ routes
    async def _context(
        self, req: ResponsesRequest, tenant: str | None
    ) -> tuple[list[ChatMessage], str, str | None, list[dict[str, Any]]]:
        """What comes before this turn's input: (history, the chain's key, the
        conversation's id, this turn's input items for the conversation)."""
        history: list[ChatMessage] = []
        root = uuid.uuid4().hex  # the chain's key: its KV pin's, and its later turns'
        cid = req.conversation_ref
        additions: list[dict[str, Any]] = []  # this turn's input, for its conversation
        if cid is not None:
            conv = await conversations.load(self.store, tenant, cid, "conversation")
            old = conv.response["items"]
            history = items_to_messages(old, "conversation.items")
            root = cid
            additions = conversations.new_items(req.input_items(), "input")
            conversations.check_new(additions, old, "input")
        if req.previous_response_id is not None:
            prev = await self._stored(tenant, req.previous_response_id, "previous_response_id")
            if prev is None:
                raise BadRequest(
                    f"previous_response_id {req.previous_response_id!r} not found (never "
                    "stored, deleted, or evicted from this server's store)",
                    "previous_response_id",
                    status=404,
                )
            if prev.response["status"] in ("queued", "in_progress"):
                raise BadRequest(
                    f"response {req.previous_response_id!r} is still in progress; continue "
                    "it once it has ended",
                    "previous_response_id",
                )
            history, root = prev.messages, prev.root
        return history, root, cid, additions

    async def responses(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req = decode_responses(body)
        tenant = request.get(TENANT)
        history, root, cid, additions = await self._context(req, tenant)
        try:
            chat = req.to_chat(history)
            if (
                chat.conversation_id is None
                and self.store.enabled
                and (req.store or req.previous_response_id or cid)
            ):
                # A turn a later one may continue: its KV stays pinned for it.
                chat.conversation_id = root
            start = await self.start_chat(request, chat, "resp_")
        except BadRequest as e:
            chat_name, e.param = e.param, responses_param(e.param)
            if chat_name and e.param != chat_name and not chat_name.startswith("messages"):
                # (a chat message's index is not its input item's: only the field renamed)
                e.message = e.message.replace(chat_name, e.param or "")
            raise
        try:
            turn = _Turn(self, req, chat, start, tenant, root, history)
            turn.conversation, turn.additions = cid, additions
            if req.background and req.stream:
                return await self._stream_background(request, turn, start)
            if req.background:
                return json_response(await self._start_background(request, turn, start))
            if req.stream:
                return await self.streamed(request, start.rid, start.subs, turn.stream(request))
            return json_response(await turn.full())
        finally:
            self._release(start.subs)

    @functools.cached_property
    def background(self) -> BackgroundResponses:
        """This server's running background turns (one registry per serving object)."""
        return BackgroundResponses()

    async def _store_queued(self, turn: _Turn, start: ChatStart) -> dict[str, Any]:
        queued = turn.response("queued", [])
        item = turn.entry(queued)
        try:
            kept = await self.store.put(turn.tenant, start.rid, item)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", "background", status=503) from e
        if not kept:
            raise BadRequest("the response does not fit in the response store", "background")
        turn.version = item.version
        if self.store.shared:  # before anyone knows its id: no reader finds it unbeaten
            try:
                await self.store.beat(turn.tenant, start.rid, HEARTBEAT_TTL_S)
            except StoreUnavailable as e:
                raise BadRequest(f"{e}; try again", "background", status=503) from e
        return queued

    async def _stream_background(
        self, request: web.Request, turn: _Turn, start: ChatStart
    ) -> web.StreamResponse:
        """Stored queued, then streamed as any response, but the turn runs to its end
        whether or not a connection reads it (`GET /v1/responses/{id}?stream=true&
        starting_after=n` picks the stream up again while the log keeps it)."""
        if self.streams is None or not self.streams.enabled:
            raise BadRequest(
                "streamed background responses need resumable streams (--resume-grace > 0)",
                "stream",
            )
        await self._store_queued(turn, start)

        def started(log: Any) -> None:
            log.background = True
            self.background.adopt(self.store, start.rid, turn, log.producer)
            if self.store.shared and self.streams is not None:
                # Any replica may be asked to resume it: its events go to the store too.
                reg = self.streams
                log.relay = EventRelay(
                    self.store, turn.tenant, start.rid, reg.cap, reg.grace, list(log.events)
                )

        produce = settled(turn, turn.stream(request))
        return await self.streamed(request, start.rid, start.subs, produce, started)

    async def _start_background(self, request: web.Request, turn: _Turn, start: ChatStart) -> Any:
        """Store the response queued and run the turn on as its own task, which takes
        the request's queue slot and client id over."""
        queued = await self._store_queued(turn, start)
        owned = list(start.subs)
        start.subs.clear()
        claim, ids = take_claim(request), request.app[LIVE_IDS]

        def on_exit() -> None:
            self._release(owned)
            if claim is not None:
                ids.release(*claim)

        busy = self.streams.busy if self.streams is not None else None
        self.background.start(self.store, start.rid, turn, on_exit, busy)
        return queued

    async def cancel_response(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{id}/cancel: a background response, stopped."""
        rid, tenant = request.match_info["id"], request.get(TENANT)
        item = await self._stored(tenant, rid, "response_id")
        if item is None:
            raise BadRequest(f"response {rid!r} not found", "response_id", status=404)
        if not item.response.get("background"):
            raise BadRequest("only background responses can be cancelled", "response_id")
        try:
            resp = await self.background.cancel(
                self.store, tenant, rid, item, lambda: self._stored(tenant, rid, "response_id")
            )
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", "response_id", status=503) from e
        return json_response(resp)

    async def input_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/responses/input_tokens: the tokens a response to this body would be
        given (instructions, the stored chain or conversation, the input, the tools),
        rendered as the response would render them, generating nothing."""
        req = decode_input_tokens(await request.read())
        history, _, _, _ = await self._context(req, request.get(TENANT))
        try:
            chat = req.to_chat(history)
            if not chat.messages:
                raise BadRequest(
                    "nothing to count: give input, previous_response_id or conversation",
                    "input",
                )
            self.check_model(chat.model)
            ids = await self.chat_prompt_ids(chat)
        except BadRequest as e:
            e.param = responses_param(e.param)
            raise
        return json_response({"object": "response.input_tokens", "input_tokens": len(ids)})

    async def get_response(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["id"]
        if request.query.get("stream", "").lower() in ("true", "1"):
            return await self._resume(request, rid)
        item = await self._stored(request.get(TENANT), rid, "response_id")
        if item is None:
            raise BadRequest(f"response {rid!r} not found", "response_id", status=404)
        return json_response(item.response)

    async def _resume(self, request: web.Request, rid: str) -> web.StreamResponse:
        """`GET /v1/responses/{id}?stream=true&starting_after=n`: a streamed response's
        events after sequence number n (all without it), then the live tail; while its
        log is kept (a background response's: until it ends, then --resume-grace)."""
        raw = request.query.get("starting_after")
        after = 0 if raw is None else parse_position(raw, "starting_after") + 1
        tenant = request.get(TENANT)
        log = self.streams.find(tenant, "sse", rid) if self.streams else None
        if log is None and self.store.shared:
            return await self._resume_relayed(request, tenant, rid, after)
        if log is None:
            raise BadRequest(
                f"no stream of response {rid!r} to resume: it was not streamed, ended more "
                "than --resume-grace seconds ago, or belongs to another API key",
                "response_id",
                status=404,
            )
        if after > log.last:
            raise BadRequest(
                f"starting_after {after - 1} is past the stream's last event ({log.last - 1})",
                "starting_after",
            )
        log.check(after, "starting_after")
        resp = await self._prepare_sse(request)
        if await follow(log, self._sink(request, resp), after):
            await end_stream(resp)
        return resp

    async def _resume_relayed(
        self, request: web.Request, tenant: str | None, rid: str, after: int
    ) -> web.StreamResponse:
        """`_resume` of a background response running (or run) on another replica: its
        events from the shared store (service/stream_relay.py)."""
        if self.relay_readers >= MAX_RELAY_READERS:
            # Each one holds a connection to the store while it waits for the tail: a
            # client opening thousands must not use up the store the fleet shares.
            raise BadRequest(
                f"{MAX_RELAY_READERS} streams are being resumed from the shared store on "
                "this replica; try again later",
                "response_id",
                status=429,
            )
        try:
            last = await self.store.relay_last(tenant, rid)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", "response_id", status=503) from e
        if last is None:
            raise BadRequest(
                f"no stream of response {rid!r} to resume: it was not streamed in the "
                "background, ended more than --resume-grace seconds ago, or belongs to "
                "another API key",
                "response_id",
                status=404,
            )
        if after > last:
            raise BadRequest(
                f"starting_after {after - 1} is past the stream's last event", "starting_after"
            )
        resp = await self._prepare_sse(request)

        async def write(data: bytes) -> None:
            await self.send(request, resp, data)

        async def gone(why: str) -> None:
            await write(b"data: " + error_body(why, 410) + b"\n\n")

        self.relay_readers += 1
        try:
            if await follow_relayed(self.store, tenant, rid, after, write, gone):
                await end_stream(resp)
        except (ConnectionError, StoreUnavailable):
            pass  # the reader or the store went away: the connection ends here
        finally:
            self.relay_readers -= 1
        return resp

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: what the model was given, earlier turns of
        the chain included (instructions not), as items; paged as OpenAI pages it."""
        rid = request.match_info["id"]
        conversations.page_args(request.query)  # a bad query is a 400 before a look-up
        item = await self._stored(request.get(TENANT), rid, "response_id")
        if item is None:
            raise BadRequest(f"response {rid!r} not found", "response_id", status=404)
        items = _as_items(item.messages[:-1], item.root)  # the last message is its reply
        return json_response(conversations.page(items, request.query))

    async def delete_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        try:
            # (conversations share the store: an id of one is no response)
            found = await self.store.peek(request.get(TENANT), rid)
            if found is None or found.get("object") != "response":
                raise BadRequest(f"response {rid!r} not found", "response_id", status=404)
            deleted = await self.store.delete(request.get(TENANT), rid)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", "response_id", status=503) from e
        if not deleted:
            raise BadRequest(f"response {rid!r} not found", "response_id", status=404)
        return json_response({"id": rid, "object": "response", "deleted": True})


class _Turn:
    """One response being answered: its output items, its events, what it stores."""

    def __init__(
        self,
        serving: ResponsesServing,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        start: ChatStart,
        tenant: str | None,
        root: str,
        history: list[ChatMessage],
    ) -> None:
        self.s, self.req, self.chat, self.start = serving, req, chat, start
        self.tenant, self.root, self.history = tenant, root, history
        self.created = int(time.time())
        self.conversation: str | None = None  # the conversation this turn extends
        self.additions: list[dict[str, Any]] = []  # its input items for it
        self.version: int | None = None  # a background turn's: its stored entry's version
        self.ended = False  # `_finish` reached
        self.seq = 0
        self.usage = StreamUsage.of(len(start.ids), None)

    # ------------------------------------------------------------- the object
    def response(
        self, status: str, output: list[dict[str, Any]], finish: str | None = None
    ) -> dict[str, Any]:
        req = self.req
        u = self.usage
        tools = [msgspec.to_builtins(t) for t in req.tools or ()]
        choice: Any = msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto"
        text = (
            {"format": msgspec.to_builtins(req.text.format)}
            if req.text and req.text.format
            else None
        )
        return {
            "id": self.start.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.start.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "background": bool(req.background),
            "conversation": {"id": self.conversation} if self.conversation else None,
            "reasoning": None,
            "store": req.store and self.s.store.enabled,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": text or {"format": {"type": "text"}},
            "tool_choice": choice,
            "tools": tools,
            "top_logprobs": req.top_logprobs,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None
            if status in ("queued", "in_progress")
            else {
                "input_tokens": u.prompt_tokens,
                # As on chat: only with --enable-prompt-tokens-details (with a shared
                # cache, the count tells what others sent).
                "input_tokens_details": {"cached_tokens": u.cached if self.s.details else 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens or 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            },
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _logprobs(self, lps: Any) -> list[Any] | None:
        if lps is None:
            return None
        out = self.s.chat_logprobs(lps, None)
        return out["content"] if out else None

    async def _finish(self, output: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
        """The final object; stored (with the conversation it ends) when asked, before
        the client sees it, so a turn that continues it finds it on any replica."""
        self.ended = True
        resp = self.response(_status(finish), output, finish)
        # (a background response's every end is stored: its client polls for it)
        if resp["store"] and (
            resp["status"] in ("completed", "incomplete") or self.version is not None
        ):
            try:
                await self.store_final(resp)
            except StoreUnavailable as e:
                # Answered all the same; the object says it was not stored.
                log.warning("response %s not stored: %s", self.start.rid, e)
                resp["store"] = False
            except StoreConflict:  # cancelled meanwhile (a background response)
                log.info("response %s was cancelled as it ended", self.start.rid)
        if self.conversation is not None and resp["status"] in ("completed", "incomplete"):
            out = [normalize_item(o, "output", uuid.uuid4().hex) for o in output]
            try:
                await conversations.append(
                    self.s.store, self.tenant, self.conversation, self.additions + out,
                    "conversation",
                )  # fmt: skip
            except BadRequest as e:  # deleted meanwhile, store down: answered all the same
                log.warning("conversation %s not extended: %s", self.conversation, e.message)
        return resp

    def entry(self, resp: dict[str, Any]) -> Stored:
        """`resp` as stored, with the conversation through it (instructions left out)."""
        mine = self.chat.messages[1:] if self.req.instructions else self.chat.messages
        mine = mine[len(self.history) :]
        reply = _reply_message(resp["output"])
        messages = [*self.history, *mine, reply]
        size = len(msgspec.json.encode(resp)) + len(msgspec.json.encode(mine))
        parent = self.req.previous_response_id
        # A chain's history is its parent entry's own objects (8 bytes a reference here); a
        # conversation's was decoded from its items for this turn, so this entry holds a
        # copy of it, which the memory store's bound must count.
        shared = parent is not None
        history = 8 * len(self.history) if shared else len(msgspec.json.encode(self.history))
        size += len(msgspec.json.encode(reply)) + history
        return Stored(resp, messages, self.root, size, parent=parent, base=len(self.history))

    async def store_final(self, resp: dict[str, Any]) -> None:
        """Store `resp`; a background turn's only over the version it wrote last."""
        item = self.entry(resp)
        await self.s.store.put(self.tenant, self.start.rid, item, expect=self.version)
        if self.version is not None:
            self.version = item.version

    # ----------------------------------------------------------- whole answer
    async def full(self) -> dict[str, Any]:
        last = await self.start.last()
        o = last.outputs[0]
        self.usage.cached = last.num_cached_tokens
        self.usage.completion_tokens = len(o.token_ids)
        output: list[dict[str, Any]] = []
        content: str | None = o.text
        calls: list[dict[str, Any]] = []
        done = "completed" if o.finish_reason == "stop" else "incomplete"
        if (thinking := self.start.thinking) is not None:
            thought, content, reasoned = split(thinking.parser, thinking.opening, o.text)
            count = ThinkingCount(thinking.parser, thinking.opening)
            count.feed(o.token_ids)
            self.usage.reasoning_tokens = count.count
            if reasoned:  # incomplete only when cut off while thinking
                status = "completed" if count.closed else done
                output.append(_reasoning_item(_new_id("rs"), thought, status))
        if self.start.mode is not None:
            parser = make_parser(self.s.tool_call_parser) if self.start.mode == "auto" else None
            content, calls = parse_output(self.start.mode, content or "", parser, self.chat)
        if content or not (calls or output):
            output.append(
                _message_item(_new_id("msg"), content or "", self._logprobs(o.logprobs), done)
            )
        output += [_call_item(_new_id("fc"), c, done) for c in calls]
        return await self._finish(output, o.finish_reason)

    # ----------------------------------------------------------------- stream
    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), msgspec.json.encode(body))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        s = self.s
        resp = await s._open_stream(request)
        # (a background response is created queued, as it is stored, then runs)
        created = self.response("queued" if self.version is not None else "in_progress", [])
        await s.write(request, resp, self.event("response.created", response=created))
        await s.write(
            request,
            resp,
            self.event("response.in_progress", response=self.response("in_progress", [])),
        )
        events = _Events(self)
        thinking = self.start.thinking
        thought = thinking.streams() if thinking is not None else None
        if thought is not None:
            self.usage.reasoning_tokens = 0
        mode = self.start.mode
        tools = (
            ToolStream(mode, make_parser(s.tool_call_parser) if mode == "auto" else None, self.chat)
            if mode
            else None
        )

        def chunks(deltas: list[ChoiceDelta], out: RequestOutput) -> list[bytes]:
            self.usage.cached = out.num_cached_tokens
            frames: list[bytes] = []
            for d in deltas:
                self.usage.completion_tokens += len(d.token_ids)
                if thought is not None:
                    thought[1].feed(d.token_ids)
                    self.usage.reasoning_tokens = thought[1].count
                frames += events.feed(d, tools, thought and thought[0])
            return frames

        # _run_stream ends a chat stream with [DONE]; the Responses stream ends with its
        # lifecycle event instead, written once the response is stored (`_Events.end`).
        return await s._run_stream(
            request, resp, [self.start.gen], 1, chunks, {}, self.usage, tail=events.end
        )


class _Events:
    """The typed events of one streamed response, from the choice's deltas."""

    def __init__(self, turn: _Turn) -> None:
        self.t = turn
        self.items: list[dict[str, Any]] = []  # output items, as they will be final
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        # The open item's text (or arguments) in pieces, joined when it closes: `+=` on
        # the item's string copied all of it every step (quadratic in a long answer).
        self.pieces: list[str] = []
        self.finish: str | None = None  # the choice's finish reason, once it came

    def _add(self, item: dict[str, Any]) -> bytes:
        self.items.append(item)
        shown = dict(item, status="in_progress")
        if item["type"] in ("message", "reasoning"):
            shown["content"] = []
        else:
            shown["arguments"] = ""
        self.open = item
        self.pieces = []
        return self.t.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=shown
        )

    def _open_item(self, item: dict[str, Any], part: dict[str, Any]) -> list[bytes]:
        """Close the open item, open `item` and its first content part."""
        out = [*self._close(), self._add(item)]
        out.append(
            self.t.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                part=part,
            )
        )
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            item = _reasoning_item(_new_id("rs"), "", "in_progress")
            out += self._open_item(item, {"type": "reasoning_text", "text": ""})
        assert self.open is not None
        self.pieces.append(text)
        out.append(
            self.t.event(
                "response.reasoning_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
            )
        )
        return out

    def _text(self, text: str, lps: list[Any] | None) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            item = _message_item(_new_id("msg"), "", None, "in_progress")
            out += self._open_item(item, dict(item["content"][0]))
        assert self.open is not None
        self.pieces.append(text)
        self.open["content"][0]["logprobs"] += lps or []
        out.append(
            self.t.event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=lps or [],
            )
        )
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        """A tool call's delta (OpenAI chat shape): a new call opens an item."""
        out = []
        fn = call.get("function", {})
        if "id" in call:
            out += self._close()
            item = _call_item(
                _new_id("fc"),
                {"id": call["id"], "function": {"name": fn["name"], "arguments": ""}},
                "in_progress",
            )
            out.append(self._add(item))
        assert self.open is not None and self.open["type"] == "function_call"
        if fn.get("arguments"):
            self.pieces.append(fn["arguments"])
            out.append(
                self.t.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items) - 1,
                    delta=fn["arguments"],
                )
            )
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.items) - 1
        item["status"] = status
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            part["text"] = "".join(self.pieces)
            common = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out.append(
                self.t.event(
                    "response.output_text.done",
                    **common,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            out.append(self.t.event("response.content_part.done", **common, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            part["text"] = "".join(self.pieces)
            common = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out.append(self.t.event("response.reasoning_text.done", **common, text=part["text"]))
            out.append(self.t.event("response.content_part.done", **common, part=part))
        else:
            item["arguments"] = "".join(self.pieces)
            out.append(
                self.t.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.t.event("response.output_item.done", output_index=i, item=item))
        return out

    def feed(
        self, d: ChoiceDelta, tools: ToolStream | None, thought: ReasoningStream | None = None
    ) -> list[bytes]:
        out: list[bytes] = []
        lps = self.t._logprobs(d.logprobs)
        text = d.text
        if thought is not None:
            reasoning, text = thought.take(text, d.finish_reason is not None)
            if reasoning:
                out += self._reasoning(reasoning)
            if not text and lps and self.open is not None and self.open["type"] == "reasoning":
                lps = None  # a thinking token's logprobs: no message to carry them
        if tools is None:
            if text or lps:
                out += self._text(text, lps)
        else:
            delta, _ = tools.take(text, d.finish_reason is not None)
            if delta.get("content"):
                out += self._text(delta["content"], lps)
            for call in delta.get("tool_calls", ()):
                out += self._call(call)
        if d.finish_reason is None:
            return out
        if not self.items:  # nothing generated: an empty message, as OpenAI's
            out += self._text("", None)
        done = "completed" if d.finish_reason == "stop" else "incomplete"
        out += self._close(done)
        self.finish = d.finish_reason
        return out

    async def end(self) -> list[bytes]:
        """The lifecycle event that ends the stream, once the response is stored."""
        if self.finish is None:
            return []
        final = await self.t._finish(self.items, self.finish)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        return [self.t.event(kind.get(final["status"], "response.failed"), response=final)]


def _as_items(messages: list[ChatMessage], root: str) -> list[dict[str, Any]]:
    """A conversation's messages as Responses items.  An item's id comes from the chain
    and its place in it, so the same item has the same id in every response of the chain."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        key = hashlib.blake2b(f"{root}:{i}".encode(), digest_size=12).hexdigest()
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        if m.role == "tool":
            out.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{key}",
                    "call_id": m.tool_call_id,
                    "output": text,
                    "status": "completed",
                }
            )
            continue
        if m.role == "assistant" and m.reasoning_content is not None:
            out.append(_reasoning_item(f"rs_{key}", m.reasoning_content, "completed"))
        if m.role != "assistant" or text or not m.tool_calls:
            kind = "output_text" if m.role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": text}
            if kind == "output_text":
                part["annotations"] = []
            out.append(
                {
                    "type": "message",
                    "id": f"msg_{key}",
                    "role": m.role,
                    "status": "completed",
                    "content": [part],
                }
            )
        for j, call in enumerate(m.tool_calls or ()):
            fn = call.function
            out.append(
                {
                    "type": "function_call",
                    "id": f"fc_{key}{j:02x}",
                    "call_id": call.id,
                    "name": fn.name,
                    "arguments": fn.arguments,
                    "status": "completed",
                }
            )
    return out


def _reply_message(output: list[dict[str, Any]]) -> ChatMessage:
    """The output items as the assistant turn a continuing turn's template sees."""
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )
    thought = [p["text"] for item in output if item["type"] == "reasoning" for p in item["content"]]
    calls = [
        ToolCall(id=i["call_id"], function=FunctionCall(name=i["name"], arguments=i["arguments"]))
        for i in output
        if i["type"] == "function_call"
    ]
    reasoning = "".join(thought) if thought else None
    if not text and not calls:
        return ChatMessage(role="assistant", content="", reasoning_content=reasoning)
    return ChatMessage(
        role="assistant", content=text or None, tool_calls=calls or None,
        reasoning_content=reasoning,
    )  # fmt: skip
