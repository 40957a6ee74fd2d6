"""Engine-side request state.  Only the scheduler mutates it."""

from __future__ import annotations

import enum
import time

from scheduler.block_pool import BlockHash, hash_block
from scheduler.prediction import PredictionTrack
from scheduler.sampling_params import SamplingParams
from scheduler.structured import GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0  # not yet admitted, or preempted and waiting to recompute
    WAITING_FOR_PARENT = 1  # sample i > 0 of an n > 1 group, before the prompt is computed
    WAITING_FOR_REMOTE = 2  # looking up the Redis prefix tier
    RUNNING = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def stop_set(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The token ids that end a sample: stop_token_ids, and eos unless ignore_eos."""
    return frozenset(params.stop_token_ids) | (
        frozenset() if params.ignore_eos else frozenset(eos_token_ids)
    )


class Request:
    # Slots, hot ones first: the columnar path reads a few fields of a thousand requests
    # a step, and with slots they sit in the object itself (one or two cache lines)
    # rather than in a separate values array, which matters once long contexts spread
    # the requests over a large heap.
    __slots__ = (  # noqa: RUF023 (the order is the layout)
        "status", "columnar", "num_computed_tokens", "token_ids", "req_id", "stop_ids",
        "length_limit", "group_id", "sample_index", "prompt_len", "num_cached_tokens",
        "first_scheduled_time", "plain", "params", "max_tokens", "cache_salt",
        "block_hashes", "fork_ids", "registered", "num_preemptions", "finish_reason",
        "stop_token_id", "arrival_time", "publish_prefix", "remote_start",
        "remote_payloads", "grammar", "prompt_logprobs", "prompt_logprobs_sent",
        "spec_accepted", "spec_trials", "tenant", "conversation", "priority",
        "grammar_share", "prediction", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int,
        cache_salt: str | None = None,
        sample_index: int = 0,
        group_id: str | None = None,
        arrival_time: float | None = None,
        publish_prefix: bool = False,
        grammar: GrammarMatcher | None = None,
        tenant: str | None = None,
        conversation: str | None = None,
        priority: int = 0,
        stop_ids: frozenset[int] | None = None,
        grammar_share: int = 1,
    ) -> None:
        """stop_ids: the set below, made once for a request's samples (a stop_token_ids
        list may be a megabyte long: 64 copies of its set held the event loop 0.3 s)."""
        self.req_id = req_id
        self.group_id = group_id or req_id
        self.params = params
        self.sample_index = sample_index
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.max_tokens = max_tokens  # already capped by max_model_len
        self.cache_salt = cache_salt
        self.stop_ids: frozenset[int] = (
            stop_ids if stop_ids is not None else stop_set(params, eos_token_ids)
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.fork_ids: list[str] = []  # n > 1: children waiting for this one's first token
        self.registered = False  # the runner has this request's NewRequestData
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from a prefix cache (first admission)
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        # Publish every full block of this request's prompt to the shared prefix tier
        # (a client registering a system prompt), rather than waiting for hits.
        self.publish_prefix = publish_prefix
        # Whose share of the shared prefix tier this request's publications count against
        # (an API key's hash; None: no share applies).  See scheduler.prefix_tier.
        self.tenant = tenant
        # The conversation whose KV this turn pins when it ends (scheduler/pins.py): a
        # key the service makes per tenant, so no key reaches another's pins.
        self.conversation = conversation
        # Order within the tenant's waiting line, lower first (scheduler/fair_queue.py).
        self.priority = priority
        # KV payloads found in the shared tier: blocks [remote_start, remote_start + len).
        self.remote_start = 0
        self.remote_payloads: list[bytes] = []
        # Constrained decoding: this sample's own matcher, advanced with every output token.
        self.grammar = grammar
        # How many prompts of one API request (a completions body's prompt list) share its
        # grammar's time budget with this one's n samples (service/structured.py).
        self.grammar_share = grammar_share
        self.prompt_logprobs: list = []  # TokenLogprobs of prompt tokens 1.. (when asked)
        self.prompt_logprobs_sent = False
        # Speculative decoding: moving averages of accepted drafts and of acceptance trials
        # per verify step (scheduler/spec.py); their ratio estimates the per-token rate.
        self.spec_accepted = 1.0
        self.spec_trials = 1.0
        # OpenAI's predicted output (SamplingParams.prediction): where the output stands
        # in it, and what its drafts earned (scheduler/spec.py).
        self.prediction = PredictionTrack(params.prediction) if params.prediction else None
        # The columnar decode path (scheduler/contract.py, DecodeColumns): `plain` says the
        # request never needs more than a token per step (no grammar, no logprobs);
        # `columnar` that it is, right now, a decode whose last block is its own and
        # whose table the runner holds as is, so a step needs no per-request object.
        self.plain = grammar is None and params.logprobs is None
        self.columnar = False
        # Length at which it ends (max_tokens or max_model_len): set by the scheduler.
        self.length_limit = self.prompt_len + max_tokens

    @property
    def spec_rate(self) -> float:
        """Estimated probability that one draft token is accepted, from recent verifies."""
        return self.spec_accepted / self.spec_trials

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the hash chain over every full block of known tokens."""
        full = len(self.token_ids) // block_size
        hashes = self.block_hashes
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(
                    parent, self.token_ids[i * block_size : (i + 1) * block_size], self.cache_salt
                )
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id}, {self.status.name}, computed={self.num_computed_tokens}"
            f"/{self.num_tokens})"
        )
