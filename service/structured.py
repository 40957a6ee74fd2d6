"""Constrained decoding on llguidance: grammars compiled off the event loop, cached.

Why llguidance (over xgrammar, measured on this machine, see README): it builds straight
from tokenizer.json and needs neither torch nor transformers, so its matchers can live on
the scheduler side (scheduler/ imports no torch); it compiles a schema in 1-5 ms with no
per-vocabulary precompute; it covers more of JSON Schema and takes Lark (and, converted,
GBNF) grammars; it reports a finished grammar (`is_stopped`) so a request ends at its
closing brace; and it can roll back tokens.  Its masks cost ~20-30 us per token, which is
well under a decode step.

A request's spec is compiled once into a prototype matcher (the cache key is the spec
itself); each sample of each request gets a deep copy, which the scheduler drives.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from llguidance.numpy import fill_next_token_bitmask_par

from scheduler.sampling_params import StructuredOutputsParams
from scheduler.structured import GrammarMatcher

# A grammar source (schema text, regex, grammar, choices) larger than this is refused.
MAX_SOURCE_BYTES = 256 << 10
# A compile that takes longer is refused (the worker finishes it in the background).
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# JSON is written compactly with readable separators: a fixed layout (no free whitespace)
# also means a model cannot wander off into an endless run of spaces.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    """One llguidance thread pool per process, made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message says why (the caller names the field)."""


class LLGuidanceMatcher:
    """scheduler.structured.GrammarMatcher over an llguidance LLMatcher."""

    __slots__ = ("m", "words")

    def __init__(self, m: llguidance.LLMatcher, words: int) -> None:
        self.m = m
        self.words = words  # int32 words in a mask

    def bitmask(self) -> bytes | None:
        mask = self.m.compute_bitmask()
        return None if self.m.is_error() else mask

    @classmethod
    def batch_bitmasks(cls, matchers: list[LLGuidanceMatcher]) -> list[bytes | None]:
        """Many masks at once on llguidance's thread pool, which runs without the GIL."""
        out = np.zeros((len(matchers), matchers[0].words), dtype=np.int32)
        fill_next_token_bitmask_par(_executor(), [(w.m, i) for i, w in enumerate(matchers)], out)
        return [None if w.m.is_error() else out[i].tobytes() for i, w in enumerate(matchers)]

    def accept(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec (raises GrammarError on malformed input)."""
    kind = spec.kind
    if kind == "json":
        assert spec.json is not None
        opts = {**_JSON_OPTIONS, "lenient": not spec.strict}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, overrides=opts)
        except ValueError as e:
            raise GrammarError(f"not a JSON schema: {e}") from e
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=_JSON_OPTIONS
        )
    if kind == "regex":
        assert spec.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        # Lark string literals take JSON's escapes, so any choice text is quoted exactly.
        alts = " | ".join(json.dumps(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alts}")
    assert spec.grammar is not None
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    except GbnfToLarkError as e:
        raise GrammarError(f"not a Lark or GBNF grammar: {e}") from e


def source_size(spec: StructuredOutputsParams) -> int:
    parts = (spec.json, spec.regex, spec.grammar, *(spec.choice or ()))
    return sum(len(p.encode()) for p in parts if p)


class GrammarCompiler:
    """Compiles specs for one tokenizer, off the event loop, with an LRU cache."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.compiles = 0  # cache misses (tests and metrics read it)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (a few hundred ms for a large vocabulary), then shared."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_json.read_text(encoding="utf-8"),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids,
                )
            return self._tokenizer

    def compile_sync(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        size = source_size(spec)
        if size > MAX_SOURCE_BYTES:
            raise GrammarError(f"the {spec.kind} is {size} bytes; the limit is {MAX_SOURCE_BYTES}")
        grammar = grammar_source(spec)
        # Terse errors: a dead end's reason goes back to the client as stop_reason, and
        # the verbose form dumps the parser state and the whole grammar.
        limits = llguidance.LLParserLimits(verbose_errors=False)
        m = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(f"cannot compile the {spec.kind}: {m.get_error()}")
        return m

    async def compile(self, spec: StructuredOutputsParams) -> None:
        """Make sure `spec` is compiled (raises GrammarError); the loop never blocks."""
        if spec in self._cache:
            self._cache.move_to_end(spec)
            return
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, self.compile_sync, spec)
        try:
            proto = await asyncio.wait_for(fut, COMPILE_TIMEOUT_S)
        except TimeoutError as e:
            raise GrammarError(
                f"the {spec.kind} took over {COMPILE_TIMEOUT_S:.0f} s to compile"
            ) from e
        self.compiles += 1
        self._cache[spec] = proto
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def matchers(self, spec: StructuredOutputsParams, n: int) -> list[GrammarMatcher]:
        """Fresh matchers for the n samples of a request; `compile(spec)` must have run
        (compiles here, synchronously, if the entry was evicted since)."""
        proto = self._cache.get(spec)
        if proto is None:
            proto = self.compile_sync(spec)
            self._cache[spec] = proto
        words = (self.tokenizer().vocab_size + 31) // 32
        return [LLGuidanceMatcher(proto.deep_copy(), words) for _ in range(n)]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
