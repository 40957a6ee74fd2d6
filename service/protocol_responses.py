"""The request body of /v1/responses (OpenAI's Responses API) and what it turns into: a
chat request (`ChatCompletionRequest`), so the template, tools, structured output and
sampling are the chat route's own (service/openai_responses.py serves it).

Input items are decoded one by one by their `type` (a message's may be left out, as
OpenAI's "easy" input message leaves it out), so a bad item is a 400 naming `input[i]`.
Built-in tools (web search, file search, computer use, MCP...), images, files and audio
are refused by name; so are stored prompts."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from service.protocol import (
    BadRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    NonNegInt,
    PositiveInt,
    RepetitionPenalty,
    RequestId,
    Temperature,
    TextPart,
    Tool,
    ToolCall,
    TopP,
    Unit,
    decode,
    field_of,
)
from service.protocol_openai import ChatCompletionRequest, ConversationId
from service.protocol_structured import JsonSchemaFormat, ResponseFormat

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Asked by clients of reasoning models (the Agents SDK with store off); nothing here is
# encrypted: a reasoning item's text is in its content, so there is nothing to add.
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"


class _Part(Struct, kw_only=True):
    """A content part: text in (`input_text`), text the model wrote (`output_text`, when
    a client sends earlier output back) or a refusal; anything else is refused."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _MessageItem(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionOutputItem(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1, max_length=256)]
    output: str | list[_Part]
    id: str | None = None
    status: str | None = None


class _ReasoningText(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["reasoning_text"]
    text: str


class _ReasoningItem(Struct, forbid_unknown_fields=True, kw_only=True):
    """A reasoning model's thinking sent back (as the Agents SDK sends a turn's output):
    its text goes to the next assistant turn as `reasoning_content`, for a template that
    keeps it.  Summaries and encrypted content (another server's) are passed over."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[_ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or ())


_ITEMS: dict[str, type[Struct]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionOutputItem,
    "reasoning": _ReasoningItem,
}


class ReasoningOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    """`reasoning`: `effort` goes to the chat template as `reasoning_effort` (as on chat);
    a summary is never written (a reasoning item's text is its `reasoning_text` content,
    its `summary` empty), so `summary` asks for nothing more."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (deprecated)


class FunctionTool(Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool of the Responses API: a function, flat (no `function` wrapper)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _ChoiceFunction(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: Any = None


class ResponsesStreamOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever added


class ResponsesRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=300)] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # accepted: prefixes are cached whatever the key
    service_tier: str | None = None
    # "auto": the oldest turns go when the conversation does not fit (service/truncation.py)
    truncation: Literal["disabled", "auto"] | None = None
    # vLLM's sampling extensions, as its Responses route takes them.
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: int | None = None
    request_id: RequestId | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    conversation_id: ConversationId | None = None
    # Refused by name (check_unsupported).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: ReasoningOptions | None = None
    max_tool_calls: NonNegInt | None = None
    context_management: Any = None

    def check_unsupported(self) -> None:
        if self.background and not self.store:
            raise BadRequest("background responses must be stored (store: true)", "background")
        for name in ("prompt", "context_management"):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.max_tool_calls is not None:
            raise BadRequest("max_tool_calls is not supported by this server", "max_tool_calls")
        if self.service_tier not in (None, "auto", "default"):
            raise BadRequest("service_tier is not supported by this server", "service_tier")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        for i, inc in enumerate(self.include or ()):
            if inc not in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE):
                raise BadRequest(
                    f"include {inc!r} is not supported by this server (only "
                    f"{LOGPROBS_INCLUDE!r} and {ENCRYPTED_INCLUDE!r})",
                    f"include[{i}]",
                )

    @property
    def logprobs(self) -> bool:
        """Logprobs come with the text only when `include` asks (`top_logprobs` says how
        many alternatives then), as OpenAI's."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages (`items_to_messages`)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return items_to_messages(self.input, "input")

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    @property
    def conversation_ref(self) -> str | None:
        """`conversation`: an id, or {"id": ...}."""
        c = self.conversation
        if c is None:
            return None
        cid = c.get("id") if isinstance(c, dict) else c
        if not isinstance(cid, str) or not 0 < len(cid) <= 300:
            raise BadRequest('conversation must be an id or {"id": ...}', "conversation")
        if self.previous_response_id is not None:
            raise BadRequest(
                "conversation and previous_response_id cannot both be given", "conversation"
            )
        return cid

    def chat_tools(self) -> list[Tool] | None:
        if not self.tools:
            return None
        tools = []
        for i, t in enumerate(self.tools):
            if t.type != "function":
                raise BadRequest(
                    f"tools[{i}].type {t.type!r} is not supported by this server "
                    "(only function tools)",
                    f"tools[{i}].type",
                )
            if t.name is None:
                raise BadRequest(f"tools[{i}].name is required", f"tools[{i}].name")
            try:
                fn = msgspec.convert(
                    {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                        "strict": t.strict,
                    },
                    FunctionDefinition,
                )
            except msgspec.ValidationError as e:
                raise BadRequest(f"tools[{i}]: {e}", f"tools[{i}].{field_of(e) or 'name'}") from e
            tools.append(Tool(function=fn))
        return tools

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema is None:
            raise BadRequest("text.format.schema is required for json_schema", "text.format.schema")
        return ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(
                name=fmt.name or "response",
                description=fmt.description,
                schema=fmt.schema,
                strict=fmt.strict,
            ),
        )

    def to_chat(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this turn is: the instructions as a system message (never
        carried from an earlier turn, as OpenAI's), the stored chain's messages, then this
        input."""
        self.check_unsupported()
        messages = list(history) + self.input_messages()
        if self.instructions:
            messages.insert(0, ChatMessage(role="system", content=self.instructions))
        choice: Any = self.tool_choice
        if isinstance(choice, _ChoiceFunction):
            choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        return ChatCompletionRequest(
            messages=messages,
            model=self.model,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs if self.logprobs else None,
            tools=self.chat_tools(),
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format(),
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            request_id=self.request_id,
            cache_salt=self.cache_salt,
            priority=self.priority,
            conversation_id=self.conversation_id,
            truncation=self.truncation,
            user=self.user,
            reasoning_effort=self.reasoning.effort if self.reasoning else None,
        )


def items_to_messages(items: list[dict[str, Any]], where: str) -> list[ChatMessage]:
    """Items as chat messages: function calls join the assistant turn before them
    (parallel calls are one turn), and their outputs become tool messages."""
    out: list[ChatMessage] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, raw in enumerate(items):
        item = decode_item(raw, f"{where}[{i}]")
        if isinstance(item, _ReasoningItem):
            thought = (thought or "") + item.text
            continue
        if isinstance(item, _MessageItem):
            role = item.role
            text = _text(item.content, f"{where}[{i}].content", assistant=role == "assistant")
            out.append(ChatMessage(role=role, content=text))
            if role == "assistant" and thought is not None:
                out[-1].reasoning_content, thought = thought, None
        elif isinstance(item, _FunctionCallItem):
            call = ToolCall(
                id=item.call_id,
                function=FunctionCall(name=item.name, arguments=item.arguments),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                if last.tool_calls is None:
                    last.tool_calls = []
                last.tool_calls.append(call)  # in place: a copy each is quadratic
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
            if thought is not None:
                out[-1].reasoning_content, thought = thought, None
        else:
            assert isinstance(item, _FunctionOutputItem)
            text = _text(item.output, f"{where}[{i}].output", assistant=False)
            out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id))
    return out


def normalize_item(raw: dict[str, Any], where: str, new_id: str) -> dict[str, Any]:
    """An input item as stored and listed (a conversation's): its type, an id (the
    client's, else `new_id`'s kind), status, and text content as typed parts."""
    item = decode_item(raw, where)
    if isinstance(item, _MessageItem):
        assistant = item.role == "assistant"
        text = _text(item.content, f"{where}.content", assistant=assistant)
        parts = [text] if isinstance(text, str) else [p.text for p in text]
        kind = "output_text" if assistant else "input_text"
        content = [
            {"type": kind, "text": t, **({"annotations": []} if assistant else {})} for t in parts
        ]
        return {"type": "message", "id": item.id or f"msg_{new_id}", "status": "completed",
                "role": item.role, "content": content}  # fmt: skip
    if isinstance(item, _ReasoningItem):
        return {"type": "reasoning", "id": item.id or f"rs_{new_id}", "summary": [],
                "content": [{"type": "reasoning_text", "text": item.text}],
                "status": "completed"}  # fmt: skip
    if isinstance(item, _FunctionCallItem):
        return {"type": "function_call", "id": item.id or f"fc_{new_id}",
                "status": "completed", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments}  # fmt: skip
    assert isinstance(item, _FunctionOutputItem)
    out = _text(item.output, f"{where}.output", assistant=False)
    return {"type": "function_call_output", "id": item.id or f"fco_{new_id}",
            "status": "completed", "call_id": item.call_id,
            "output": out if isinstance(out, str) else "".join(p.text for p in out)}  # fmt: skip


def decode_item(raw: dict[str, Any], where: str) -> Struct:
    kind = raw.get("type", "message")
    cls = _ITEMS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadRequest(
            f"{where}.type {kind!r} is not supported by this server (message, "
            "function_call, function_call_output and reasoning items are)",
            f"{where}.type",
        )
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        sub = field_of(e)
        missing = re.search(r"missing required field `([^`]+)`", str(e))
        if missing is not None:
            sub = f"{sub}.{missing.group(1)}" if sub else missing.group(1)
        raise BadRequest(f"{where}: {e}", f"{where}.{sub}" if sub else where) from e


def _text(content: str | list[_Part], where: str, *, assistant: bool) -> str | list[TextPart]:
    if isinstance(content, str):
        return content
    kinds = ("output_text", "refusal") if assistant else ("input_text",)
    parts = []
    for j, p in enumerate(content):
        if p.type not in kinds:
            raise BadRequest(
                f"{where}[{j}].type {p.type!r} is not supported here (this server takes "
                f"{' and '.join(kinds)} parts{' in assistant messages' if assistant else ''})",
                f"{where}[{j}].type",
            )
        text = p.refusal if p.type == "refusal" else p.text
        if text is None:
            raise BadRequest(f"{where}[{j}] has no text", f"{where}[{j}]")
        parts.append(TextPart(text=text))
    return parts


_decoder = msgspec.json.Decoder(ResponsesRequest)


class InputTokensRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/responses/input_tokens: a response's body, what shapes its prompt."""

    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=300)] | None = None
    conversation: Any = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None
    personality: str | None = None  # a hosted model's persona: no part of this prompt

    def to_responses(self) -> ResponsesRequest:
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if f != "personality"}
        return ResponsesRequest(**{**fields, "input": self.input or []})


_input_tokens_decoder = msgspec.json.Decoder(InputTokensRequest)


def decode_input_tokens(body: bytes) -> ResponsesRequest:
    return decode(_input_tokens_decoder, body).to_responses()  # type: ignore[no-any-return]


# OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]
MAX_ITEMS_PER_REQUEST = 20  # items a conversation takes in one request, as OpenAI's


class ConversationCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    items: Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS_PER_REQUEST)] | None = None
    metadata: Metadata | None = None


class ConversationUpdate(Struct, forbid_unknown_fields=True, kw_only=True):
    metadata: Metadata


class ConversationItemsCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    items: Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)]


def decode_responses(body: bytes) -> ResponsesRequest:
    return decode(_decoder, body)


# Where a chat-side 400 names a chat field, the Responses request's name for it.
_RENAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in _RENAMES:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours + param[len(chat) :] if chat != "messages" else ours
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param
