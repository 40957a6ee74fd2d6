"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import msgspec


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A constraint on what may be generated (vLLM's StructuredOutputsParams); exactly one
    of json, regex, choice, grammar, json_object."""

    json: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object
    # True: a schema keyword the engine cannot enforce is an error; False: it is ignored
    # (OpenAI's `strict`).
    strict: bool = True
    # A reasoning model's tags (service/reasoning.py; set by the server, never by a
    # client): the grammar holds the answer after `reasoning_end`; with
    # `reasoning_start`, the output may open its thinking with that token first
    # (scheduler/structured.py AfterReasoning).
    reasoning_end: int | None = None
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(given) or 'none'})"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice: must not be empty")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )


class ReasoningBudget(msgspec.Struct, kw_only=True, frozen=True):
    """At most `budget` tokens of thinking (vLLM's thinking_token_budget; Anthropic's
    budget_tokens): then the closing token `end` is forced.  `start`: the output may still
    open its thinking with that token (service/reasoning.py).  Set by the server."""

    end: int
    budget: int
    start: int | None = None


# sentence-transformers' pooling modes.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "last")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request.  Field names and defaults follow vLLM's SamplingParams.

    `top_k` of 0 or -1 disables top-k; `max_tokens=None` means "up to max_model_len".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Logprob of every prompt token after the first, with this many alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (OpenAI's logit_bias, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these ids may be sampled (every other logit -inf).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, and the token sequences they ban (service/bad_words.py: the engine
    # derives these from the words where the caller has not).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # The LoRA adapter this request runs with (a name of --lora-modules; the server sets it
    # from the request's `model`), None for the base model.  Not a sampling setting, but
    # it travels with them to the runner and keys the request's cached KV.
    lora: str | None = None
    # A reasoning model's thinking, bounded (scheduler/structured.py AfterReasoning).
    reasoning_budget: ReasoningBudget | None = None
    # OpenAI's predicted output (`prediction`), as token ids (set by the server): under
    # n-gram speculation the drafts come from it first (scheduler/spec.py).  It never
    # changes what is generated.
    prediction: list[int] | None = None
    # An embedding request (/v1/embeddings; set by the server): the runner returns the
    # prompt's pooled final hidden states with the one token it samples.
    embed: bool = False
    # How an embedding request pools (set by the server from the checkpoint's
    # sentence-transformers config or --pooler-config): modes of POOLING_MODES, their
    # vectors concatenated in this tuple's order.  The last position's state alone is what decoder
    # embedding models are trained for; every other mode reads every prompt position.
    pooling: tuple[str, ...] = ("last",)

    def __post_init__(self) -> None:
        # Normalise the aliases so the hot path tests one value.
        if self.top_k < 0:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""

        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field}: {why}")

        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} is larger than max_tokens {self.max_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop", "empty stop strings are not allowed")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                bad("logit_bias", f"token id {tok} is negative")
            if not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"bias {bias} for token {tok} is outside [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
            if min(self.allowed_token_ids) < 0:
                bad("allowed_token_ids", f"token id {min(self.allowed_token_ids)} is negative")
        for seq in self.bad_words_token_ids or ():
            if not seq or min(seq) < 0:
                bad("bad_words", f"a banned sequence must be non-empty token ids, got {seq}")
        if (
            not self.pooling
            or len(set(self.pooling)) != len(self.pooling)
            or any(m not in POOLING_MODES for m in self.pooling)
        ):
            bad("pooling", f"must be distinct modes of {POOLING_MODES}, got {self.pooling}")

    @property
    def reads_every_position(self) -> bool:
        """The runner needs every prompt position's hidden state computed (prompt
        logprobs, or pooling other than the last token's): cached KV cannot stand in."""
        return self.prompt_logprobs is not None or (self.embed and self.pooling != ("last",))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
