"""The scheduler's configuration and what it hands back: per-step request updates,
stats, and the rejection it raises (scheduler/scheduler.py holds the policy)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from scheduler.contract import TokenLogprobs
from scheduler.pins import PinStats
from scheduler.spec import SpecStats

if TYPE_CHECKING:
    from scheduler.config import EngineConfig
    from scheduler.request import Request


class RequestRejected(ValueError):
    """A request the engine cannot take (too long, bad params); the message says why."""


@dataclass
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    # Waiting-queue policy (scheduler/fair_queue.py): "fair" = deficit round robin on
    # prompt tokens across tenants (weights by tenant id, default 1), priority within
    # one; "fcfs" = one line for all, by priority then arrival.
    scheduling_policy: str = "fair"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Conversation pins (scheduler/pins.py): at most this fraction of the blocks, each
    # pin kept for session_ttl seconds (0 for either: no pinning).
    pinned_kv_fraction: float = 0.25
    session_ttl: float = 300.0
    # Distinct LoRA adapters among the running requests (vLLM's max_loras); None: any.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError("scheduling_policy must be 'fair' or 'fcfs'")
        if not 0 <= self.pinned_kv_fraction <= 1:
            raise ValueError("pinned_kv_fraction must be in [0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_kv_blocks} blocks of {self.block_size} tokens) cannot "
                f"hold one sequence of max_model_len {self.max_model_len}; add blocks or lower "
                "max_model_len"
            )

    @classmethod
    def from_engine(
        cls, config: EngineConfig, num_kv_blocks: int, max_model_len: int, budget: int
    ) -> SchedulerConfig:
        """The scheduler's share of the engine's config, with what only the built runner
        knows: its KV blocks, the sequence length they allow, the step's token budget
        (the setting, or the device's default)."""
        s, cache = config.scheduler, config.cache
        return cls(
            num_kv_blocks=num_kv_blocks,
            block_size=cache.block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=s.max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching,
            scheduling_policy=s.scheduling_policy,
            tenant_weights=dict(s.tenant_weights or {}),
            pinned_kv_fraction=cache.pinned_kv_fraction,
            session_ttl=cache.session_ttl,
            max_loras=s.max_loras,
        )


class RequestUpdate(msgspec.Struct, gc=False, kw_only=True):
    """What one sequence produced in one step (or how it ended).  A Struct, not a
    dataclass: one is built per running sequence per step, and a Struct builds several times faster."""

    req_id: str
    group_id: str
    sample_index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # The request's own spec caused the error (its grammar hit a dead end or its time
    # budget): the client's fault, reported as a 4xx, not the server's 500.
    client_error: bool = False
    first_scheduled_time: float | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, with the first token
    embedding: list[float] | None = None  # SamplingParams.embed: with the first token
    # SamplingParams.prediction: (drafts from it kept, drafts refused), with the finish.
    prediction_tokens: tuple[int, int] | None = None


class StepUpdates:
    """What one step produced: full updates (first tokens, ends, errors, logprobs...),
    and the columnar decode rows that took one token and go on, as two parallel lists
    (the engine hands each stream its token; nothing per row is built here).  Iterating
    gives every update as a RequestUpdate, for callers that want one shape."""

    __slots__ = ("decode_reqs", "decode_tokens", "updates")

    def __init__(
        self,
        updates: list[RequestUpdate],
        decode_reqs: list[Request] | None = None,
        decode_tokens: list[int] | None = None,
    ) -> None:
        self.updates = updates
        self.decode_reqs = decode_reqs or []
        self.decode_tokens = decode_tokens or []

    def __len__(self) -> int:
        return len(self.updates) + len(self.decode_reqs)

    def __iter__(self) -> Iterator[RequestUpdate]:
        for req, tok in zip(self.decode_reqs, self.decode_tokens, strict=True):
            yield request_update(req, [tok])
        yield from self.updates


def request_update(
    req: Request,
    toks: list[int],
    lps: list[TokenLogprobs | None] | None = None,
    error: str | None = None,
) -> RequestUpdate:
    """A sequence's RequestUpdate carrying `toks`, with its state as it stands now."""
    return RequestUpdate(
        req_id=req.req_id,
        group_id=req.group_id,
        sample_index=req.sample_index,
        new_token_ids=toks,
        logprobs=lps,
        finish_reason=req.finish_reason,
        stop_token_id=req.stop_token_id,
        num_prompt_tokens=req.prompt_len,
        num_cached_tokens=req.num_cached_tokens,
        error=error,
        first_scheduled_time=req.first_scheduled_time,
        prediction_tokens=(
            (track.accepted, track.rejected)
            if (track := req.prediction) is not None and req.finish_reason is not None
            else None
        ),
    )


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prefix_hits_remote: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    spec: SpecStats | None = None  # speculative decoding counters (cumulative)
    pins: PinStats | None = None  # conversation pins (gauges and cumulative counters)
