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
import weakref
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
    # A new request starts from the recent verifies of all requests (a slower average):
    # the rate 1 it would otherwise assume makes the policy's first steps for it count on
    # drafts that free text does not keep.  The same average calibrates the estimate.
    PRIOR_EMA = 0.95
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
        self.prior: tuple[float, float] | None = None  # (accepted, trials) averages
        # Averages of the drafts verifies kept and of what _estimate promised them; they
        # start level (as if a few verifies had kept what was promised), so the first
        # verifies cannot set a factor that stops speculation before more are seen.
        self.calibration = (2.0, 2.0)
        self._started: weakref.WeakSet[Request] = weakref.WeakSet()

    def enabled_for_step(self, num_requests: int) -> bool:
        cap = self.config.disable_by_batch_size
        return cap is None or num_requests <= cap

    def expected_accepted(self, req: Request, num_draft: int) -> float:
        """Drafts a verify of `num_draft` tokens is expected to keep: the j-th survives
        with probability rate ** j, scaled by what verifies kept against that estimate
        (acceptance comes in runs, so independent draws overestimate a chain's tail)."""
        a, p = self.calibration
        return self._estimate(req, num_draft) * (min(2.0, a / p) if p > 0.0 else 1.0)

    @staticmethod
    def _estimate(req: Request, num_draft: int) -> float:
        r = req.spec_rate
        if r >= 1.0:
            return float(num_draft)
        return r * (1.0 - r**num_draft) / (1.0 - r)

    def wanted(self, req: Request, room: int) -> int:
        """How many tokens `req` would draft this step (0: none), before any proposing:
        its depth for its acceptance rate, or an occasional one-token probe.  `room` is
        the most drafts that fit (token budget, max_tokens, max_model_len)."""
        # (The float test first: the set is asked only while the request's average is
        # untouched, not for every row of every step.)
        if req.spec_trials == 1.0 and req not in self._started:
            self._started.add(req)
            if self.prior is not None:
                req.spec_accepted, req.spec_trials = self.prior
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
        fewer), from the request's predicted output first (scheduler/prediction.py, with
        the draft model too); the draft model gets k slots to fill; Medusa a tree."""
        if self.tree:
            return [], tree_size(k)
        track = req.prediction
        if track is not None:
            c = self.config
            drafts = track.drafts(
                req.token_ids, req.prompt_len, k, c.prompt_lookup_min, c.prompt_lookup_max
            )
            track.drafted = len(drafts)
            if drafts:  # (under the draft model too: it then skips this request's step)
                return drafts, len(drafts)
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
        e = self.PRIOR_EMA
        a, p = self.calibration
        self.calibration = (
            e * a + (1 - e) * num_accepted,
            e * p + (1 - e) * self._estimate(req, num_draft),
        )
        trials = num_accepted + (num_accepted < num_draft)
        req.spec_accepted = self.EMA * req.spec_accepted + (1 - self.EMA) * num_accepted
        req.spec_trials = self.EMA * req.spec_trials + (1 - self.EMA) * trials
        a, t = self.prior or (num_accepted, trials)
        e = self.PRIOR_EMA
        self.prior = (e * a + (1 - e) * num_accepted, e * t + (1 - e) * trials)


class StepCostPolicy:
    """Whether a decode step speculates, from what steps measurably cost on this machine.

    A verify step runs k+1 query tokens per row and (draft method) k draft passes: on a
    memory-bound step (small batch, weights far bigger than the cache) that is nearly free,
    on a compute-bound one (larger batch, a tiny model whose step is all fixed cost, or a
    CPU shared with other work) it costs several plain steps, and where the line falls
    depends on the model, the machine and its load, not on a batch size fixed in advance.
    So each batch size keeps the seconds its last few plain decode steps and speculating
    steps took (timed from scheduling to dispatch, so host work counts), and reads a
    speculating step's cost as the plain figure (a median) times the median ratio
    speculating / plain of its timing runs (below), each ratio a speculating step against
    the plain steps just before it or the other way round, so load that moves both alike
    leaves it alone.  A step speculates when

    - the tokens it is expected to emit (rows plus each row's expected accepted drafts,
      from its own acceptance rate) per predicted second beat the plain step's rows per
      second (throughput), and
    - no row is expected to decode more than 5% slower than in a plain step: every row
      waits for the whole step, so one with few or no drafts (free text beside copied
      text) pays the verify step's cost without its gain, and in a batch that ends with
      its slowest request, throughput won on the others is lost time (TPOT).

    The side running now keeps the choice unless the other wins by SWITCH_MARGIN: a
    switch to the draft model costs its catch-up, so noise must not flip it back and forth.

    Only steady steps are figures.  The first step of a run on a side pays what the switch
    costs (the draft model's catch-up on every token of the steps it sat out, its prefill
    of a new prompt, rows leaving or rejoining the bulk decode path), so it is kept apart
    as that side's switch cost and never read as its step time.  That is why each side is
    timed in runs of RUN steps: before a batch size's first choice, speculating first (a
    batch size near one already measured takes that one's figures instead, so the
    shrinking tail of a batch does not pay a fresh warm-up at every size), and whenever the
    side not chosen is re-timed.

    Re-timing the losing side costs the time it loses against the chosen one (its switch
    cost, then its steps at their measured speed, and the switch back).  It is due once the steps run since the
    last one took 1/REGRET times that cost (and at least MIN_EXPLORE steps): exploring
    never takes more than REGRET of the time, a side that is far worse is re-timed rarely
    (not at all in a short run), a close one often enough to follow a change of load or
    of text.  A choice that moves starts the count again.
    """

    SAMPLES = 5
    RUN = 3  # steps per timing run: the switch, then two steady steps
    MIN_EXPLORE = 32
    REGRET = 0.01  # the most of the time re-timing the losing side may cost
    SWITCH_MARGIN = 1.05
    MAX_ROW_SLOWDOWN = 0.95  # a row's expected speed in a verify step vs a plain one
    NEAR = 4  # sizes within this factor share figures until both sides are measured
    PAYBACK = 128  # steps a switch to speculating must repay its switch step's extra in

    def __init__(self) -> None:
        # (bucket, speculated) -> the last SAMPLES steady step times
        self.samples: dict[tuple[int, bool], deque[float]] = {}
        # bucket -> the last ratios speculating / plain, each from a timing run's steady
        # step and the other side's figure just before it
        self.ratios: dict[int, deque[float]] = {}
        # (bucket, speculated) -> the last switching step's time
        self.switch: dict[tuple[int, bool], float] = {}
        self.buckets: dict[int, _BucketState] = {}
        self._last: bool | None = None  # the side of the last timed step
        self._plain_steps = 0  # timed plain steps since the last speculating one
        # bucket -> the plain steps before its last switch to speculating (the switch
        # cost's catch-up is read per step sat out)
        self.sat_out: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """Batch sizes 1-4 apart, then powers of two (the cost moves slowly with size)."""
        return rows if rows <= 4 else 1 << (rows - 1).bit_length()

    def choose(
        self, rows: int, expected_tokens: float, worst_row: float = 1.0, timed: bool = True
    ) -> bool:
        """Speculate in a step of `rows` decodes expected to emit `expected_tokens`, the
        least of them `worst_row` tokens (1: a row without drafts)?  `timed`: the step is
        a pure decode step whose time `observe` will get; an untimed one (a prompt chunk
        rides along) starts no timing run and takes no step of one, since its time would
        teach nothing, and speculates only where timed steps of its size chose to: a
        speculating step there still pays the draft model's catch-up (a new batch's
        prompts whole) or the verify rows, on figures borrowed or never taken."""
        b = self.bucket(rows)
        st = self.buckets.setdefault(b, _BucketState())
        if not timed:
            figures = self.figures(b)
            if figures is None:
                return False
            spec, plain = figures
            gain = self.gain(rows, expected_tokens, worst_row)
            return st.choice is True and self._better(b, st, gain, spec, plain)
        if st.run_left > 0:
            st.run_left -= 1
            return st.run_side
        figures = self.figures(b)
        if figures is None:  # warm-up: a run on each side, speculating first
            return self._start_run(st, (b, True) not in self.samples)
        spec, plain = figures
        gain = self.gain(rows, expected_tokens, worst_row)
        better = self._better(b, st, gain, spec, plain)
        if better != st.choice:
            st.choice, st.steps, st.elapsed = better, 0, 0.0
        st.steps += 1
        cost = st.cost = self._explore_cost(b, not better, gain, spec, plain)
        if st.steps > self.MIN_EXPLORE and st.elapsed * self.REGRET >= cost:
            st.steps, st.elapsed = 0, 0.0
            return self._start_run(st, not better)
        return better

    def plain_for_sure(self, rows: int, most: float, timed: bool = True) -> bool:
        """Whether a step of `rows` decodes runs plain whatever its rows expect, each at
        most `most` tokens: its size chose plain, no timing run is under way or may be
        due, and even `most` tokens a row would not pay.  The scheduler then skips the
        per-row estimates (on a small model they are a visible share of a plain step);
        the step counts towards the next re-timing as a full choice would."""
        b = self.bucket(rows)
        st = self.buckets.get(b)
        if st is None or st.choice is not False or st.run_left > 0:
            return False
        if timed and st.steps >= self.MIN_EXPLORE and st.elapsed * self.REGRET >= st.cost:
            return False  # a re-timing may be due: the full choice prices it
        figures = self.figures(b)
        if figures is None or self._better(b, st, most, *figures):
            return False
        if timed:
            st.steps += 1
        return True

    def _better(self, b: int, st: _BucketState, gain: float, spec: float, plain: float) -> bool:
        """Whether speculating beats plain decoding now: the side running keeps a close
        choice (SWITCH_MARGIN), and a switch to speculating must also earn back what its
        last switch step cost over a steady one (a draft model's catch-up: a new batch's
        prompts whole) within PAYBACK steps, or a batch whose first verifies disappoint
        pays that catch-up for a handful of speculating steps."""
        if st.choice is True:
            return gain * plain > spec / self.SWITCH_MARGIN
        extra = max(0.0, self.switch.get((b, True), spec) - spec) / self.PAYBACK
        return gain * plain > spec * self.SWITCH_MARGIN + extra

    def _start_run(self, st: _BucketState, side: bool) -> bool:
        st.run_side, st.run_left = side, self.RUN - 1
        return side

    def gain(self, rows: int, expected: float, worst: float) -> float:
        """What a speculating step is worth in plain steps, by the rule of the class
        docstring: the rows' mean expected tokens, or the worst row's with its 5% slack,
        whichever is less."""
        return min(expected / rows, worst / self.MAX_ROW_SLOWDOWN)

    def _explore_cost(self, b: int, side: bool, gain: float, spec: float, plain: float) -> float:
        """Seconds a timing run on `side` loses against the other side: its steps' time
        (the first at its last switch cost) less the other side's time for the same
        progress, and what switching back costs the other side."""
        secs, back = (spec, plain) if side else (plain, spec)
        first = self.switch.get((b, side), secs)
        if side:
            # A draft model catches up on every step it sat out: its last switch's extra,
            # per plain step before it, times the plain steps since.
            sat = self.sat_out.get(b, 0)
            first = secs + max(0.0, first - secs) / max(1, sat) * max(1, self._plain_steps)
        same = gain * plain if side else spec / gain  # the other side's time for a step's progress
        run = first + (self.RUN - 1) * secs - self.RUN * same
        return max(0.0, run) + max(0.0, self.switch.get((b, not side), back) - back)

    def figures(self, bucket: int) -> tuple[float, float] | None:
        """(speculating, plain) seconds of a step in this bucket: its plain figure and the
        median ratio of its paired timings, else the nearest bucket's ratio (within a
        factor NEAR in size) scaled to a side this one has; None before any ratio."""
        own = self.ratios.get(bucket)
        near = bucket if own else self._nearest_measured(bucket)
        if near is None:
            return None
        ratio = statistics.median(self.ratios[near])
        for b in (bucket, near):
            if (b, False) in self.samples:
                plain = self.seconds(b, False)
                return ratio * plain, plain
            if (b, True) in self.samples:
                spec = self.seconds(b, True)
                return spec, spec / ratio
        return None

    def _nearest_measured(self, bucket: int) -> int | None:
        """The bucket with a ratio of the size nearest this one, within a factor NEAR."""

        def apart(b: int) -> float:
            return max(b, bucket) / min(b, bucket)

        near = [b for b in self.ratios if apart(b) <= self.NEAR]
        return min(near, key=lambda b: (apart(b), -b), default=None)

    def seconds(self, bucket: int, speculated: bool) -> float:
        """A side's figure: the median of its last steady timings."""
        return statistics.median(self.samples[(bucket, speculated)])

    def observe(self, rows: int, speculated: bool, seconds: float) -> None:
        """A timed step: a steady sample of its side, or (the first after the other side
        ran) that side's switch cost."""
        b = self.bucket(rows)
        key = (b, speculated)
        st = self.buckets.get(b)
        if speculated != self._last:
            self.switch[key] = seconds
            if speculated:
                self.sat_out[b] = self._plain_steps
        else:
            self.samples.setdefault(key, deque(maxlen=self.SAMPLES)).append(seconds)
            other = (b, not speculated)
            if other in self.samples and (st is None or st.choice != speculated):
                # A timing run's step against the side just running: load that moves
                # both alike leaves the ratio alone.
                o = self.seconds(*other)
                r = seconds / o if speculated else o / seconds
                self.ratios.setdefault(b, deque(maxlen=self.SAMPLES)).append(r)
        self._last = speculated
        self._plain_steps = 0 if speculated else self._plain_steps + 1
        if st is not None and st.choice == speculated:
            st.elapsed += seconds


@dataclass
class _BucketState:
    """A batch size's choice and its re-timing count."""

    choice: bool | None = None  # the side the last choice picked
    steps: int = 0  # choices since the last re-timing (or the choice moved)
    elapsed: float = 0.0  # seconds the chosen side ran since then
    run_side: bool = False  # the side of the timing run under way
    run_left: int = 0  # its steps still to come
    cost: float = 0.0  # what re-timing the losing side cost at the last full choice
