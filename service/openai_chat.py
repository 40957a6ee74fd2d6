"""/v1/chat/completions: validate, render the chat template, queue, then answer in one
JSON body or as a stream of `chat.completion.chunk` events (tool calls parsed from the
text when the request offers tools)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from scheduler.contract import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from service.completion_extras import (
    OFF_LOOP_LOGPROB_ENTRIES,
    finite,
    prompt_logprobs_json,
)
from service.http_util import TENANT_SALT, json_response, salted
from service.openai_common import ChoiceDelta, ServingBase, StreamUsage, sse
from service.outputs import RequestOutput, Submitted
from service.protocol import BadRequest, check_messages
from service.protocol_openai import ChatCompletionRequest, decode_chat
from service.reasoning import ReasoningParser, ReasoningStream, ThinkingCount, split
from service.request_ids import TENANT, conversation_key, request_id
from service.tool_calls import (
    Mode,
    ToolStream,
    constraint,
    make_parser,
    parse_output,
    template_tools,
    tool_mode,
)
from service.truncation import check_mode


@dataclass(frozen=True, slots=True)
class Thinking:
    """A reasoning parser and where one prompt's output starts (service/reasoning.py)."""

    parser: ReasoningParser
    opening: bool | None
    include: bool = True  # the request's include_reasoning

    def put(self, message: dict[str, Any], thought: str | None) -> None:
        """A whole message's thinking, under both names clients read."""
        if self.include and thought is not None:
            message["reasoning"] = message["reasoning_content"] = thought

    def streams(self) -> tuple[ReasoningStream, ThinkingCount]:
        return ReasoningStream(self.parser, self.opening), ThinkingCount(self.parser, self.opening)


@dataclass(slots=True)
class ChatStart:
    """A chat request validated, rendered and queued (`ChatServing.start_chat`)."""

    rid: str  # the public id
    model: str
    ids: list[int]  # the prompt's token ids
    gen: AsyncIterator[RequestOutput]
    params: SamplingParams
    mode: Mode | None  # tool calling (service/tool_calls.py); None: no tools
    subs: list[Submitted]
    # --reasoning-parser: how the output starts (ReasoningParser.opening_state)
    thinking: Thinking | None = None

    async def last(self) -> RequestOutput:
        """The whole answer: the generator read to its end."""
        last: RequestOutput | None = None
        async with contextlib.aclosing(self.gen):  # type: ignore[type-var]
            async for out in self.gen:
                last = out
        assert last is not None
        return last


class ChatServing(ServingBase):
    def reply_role(self, req: ChatCompletionRequest) -> str:
        """The reply's role, as vLLM names it: --response-role after a generation prompt,
        else the role of the message the reply carries on."""
        if req.add_generation_prompt or not req.messages:
            return self.response_role
        return req.messages[-1].role

    def chat_logprobs(
        self, lps: list[TokenLogprobs] | None, label: Callable[[int], str] | None
    ) -> dict[str, Any] | None:
        """label: how tokens are named (token_labels; None: their text)."""
        if lps is None:
            return None
        label = label or self.token_text
        content = []
        for lp in lps:
            tok = label(lp.token_id)
            content.append(
                {
                    "token": tok,
                    "logprob": finite(lp.logprob),
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := label(i)),
                            "logprob": finite(v),
                            "bytes": list(t.encode()),
                        }
                        for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                }
            )
        return {"content": content}

    async def chat(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req: ChatCompletionRequest = decode_chat(body)
        start = await self.start_chat(request, req, "chatcmpl-")
        try:
            if req.stream:
                stream = self._chat_stream(request, req, start)
                return await self.streamed(request, start.rid, start.subs, stream)
            return await self._chat_full(req, start)
        finally:
            self._release(start.subs)

    async def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the messages (and tools) through the chat template, in
        the sandboxed render pool."""
        template, template_field, kwargs = req.template_request()
        messages = [m.as_template_dict() for m in req.messages]
        render: dict[str, Any] = {
            "add_generation_prompt": req.add_generation_prompt,
            "chat_template": template,
            "template_param": template_field,
            "kwargs": kwargs,
            "tools": template_tools(req) if req.tools else None,
            "continue_final_message": req.continue_final_message,
        }
        if check_mode(req.truncation, req.truncate_prompt_tokens):
            limit = self.defaults.cap(req.max_completion_tokens or req.max_tokens)
            return await self.prep.chat_ids_auto(messages, limit, **render)  # type: ignore[no-any-return]
        return await self.prep.chat_ids(  # type: ignore[no-any-return]
            messages, truncate=req.keep_last(self.engine.max_model_len), **render
        )

    async def start_chat(
        self, request: web.Request, req: ChatCompletionRequest, id_prefix: str
    ) -> ChatStart:
        """Everything before the answer: validate, render, queue (all 400s come from
        here).  The caller must `_release(start.subs)` in a finally.  /v1/responses
        (service/openai_responses.py) turns its request into a chat one and starts here."""
        lora = self.check_model(req.model)
        check_messages(req.messages)
        params = self.with_lora(req.to_sampling_params(self.defaults), lora)
        self.limits.check_sampling(params, logprobs_field="top_logprobs")
        self.prep.check_vocab_ids(params)
        params = await self.prep.with_bad_words(params)
        mode = tool_mode(req, self.tool_call_parser)
        spec = req.structured()
        if (tc := constraint(req, mode)) is not None:
            if spec is not None:
                raise BadRequest(
                    f"tool_choice {mode!r} constrains the output; it cannot be combined "
                    f"with {spec[1]}",
                    "tool_choice",
                )
            spec = tc
            params = msgspec.structs.replace(params, structured_outputs=tc[0])
        await self.compile(request, params, spec[1] if spec else None)
        ids = await self.chat_prompt_ids(req)
        if req.prediction is not None:
            params = await self._with_prediction(params, req.prediction.text)
        thinking = self.thinking(ids, req.include_reasoning)
        if thinking is not None and params.structured_outputs is not None:
            # Compiled above without it: where the grammar starts is not part of its key.
            so = thinking.parser.constrain(params.structured_outputs, thinking.opening)
            params = msgspec.structs.replace(params, structured_outputs=so)
        if req.thinking_token_budget is not None:
            if thinking is None:
                raise BadRequest("thinking_token_budget needs a reasoning model served with "
                                 "--reasoning-parser", "thinking_token_budget")  # fmt: skip
            budget = thinking.parser.budget(req.thinking_token_budget, thinking.opening)
            params = msgspec.structs.replace(params, reasoning_budget=budget)
        if req.prompt_logprobs is not None:  # once per response on chat
            self.limits.check_prompt_logprobs(
                {"prompt_logprobs": len(ids) * (req.prompt_logprobs + 1)}
            )
        rid, engine_rid = request_id(request, req.request_id, id_prefix)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        salt = salted(request.get(TENANT_SALT), req.cache_salt)
        tenant = request.get(TENANT)
        conversation = conversation_key(tenant, req.conversation_id or req.session_id)
        gens, subs = self._start(
            engine_rid, [ids], [None], params, salt, field,
            tenant=tenant, conversation=conversation, priority=req.priority,
            prompt_field="messages",
            beam=req.beam_spec(self.defaults.cap(req.max_completion_tokens or req.max_tokens)),
        )  # fmt: skip
        model = req.model or self.names[0]
        return ChatStart(rid, model, ids, gens[0], params, mode, subs, thinking)

    async def _with_prediction(self, params: SamplingParams, text: str) -> SamplingParams:
        """OpenAI's predicted output, tokenized as output text is (no special tokens)."""
        if not text:
            return params
        (ids,) = await self.prep.prompt_ids([text], param="prediction", add_special_tokens=False)
        if len(ids) > self.engine.max_model_len:
            raise BadRequest(
                f"prediction has {len(ids)} tokens; at most max_model_len "
                f"({self.engine.max_model_len}) can be used",
                "prediction",
            )
        return msgspec.structs.replace(params, prediction=ids)

    def thinking(self, ids: list[int], include: bool = True) -> Thinking | None:
        """How a prompt's output starts, when a reasoning parser runs."""
        if self.reasoning is None:
            return None
        opening = self.reasoning.opening_state(ids, self.tokenizer.decode)
        return Thinking(self.reasoning, opening, include)

    async def _chat_full(self, req: ChatCompletionRequest, start: ChatStart) -> web.Response:
        rid, model, ids, mode = start.rid, start.model, start.ids, start.mode
        last = await start.last()
        parser = make_parser(self.tool_call_parser) if mode == "auto" else None
        choices = []
        thinking, reasoning_tokens = start.thinking, 0
        for o in last.outputs:
            message: dict[str, Any] = {"role": self.reply_role(req), "content": o.text}
            text = o.text
            if thinking is not None:
                thought, text, reasoned = split(thinking.parser, thinking.opening, text)
                message["content"] = text if text or not reasoned else None
                thinking.put(message, thought if reasoned else None)
                count = ThinkingCount(thinking.parser, thinking.opening)
                count.feed(o.token_ids)
                reasoning_tokens += count.count
            finish = o.finish_reason
            if mode is not None:
                content, calls = parse_output(mode, text, parser, req)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    if mode != "named" and finish == "stop":
                        finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": o.index,
                "message": message,
                "logprobs": self.chat_logprobs(o.logprobs, self.labels(req)),
                "finish_reason": finish,
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = o.token_ids
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in last.outputs)
        resp: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self._usage(
                len(ids),
                completion,
                last.num_cached_tokens,
                reasoning_tokens if thinking is not None else None,
                last.prediction_tokens,
            ),
        }
        if req.return_token_ids:
            resp["prompt_token_ids"] = ids
        if req.prompt_logprobs is not None:
            plp = (last.prompt_logprobs, self.token_text)
            if len(ids) * (req.prompt_logprobs + 1) > OFF_LOOP_LOGPROB_ENTRIES:
                resp["prompt_logprobs"] = await asyncio.to_thread(prompt_logprobs_json, *plp)
            else:
                resp["prompt_logprobs"] = prompt_logprobs_json(*plp)
        return json_response(resp)

    async def _chat_stream(
        self, request: web.Request, req: ChatCompletionRequest, start: ChatStart
    ) -> web.StreamResponse:
        """The role chunk, then a chunk per step with every choice that moved."""
        rid, model, ids, params, mode = start.rid, start.model, start.ids, start.params, start.mode
        resp = await self._open_stream(request)
        created = int(time.time())
        parser = make_parser(self.tool_call_parser) if mode == "auto" else None
        tools = {i: ToolStream(mode, parser, req) for i in range(params.n)} if mode else {}
        usage = StreamUsage.of(len(ids), req.stream_options, self.force_usage)
        thinking = start.thinking
        thoughts: dict[int, tuple[ReasoningStream, ThinkingCount]] = {}
        if thinking is not None:
            usage.reasoning_tokens = 0
            thoughts = {i: thinking.streams() for i in range(params.n)}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        # A reply that may be tool calls opens without `content: ""`: OpenAI's does, and a
        # client that sees an empty content string first may take the reply for text.
        role: dict[str, Any] = {"role": self.reply_role(req)}
        if not mode:
            role["content"] = ""
        head = [
            {"index": i, "delta": dict(role), "logprobs": None, "finish_reason": None}
            for i in range(params.n)
        ]
        if req.return_token_ids:
            await self.write(request, resp, sse({**base, "prompt_token_ids": ids, "choices": head}))
        else:
            await self.write(request, resp, sse({**base, "choices": head}))

        def chunks(deltas: list[ChoiceDelta], out: RequestOutput) -> list[dict[str, Any]]:
            return self._chat_chunks(req, base, deltas, out, tools, mode, usage, thoughts)

        return await self._run_stream(request, resp, [start.gen], params.n, chunks, base, usage)

    def _chat_chunks(
        self,
        req: ChatCompletionRequest,
        base: dict[str, Any],
        deltas: list[ChoiceDelta],
        out: RequestOutput,
        tools: dict[int, ToolStream],
        mode: Mode | None,
        usage: StreamUsage,
        thoughts: dict[int, tuple[ReasoningStream, ThinkingCount]],
    ) -> list[dict[str, Any]]:
        """One output's chunks: the choices that moved, then (tool calls) the finishes."""
        usage.cached = out.num_cached_tokens
        usage.prediction = out.prediction_tokens
        choices, ends = [], []
        for d in deltas:
            usage.completion_tokens += len(d.token_ids)
            thought = thoughts.get(d.index)
            if thought is not None:
                count = thought[1]
                before = count.count
                count.feed(d.token_ids)
                usage.reasoning_tokens += count.count - before  # type: ignore[operator]
            choice = self._chat_choice_delta(req, d, tools.get(d.index), mode, thought)
            if choice is None:
                continue
            if choice["delta"].get("tool_calls") and choice["finish_reason"]:
                choice, end = _split_finish(choice)
                ends.append(end)
            choices.append(choice)
        chunks = [self._chunk(base, choices, usage)] if choices else []
        if ends:
            chunks.append(self._chunk(base, ends, usage))
        return chunks

    def _chat_choice_delta(
        self,
        req: ChatCompletionRequest,
        d: ChoiceDelta,
        ts: ToolStream | None,
        mode: Mode | None,
        thought: tuple[ReasoningStream, ThinkingCount] | None = None,
    ) -> dict[str, Any] | None:
        """One choice's part of a chunk; None while a tool call's (or a tag's) text is
        held back."""
        text, finish, reasoning = d.text, d.finish_reason, ""
        if thought is not None:
            reasoning, text = thought[0].take(text, finish is not None)
        delta: dict[str, Any] = {"content": text} if text else {}
        if ts is not None:
            delta, called = ts.take(text, finish is not None)
            if called and mode != "named" and finish == "stop":
                finish = "tool_calls"
        if reasoning and req.include_reasoning:
            delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
        held = not delta and finish is None and d.logprobs is None
        if held and (thought is not None or ts is not None):
            return None  # text held back until the call (or the tag) can be parsed
        c: dict[str, Any] = {
            "index": d.index,
            "delta": delta,
            "logprobs": self.chat_logprobs(d.logprobs, self.labels(req)),
            "finish_reason": finish,
        }
        if d.finish_reason is not None:
            c["stop_reason"] = d.stop_reason
        if req.return_token_ids:
            c["token_ids"] = d.token_ids
        return c


def _split_finish(choice: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A finishing choice whose delta carries tool calls, as OpenAI streams it: the calls
    first, then `finish_reason` in a chunk of its own with an empty delta.  The openai
    SDK's stream helper closes a call (`tool_calls.function.arguments.done`) only when a
    later chunk finishes the choice; one chunk holding both never closes the last call."""
    first = {k: v for k, v in choice.items() if k != "stop_reason"}
    first["finish_reason"] = None
    end = {"index": choice["index"], "delta": {}, "logprobs": None}
    end["finish_reason"] = choice["finish_reason"]
    end["stop_reason"] = choice.get("stop_reason")
    if "token_ids" in choice:
        end["token_ids"] = []
    return first, end
