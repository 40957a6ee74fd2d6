"""Wire types: OpenAI-compatible requests and the WebSocket protocol, as msgspec Structs.

Every edge decodes into these with unknown fields forbidden and value ranges declared,
so a bad request becomes a 400 naming the field before anything else runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from scheduler.sampling_params import SamplingParams

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


class StreamOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


def check_messages(messages: list[ChatMessage], field: str = "messages") -> None:
    """OpenAI's rule: every message has content, except an assistant message that carries
    tool calls (not accepted by this server yet; when they are, that case passes here)."""
    for i, m in enumerate(messages):
        if m.content is None:
            raise BadRequest(
                f"{field}[{i}] (role {m.role}) has no content", f"{field}[{i}].content"
            )


class ResponseFormat(Struct, forbid_unknown_fields=False, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by both OpenAI endpoints (vLLM's extensions included)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty or 1.0,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadRequest(str(e), field if why else None) from e


class ChatCompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None

    def template_request(self) -> tuple[str | None, str, dict[str, Any]]:
        """(request-supplied template or None, the field that carried it, other kwargs)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if "chat_template" in kwargs:
            template = kwargs.pop("chat_template")
            if self.chat_template is not None or not isinstance(template, str):
                raise BadRequest(
                    "chat_template_kwargs.chat_template must be a string (and not given twice)",
                    "chat_template_kwargs.chat_template",
                )
            return template, "chat_template_kwargs.chat_template", kwargs
        return self.chat_template, "chat_template", kwargs

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise BadRequest(f"{name} (tool calling) is not supported by this server", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise BadRequest(f"{name} (tool calling) is not supported by this server", name)
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest(
                f"response_format {self.response_format.type!r} is not supported; only 'text'",
                "response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")

    def to_sampling_params(self) -> SamplingParams:
        self.check_unsupported()
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class CompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str | NonNegInt | list[NonNegInt]]
    max_tokens: PositiveInt | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise BadRequest("echo is not supported by this server", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in p):
            if any(not x for x in p):  # type: ignore[union-attr]
                raise BadRequest("token-id prompts must not be empty", "prompt")
            return [list(x) for x in p]  # type: ignore[arg-type]
        raise BadRequest(
            "prompt must be a string, a list of strings, a list of token ids, or a list of "
            "token-id lists (not a mix)",
            "prompt",
        )

    def to_sampling_params(self) -> SamplingParams:
        self.check_unsupported()
        return self.sampling_params(self.max_tokens, self.logprobs)


# ----------------------------------------------------------------------------- WebSocket
class WSParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Sampling parameters of a WebSocket `generate` frame (SamplingParams' names)."""

    max_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    min_p: Unit = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[NonNegInt] = msgspec.field(default_factory=list)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None

    def to_sampling_params(self) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadRequest(str(e), f"params.{field}" if why else None) from e


class WSGenerate(
    Struct, forbid_unknown_fields=True, tag="generate", tag_field="type", kw_only=True
):
    id: RequestId
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt: str | list[NonNegInt] | None = None
    params: WSParams = msgspec.field(default_factory=WSParams)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class WSCancel(Struct, forbid_unknown_fields=True, tag="cancel", tag_field="type", kw_only=True):
    id: RequestId


class WSPing(Struct, forbid_unknown_fields=True, tag="ping", tag_field="type", kw_only=True):
    pass


ClientFrame = WSGenerate | WSCancel | WSPing


class PrefixRegistration(Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of POST /v1/cache/prefixes."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    prompt: str | list[NonNegInt] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    model: str | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_ws_decoder = msgspec.json.Decoder(ClientFrame)
_prefix_decoder = msgspec.json.Decoder(PrefixRegistration)


def field_of(err: msgspec.ValidationError) -> str | None:
    """The field path msgspec names in a validation error: '... - at `$.a.b[0]`' -> 'a.b[0]'."""
    msg = str(err)
    marker = "at `$"
    i = msg.rfind(marker)
    path = msg[i + len(marker) :].rstrip("`").lstrip(".") if i >= 0 else ""
    unknown = "unknown field `"
    j = msg.find(unknown)
    if j >= 0:
        name = msg[j + len(unknown) : msg.index("`", j + len(unknown))]
        path = f"{path}.{name}" if path else name
    return path or None


def decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """Decode or raise BadRequest naming the field."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise BadRequest(str(e), field_of(e)) from e
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return decode(_chat_decoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    return decode(_completion_decoder, body)


def decode_ws(frame: str | bytes) -> WSGenerate | WSCancel | WSPing:
    return decode(_ws_decoder, frame)


def decode_prefix(body: bytes) -> PrefixRegistration:
    return decode(_prefix_decoder, body)
