"""What `AsyncEngine.generate` yields: a request's outputs, vLLM's shape, cumulative per
sample with the latest delta beside it; and the handle of a request queued but not yet read."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.contract import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from scheduler.stream import RequestStream


@dataclass
class Submitted:
    """A request queued in the engine whose outputs nobody has read yet."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    arrival_time: float
    consumed: bool = False


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's shape), cumulative, with the latest delta."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None
    # The text so far, in pieces joined when read: `text += delta` every step copied the
    # whole text each time (quadratic in a long answer's length).
    _pieces: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        """All text so far."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    def add_text(self, delta: str) -> None:
        if delta:
            self._pieces.append(delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # params.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    lora: str | None = None  # the LoRA adapter it ran with (vLLM's lora_request), if any
    # SamplingParams.embed: the last prompt position's final hidden state (not normalized).
    embedding: list[float] | None = None
    # SamplingParams.prediction: drafts taken from it that verification kept and refused,
    # summed over the finished samples (OpenAI's accepted / rejected_prediction_tokens).
    prediction_tokens: tuple[int, int] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
