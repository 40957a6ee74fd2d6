"""The request body of /v1/messages (Anthropic's Messages API) and the chat request it
becomes (`MessagesRequest.to_chat`): the template, tools, stop strings and sampling are
the chat route's own, as vLLM's and llama.cpp's Messages routes reuse their chat path.

Content blocks are decoded by their `type`: text, tool_use (assistant), tool_result
(user) and thinking (assistant: the template gets it as `reasoning_content`).  Images,
documents, server tools, MCP servers and containers are refused by name; `cache_control`
marks are accepted and need nothing (every prefix is cached).
"""

from __future__ import annotations

import base64
import binascii
import json
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
    PositiveInt,
    Temperature,
    Tool,
    ToolCall,
    TopP,
    decode,
)
from service.protocol_openai import ChatCompletionRequest
from service.protocol_structured import JsonSchemaFormat, ResponseFormat


class TextBlock(Struct, tag="text", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class _Refused(Struct, kw_only=True):
    """A block this server cannot take (image, document...): decoded loosely, refused
    with its path."""

    source: Any = None
    cache_control: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None


class ImageBlock(_Refused, tag="image", tag_field="type"):
    pass


class DocumentBlock(_Refused, tag="document", tag_field="type"):
    pass


class ToolUseBlock(
    Struct, tag="tool_use", tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    # The SDK's own tool_use blocks carry these when sent back as they came.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(
    Struct, tag="tool_result", tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    tool_use_id: Annotated[str, Meta(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


# A thinking block's signature, as this server writes it: the thinking itself (base64 of
# its UTF-8), so a block sent back with its text omitted (`display: "omitted"`, or a
# client that keeps only signatures) still gives the template its thinking.  Anthropic's
# signature is the encrypted thinking for the same reason.  It is not a secret and not a
# seal: a client may send any thinking text in the clear anyway.
SIGNATURE_PREFIX = "pagestream.thinking.v1."


def sign_thinking(thought: str) -> str:
    return SIGNATURE_PREFIX + base64.b64encode(thought.encode()).decode("ascii")


class ThinkingBlock(
    Struct, tag="thinking", tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    thinking: str
    signature: str | None = None

    def text(self, where: str) -> str:
        """The thinking: its text, or what this server's signature holds when the text
        was omitted (another server's signature holds nothing readable here)."""
        sig = self.signature
        if self.thinking or not sig or not sig.startswith(SIGNATURE_PREFIX):
            return self.thinking
        try:
            return base64.b64decode(sig[len(SIGNATURE_PREFIX) :], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise BadRequest("the signature is not one this server wrote (it does not "
                             "decode)", f"{where}.signature") from None  # fmt: skip


class RedactedThinkingBlock(
    Struct, tag="redacted_thinking", tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    data: str  # another server's encrypted thinking: nothing a template can use


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class Message(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom"; a server tool ("web_search_...") is refused
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # as chat's: a schema keyword the grammar cannot hold is a 400
    input_examples: list[dict[str, Any]] | None = None  # (for the model's prompt; unused)
    eager_input_streaming: bool | None = None  # (the input streams as it is written anyway)
    # Anthropic's tool search and programmatic calling: refused unless at their defaults.
    defer_loading: bool | None = None
    allowed_callers: list[Any] | None = None


class ToolChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """Whether the model thinks (a reasoning model's template variable); the budget is
    checked as Anthropic checks it (below max_tokens), not enforced on the thinking."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: PositiveInt | None = None
    # omitted: thinking blocks whose text is empty (the signature still holds it)
    display: Literal["summarized", "omitted"] | None = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class JsonOutputFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """`effort` reaches the template as `reasoning_effort` (as on chat); `format` holds
    the answer to a JSON schema (structured output, after any thinking)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class _Common(Struct, forbid_unknown_fields=True, kw_only=True):
    """What shapes the prompt: the messages route's and count_tokens' fields."""

    model: Annotated[str, Meta(max_length=256)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted, nothing to do: every prefix is cached (cache_control); hints of where and
    # how fast to serve, and accounting ids, that a single deployment has no choice in.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict[str, Any] | None = None
    # Refused by name.
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None

    def check_unsupported(self) -> None:
        for name in ("mcp_servers", "container", "context_management"):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is not supported by this server", name)
        for i, t in enumerate(self.tools or ()):
            for name in ("defer_loading", "allowed_callers"):
                if getattr(t, name):
                    raise BadRequest(f"tools[{i}].{name} is not supported by this server",
                                     f"tools[{i}].{name}")  # fmt: skip
            if t.type not in (None, "custom"):
                raise BadRequest(
                    f"tools[{i}].type {t.type!r} is not supported by this server (only "
                    "custom tools)",
                    f"tools[{i}].type",
                )
        tc = self.tool_choice
        if tc is not None and (tc.type == "tool") != (tc.name is not None):
            raise BadRequest('tool_choice.name is given with type "tool", and only then',
                             "tool_choice.name")  # fmt: skip

    def chat_messages(self) -> list[ChatMessage]:
        """The system prompt and messages as chat messages: a user turn's tool results
        become tool messages (first, as the calls they answer came just before), an
        assistant turn's tool_use blocks its tool calls, its thinking `reasoning_content`."""
        out: list[ChatMessage] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            out.append(ChatMessage(role="system", content=text))
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
            texts, calls, thought = [], [], None
            for j, b in enumerate(blocks):
                where = f"messages[{i}].content[{j}]"
                if isinstance(b, ImageBlock | DocumentBlock):
                    kind = "image" if isinstance(b, ImageBlock) else "document"
                    raise BadRequest(f"{where}.type {kind!r} is not supported by this server "
                                     "(text only)", f"{where}.type")  # fmt: skip
                allowed = (
                    (TextBlock, ToolResultBlock)
                    if m.role == "user"
                    else (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
                )
                if not isinstance(b, allowed):
                    raise BadRequest(f"{where}: a {b.__struct_config__.tag!r} block cannot be "
                                     f"in a {m.role} message", f"{where}.type")  # fmt: skip
                if isinstance(b, TextBlock):
                    texts.append(b.text)
                elif isinstance(b, ToolResultBlock):
                    out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                           content=b.text))  # fmt: skip
                elif isinstance(b, ToolUseBlock):
                    args = json.dumps(b.input, ensure_ascii=False)
                    calls.append(ToolCall(id=b.id, function=FunctionCall(name=b.name,
                                                                         arguments=args)))  # fmt: skip
                elif isinstance(b, ThinkingBlock):
                    thought = (thought or "") + b.text(where)
            text = "".join(texts)
            if m.role == "user":
                if text or not blocks or not all(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append(ChatMessage(role="user", content=text))
            else:
                out.append(ChatMessage(role="assistant", content=text or (None if calls else ""),
                                       tool_calls=calls or None,
                                       reasoning_content=thought))  # fmt: skip
        return out

    def chat_tools(self) -> tuple[list[Tool] | None, Any, bool | None]:
        """(tools, tool_choice, parallel_tool_calls) in chat's terms."""
        if not self.tools:
            return None, None, None
        tools = []
        for i, t in enumerate(self.tools):
            try:
                fn = msgspec.convert({"name": t.name, "description": t.description,
                                      "parameters": t.input_schema, "strict": t.strict},
                                     FunctionDefinition)  # fmt: skip
            except msgspec.ValidationError as e:
                raise BadRequest(f"tools[{i}]: {e}", f"tools[{i}].name") from e
            tools.append(Tool(function=fn))
        tc = self.tool_choice
        if tc is None:
            return tools, "auto", None
        choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type)
        if tc.type == "tool":
            if tc.name not in {t.name for t in self.tools}:
                raise BadRequest(f"tool_choice.name {tc.name!r} is not one of the tools",
                                 "tool_choice.name")  # fmt: skip
            choice = NamedToolChoice(function=NamedFunction(name=tc.name or ""))
        return tools, choice, (False if tc.disable_parallel_tool_use else None)

    def template_kwargs(self) -> dict[str, Any] | None:
        """`thinking` as the template variable reasoning models' templates read (Qwen3's
        `enable_thinking`; a template that does not read it ignores it)."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.on}

    @property
    def effort(self) -> Any:
        effort = self.output_config.effort if self.output_config else None
        return "xhigh" if effort == "max" else effort

    def response_format(self) -> ResponseFormat | None:
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return None
        schema = JsonSchemaFormat(name="output", schema=fmt.schema, strict=True)
        return ResponseFormat(type="json_schema", json_schema=schema)

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat request of what shapes the prompt (both routes), plus `sampling`."""
        tools, choice, parallel = self.chat_tools()
        return ChatCompletionRequest(
            messages=self.chat_messages(),
            add_generation_prompt=not self.prefill,
            continue_final_message=self.prefill,
            model=self.model,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            chat_template_kwargs=self.template_kwargs(),
            reasoning_effort=self.effort,
            **sampling,
        )

    @property
    def prefill(self) -> bool:
        """A last assistant message is a prefill the answer continues (Anthropic's way to
        start the answer for the model), not a finished turn."""
        return self.messages[-1].role == "assistant"

    def shows_thinking(self) -> bool:
        """Whether the answer has thinking blocks (their text may be omitted)."""
        t = self.thinking
        return t is None or t.on

    @property
    def omits_thinking(self) -> bool:
        t = self.thinking
        return t is not None and t.display == "omitted"


class MessagesRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        self.check_unsupported()
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise BadRequest("thinking.budget_tokens must be less than max_tokens",
                             "thinking.budget_tokens")  # fmt: skip
        user = (self.metadata or {}).get("user_id")
        return self.chat_request(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            include_reasoning=self.shows_thinking(),
            response_format=self.response_format(),
            user=user if isinstance(user, str) else None,
        )


class CountTokensRequest(_Common, forbid_unknown_fields=True, kw_only=True):
    def to_chat(self) -> ChatCompletionRequest:
        self.check_unsupported()
        return self.chat_request()


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def decode_messages(body: bytes) -> MessagesRequest:
    return decode(_messages_decoder, body)  # type: ignore[no-any-return]


def decode_count_tokens(body: bytes) -> CountTokensRequest:
    return decode(_count_decoder, body)  # type: ignore[no-any-return]
