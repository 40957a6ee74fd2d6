"""Batched token sampler: one call per step turns the logits of every sampling row into a token.

Per row, in vLLM's order: raw logits -> allowed_token_ids, bad_words and min_tokens masking ->
logit_bias -> repetition / frequency / presence penalties -> (greedy rows: argmax) ->
temperature -> top-k -> top-p -> min-p -> sample.

Top-p keeps a token while the probability mass strictly above it is below top_p of the row's
mass, counted exactly in integer units of 2**-30, so the cut is the same whichever way it is
found: from the top 256 tokens when the nucleus is that small, else from mass histograms over
the probabilities' bit patterns (no vocabulary sort, which is what top-p costs on CPU otherwise).

Sampling is an inverse-CDF draw: one uniform u per row, and the first token whose cumulative
(unnormalised, filtered) probability reaches u times the row's total.  Filtered tokens are
simply probability 0 (zero width in the CDF), so no renormalisation is needed.  A seeded row
draws its u from its own generator, exactly one per step, so its tokens depend only on its own
logits and seed, never on its batchmates.

Every stage only touches the rows that need it: an all-greedy batch with no penalties and no
logprobs is a single argmax.  The caller's logits tensor is never written to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from gpu.cpu import kernels as cpu_kernels
from scheduler.contract import NewRequestData, TokenLogprobs
from scheduler.sampling_params import SamplingParams

T = TypeVar("T")

# vLLM raises temperatures in (0, 0.01) to 0.01: smaller ones blow logits / T up towards inf.
_MIN_TEMPERATURE = 1e-2
# Top-p looks for the nucleus among the most likely 256 tokens (a cheap topk); rows whose
# nucleus is wider find it with histograms (`_radix_floor`), never a vocabulary sort.
_TOP_P_WINDOW = 256
_MASS_UNIT = float(1 << 30)  # top-p counts mass in units of 2**-30 (see _quantized)
# torch.Generator.manual_seed takes a 64-bit value; request seeds are unbounded Python ints.
_SEED_MASK = (1 << 64) - 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """torch.argmax(x, -1); on CPU through the compiled kernel where there is one (ATen's
    bf16 argmax is several times slower, and an OpenMP region on every call)."""
    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels.available()
    ):
        return cpu_kernels.argmax(x)
    return x.argmax(-1)


class RequestSamplingState:
    """Per-request state the model runner caches (created once from NewRequestData).

    `token_ids` is the prompt followed by every output token so far; the runner calls
    `append` with each sampled token.  Penalties and min_tokens read it.
    """

    __slots__ = (
        "_allowed",
        "_bad",
        "_bias",
        "_min_mask",
        "_out",
        "_out_n",
        "_prompt_ids",
        "generator",
        "greedy",
        "has_allowed",
        "has_bad_words",
        "has_bias",
        "needs_penalties",
        "params",
        "plain_greedy",
        "prompt_len",
        "token_ids",
    )

    def __init__(
        self,
        params: SamplingParams,
        prompt_len: int,
        token_ids: list[int],
        generator: torch.Generator | None = None,
    ) -> None:
        self.params = params
        self.generator = generator
        self.prompt_len = prompt_len
        self.token_ids = token_ids
        # Cached once: the per-step loop reads plain attributes instead of re-deriving them.
        self.greedy = params.greedy
        self.needs_penalties = params.needs_penalties
        bias = params.logit_bias or {}
        self.has_bias = bool(bias)
        self.has_allowed = params.allowed_token_ids is not None
        self.has_bad_words = bool(params.bad_words_token_ids)
        # Rows that can take the batch-wide argmax fast path whatever their state.
        self.plain_greedy = (
            self.greedy
            and not self.needs_penalties
            and params.logprobs is None
            and params.min_tokens == 0
            and not bias
            and not self.has_allowed
            and not self.has_bad_words
        )
        self._prompt_ids: torch.Tensor | None = None
        # Built once a request: a logit_bias or stop_token_ids list may hold the whole
        # vocabulary, and n samples of it rebuilt in Python every step held every step
        # for seconds (n = 64 x 2,000 entries: 80x slower steps for everyone).
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        self._allowed: torch.Tensor | None = None
        self._bad: tuple[list[int], dict[int, list[tuple[list[int], int]]]] | None = None
        self._min_mask: torch.Tensor | None = None
        # The output ids as an int64 tensor, grown as tokens come (penalties count them
        # every step: rebuilt in Python per step, n = 64 samples 1,900 tokens long took
        # 2.4x as long and held every other request's steps meanwhile).
        self._out: torch.Tensor | None = None
        self._out_n = 0

    @classmethod
    def create(cls, data: NewRequestData, device: torch.device) -> RequestSamplingState:
        """State for a newly registered request; seeded requests get their own generator."""
        params = data.sampling
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            # seed + sample_index: the n samples of one request differ, yet repeat run to run.
            generator.manual_seed((params.seed + data.sample_index) & _SEED_MASK)
        return cls(params, data.prompt_len, list(data.token_ids), generator)

    def append(self, token_id: int) -> None:
        """Record a sampled token (the runner calls this once per step per sampled row)."""
        self.token_ids.append(token_id)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def output_tensor(self) -> torch.Tensor:
        """The output token ids (int64, CPU), kept up to date with `token_ids` at the
        cost of the tokens added since the last call."""
        n = len(self.token_ids) - self.prompt_len
        buf = self._out
        if buf is None or n < self._out_n:  # first call, or a state rebuilt shorter
            buf, self._out_n = torch.empty(max(16, 2 * n), dtype=torch.long), 0
        elif n > buf.numel():
            grown = torch.empty(2 * n, dtype=torch.long)
            grown[: self._out_n] = buf[: self._out_n]
            buf = grown
        if n > self._out_n:
            start = self.prompt_len + self._out_n
            buf[self._out_n : n] = torch.tensor(self.token_ids[start:], dtype=torch.long)
            self._out_n = n
        self._out = buf
        return buf[:n]

    def bias_tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids, values) on `device`, ids past `vocab` (a padded head)
        left out; built once for all the samples of a request (they share its params)."""
        if self._bias is None or self._bias[0].device != device:

            def build() -> tuple[torch.Tensor, torch.Tensor]:
                bias = self.params.logit_bias or {}
                keep = [(t, v) for t, v in bias.items() if t < vocab]
                ids = torch.tensor([t for t, _ in keep], dtype=torch.long, device=device)
                vals = torch.tensor([v for _, v in keep], dtype=torch.float32, device=device)
                return ids, vals

            self._bias = _per_params(("bias", vocab, device), self.params, build)
        return self._bias

    def allowed_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool, True where allowed_token_ids forbids the token (ids past `vocab`,
        a padded head's, stay forbidden); built once for all the samples of a request."""
        if self._allowed is None or self._allowed.device != device:

            def build() -> torch.Tensor:
                ids = [t for t in self.params.allowed_token_ids or () if t < vocab]
                mask = torch.ones(vocab, dtype=torch.bool, device=device)
                mask[torch.tensor(ids, dtype=torch.long, device=device)] = False
                return mask

            self._allowed = _per_params(("allowed", vocab, device), self.params, build)
        return self._allowed

    def banned_now(self, vocab: int) -> list[int]:
        """The ids bad_words bans at this step: every one-token word's, and the last token
        of each longer sequence the output so far ends with the rest of (the sequences
        indexed once a request by the token before the banned one, so a step checks only
        those the last output token can complete)."""
        if self._bad is None:

            def build() -> tuple[list[int], dict[int, list[tuple[list[int], int]]]]:
                singles, by_last = [], {}
                for seq in self.params.bad_words_token_ids or ():
                    if seq[-1] >= vocab:
                        continue
                    if len(seq) == 1:
                        singles.append(seq[0])
                    else:
                        by_last.setdefault(seq[-2], []).append((seq[:-1], seq[-1]))
                return singles, by_last

            self._bad = _per_params(("bad", vocab), self.params, build)
        singles, by_last = self._bad
        out_len = len(self.token_ids) - self.prompt_len
        if not out_len or not (cands := by_last.get(self.token_ids[-1])):
            return singles
        ids = self.token_ids
        hits = [last for prefix, last in cands
                if len(prefix) <= out_len and ids[len(ids) - len(prefix):] == prefix]  # fmt: skip
        return singles + hits if hits else singles

    def min_tokens_mask(
        self, eos_token_ids: Sequence[int], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """The ids min_tokens holds back (the model's eos, even under ignore_eos, as vLLM
        does, and the request's stop_token_ids); built once."""
        if self._min_mask is None or self._min_mask.device != device:

            def build() -> torch.Tensor:
                stop = [t for t in self.params.stop_token_ids if 0 <= t < vocab]
                ids = list(dict.fromkeys([*eos_token_ids, *stop]))
                return torch.tensor(ids, dtype=torch.long, device=device)

            key = ("min", tuple(eos_token_ids), vocab, device)
            self._min_mask = _per_params(key, self.params, build)
        return self._min_mask

    def prompt_id_tensor(self, device: torch.device) -> torch.Tensor:
        """Distinct prompt token ids as an int64 tensor, built once (repetition penalty)."""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = torch.tensor(self.token_ids[: self.prompt_len], dtype=torch.long, device=device)
            self._prompt_ids = torch.unique(ids)
        return self._prompt_ids


# Tensors made from one request's params, shared by its n samples (they hold the same
# params object): a whole-vocabulary logit_bias made 64 times was ~0.5 s of one step.
# Keyed by the params' identity (the entry keeps the object, so the id is not reused);
# the most recent few are kept.
_PER_PARAMS: OrderedDict[tuple[Any, ...], tuple[SamplingParams, Any]] = OrderedDict()
_PER_PARAMS_KEEP = 16


def _per_params(key: tuple[Any, ...], params: SamplingParams, build: Callable[[], T]) -> T:
    k = (id(params), *key)
    hit = _PER_PARAMS.get(k)
    if hit is not None and hit[0] is params:
        _PER_PARAMS.move_to_end(k)
        return hit[1]
    value = build()
    _PER_PARAMS[k] = (params, value)
    while len(_PER_PARAMS) > _PER_PARAMS_KEEP:
        _PER_PARAMS.popitem(last=False)
    return value


def _rows_and_cols(
    rows: list[int], cols: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column) pairs for index_put_: row rows[j] with each id of cols[j].
    The row indices are expanded on the host (their counts are host ints: on a GPU a
    device-side repeat_interleave would wait for the device to learn its output size)."""
    lens = torch.tensor([len(c) for c in cols], dtype=torch.long)
    r_t = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lens)
    return r_t.to(device), torch.cat(cols)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


def apply_penalties(logits: torch.Tensor, rows: Sequence[RequestSamplingState]) -> torch.Tensor:
    """Apply vLLM's repetition, frequency and presence penalties to `logits` in place.

    logits: [P, V], one row per entry of `rows`.  Repetition penalty scales every token seen
    in the prompt or the output (positive logits divided, others multiplied); frequency and
    presence penalties subtract penalty * count and penalty * (count > 0) over output tokens.
    Returns `logits`.
    """
    _penalize(logits, list(range(len(rows))), rows)
    return logits


def _penalize(
    logits: torch.Tensor,  # [R, V], written in place
    row_ids: list[int],  # the rows of logits to penalise
    rows: Sequence[RequestSamplingState],  # their states, parallel to row_ids
) -> None:
    """Penalties touch only the tokens a row has seen, so work on those (row, token) pairs
    alone: O(tokens seen), never O(rows * vocabulary)."""
    vocab = logits.shape[1]
    dev = logits.device
    # Output tokens as flat (row * V + token) keys, then their counts per (row, token).
    outputs = [r.output_tensor() for r in rows]
    lens = torch.tensor([len(o) for o in outputs], dtype=torch.long)
    base = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long) * vocab, lens)
    out_keys = (torch.cat(outputs) + base).to(dev)
    out_uniq, out_count = torch.unique(out_keys, return_counts=True)  # sorted keys
    keys = [out_uniq]
    rep = [r.params.repetition_penalty for r in rows]
    for i, r, p in zip(row_ids, rows, rep, strict=True):
        # Repetition penalty also covers the prompt (its distinct ids are cached per request).
        if p != 1.0 and r.prompt_len:
            keys.append(r.prompt_id_tensor(dev) + i * vocab)
    # A key may appear twice (a prompt token also in the output): both copies compute the
    # same value from the same inputs, so the duplicate write below is harmless.
    keys_t = torch.cat(keys)  # [N]
    if keys_t.numel() == 0:
        return
    # Output count of every key: look it up among the sorted output keys (0 if absent).
    count = torch.zeros(keys_t.shape, dtype=logits.dtype, device=dev)  # [N]
    if out_uniq.numel():
        j = torch.searchsorted(out_uniq, keys_t).clamp_max_(out_uniq.numel() - 1)
        count = torch.where(out_uniq[j] == keys_t, out_count[j].to(logits.dtype), count)
    # Per-row parameters, expanded to the keys' rows.
    slot_of_row = torch.full((logits.shape[0],), -1, dtype=torch.long)  # [R]
    slot_of_row[torch.tensor(row_ids, dtype=torch.long)] = torch.arange(len(row_ids))
    row = keys_t // vocab
    tok = keys_t - row * vocab
    slot = slot_of_row.to(dev)[row]  # [N] index into rows

    def param(values: list[float]) -> torch.Tensor:  # [N]
        return torch.tensor(values, dtype=logits.dtype, device=dev)[slot]

    val = logits[row, tok]  # [N]
    if any(p != 1.0 for p in rep):
        penalty = param(rep)
        # Same arithmetic as vLLM (multiply by 1/penalty), so results match it bit for bit.
        val = val * torch.where(val > 0, 1.0 / penalty, penalty)
    freq = [r.params.frequency_penalty for r in rows]
    if any(freq):
        val = val - param(freq) * count
    pres = [r.params.presence_penalty for r in rows]
    if any(pres):
        val = val - param(pres) * (count > 0)
    logits[row, tok] = val


# Per byte value, the 8 tokens it covers as logit offsets: 0 where its bit is set, else -inf.
_BYTE_PENALTY = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
)  # [256, 8]


def apply_token_bitmask_(
    logits: torch.Tensor,  # [R, >= V], written in place
    rows: list[int],  # the constrained rows
    masks: list[bytes],  # their allowed-token bitmasks: packed little-endian int32 words
) -> None:
    """Set every token a row's grammar forbids to -inf; only the listed rows are read or
    written, so unconstrained rows pay nothing.  Columns past the mask are forbidden; a
    mask that allows nothing is left unapplied (the scheduler ends that request).

    Little-endian words put tokens 32w + 8j .. 32w + 8j + 7 in byte j of word w, lowest
    bit first, so a byte-indexed table turns the mask into additive offsets in one gather
    (a boolean masked_fill over the vocabulary is several times slower on CPU)."""
    width = logits.shape[1]
    raw = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(rows), -1)
    live = raw.any(axis=1)
    if not live.all():
        rows = [r for r, ok in zip(rows, live, strict=True) if ok]
        raw = raw[live]
        if not rows:
            return
    pen = _BYTE_PENALTY[raw].reshape(len(rows), -1)  # [k, 32 * W]
    if pen.shape[1] < width:
        pen = np.pad(pen, ((0, 0), (0, width - pen.shape[1])), constant_values=-np.inf)
    offsets = torch.from_numpy(np.ascontiguousarray(pen[:, :width]))
    offsets = offsets.to(device=logits.device, dtype=logits.dtype)
    idx = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).add_(offsets))


def _on_rows(t: torch.Tensor, pos: list[int], fn: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place `fn` on rows `pos` of `t`, copying them out only for a strict subset."""
    if len(pos) == t.shape[0]:
        fn(t)
        return
    idx = torch.tensor(pos, device=t.device)
    sub = t.index_select(0, idx)
    fn(sub)
    t.index_copy_(0, idx, sub)


def _top_k_(probs: torch.Tensor, k: list[int]) -> None:
    """Zero every prob below the row's k-th largest (ties with it are kept, as in vLLM)."""
    k_t = torch.tensor(k, device=probs.device).unsqueeze(1)  # [K, 1]
    kth = probs.topk(max(k), dim=-1).values.gather(1, k_t - 1)  # [K, 1]
    probs.masked_fill_(probs < kth, 0.0)


def _quantized(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities as exact integer masses, in units of 2**-30 (int32: a row of probs
    sums to ~1, so even its total fits).

    Scaling by a power of two and truncating are exact, and so is any sum of these, in
    any order: the top-p cut comes out the same from a sort, a top-k window or a
    histogram, on any device."""
    return (probs * _MASS_UNIT).to(torch.int32)


def _window_floor(
    desc: torch.Tensor,  # [S, W] probs sorted descending (the top W of each row)
    limit: torch.Tensor,  # [S, 1] float64: top_p * the row's quantized mass
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept prob of each row's nucleus, and whether the nucleus fits in the W."""
    q = _quantized(desc)
    cum = q.cumsum(-1)  # [S, W], exact
    # Keep a token while the mass strictly above it is below the limit (vLLM: drop tokens
    # whose ascending cumulative mass <= 1 - p); the top token is always kept.
    n_keep = ((cum - q) < limit).sum(-1, keepdim=True)  # [S, 1], >= 1
    return desc.gather(1, n_keep - 1), cum[:, -1:] >= limit


# _radix_floor's digits of a float32 bit pattern (sign bit 0), high to low: (shift, bits).
_RADIX_DIGITS = ((18, 13), (9, 9), (0, 9))


def _radix_floor(probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:  # [S, 1]
    """The same floor as a full sort would give, from three mass histograms.

    A non-negative float32's bit pattern orders like its value.  The floor is the largest
    pattern T whose tokens at or above it hold at least `limit` of mass (the mass above T
    alone is short of it, so exactly the tokens >= T are kept).  Each histogram fixes one
    more digit of T, reading the bins from the top down; the first covers the rows, the
    next ones only the tokens sharing the digits found so far (a small share of them)."""
    rows = probs.shape[0]
    dev = probs.device
    vals = probs.contiguous().view(torch.int32)  # [S, V]
    mass = _quantized(probs)
    row = torch.arange(rows, dtype=torch.int32, device=dev).unsqueeze(1)  # [S, 1]
    above = torch.zeros(rows, 1, dtype=torch.int64, device=dev)  # mass above the bucket
    floor = torch.zeros(rows, 1, dtype=torch.int32, device=dev)
    for i, (shift, width) in enumerate(_RADIX_DIGITS):
        nb = 1 << width
        digit = (vals >> shift) & (nb - 1)
        hist = torch.zeros(rows * nb, dtype=torch.int32, device=dev)
        hist = hist.index_add_(0, (digit + row * nb).flatten(), mass.flatten()).view(rows, nb)
        # Mass at or above each bin: what is above the bucket, plus its bins from here up.
        at_or_above = above + hist.sum(-1, keepdim=True) - hist.cumsum(-1) + hist  # exact
        d = (at_or_above >= limit).sum(-1, keepdim=True) - 1  # highest bin reaching it
        above = torch.where(d + 1 < nb, at_or_above.gather(1, (d + 1).clamp_max(nb - 1)), above)
        d = d.to(torch.int32)
        floor |= d << shift
        if i + 1 < len(_RADIX_DIGITS):
            # Only the tokens in the chosen bin go on, flattened (rows differ in count).
            keep = (digit == (d if i == 0 else d.squeeze(1)[row])).nonzero(as_tuple=True)
            row = keep[0].to(torch.int32) if i == 0 else row[keep]
            vals, mass = vals[keep], mass[keep]
    return floor.view(torch.float32)


def _top_p_(probs: torch.Tensor, top_p: list[float]) -> None:
    """Zero every prob outside the row's nucleus, computed on what top-k left (renormalised).

    The nucleus is cut at a probability value, so tokens tied with its smallest member are
    all kept (vLLM's sort splits such ties arbitrarily).  Mass is counted exactly, in units
    of 2**-30 (`_quantized`), so the cut does not depend on summation order.  Rows whose
    nucleus fits in the top 256 take it from a cheap topk; the rest (flat distributions)
    find the same cut with histograms (`_radix_floor`), never sorting the vocabulary.
    """
    mass = _quantized(probs).sum(-1, keepdim=True)  # [S, 1]; < 1 when top-k removed tokens
    limit = torch.tensor(top_p, dtype=torch.float64, device=probs.device).unsqueeze(1) * mass
    # The histograms read float32 bit patterns; other dtypes (not met in serving: logits
    # are float32) take the whole row as the window, i.e. a sort.
    vocab = probs.shape[1]
    window = min(_TOP_P_WINDOW, vocab) if probs.dtype == torch.float32 else vocab
    floor, fits = _window_floor(probs.topk(window, dim=-1).values, limit)
    fits = fits.squeeze(1)
    if not bool(fits.all()):
        todo = (~fits).nonzero().squeeze(1)
        sub = probs.index_select(0, todo)
        floor.index_copy_(0, todo, _radix_floor(sub, limit.index_select(0, todo)))
    probs.masked_fill_(probs < floor, 0.0)


def _min_p_(probs: torch.Tensor, min_p: list[float]) -> None:
    """Zero every prob below min_p times the row's largest."""
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    probs.masked_fill_(probs < probs.amax(-1, keepdim=True) * scale, 0.0)


class Sampler:
    """Samples one token per row from a step's logits; see the module docstring for the order."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in dict.fromkeys(eos_token_ids) if 0 <= t < vocab_size)
        self.device = torch.device(device)
        # Unseeded rows draw from this, so an engine started with the same seed repeats itself.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)

    def __call__(self, logits: torch.Tensor, rows: list[RequestSamplingState]) -> SamplerOutput:
        """Sample a token for each row.  logits: [R, >= V] float32 on `device` (or the model
        dtype, for a batch of plain greedy rows), never modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.shape[1] > self.vocab_size:
            # A padded lm_head: the columns past the vocabulary are not tokens.
            logits = logits[:, : self.vocab_size]
        if all(r.plain_greedy for r in rows):  # any dtype: widening never moves an argmax
            return SamplerOutput(token_ids=argmax_rows(logits).tolist(), logprobs=None)
        if logits.dtype != torch.float32:
            logits = logits.float()
        return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[RequestSamplingState]) -> SamplerOutput:
        num_rows = logits.shape[0]
        dev = logits.device
        greedy: list[int] = []
        unseeded: list[int] = []
        seeded: list[int] = []
        want_lp: list[int] = []
        for i, r in enumerate(rows):
            if r.greedy:
                greedy.append(i)
            elif r.generator is None:
                unseeded.append(i)
            else:
                seeded.append(i)
            if r.params.logprobs is not None:
                want_lp.append(i)
        x = self.processed_logits(logits, rows)

        tokens = torch.empty(num_rows, dtype=torch.long, device=dev)  # [R]
        if len(greedy) == num_rows:
            tokens = argmax_rows(x)
        elif greedy:
            g = torch.tensor(greedy, device=dev)
            tokens.index_copy_(0, g, argmax_rows(x.index_select(0, g)))

        # Random rows, unseeded first: their noise is then one contiguous batched draw.
        rand = unseeded + seeded
        if rand:
            if len(rand) == num_rows and (not seeded or not unseeded or unseeded[-1] < seeded[0]):
                tokens = self._sample_rows(x, [rows[i] for i in rand], len(unseeded), x is logits)
            else:
                r_idx = torch.tensor(rand, device=dev)
                sub = x.index_select(0, r_idx)  # [Rr, V]
                sampled = self._sample_rows(sub, [rows[i] for i in rand], len(unseeded), False)
                tokens.index_copy_(0, r_idx, sampled)

        logprobs = self._logprobs(logits, tokens, rows, want_lp)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)

    def processed_logits(
        self, logits: torch.Tensor, rows: Sequence[RequestSamplingState]
    ) -> torch.Tensor:
        """allowed_token_ids, bad_words and min_tokens masking, logit_bias and penalties:
        the logits greedy rows take the argmax of.  logits: [R, V] float32; returned as is
        when no row needs any of them (never written)."""
        vocab = logits.shape[1]
        dev = logits.device
        # (row, ids) set to -inf: bad_words' bans this step and what min_tokens holds back
        held_rows: list[int] = []
        held_ids: list[torch.Tensor] = []
        biased: list[int] = []
        penal: list[int] = []
        allowed: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if r.has_allowed:
                allowed.append(i)
            if r.has_bad_words and (ids := r.banned_now(vocab)):
                held_rows.append(i)
                held_ids.append(torch.tensor(ids, dtype=torch.long, device=dev))
            if p.min_tokens and len(r.token_ids) - r.prompt_len < p.min_tokens:
                held_rows.append(i)
                held_ids.append(r.min_tokens_mask(self.eos_token_ids, vocab, dev))
            if r.has_bias:
                biased.append(i)
            if r.needs_penalties:
                penal.append(i)
        x = logits  # [R, V]; copied before the first in-place write so logprobs see raw logits
        if allowed:
            x = x.clone()
            for i in allowed:
                x[i].masked_fill_(rows[i].allowed_mask(vocab, dev), -torch.inf)
        if held_rows:
            if x is logits:
                x = x.clone()
            r_t, c_t = _rows_and_cols(held_rows, held_ids, dev)
            x[r_t, c_t] = -torch.inf
        if biased:
            if x is logits:
                x = x.clone()
            pairs = [rows[i].bias_tensors(vocab, dev) for i in biased]
            r_t, c_t = _rows_and_cols(biased, [ids for ids, _ in pairs], dev)
            vals = torch.cat([v for _, v in pairs]).to(x.dtype)
            x.index_put_((r_t, c_t), vals, accumulate=True)
        if penal:
            if x is logits:
                x = x.clone()
            _penalize(x, penal, [rows[i] for i in penal])
        return x

    def _sample_rows(
        self,
        x: torch.Tensor,  # [Rr, V] penalised logits of the random rows, unseeded rows first
        rows: list[RequestSamplingState],
        num_unseeded: int,
        shared: bool,  # x is the caller's tensor: no in-place writes
    ) -> torch.Tensor:  # [Rr] token ids
        vocab = x.shape[1]
        probs = self.filtered_probs(x, rows, shared)
        # Inverse-CDF sampling: one uniform per row, u in (0, 1], and the first token
        # whose cumulative (unnormalised, filtered) probability reaches u * total.  A
        # filtered token has zero width in the CDF, so it is never the first to reach a
        # positive target.  One draw per row (rather than an exponential race with a full
        # vocabulary of noise per row) is ~10x cheaper on CPU, and a seeded request still
        # consumes exactly one draw per step whatever its batch.
        cdf = probs.cumsum_(-1)  # [Rr, V]
        u = torch.empty(len(rows), 1, dtype=cdf.dtype, device=cdf.device)  # [Rr, 1]
        if num_unseeded:
            u[:num_unseeded].uniform_(generator=self.generator)
        for j in range(num_unseeded, len(rows)):
            u[j].uniform_(generator=rows[j].generator)
        target = (1.0 - u).mul_(cdf[:, -1:])  # [Rr, 1]
        tok = torch.searchsorted(cdf, target).squeeze(1)
        return tok.clamp_(max=vocab - 1)

    @staticmethod
    def filtered_probs(
        x: torch.Tensor,  # [Rr, V] processed logits of random rows
        rows: Sequence[RequestSamplingState],
        shared: bool = True,  # x must not be written
    ) -> torch.Tensor:  # [Rr, V] unnormalised: filtered tokens are 0, the rest sum to <= 1
        """Temperature, softmax, then top-k, top-p and min-p: what a random row draws from."""
        vocab = x.shape[1]
        temps = [max(r.params.temperature, _MIN_TEMPERATURE) for r in rows]
        if any(t != 1.0 for t in temps):
            t = torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1)  # [Rr, 1]
            x = x / t if shared else x.div_(t)
        probs = torch.softmax(x, dim=-1)  # [Rr, V]

        top_k: list[int] = []
        k_pos: list[int] = []
        top_p: list[float] = []
        p_pos: list[int] = []
        min_p: list[float] = []
        m_pos: list[int] = []
        for j, r in enumerate(rows):
            p = r.params
            if 0 < p.top_k < vocab:
                k_pos.append(j)
                top_k.append(p.top_k)
            if p.top_p < 1.0:
                p_pos.append(j)
                top_p.append(p.top_p)
            if p.min_p > 0.0:
                m_pos.append(j)
                min_p.append(p.min_p)
        # Filters zero probabilities in place; the CDF draw below needs no renormalisation.
        if k_pos:
            _on_rows(probs, k_pos, lambda sub: _top_k_(sub, top_k))
        if p_pos:
            _on_rows(probs, p_pos, lambda sub: _top_p_(sub, top_p))
        if m_pos:
            _on_rows(probs, m_pos, lambda sub: _min_p_(sub, min_p))
        return probs

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,  # [R, V] raw
        tokens: torch.Tensor,  # [R]
        rows: list[RequestSamplingState],
        want: list[int],
    ) -> list[TokenLogprobs | None] | None:
        """Logprob of each sampled token and the top-n, from the raw logits (vLLM's default)."""
        if not want:
            return None
        if len(want) == len(rows):
            raw, tok = logits, tokens
        else:
            idx = torch.tensor(want, device=logits.device)
            raw, tok = logits.index_select(0, idx), tokens.index_select(0, idx)
        lp = torch.log_softmax(raw, dim=-1)  # [L, V]
        tok_lp = lp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
        tok_ids = tok.tolist()
        ns = [rows[i].params.logprobs or 0 for i in want]
        if max(ns):
            top_v, top_i = lp.topk(max(ns), dim=-1)  # [L, n_max], sorted descending
            top_vals, top_ids = top_v.tolist(), top_i.tolist()
        else:
            top_vals = top_ids = [[] for _ in want]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        for j, i in enumerate(want):
            n = ns[j]
            out[i] = TokenLogprobs(tok_ids[j], tok_lp[j], top_ids[j][:n], top_vals[j][:n])
        return out
