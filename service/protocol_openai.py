"""Request bodies of the OpenAI-compatible routes: /v1/chat/completions and
/v1/completions, with vLLM's extensions, and what each turns into (`SamplingParams`).

Fields OpenAI or vLLM document but this server does not implement are declared so a
request naming them gets a 400 saying so by name, instead of an unknown-field error.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from service.generation_defaults import NONE as NO_DEFAULTS
from service.generation_defaults import GenerationDefaults
from service.protocol import (
    BadRequest,
    ChatMessage,
    NamedToolChoice,
    NonNegInt,
    Penalty,
    PositiveInt,
    RepetitionPenalty,
    RequestId,
    Temperature,
    TextPart,
    Tool,
    TopP,
    Unit,
    decode,
)
from service.protocol_structured import ResponseFormat, StructuredOutputsRequest, structured_spec

# Printable, as it names a conversation in logs and pins; 256 characters at most.
ConversationId = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]


class StreamOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    allowed_token_ids: Annotated[list[NonNegInt], Meta(min_length=1)] | None = None
    # Token sequences never generated (service/bad_words.py).
    bad_words: list[Annotated[str, Meta(max_length=1024)]] | None = None
    # Keep only the prompt's last so many tokens (-1: max_model_len's worth).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
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
    logits_processors: Any = None
    # Beam search (service/beam_search.py): n is the beam width, and the n best beams
    # are the choices; length_penalty is the exponent of the length in their ranking.
    use_beam_search: bool = False
    length_penalty: Annotated[float, Meta(ge=-10.0, le=10.0)] = 1.0
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    # Logprobs name tokens "token_id:<id>" (for tokens whose text is not valid UTF-8 alone).
    return_tokens_as_token_ids: bool = False
    # Order within the API key's waiting line, lower first (vLLM's; scheduler/fair_queue.py).
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    # The conversation this turn belongs to: its KV stays pinned for the next turn
    # (scheduler/pins.py).  Either name; the same conversation for the same API key.
    conversation_id: ConversationId | None = None
    session_id: ConversationId | None = None

    _REFUSED = (
        "guided_whitespace_pattern",
        "logits_processors",
        "kv_transfer_params",
        "vllm_xargs",
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
        if None not in (self.conversation_id, self.session_id) and (
            self.conversation_id != self.session_id
        ):
            raise BadRequest("conversation_id and session_id name different conversations",
                             "session_id")  # fmt: skip
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise BadRequest(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; "
                "this server decodes with llguidance ('guidance')",
                "guided_decoding_backend",
            )
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if self.use_beam_search:
            self.check_beam_search()

    # What beam search does not take (it ranks beams by the raw logprobs, greedily): a
    # field set to anything but its default is refused rather than ignored.
    _NOT_WITH_BEAMS: ClassVar[tuple[tuple[str, tuple[Any, ...]], ...]] = (
        ("top_p", (None, 1.0)),
        ("top_k", (None, 0, -1)),
        ("min_p", (None, 0.0)),
        ("seed", (None,)),
        ("stop", (None, [])),
        ("stop_token_ids", (None, [])),
        ("min_tokens", (0,)),
        ("presence_penalty", (0.0,)),
        ("frequency_penalty", (0.0,)),
        ("repetition_penalty", (None, 1.0)),
        ("logit_bias", (None, {})),
        ("allowed_token_ids", (None,)),
        ("bad_words", (None, [])),
        ("prompt_logprobs", (None,)),
        ("structured_outputs", (None,)),
        ("guided_json", (None,)),
        ("guided_regex", (None,)),
        ("guided_choice", (None,)),
        ("guided_grammar", (None,)),
        ("conversation_id", (None,)),
        ("session_id", (None,)),
    )

    def check_beam_search(self) -> None:
        if self.n > MAX_BEAM_WIDTH:
            raise BadRequest(
                f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}", "n"
            )
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest("response_format cannot be combined with use_beam_search",
                             "response_format")  # fmt: skip
        for name, unset in self._NOT_WITH_BEAMS:
            if getattr(self, name) not in unset:
                raise BadRequest(f"{name} cannot be combined with use_beam_search", name)

    def beam_spec(self, max_tokens: int | None) -> BeamSearchParams | None:
        if not self.use_beam_search:
            return None
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            length_penalty=self.length_penalty,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    def keep_last(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens to keep (None: all), or a 400."""
        return truncation(self.truncate_prompt_tokens, max_model_len)

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
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: GenerationDefaults = NO_DEFAULTS,
        **extra: Any,
    ) -> SamplingParams:
        """defaults: the model's recommended sampling, for the fields left out
        (service/generation_defaults.py)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias, spec = self.token_bias(), self.structured()
        d = defaults
        try:
            return SamplingParams(
                n=extra.pop("n", self.n),
                temperature=d.pick("temperature", self.temperature),
                top_p=d.pick("top_p", self.top_p),
                top_k=d.pick("top_k", self.top_k),
                min_p=d.pick("min_p", self.min_p),
                seed=self.seed,
                max_tokens=d.cap(max_tokens),
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=d.pick("repetition_penalty", self.repetition_penalty),
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=bias,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or None,
                structured_outputs=spec[0] if spec else None,
                prompt_logprobs=extra.pop("prompt_logprobs", self.prompt_logprobs),
            )
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise BadRequest(str(e), field if why else None) from e


class Prediction(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `prediction`: the output the client expects, as text or text parts."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


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
    # OpenAI's predicted output: drafts for speculative decoding (scheduler/prediction.py).
    prediction: Prediction | None = None
    service_tier: Any = None
    web_search_options: Any = None
    # Given to the chat template as `reasoning_effort` (a template that reads it, as
    # gpt-oss's does, sets its thinking budget; others ignore it), as vLLM does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Any = None
    prompt_cache_key: str | None = None  # accepted: prefixes are cached whatever the key
    safety_identifier: str | None = None
    # vLLM extensions
    include_reasoning: bool = True  # False: the thinking is parsed out and dropped
    # At most this many tokens of thinking, then `</think>` is forced (--reasoning-parser)
    thinking_token_budget: NonNegInt | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI Responses' `truncation`, here on chat too: "auto" drops the oldest turns of a
    # conversation that does not fit, half a window at a time (service/truncation.py).
    truncation: Literal["disabled", "auto"] | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    add_special_tokens: bool = False
    documents: Any = None
    mm_processor_kwargs: Any = None

    def template_request(self) -> tuple[str | None, str, dict[str, Any]]:
        """(request-supplied template or None, the field that carried it, other kwargs)."""
        template, field, kwargs = template_choice(self.chat_template, self.chat_template_kwargs)
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return template, field, kwargs

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
            "web_search_options",
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
        if self.echo:
            raise BadRequest("echo is not supported on chat completions by this server", "echo")
        if self.continue_final_message and self.add_generation_prompt:
            # vLLM's rule: add_generation_prompt defaults to true, so a client that
            # continues a message says add_generation_prompt=false.
            raise BadRequest(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false)",
                "continue_final_message",
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
        if self.use_beam_search:
            for name in ("logprobs", "echo"):
                if getattr(self, name):
                    raise BadRequest(f"{name} cannot be combined with use_beam_search", name)
            if self.tools and self.tool_choice != "none":
                raise BadRequest("tools cannot be combined with use_beam_search", "tools")

    def to_sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        self.check_unsupported()
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, defaults)


class CompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str | NonNegInt | list[NonNegInt]]
    # 0 only with echo (see echo_only).
    max_tokens: NonNegInt | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1, le=64)] | None = None
    # vLLM extensions
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    @property
    def echo_only(self) -> bool:
        """vLLM's `echo` with `max_tokens: 0`: the prompt alone (and its logprobs), no
        output; lm-eval's local-completions scores a continuation this way."""
        return self.echo and self.max_tokens == 0

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest(
                "max_tokens must be >= 1 (0 is taken only with echo, which then "
                "returns the prompt alone)",
                "max_tokens",
            )
        if self.suffix:
            # (the model's fill-in-the-middle tokens are checked when the prompt is built)
            for name in ("echo", "truncate_prompt_tokens"):
                if getattr(self, name):
                    raise BadRequest(f"{name} cannot be combined with suffix", name)
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
        if self.use_beam_search:
            for name in ("logprobs", "best_of"):
                if getattr(self, name) is not None:
                    raise BadRequest(f"{name} cannot be combined with use_beam_search", name)
            if self.echo:
                raise BadRequest("echo cannot be combined with use_beam_search", "echo")

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    def to_sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
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
        # echo_only runs the prompt through one step, as vLLM does: its logprobs come out
        # of that prefill, and the one token sampled after it is not returned.
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.sampling_params(max_tokens, logprobs, defaults, **extra)


def template_choice(
    chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
) -> tuple[str | None, str, dict[str, Any]]:
    """A request's own chat template (given as `chat_template` or, as vLLM also takes it,
    inside `chat_template_kwargs`), the field that carried it, and the other kwargs."""
    kwargs = dict(chat_template_kwargs or {})
    if "chat_template" not in kwargs:
        return chat_template, "chat_template", kwargs
    template = kwargs.pop("chat_template")
    if chat_template is not None or not isinstance(template, str):
        raise BadRequest(
            "chat_template_kwargs.chat_template must be a string (and not given twice)",
            "chat_template_kwargs.chat_template",
        )
    return template, "chat_template_kwargs.chat_template", kwargs


def truncation(k: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens to keep (None:
    all; -1: max_model_len's worth), or a 400."""
    if k is None:
        return None
    if k == 0:
        raise BadRequest(
            "truncate_prompt_tokens must be >= 1, or -1 for max_model_len's worth",
            "truncate_prompt_tokens",
        )
    if k > max_model_len:
        raise BadRequest(
            f"truncate_prompt_tokens ({k}) is larger than max_model_len ({max_model_len})",
            "truncate_prompt_tokens",
        )
    return max_model_len if k == -1 else k


def prompt_list(p: str | list[Any], field: str = "prompt") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists, as
    a list of prompts."""
    if isinstance(p, str):
        return [p]
    if not p:
        raise BadRequest(f"{field} must not be empty", field)
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p):
        return list(p)
    if all(isinstance(x, list) for x in p):
        if any(not x for x in p):
            raise BadRequest(f"token-id {field}s must not be empty", field)
        return [list(x) for x in p]
    raise BadRequest(
        f"{field} must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists (not a mix)",
        field,
    )


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return decode(_chat_decoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    return decode(_completion_decoder, body)
