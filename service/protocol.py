"""Wire types: OpenAI-compatible requests and the WebSocket protocol, as msgspec Structs.

Every edge decodes into these with unknown fields forbidden and value ranges declared,
so a bad request becomes a 400 naming the field before anything else runs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

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
    reasoning_content: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
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
    try:
        return json.loads(text)
    except ValueError:
        return text


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs` request field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's knobs we do not implement (refused when set).
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


def _schema_text(schema: dict[str, Any] | str, field: str) -> str:
    """A JSON schema as canonical JSON text (the cache key), checked to be an object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadRequest(f"{field} is not valid JSON: {e}", field) from e
    if not isinstance(schema, dict):
        raise BadRequest(f"{field} must be a JSON schema object", field)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def structured_spec(
    fmt: ResponseFormat | None,
    so: StructuredOutputsRequest | None,
    guided: dict[str, Any],
) -> tuple[StructuredOutputsParams, str] | None:
    """The one constraint a request asks for, and the field that asked (for errors)."""
    found: list[tuple[StructuredOutputsParams, str]] = []

    def add(field: str, **kw: Any) -> None:
        try:
            found.append((StructuredOutputsParams(**kw), field))
        except ValueError as e:
            raise BadRequest(str(e).partition(": ")[2] or str(e), field) from e

    if fmt is not None and fmt.type == "json_object":
        add("response_format", json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        field = "response_format.json_schema.schema"
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise BadRequest("response_format json_schema needs json_schema.schema", field)
        add(
            field,
            json=_schema_text(fmt.json_schema.schema, field),
            strict=bool(fmt.json_schema.strict),
        )
    elif fmt is not None and fmt.type == "structural_tag":
        raise BadRequest("response_format structural_tag is not supported", "response_format")
    if so is not None:
        for name in (
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
            "whitespace_pattern",
            "structural_tag",
        ):
            if getattr(so, name) is not None:
                raise BadRequest(
                    f"structured_outputs.{name} is not supported", f"structured_outputs.{name}"
                )
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
        kinds += ["json_object"] if so.json_object else []
        if len(kinds) != 1:
            raise BadRequest(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        k = kinds[0]
        field = f"structured_outputs.{k}"
        if k == "json":
            add(field, json=_schema_text(so.json, field))  # type: ignore[arg-type]
        elif k == "choice":
            add(field, choice=tuple(so.choice or ()))
        elif k == "json_object":
            add(field, json_object=True)
        else:
            add(field, **{k: getattr(so, k)})
    for name, value in guided.items():
        if value is None:
            continue
        if name == "guided_json":
            add(name, json=_schema_text(value, name))
        elif name == "guided_choice":
            add(name, choice=tuple(value))
        else:
            add(name, **{name.removeprefix("guided_"): value})
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise BadRequest(f"ask for one structured output at a time (got {names})", found[1][1])
    return found[0] if found else None


def check_messages(messages: list[ChatMessage], field: str = "messages") -> None:
    """OpenAI's rule: every message has content, except an assistant message that carries
    tool calls."""
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise BadRequest(
                f"{field}[{i}] (role {m.role}) has no content", f"{field}[{i}].content"
            )


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
    request_id: RequestId | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* names (exactly one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Documented by vLLM, refused here (check_unsupported says so by name).
    guided_whitespace_pattern: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    return_tokens_as_token_ids: Any = None
    priority: int = 0

    _REFUSED = (
        "guided_whitespace_pattern",
        "allowed_token_ids",
        "bad_words",
        "logits_processors",
        "truncate_prompt_tokens",
        "use_beam_search",
        "length_penalty",
        "kv_transfer_params",
        "vllm_xargs",
        "return_tokens_as_token_ids",
    )

    def check_unsupported(self) -> None:
        for name in self._REFUSED:
            if getattr(self, name) not in (None, False):
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.spaces_between_special_tokens is False:
            raise BadRequest(
                "spaces_between_special_tokens=false is not supported by this server",
                "spaces_between_special_tokens",
            )
        if self.priority != 0:
            raise BadRequest("priority scheduling is not supported by this server", "priority")
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise BadRequest(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; "
                "this server decodes with llguidance ('guidance')",
                "guided_decoding_backend",
            )
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return structured_spec(self.response_format, self.structured_outputs, guided)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys (token ids as strings, as OpenAI sends them) as ints."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                out[int(key)] = value
            except ValueError as e:
                raise BadRequest(f"logit_bias keys are token ids; got {key!r}", "logit_bias") from e
        return out

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, **extra: Any
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias, spec = self.token_bias(), self.structured()
        try:
            return SamplingParams(
                n=extra.pop("n", self.n),
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
                logit_bias=bias,
                structured_outputs=spec[0] if spec else None,
                prompt_logprobs=extra.pop("prompt_logprobs", self.prompt_logprobs),
            )
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadRequest(str(e), field if why else None) from e


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


class ChatCompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    # Refused: the deprecated function-calling names (use tools), and the rest below.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: str | None = None  # accepted: prefixes are cached whatever the key
    safety_identifier: str | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    add_special_tokens: bool = False
    documents: Any = None
    mm_processor_kwargs: Any = None

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
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is deprecated and not supported; use tools", name)
        if self.add_special_tokens:
            raise BadRequest(
                "add_special_tokens=true is not supported on chat (the template adds them)",
                "add_special_tokens",
            )
        for name in (
            "audio",
            "modalities",
            "prediction",
            "web_search_options",
            "reasoning_effort",
            "verbosity",
            "documents",
            "mm_processor_kwargs",
        ):
            if getattr(self, name) is not None:
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.service_tier not in (None, "auto", "default"):
            raise BadRequest("service_tier is not supported by this server", "service_tier")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest(
                "prompt_logprobs on a streamed chat completion is not supported",
                "prompt_logprobs",
            )
        for name in ("continue_final_message", "echo"):
            if getattr(self, name):
                raise BadRequest(
                    f"{name} is not supported on chat completions by this server", name
                )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise BadRequest("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise BadRequest(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                    f"among the tools ({', '.join(names)})",
                    "tool_choice.function.name",
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
    best_of: Annotated[int, Meta(ge=1, le=64)] | None = None
    # vLLM extensions
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise BadRequest("suffix (insertion) is not supported by this server", "suffix")
        if self.prompt_embeds is not None:
            raise BadRequest("prompt_embeds is not supported by this server", "prompt_embeds")
        if not self.add_special_tokens:
            raise BadRequest(
                "add_special_tokens=false is not supported by this server", "add_special_tokens"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise BadRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise BadRequest("best_of > n cannot be streamed", "best_of")

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
        """best_of > n samples best_of sequences (with their logprobs, to rank them);
        echo with logprobs also needs the prompt's."""
        self.check_unsupported()
        extra: dict[str, Any] = {}
        logprobs = self.logprobs
        if self.best_of is not None and self.best_of > self.n:
            extra["n"] = self.best_of
            logprobs = logprobs or 0
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            extra["prompt_logprobs"] = self.logprobs
        return self.sampling_params(self.max_tokens, logprobs, **extra)


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
    logit_bias: dict[int, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        try:
            spec = structured_spec(self.response_format, self.structured_outputs, {})
        except BadRequest as e:
            raise BadRequest(e.message, f"params.{e.param}" if e.param else None) from e
        return None if spec is None else (spec[0], f"params.{spec[1]}")

    def to_sampling_params(self) -> SamplingParams:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        del fields["response_format"]
        spec = self.structured()
        fields["structured_outputs"] = spec[0] if spec else None
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
