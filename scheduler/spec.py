"""Speculative decoding, scheduler side: configuration, proposers and the per-step policy.

A cheap proposer guesses the next k tokens of a decoding request; the target model
verifies them in the same step as one short multi-token query (a verify chunk rides
through the paged-attention path like a prefill chunk) and keeps the longest prefix the
rejection rule accepts plus one token of its own.  The output distribution stays exactly
the target's (gpu/spec_decode.py holds the rule); only the number of forward passes drops.

Two proposers sit behind one interface:
- n-gram prompt lookup (here, pure Python): the tokens that followed the most recent
  earlier occurrence of the request's last n tokens;
- a draft model (gpu/spec_decode.DraftModel): the scheduler only reserves k slots and the
  executor fills them, running the draft over its own paged KV that follows the target's
  block tables;
- Medusa heads (gpu/medusa.py) on the target's own last hidden state: the scheduler
  reserves the slots of the static candidate tree cut to the wanted depth
  (scheduler/medusa_tree.py) and the executor fills them; one verify pass with a tree
  mask keeps the longest accepted path.  A request's depth, acceptance rate and the
  step-cost policy count tree levels, as they count a chain's tokens.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from scheduler.medusa_tree import tree_depth, tree_size
from scheduler.request import Request

METHODS = ("ngram", "draft", "medusa")


@dataclass
class SpecConfig:
    """vLLM's speculative_config, with its key names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft checkpoint (method "draft"), Medusa heads ("medusa")
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # vLLM's hard cap: no speculation in steps with more requests running or queued than
    # this.  None (the default) leaves it to the measured policy (StepCostPolicy), which
    # finds where a batch is compute-bound on this machine rather than guessing a size.
    disable_by_batch_size: int | None = None
    # Each request drafts only as deep as its j-th draft is still accepted with at least
    # this probability (estimated rate ** j); below it for even one token it stops
    # speculating, except for an occasional probe, so a hopeless proposer costs little.
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model directory")
        if self.method == "medusa" and not self.model:
            raise ValueError("speculative method 'medusa' needs a Medusa heads directory")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 0.0 <= self.min_acceptance_rate < 1.0:
            raise ValueError(
                f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecConfig:
        """From vLLM's dict shape; a draft model given without a method means 'draft'."""
        d = dict(d)
        if "method" not in d:
            d["method"] = "draft" if d.get("model") else "ngram"
        if d.get("method") == "draft_model":
            d["method"] = "draft"
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**d)


class Proposer(Protocol):
    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k guesses for the tokens after req.token_ids (fewer or none allowed)."""
        ...


class NgramProposer:
    """Prompt lookup: match the last n tokens (n from max down to min) earlier in the
    request's own context and propose what followed the most recent match."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, req: Request, k: int) -> list[int]:
        toks = req.token_ids
        size = len(toks)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            tail = toks[size - n :]
            # The most recent earlier occurrence that still has k tokens after it, else
            # the most recent one (a run that reaches the end, as in "a a a a").
            i = _find_back(toks, tail, size - n - k)
            if i < 0:
                i = _find_back(toks, tail, size - n - 1, stop=max(size - n - k, -1))
            if i >= 0:
                return toks[i + n : i + n + k]
        return []


def _find_back(seq: list[int], pat: list[int], start: int, stop: int = -1) -> int:
    """Largest i in (stop, start] with seq[i : i + len(pat)] == pat, or -1."""
    first, n = pat[0], len(pat)
    for i in range(start, stop, -1):
        if seq[i] == first and seq[i : i + n] == pat:
            return i
    return -1


def medusa_num_heads(path: str) -> int:
    """The heads a Medusa checkpoint has (its config.json), which bound the tree's depth."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        n = int(cfg["medusa_num_heads"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Medusa checkpoint (config.json: {e!r})") from e
    if n < 1:
        raise ValueError(f"{path}: medusa_num_heads must be >= 1, got {n}")
    return n


class DraftSlots:
    """The draft model proposes inside the executor: the scheduler reserves k slots."""

    def propose(self, req: Request, k: int) -> list[int]:
        return []


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify steps (one per request per step with >= 1 draft token)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        pos = self.accepted_by_position
        if len(pos) < num_draft:
            pos.extend([0] * (num_draft - len(pos)))
        for i in range(num_accepted):
            pos[i] += 1


class SpecDecoder:
    """Decides, per step and per request, how many tokens to speculate, and counts."""

    # Acceptance rate is an exponential moving average over verify steps.
    EMA = 0.7
    PROBE_EVERY = 8  # output tokens between probes of a request that stopped speculating

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.in_executor = config.method in ("draft", "medusa")
        # Medusa: k is the tree's depth (one level per head at most); a verify chunk
        # holds the tree's nodes down to the wanted depth.
        self.tree = config.method == "medusa"
        if self.tree:
            assert config.model is not None
            self.k = min(self.k, medusa_num_heads(config.model))
        self.proposer: Proposer = (
            DraftSlots()
            if self.in_executor
            else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        )
        self.stats = SpecStats(accepted_by_position=[0] * self.k)
        self.policy = StepCostPolicy()

    def enabled_for_step(self, num_requests: int) -> bool:
        cap = self.config.disable_by_batch_size
        return cap is None or num_requests <= cap

    def expected_accepted(self, req: Request, num_draft: int) -> float:
        """Drafts a verify of `num_draft` tokens is expected to keep: the j-th survives
        with probability rate ** j."""
        r = req.spec_rate
        if r >= 1.0:
            return float(num_draft)
        return r * (1.0 - r**num_draft) / (1.0 - r)

    def wanted(self, req: Request, room: int) -> int:
        """How many tokens `req` would draft this step (0: none), before any proposing:
        its depth for its acceptance rate, or an occasional one-token probe.  `room` is
        the most drafts that fit (token budget, max_tokens, max_model_len)."""
        k = min(self.depth(req.spec_rate), room)
        if k <= 0:
            # Too unlikely to be accepted: an occasional one-token probe keeps the
            # estimate moving (a request's text may turn repetitive later).
            if room <= 0 or req.num_output_tokens % self.PROBE_EVERY:
                return 0
            k = 1
        return k

    def propose(self, req: Request, k: int) -> tuple[list[int], int]:
        """(draft tokens, slots) for `k` wanted drafts: n-gram drafts come as tokens (maybe
        fewer); the draft model gets k slots to fill."""
        if self.tree:
            return [], tree_size(k)
        if self.in_executor:
            return [], k
        drafts = self.proposer.propose(req, k)
        return drafts, len(drafts)

    def depth(self, rate: float) -> int:
        """How many tokens to draft at per-token acceptance rate `rate`: the j-th draft is
        accepted with probability rate ** j, and is worth its cost while that stays at or
        above min_acceptance_rate (0: never worth it)."""
        floor = self.config.min_acceptance_rate
        if rate >= 1.0 or floor <= 0.0:
            return self.k
        if rate < floor or rate <= 0.0:
            return 0
        return max(1, min(self.k, int(math.log(floor) / math.log(rate))))

    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """Per verify step: `num_accepted` successes, then one failure unless all passed
        (the drafts after a rejection were never tried), so the ratio of the two averages
        estimates the per-token rate whatever depth the request drafted at.  A tree's
        `num_draft` is its node count; its trials are its levels."""
        if self.tree:
            num_draft = tree_depth(num_draft, self.k)
        self.stats.record(num_draft, num_accepted)
        trials = num_accepted + (num_accepted < num_draft)
        req.spec_accepted = self.EMA * req.spec_accepted + (1 - self.EMA) * num_accepted
        req.spec_trials = self.EMA * req.spec_trials + (1 - self.EMA) * trials


class StepCostPolicy:
    """Whether a decode step speculates, from what steps measurably cost on this machine.

    A verify step runs k+1 query tokens per row and (draft method) k draft passes: on a
    memory-bound step (small batch, weights far bigger than the cache) that is nearly free,
    on a compute-bound one (larger batch, or a CPU shared with other work) it costs about
    k+1 times a plain step, and where the line falls depends on the model, the machine and
    its load, not on a batch size fixed in advance.  So each batch size keeps the seconds
    its last few plain decode steps and speculating steps took (timed from scheduling to
    dispatch, so host work counts) and reads each side as their median, and a step
    speculates when

    - the tokens it is expected to emit (rows plus each row's expected accepted drafts,
      from its own acceptance rate) per predicted second beat the plain step's rows per
      second (throughput), and
    - no row is expected to decode more than 5% slower than in a plain step: every row
      waits for the whole step, so one with few or no drafts (free text beside copied
      text) pays the verify step's cost without its gain, and in a batch that ends with
      its slowest request, throughput won on the others is lost time (TPOT).

    Each side is timed WARM times, alternately, before the first choice, and a side's
    figure is the median of its last SAMPLES timings: a single step that paid a one-time
    cost (a GEMM shape built on first use, a draft model's catch-up) or lost its core
    once cannot hold the choice on the wrong side.  The side not chosen is re-timed after
    EXPLORE_EVERY steps of that size, and after twice as many each time the choice stays
    where it was (up to MAX_EXPLORE_EVERY), so a change of load or of text is followed
    while a side that keeps losing costs ever less: a draft model must first catch up on
    every token of the steps it sat out, so one exploring step there costs several plain
    ones.  A choice that moves is watched closely again.
    """

    SAMPLES = 5
    WARM = 2
    EXPLORE_EVERY = 32
    MAX_EXPLORE_EVERY = 512
    MAX_ROW_SLOWDOWN = 0.95  # a row's expected speed in a verify step vs a plain one

    def __init__(self) -> None:
        # (bucket, speculated) -> the last SAMPLES step times
        self.samples: dict[tuple[int, bool], deque[float]] = {}
        self.visits: dict[int, int] = {}
        # bucket -> (visit of the next exploration, the interval, the last choice)
        self.explore: dict[int, tuple[int, int, bool]] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """Batch sizes 1-4 apart, then powers of two (the cost moves slowly with size)."""
        return rows if rows <= 4 else 1 << (rows - 1).bit_length()

    def choose(self, rows: int, expected_tokens: float, worst_row: float = 1.0) -> bool:
        """Speculate in a step of `rows` decodes expected to emit `expected_tokens`, the
        least of them `worst_row` tokens (1: a row without drafts)?"""
        b = self.bucket(rows)
        n_spec = len(self.samples.get((b, True), ()))
        n_plain = len(self.samples.get((b, False), ()))
        if min(n_spec, n_plain) < self.WARM:
            return n_spec <= n_plain  # alternate, speculating first
        spec, plain = self.seconds(b, True), self.seconds(b, False)
        better = (
            expected_tokens * plain > rows * spec
            and worst_row * plain >= self.MAX_ROW_SLOWDOWN * spec
        )
        n = self.visits[b] = self.visits.get(b, 0) + 1
        every = self.EXPLORE_EVERY
        due, interval, last = self.explore.get(b, (every, every, better))
        if better != last:
            due, interval = n + every, every
        explore = n >= due
        if explore:
            interval = min(2 * interval, self.MAX_EXPLORE_EVERY)
            due = n + interval
        self.explore[b] = (due, interval, better)
        return better != explore

    def seconds(self, bucket: int, speculated: bool) -> float:
        """A side's figure: the median of its last timings."""
        return statistics.median(self.samples[(bucket, speculated)])

    def observe(self, rows: int, speculated: bool, seconds: float) -> None:
        key = (self.bucket(rows), speculated)
        self.samples.setdefault(key, deque(maxlen=self.SAMPLES)).append(seconds)
