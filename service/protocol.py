"""Wire types every edge shares, as msgspec Structs: value ranges, `BadRequest`, chat
messages and tool definitions, the prefix-registration body, and `decode`.

Every edge decodes with unknown fields forbidden and value ranges declared, so a bad
request becomes a 400 naming the field before anything else runs.  Each edge's own
bodies live beside this module: `service/protocol_openai.py` (chat and completions),
`service/protocol_ws.py` (WebSocket frames), `service/protocol_structured.py` (the
structured-output fields both accept).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from service.json_depth import TooDeep, check_depth

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]


class BadRequest(ValueError):
    """A request that decoded but cannot be served as asked; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class TextPart(Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    text: str


class FunctionCall(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    # An assistant turn's thinking as this server (or SGLang, DeepSeek) returned it; given
    # to the template as `reasoning_content` (Qwen3's reads it), `reasoning` is vLLM's name.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if (thought := self.reasoning_content or self.reasoning) is not None:
            d["reasoning_content"] = thought
        if self.tool_calls:
            # HF templates read arguments as a mapping (`arguments | tojson`), as vLLM
            # passes them; text that is not JSON is passed through as is.
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": _json_or_text(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        return d


def _json_or_text(text: str) -> Any:
    """JSON text as a value; anything else (text nested past the limit included: the
    edges refuse that first, in `check_tool_arguments`) passes through as text."""
    try:
        check_depth(text)
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


class FunctionDefinition(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


def check_messages(messages: list[ChatMessage], field: str = "messages") -> None:
    """OpenAI's rule: every message has content, except an assistant message that carries
    tool calls."""
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise BadRequest(
                f"{field}[{i}] (role {m.role}) has no content", f"{field}[{i}].content"
            )
    check_tool_arguments(messages, field)


def check_tool_arguments(messages: list[ChatMessage], field: str = "messages") -> None:
    """Tool-call arguments are JSON text the template reads as a value: held to the same
    nesting limit as the body (service/json_depth.py)."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            try:
                check_depth(call.function.arguments)
            except TooDeep as e:
                where = f"{field}[{i}].tool_calls[{j}].function.arguments"
                raise BadRequest(
                    f"{where} is JSON nested more than {e.limit} levels deep", where
                ) from None


class PrefixRegistration(Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of POST /v1/cache/prefixes."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt: str | list[NonNegInt] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    model: str | None = None


_prefix_decoder = msgspec.json.Decoder(PrefixRegistration)


def field_of(err: msgspec.ValidationError) -> str | None:
    """The field path msgspec names in a validation error: '... - at `$.a.b[0]`' -> 'a.b[0]'."""
    msg = str(err)
    marker = "at `$"
    i = msg.rfind(marker)
    path = msg[i + len(marker) :].rstrip("`").lstrip(".") if i >= 0 else ""
    path = path.replace("[...]", "")  # (a dict's value: msgspec does not say its key)
    unknown = "unknown field `"
    j = msg.find(unknown)
    if j >= 0:
        name = msg[j + len(unknown) : msg.index("`", j + len(unknown))]
        path = f"{path}.{name}" if path else name
    return path or None


def decode(decoder: msgspec.json.Decoder, body: bytes | str) -> Any:
    """Decode or raise BadRequest naming the field.  Every edge decodes through here, so
    the nesting limit (service/json_depth.py) holds for every value a client sends."""
    try:
        check_depth(body)
    except TooDeep as e:
        raise BadRequest(str(e), e.field) from None
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise BadRequest(str(e), field_of(e)) from e
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError:  # unreachable under the depth limit; never a 500 if it is not
        raise BadRequest("the request body is nested too deeply") from None


def decode_prefix(body: bytes) -> PrefixRegistration:
    return decode(_prefix_decoder, body)
