"""Constrained decoding on llguidance: grammars compiled off the event loop, cached.

Why llguidance (over xgrammar; docs/PERFORMANCE.md compares them): it builds straight
from tokenizer.json and needs neither torch nor transformers, so its matchers can live on
the scheduler side (scheduler/ imports no torch); it compiles a schema quickly, with no
per-vocabulary precompute, so a new schema costs its first request little; it covers more of JSON Schema and takes Lark (and, converted,
GBNF) grammars; it reports a finished grammar (`is_stopped`) so a request ends at its
closing brace; and it can roll back tokens.  Its masks are slower than xgrammar's but
small next to a decode step.

A request's spec is compiled once into a prototype matcher (the cache key is the spec
itself); each sample of each request gets a deep copy, which the scheduler drives.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llguidance
import msgspec
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from scheduler.sampling_params import StructuredOutputsParams
from scheduler.structured import AfterReasoning, GrammarMatcher
from service.grammar_workers import (
    TOKEN_BUDGET_S,
    GrammarError,
    GrammarWorkers,
    cpu_seconds,
    grammar_source,
    make_tokenizer,
    parser_limits,
    submit_big_stack,
)

# A grammar source (schema text, regex, grammar, choices) larger than this is refused.
MAX_SOURCE_BYTES = 256 << 10
# A compile that takes longer is refused (its worker process is killed): far more than a
# large schema takes, and twice it (the worker's, then the server's) stays under the 3 s
# in which a hostile request must have its 4xx.
COMPILE_TIMEOUT_S = 1.0
CACHE_SIZE = 256
PIN_S = 30.0
MAX_CACHED = 4 * CACHE_SIZE


_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    """One llguidance thread pool per process, made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


class LLGuidanceMatcher:
    """scheduler.structured.GrammarMatcher over an llguidance LLMatcher, on a time budget.

    An ambiguous grammar (`a: a a a | a a | "x"`) makes llguidance's Earley sets, and so
    each token's work, grow with the output until a token takes seconds, all of it inside
    the engine's step (and `consume_token` holds the GIL).
    llguidance's own fuel limits do not bound wall time, so each matcher times itself: a
    token whose advance plus next mask took over TOKEN_BUDGET_S of its thread's CPU time
    (time preempted by other processes is not the grammar's) puts the matcher in error,
    and the scheduler ends its request with that reason (a 4xx-class failure: the
    client's grammar).  Masks computed together on llguidance's pool are timed as a
    batch; a batch over the budget makes its matchers suspects, timed one by one next
    token, so one costly grammar cannot hide behind, or be blamed on, its neighbours.

    The samples of one API request (n of them for each of its prompts) share the budget
    (each gets TOKEN_BUDGET_S / their count, the `n` given here): they advance together,
    so a step pays for all of them, and with a budget each an n = 8 request held every
    step at up to 8x the budget for 8x as long before its 4xx."""

    __slots__ = ("budget", "m", "n", "over", "spent", "suspect", "words")
    # Its mask covers every position (None only in error): speculative drafts can be
    # verified under it (Scheduler.fill_masks walks it through them).
    drafts = True

    def __init__(self, m: llguidance.LLMatcher, words: int, n: int = 1) -> None:
        self.m = m
        self.words = words  # int32 words in a mask
        self.n = n  # the API request's samples (over all its prompts): they share the budget
        self.budget = TOKEN_BUDGET_S / n
        self.spent = 0.0  # seconds on the current token: its advance, then its mask
        self.suspect = False
        self.over: str | None = None

    def _charge(self, seconds: float) -> None:
        self.spent += seconds
        if self.spent > self.budget and self.over is None:
            limit = f"{TOKEN_BUDGET_S * 1e3:.0f} ms"
            if self.n > 1:
                limit += (
                    f" a token over the request's {self.n} samples, {self.budget * 1e3:.1f} each"
                )
            self.over = (
                f"the grammar needed {self.spent * 1e3:.1f} ms for one token (the limit is "
                f"{limit}): it is too ambiguous"
            )

    def bitmask(self) -> bytes | None:
        if self.over is not None:
            return None
        t0 = cpu_seconds()
        mask = self.m.compute_bitmask()
        self._charge(cpu_seconds() - t0)
        self.suspect = False
        # llguidance pads its mask; every mask of a step must be `words` long, as the
        # batch's are (the runner stacks them into one array).
        return None if self.m.is_error() or self.over is not None else mask[: 4 * self.words]

    @classmethod
    def batch_bitmasks(cls, matchers: list[LLGuidanceMatcher]) -> list[bytes | None]:
        """Many masks at once on llguidance's thread pool, which runs without the GIL
        (suspects and matchers already over budget are asked one by one)."""
        masks: list[bytes | None] = [None] * len(matchers)
        batch = []
        for i, w in enumerate(matchers):
            if w.suspect or w.over is not None:
                masks[i] = w.bitmask()
            else:
                batch.append(i)
        if not batch:
            return masks
        out = np.zeros((len(batch), matchers[0].words), dtype=np.int32)
        t0 = time.perf_counter()
        fill_next_token_bitmask_par(
            _executor(), [(matchers[i].m, j) for j, i in enumerate(batch)], out
        )
        took = time.perf_counter() - t0
        for j, i in enumerate(batch):
            w = matchers[i]
            w.suspect = took + w.spent > w.budget
            masks[i] = None if w.m.is_error() else out[j].tobytes()
        return masks

    def accept(self, token_id: int) -> bool:
        if self.over is not None:
            return False
        self.spent = 0.0
        t0 = cpu_seconds()
        ok = self.m.consume_token(token_id)
        self._charge(cpu_seconds() - t0)
        return ok and self.over is None

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str | None:
        if self.over is not None:
            return self.over
        return self.m.get_error() if self.m.is_error() else None


def _grammar_of(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """The spec as the cache knows it: where the grammar starts is not part of it."""
    if spec.reasoning_end is None:
        return spec
    return msgspec.structs.replace(spec, reasoning_end=None, reasoning_start=None)


def check_size(spec: StructuredOutputsParams) -> None:
    parts = (spec.json, spec.regex, spec.grammar, *(spec.choice or ()))
    size = sum(len(p.encode()) for p in parts if p)
    if size > MAX_SOURCE_BYTES:
        raise GrammarError(f"the {spec.kind} is {size} bytes; the limit is {MAX_SOURCE_BYTES}")


class GrammarCompiler:
    """Compiles specs for one tokenizer with an LRU cache; `compile` never runs untrusted
    compilation in this process before a worker process survived it
    (service/grammar_workers.py), and never on the event loop."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        workers: int = 2,
        timeout: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout = timeout
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # spec -> (prototype, when `compile` last asked for it)
        self._cache: OrderedDict[StructuredOutputsParams, tuple[llguidance.LLMatcher, float]]
        self._cache = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.workers = GrammarWorkers(
            tokenizer_json, vocab_size, self.eos_token_ids, workers=workers, timeout=timeout
        )
        self.compiles = 0  # cache misses (tests and metrics read it)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (a few hundred ms for a large vocabulary), then shared."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = make_tokenizer(
                    self.tokenizer_json, self.vocab_size, self.eos_token_ids
                )
            return self._tokenizer

    def _compile_text(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=parser_limits())
        if m.is_error():
            raise GrammarError(f"cannot compile the {kind}: {m.get_error()}")
        return m

    def compile_trusted(self, spec: StructuredOutputsParams) -> None:
        """Compile in this process, on the calling thread, with no worker first: for specs
        the caller wrote itself (benchmarks), never a client's."""
        spec = _grammar_of(spec)
        check_size(spec)
        self._cache[spec] = (self._compile_text(spec.kind, grammar_source(spec)), 0.0)

    async def compile(self, spec: StructuredOutputsParams) -> None:
        """Make sure `spec` is compiled (raises GrammarError); the loop never blocks."""
        loop = asyncio.get_running_loop()
        spec = _grammar_of(spec)
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache[spec] = (hit[0], loop.time())
            self._cache.move_to_end(spec)
            return
        check_size(spec)
        grammar = await self.workers.check(spec)  # raises GrammarError
        fut = submit_big_stack(self._pool, self._compile_text, spec.kind, grammar)
        try:
            proto = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except TimeoutError as e:
            raise GrammarError(f"the {spec.kind} took over {self.timeout:g} s to compile") from e
        self.compiles += 1
        self._cache[spec] = (proto, loop.time())
        self._evict(loop.time())

    def _evict(self, now: float) -> None:
        """Least recently used first, but never one a request compiled in the last
        PIN_S seconds: it may be between `compile` and `matchers` (tokenizing, rendering),
        and `matchers` must not compile.  Past MAX_CACHED even those go."""
        excess = len(self._cache) - CACHE_SIZE
        for spec, (_, used) in list(self._cache.items()):
            if excess <= 0:
                break
            if now - used > PIN_S or len(self._cache) > MAX_CACHED:
                del self._cache[spec]
                excess -= 1

    def matchers(
        self, spec: StructuredOutputsParams, n: int, share: int = 1
    ) -> list[GrammarMatcher]:
        """Fresh matchers for the n samples of a request; `compile(spec)` must have run.
        share: the prompts of the API request this one is part of, whose n x share
        samples split the per-token budget."""
        hit = self._cache.get(_grammar_of(spec))
        if hit is None:  # only past MAX_CACHED distinct specs within PIN_S
            raise GrammarError(f"the {spec.kind} was evicted by newer grammars; send it again")
        words = (self.tokenizer().vocab_size + 31) // 32
        made = [LLGuidanceMatcher(hit[0].deep_copy(), words, n * share) for _ in range(n)]
        if spec.reasoning_end is None:
            return made  # type: ignore[return-value]
        return [AfterReasoning(m, spec.reasoning_end, spec.reasoning_start) for m in made]

    def shutdown(self) -> None:
        self.workers.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
