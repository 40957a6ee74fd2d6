"""Untrusted grammars are compiled first in killable worker processes.

llguidance compiles in native code that recurses with the grammar's depth: a 3,000-rule
Lark chain or a JSON schema whose `$ref`s chain 2,600 definitions overflows an 8 MB stack
and kills the whole process (SIGSEGV); some specs compile for seconds in code no thread
can interrupt.  So the server never compiles a spec that a worker process has not
compiled first:

- a worker converts the spec to llguidance's grammar text, compiles it on a thread of
  `WORKER_STACK` bytes and computes its first token mask on llguidance's own thread pool,
  as the scheduler will.  A spec that fails there is the client's fault: a compile error,
  a parser limit hit on the first token, or a first mask with no token in it (a grammar
  the vocabulary cannot satisfy) is a 400 naming the field;
- a worker that dies (a native crash, its memory allowance) costs its request a 400 and is
  replaced; a compile past the deadline has its worker killed and replaced, so it holds
  nothing and innocent requests get the next worker;
- the server then compiles the grammar text the worker produced, on a thread whose stack
  is `SERVER_STACK` (8x the worker's): the same code on the same input recurses no
  deeper, so what passed in the worker cannot overflow here, and it takes about as long
  as it took there (under the deadline).  Refusals are remembered, so a client repeating
  a crashing spec costs a dictionary look-up, not a worker.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from scheduler.sampling_params import StructuredOutputsParams
from service.render_pool import limit_memory
from service.worker_pool import START_TIMEOUT, Worker, WorkerPool

log = logging.getLogger(__name__)

# Most time a constrained sample may spend on one token (advance + next mask): ~2,000x
# what a JSON schema's token takes, and small enough that n of them in one step keep
# other streams' inter-token gaps well under half a second.  The worker refuses a spec
# whose first token already costs more; service/structured.py enforces it on the rest.
# Counted in the computing thread's CPU time (cpu_seconds): on a shared machine a wall
# clock charged a well-behaved grammar for the time its thread sat preempted (a 222 ms
# token of a JSON schema's in a test run beside other processes) and failed the request.
TOKEN_BUDGET_S = 0.05
cpu_seconds = time.thread_time
WORKER_STACK = 8 << 20  # what a Linux main thread gets by default (ulimit -s)
SERVER_STACK = 64 << 20  # virtual: only the pages a compile touches are committed
_STACK_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message says why (the caller names the field)."""


# JSON is written compactly with readable separators: a fixed layout (no free whitespace)
# also means a model cannot wander off into an endless run of spaces.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> llguidance.LLParserLimits:
    # Terse errors: a dead end's reason goes back to the client as stop_reason, and the
    # verbose form dumps the parser state and the whole grammar.
    return llguidance.LLParserLimits(verbose_errors=False)


def make_tokenizer(tokenizer_json: Path, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(
        tokenizer_json.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos
    )


def check_spec(tok: llguidance.LLTokenizer, spec: StructuredOutputsParams) -> tuple[str, str]:
    """("ok", grammar text) or ("err", why): what the worker does with one spec."""
    kind = spec.kind
    try:
        grammar = grammar_source(spec)
        m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=parser_limits())
        if m.is_error():
            return "err", f"cannot compile the {kind}: {m.get_error()}"
        # One mask at a time, as the scheduler asks for a lone row's (the batched call
        # answers a lexer blow-up with an end-of-text-only mask instead of an error).
        t0 = cpu_seconds()
        mask = m.compute_bitmask()
        took = cpu_seconds() - t0
        if m.is_error():
            return "err", f"the {kind} fails before its first token: {m.get_error()}"
        if took > TOKEN_BUDGET_S:
            return "slow", (
                f"the {kind} needs {took * 1e3:.0f} ms for its first token (the limit is "
                f"{TOKEN_BUDGET_S * 1e3:.0f} ms a token): it is too costly to enforce"
            )
        if not any(mask[: 4 * ((tok.vocab_size + 31) // 32)]) and not m.is_stopped():
            return "err", f"no token of the model's vocabulary can begin the {kind}"
        return "ok", grammar
    except GrammarError as e:
        return "err", str(e)
    except RecursionError:
        return "err", f"the {kind} is nested too deeply"
    except MemoryError:
        return "err", f"compiling the {kind} ran out of its memory allowance"
    except Exception as e:  # llguidance raises plain ValueErrors for malformed input
        return "err", f"cannot compile the {kind}: {e}"


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


def _check_into(tok: llguidance.LLTokenizer, spec: StructuredOutputsParams, box: list) -> None:
    box.append(check_spec(tok, spec))


def _worker_main(
    conn: multiprocessing.connection.Connection,
    tokenizer_json: Path,
    vocab_size: int,
    eos: list[int],
    max_memory: int,
) -> None:
    threading.stack_size(WORKER_STACK)
    tok = make_tokenizer(tokenizer_json, vocab_size, eos)
    limit_memory(max_memory)
    conn.send(("ready", ""))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        box: list[tuple[str, str]] = []
        t = threading.Thread(target=_check_into, args=(tok, spec, box))
        t.start()
        t.join()
        try:
            conn.send(box[0] if box else ("err", f"compiling the {spec.kind} failed"))
        except (OSError, ValueError):
            return


class _Worker(Worker):
    target = _worker_main
    name = "pagestream-grammar"


class GrammarWorkers(WorkerPool[_Worker]):
    """`workers` checking processes, started on first use; `check(spec)` returns the
    grammar text to compile in-process or raises GrammarError."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos: list[int],
        *,
        workers: int = 2,
        timeout: float = 1.0,
        max_memory: int = 2 << 30,
        remember: int = 256,
    ) -> None:
        super().__init__(max(1, workers), "grammar", "a grammar worker")
        self._args = (tokenizer_json, vocab_size, eos, max_memory)
        self.timeout = timeout
        self.remember = remember
        self._refused: OrderedDict[StructuredOutputsParams, str] = OrderedDict()

    def _start_worker(self) -> _Worker:
        return _Worker(self._ctx, *self._args)

    async def check(self, spec: StructuredOutputsParams) -> str:
        why = self._refused.get(spec)
        if why is not None:
            raise GrammarError(why)
        if self._idle is None:  # started on first use
            self._open()
            for _ in range(self.size):
                self._spawn_later()
        # No worker within START_TIMEOUT is the server's fault: TimeoutError, a 500.
        worker = await self._take(time.monotonic() + START_TIMEOUT)
        try:
            status, text = await self._run(worker, lambda w: w.roundtrip(spec), self.timeout)
        except TimeoutError:
            status, text = "slow", f"the {spec.kind} took over {self.timeout:g} s to compile"
        except (EOFError, OSError, ValueError):
            log.warning("a grammar worker died compiling a %s; replaced", spec.kind)
            why = "too deeply nested or too large"
            status, text = "err", f"the {spec.kind} crashed the grammar compiler ({why})"
        if status == "err":  # a crash or a compile error: the same spec fails the same way
            self._refused[spec] = text
            while len(self._refused) > self.remember:
                self._refused.popitem(last=False)
        if status != "ok":  # "slow" depends on the machine's load: not remembered
            raise GrammarError(text)
        return text

    def close(self) -> None:  # type: ignore[override]
        # Synchronous for GrammarCompiler.shutdown: the cancelled tasks end on their own.
        self._shut_down()


def submit_big_stack(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
    """pool.submit with any thread it starts given SERVER_STACK (threads are made on
    submit; stack_size is process-wide, so a thread started elsewhere meanwhile gets the
    same large but merely virtual stack)."""
    with _STACK_LOCK:
        old = threading.stack_size(SERVER_STACK)
        try:
            return pool.submit(fn, *args)
        finally:
            threading.stack_size(old)
