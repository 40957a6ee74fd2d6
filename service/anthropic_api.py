"""/v1/messages (Anthropic's Messages API, as vLLM and llama.cpp serve it): a message is
a chat turn (the request becomes a chat request, `MessagesRequest.to_chat`, and starts
as one, `ChatServing.start_chat`), answered as a `message` object of content blocks
(thinking, text, tool_use) or as the API's stream of named events (`message_start`,
`content_block_start` / `_delta` / `_stop` per block, `message_delta`, `message_stop`).
`/v1/messages/count_tokens` renders the prompt and counts it.  Errors keep the server's
shape with Anthropic's `"type": "error"` on top (the middleware adds it for these
paths), so either SDK reads them."""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web

from service.http_util import json_response
from service.openai_chat import ChatServing, ChatStart, Thinking
from service.openai_common import ChoiceDelta, StreamUsage
from service.outputs import RequestOutput
from service.protocol import BadRequest
from service.protocol_anthropic import (
    MessagesRequest,
    decode_count_tokens,
    decode_messages,
    sign_thinking,
)
from service.protocol_openai import ChatCompletionRequest
from service.reasoning import ReasoningStream, ThinkingCount, split
from service.tool_calls import ToolStream, make_parser, parse_output


def messages_param(chat_param: str | None) -> str | None:
    """A chat request's field as this request's (a chat message's index is not a
    message's here: the system prompt and tool results are messages of their own)."""
    if chat_param is None:
        return None
    for chat, ours in (
        ("response_format.json_schema.schema", "output_config.format.schema"),
        ("response_format", "output_config.format"),
        ("max_completion_tokens", "max_tokens"),
        ("stop", "stop_sequences"),
        ("chat_template_kwargs", "thinking"),
        ("messages", "messages"),
    ):
        if chat_param == chat or chat_param.startswith((chat + ".", chat + "[")):
            return ours if chat == "messages" else ours + chat_param[len(chat) :]
    if chat_param.startswith("tools[") and ".function.parameters" in chat_param:
        return chat_param.replace(".function.parameters", ".input_schema")
    return chat_param


def event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind, **body}))


def _stop(finish: str | None, matched: str | int | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = {}  # cut off by max_tokens: what there is is not an object yet
    return {"type": "tool_use", "id": _tool_id(call["id"]), "name": fn["name"],
            "input": args if isinstance(args, dict) else {"value": args}}  # fmt: skip


def _tool_id(call_id: str) -> str:
    """A chat call id (`call_...`) as Anthropic spells tool ids."""
    return "toolu_" + call_id.removeprefix("call_")


class MessagesServing(ChatServing):
    async def messages(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req = decode_messages(body)
        chat = req.to_chat()
        t = req.thinking
        if t is not None and t.on and t.budget_tokens is not None and self.reasoning is not None:
            # (a model that does not think has nothing to bound: the budget is not an error)
            chat.thinking_token_budget = t.budget_tokens
        try:
            start = await self.start_chat(request, chat, "msg_")
        except BadRequest as e:
            e.param = messages_param(e.param)
            raise
        try:
            if req.stream:
                turn = _Turn(self, req, chat, start)
                return await self.streamed(request, start.rid, start.subs, turn.stream(request))
            return json_response(await self._whole(req, chat, start))
        finally:
            self._release(start.subs)

    async def count_tokens(self, request: web.Request) -> web.Response:
        req = decode_count_tokens(await request.read())
        chat = req.to_chat()
        self.check_model(chat.model)
        try:
            ids = await self.chat_prompt_ids(chat)
        except BadRequest as e:
            e.param = messages_param(e.param)
            raise
        return json_response({"input_tokens": len(ids)})

    def _message(self, start: ChatStart, model: str) -> dict[str, Any]:
        return {"id": start.rid, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None}  # fmt: skip

    def anthropic_usage(self, u: StreamUsage) -> dict[str, Any]:
        return {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            # As on chat: the cached count only with --enable-prompt-tokens-details.
            "cache_read_input_tokens": u.cached if self.details else None,
            "cache_creation_input_tokens": None,
        }

    async def _whole(
        self, req: MessagesRequest, chat: ChatCompletionRequest, start: ChatStart
    ) -> dict[str, Any]:
        last = await start.last()
        o = last.outputs[0]
        content: list[dict[str, Any]] = []
        text: str | None = o.text
        th = start.thinking
        if th is not None:
            thought, text, reasoned = split(th.parser, th.opening, o.text)
            if reasoned and th.include:
                shown = "" if req.omits_thinking else thought
                content.append({"type": "thinking", "thinking": shown,
                                "signature": sign_thinking(thought)})  # fmt: skip
        calls: list[dict[str, Any]] = []
        if start.mode is not None:
            parser = make_parser(self.tool_call_parser) if start.mode == "auto" else None
            text, calls = parse_output(start.mode, text or "", parser, chat)
        if text or not (content or calls):
            content.append({"type": "text", "text": text or ""})
        content += [_tool_use(c) for c in calls]
        reason, seq = _stop(o.finish_reason, o.stop_reason, bool(calls))
        usage = StreamUsage(len(start.ids), False, False, len(o.token_ids), last.num_cached_tokens)
        msg = self._message(start, req.model)
        msg.update(content=content, stop_reason=reason, stop_sequence=seq,
                   usage=self.anthropic_usage(usage))  # fmt: skip
        return msg


class _Turn:
    """One streamed message: its blocks opened, fed and closed as the choice moves."""

    def __init__(
        self, s: MessagesServing, req: MessagesRequest, chat: ChatCompletionRequest,
        start: ChatStart,
    ) -> None:  # fmt: skip
        self.s, self.req, self.chat, self.start = s, req, chat, start
        self.usage = StreamUsage(len(start.ids), False, False)
        self.blocks = -1  # the index of the last block opened
        self.open: str | None = None  # its type while it is open
        self.thought: list[str] = []  # the open thinking block's text, for its signature
        self.finish: tuple[str, str | None] | None = None

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.blocks += 1
        self.open = block["type"]
        out.append(event("content_block_start", {"index": self.blocks, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            # As Anthropic's stream: the signature last, just before the block ends.
            sig = sign_thinking("".join(self.thought))
            self.thought = []
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
        self.open = None
        out.append(event("content_block_stop", {"index": self.blocks}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.blocks, "delta": delta})

    def _thinking(self, text: str) -> list[bytes]:
        out = []
        if self.open != "thinking":
            out += self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.thought.append(text)
        if not self.req.omits_thinking:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self.open != "text":
            out += self._open({"type": "text", "text": ""})
        out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        fn = call.get("function", {})
        if "id" in call:
            block = {"type": "tool_use", "id": _tool_id(call["id"]), "name": fn["name"],
                     "input": {}}  # fmt: skip
            out += self._open(block)
        if fn.get("arguments"):
            out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def feed(
        self, d: ChoiceDelta, tools: ToolStream | None, thought: ReasoningStream | None
    ) -> list[bytes]:
        out: list[bytes] = []
        text = d.text
        if thought is not None:
            reasoning, text = thought.take(text, d.finish_reason is not None)
            th = self.start.thinking
            if reasoning and th is not None and th.include:
                out += self._thinking(reasoning)
        called = False
        if tools is None:
            if text:
                out += self._text(text)
        else:
            delta, called = tools.take(text, d.finish_reason is not None)
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                out += self._call(call)
        if d.finish_reason is not None:
            if self.blocks < 0:  # nothing generated: an empty text block
                out += self._text("")
            out += self._close()
            called = called or self.start.mode == "named"
            self.finish = _stop(d.finish_reason, d.stop_reason, called)
        return out

    async def stream(self, request: web.Request) -> web.StreamResponse:
        s, start = self.s, self.start
        resp = await s._open_stream(request)
        msg = s._message(start, self.req.model)
        msg["usage"] = s.anthropic_usage(self.usage)
        await s.write(request, resp, event("message_start", {"message": msg}))
        mode = start.mode
        parser = make_parser(s.tool_call_parser) if mode == "auto" else None
        tools = ToolStream(mode, parser, self.chat) if mode else None
        th: Thinking | None = start.thinking
        thought: tuple[ReasoningStream, ThinkingCount] | None = th.streams() if th else None

        def chunks(deltas: list[ChoiceDelta], out: RequestOutput) -> list[bytes]:
            self.usage.cached = out.num_cached_tokens
            frames: list[bytes] = []
            for d in deltas:
                self.usage.completion_tokens += len(d.token_ids)
                frames += self.feed(d, tools, thought and thought[0])
            return frames

        async def tail() -> list[bytes]:
            if self.finish is None:
                return []
            reason, seq = self.finish
            return [
                event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                        "usage": {"output_tokens": self.usage.completion_tokens}}),
                event("message_stop", {}),
            ]  # fmt: skip

        return await s._run_stream(
            request, resp, [start.gen], 1, chunks, {}, self.usage, tail=tail,
            error_event=_error_event,
        )  # fmt: skip


def _error_event(body: bytes) -> list[bytes]:
    """A failure after the stream began, as Anthropic's `error` event."""
    err = orjson.loads(body)["error"]
    return [event("error", {"error": err})]
