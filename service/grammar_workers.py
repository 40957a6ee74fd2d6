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

import asyncio
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import sys
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

log = logging.getLogger(__name__)

# Most time a constrained sample may spend on one token (advance + next mask): ~2,000x
# what a JSON schema's token takes, and small enough that n of them in one step keep
# other streams' inter-token gaps well under half a second.  The worker refuses a spec
# whose first token already costs more; service/structured.py enforces it on the rest.
TOKEN_BUDGET_S = 0.05
WORKER_STACK = 8 << 20  # what a Linux main thread gets by default (ulimit -s)
SERVER_STACK = 64 << 20  # virtual: only the pages a compile touches are committed
_START_TIMEOUT = 120.0
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
        t0 = time.perf_counter()
        mask = m.compute_bitmask()
        took = time.perf_counter() - t0
        if m.is_error():
            return "err", f"the {kind} fails before its first token: {m.get_error()}"
        if took > TOKEN_BUDGET_S:
            return "err", (
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


class _Worker:
    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, *args), daemon=True, name="pagestream-grammar"
        )
        self.proc.start()
        child.close()
        # Start-up (imports, the tokenizer) is not compile time.
        if not self.conn.poll(_START_TIMEOUT):
            self.kill()
            raise RuntimeError(f"a grammar worker did not start in {_START_TIMEOUT} s")
        self.conn.recv()

    def roundtrip(self, spec: StructuredOutputsParams) -> tuple[str, str]:
        self.conn.send(spec)
        return self.conn.recv()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(Exception):
            self.proc.join(5)


class GrammarWorkers:
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
        self._args = (tokenizer_json, vocab_size, eos, max_memory)
        self.size = max(1, workers)
        self.timeout = timeout
        self.remember = remember
        method = "forkserver" if sys.platform == "linux" else "spawn"
        self._ctx = multiprocessing.get_context(method)
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._io = ThreadPoolExecutor(self.size, thread_name_prefix="pagestream-grammar-io")
        self._spawns: set[asyncio.Task[None]] = set()
        self._jobs: set[asyncio.Task[Any]] = set()
        self._refused: OrderedDict[StructuredOutputsParams, str] = OrderedDict()
        self.killed = 0  # workers lost to a crash or a deadline (tests and metrics read it)

    async def _ensure_started(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.size):
                self._respawn_later()
        return self._idle

    async def _replace(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                w = await loop.run_in_executor(None, _Worker, self._ctx, self._args)
                break
            except Exception:  # the machine is out of processes or memory: try again
                log.exception("a grammar worker did not start; retrying in 1 s")
                await asyncio.sleep(1.0)
        self._all.add(w)
        assert self._idle is not None
        self._idle.put_nowait(w)

    def _respawn_later(self) -> None:
        task = asyncio.create_task(self._replace())
        self._spawns.add(task)
        task.add_done_callback(self._spawns.discard)

    async def check(self, spec: StructuredOutputsParams) -> str:
        why = self._refused.get(spec)
        if why is not None:
            raise GrammarError(why)
        idle = await self._ensure_started()
        while True:
            async with asyncio.timeout(_START_TIMEOUT):  # the server's fault: a 500
                worker = await idle.get()
            if worker.proc.is_alive():
                break
            # Died while idle (the OOM killer, an operator): not this spec's fault.
            self._discard(worker)
        # Its own task: a caller that goes away mid-compile leaves the worker to finish
        # (or be killed at the deadline) and return to the pool.
        task = asyncio.ensure_future(self._roundtrip(worker, spec))
        self._jobs.add(task)
        task.add_done_callback(self._job_done)
        status, text = await asyncio.shield(task)
        if status != "ok":
            self._refused[spec] = text
            while len(self._refused) > self.remember:
                self._refused.popitem(last=False)
            raise GrammarError(text)
        return text

    async def _roundtrip(self, worker: _Worker, spec: StructuredOutputsParams) -> tuple[str, str]:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._io, worker.roundtrip, spec)
        try:
            reply = await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self._discard(worker)
            return "err", f"the {spec.kind} took over {self.timeout:g} s to compile"
        except asyncio.CancelledError:  # closing
            self._discard(worker)
            raise
        except (EOFError, OSError, ValueError):
            self._discard(worker)
            log.warning("a grammar worker died compiling a %s; replaced", spec.kind)
            return "err", (
                f"the {spec.kind} crashed the grammar compiler (too deeply nested or too large)"
            )
        except BaseException:
            self._discard(worker)
            raise
        assert self._idle is not None
        self._idle.put_nowait(worker)
        return reply

    def _job_done(self, task: asyncio.Task[Any]) -> None:
        self._jobs.discard(task)
        if not task.cancelled():
            task.exception()

    def _discard(self, worker: _Worker) -> None:
        self.killed += 1
        self._all.discard(worker)
        worker.kill()
        self._respawn_later()

    def close(self) -> None:
        for t in [*self._spawns, *self._jobs]:
            t.cancel()
        for w in list(self._all):
            w.kill()
        self._all.clear()
        self._io.shutdown(wait=False, cancel_futures=True)


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
