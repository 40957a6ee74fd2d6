"""Tokenization and detokenization of client-sized input, never on the event loop.

`tokenizers`' `encode` and `decode` hold the GIL for their whole run (a multi-MB prompt
froze the event loop for seconds); its batch calls (`encode_batch_fast`,
`decode_batch`) release it while the Rust code runs.  So a job, sized by its text's UTF-8
bytes (4 bytes a token id), goes to one of three tiers:

- up to `INLINE_BYTES` (2 KiB): on the loop, where a thread hop would cost more than the
  work (well under a millisecond);
- up to `process_bytes` (`--tokenize-process-bytes`, 256 KiB): a thread of this process,
  through the GIL-releasing calls; the loop keeps running (the thread takes the GIL back
  only to turn the result into a list: milliseconds at this size);
- anything bigger: a worker process holding its own copy of the tokenizer (the string
  goes out pickled, the ids come back packed, both on an I/O thread), at nice 10, so it
  takes the CPU the event loop and the model step leave rather than a share of theirs.

What bounds what:

- the text: `--max-request-bytes` (4 MiB) for a prompt, `--max-template-output-chars`
  for a rendered chat, `--max-ws-frame-bytes` on the WebSocket; and, before any of this,
  `max_model_len` x `Tokenizer.max_bytes_per_token` where the tokenizer cannot drop text
  (service/prep.py refuses a longer text untokenized);
- time: every job has one deadline, `timeout` (`--tokenize-timeout`, 2 s), counted from
  the call, waiting included.  A job still waiting at it never runs (TokenizeTimeout,
  `started=False`: busy, 429).  A running process job is killed with its worker, which is
  replaced (`started=True`: 413).  A thread cannot be stopped: a running thread job ends
  on its own, and `process_bytes` is what bounds it (well under the deadline even on a
  slow core);
- memory: tokenizing takes ~100 bytes per input byte at its peak; in this process that
  is at most `process_bytes` per thread, and a worker hands its heap back after each job
  (or dies with it);
- waiting: at most `max_queued` jobs for the threads and 4 per worker process for the
  processes (TokenizeBusy past that: 429).

Pools that heal: a thread never dies with its job (every exception, the tokenizer's
PanicException included, reaches the caller as TokenizeFailed); a worker process goes back
to the idle queue only after a clean reply (a result or a refusal of the input), and on
any other outcome (deadline, crash, a pipe or pickling error, cancellation at close) it is
killed and a replacement started, retried with back-off until one starts; a worker found
dead while idle is replaced without failing the job that drew it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import multiprocessing.connection
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from scheduler import envs
from service.tokenizer import Codec
from service.worker_pool import Worker, WorkerPool

T = TypeVar("T")

INLINE_BYTES = 2048
_ID_BYTES = 4  # what one token id counts for in a job's size
_RESPAWN_BACKOFF = (0.5, 30.0)  # first and longest wait between failed worker starts
_WORKER_NICE = 10


class TokenizeTimeout(Exception):
    """A job passed its deadline; `started`: whether it was running (else still waiting)."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


class TokenizeBusy(RuntimeError):
    """Too many jobs already wait for a thread or a worker."""


class TokenizeFailed(ValueError):
    """The tokenizer refused the input (or its worker process died on it)."""


class _Refused:
    """A `check` that raised on a worker's result (raised again on the loop)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _guarded(fn: Callable[..., T], *args: Any) -> T:
    """Run a tokenizer call; any exception from it (PanicException is a BaseException)
    becomes TokenizeFailed."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise TokenizeFailed(f"{type(e).__name__}: {e}"[:300]) from None


def token_strs(codec: Codec, ids: Sequence[int]) -> list[str]:
    """Each id's text on its own (special tokens kept): each distinct id decoded once."""
    uniq = list(set(ids))
    texts = dict(zip(uniq, codec.decode_batch([[t] for t in uniq], False), strict=True))
    return [texts[t] for t in ids]


def _unpack(packed: bytes, chunk: int = 1 << 16) -> list[int]:
    """Packed ids as a list, built a chunk at a time: one `tolist()` of millions of ids
    holds the GIL for its whole run (and its page faults), chunks let the loop in between."""
    ids = array("I")
    ids.frombytes(packed)
    out: list[int] = []
    for i in range(0, len(ids), chunk):
        out += ids[i : i + chunk].tolist()
    return out


# -- worker process ---------------------------------------------------------------------


def _trim_heap() -> None:
    """Give the freed heap back to the OS (glibc keeps it otherwise): a worker that
    tokenized 4 MB must not keep the ~0.4 GB that took."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _run_job(codec: Codec, job: tuple[Any, ...]) -> tuple[str, Any]:
    kind = job[0]
    if kind == "encode":
        _, texts, add_special = job
        return "ok", [array("I", ids).tobytes() for ids in codec.encode_batch(texts, add_special)]
    if kind == "pairs":
        _, pairs, second_max, max_len = job
        ids_list = codec.encode_pairs(pairs, second_max, max_len)
        return "ok", [array("I", ids).tobytes() for ids in ids_list]
    if kind == "decode":
        _, packed, skip = job
        return "ok", codec.decode_batch([array("I", p) for p in packed], skip)
    return "err", f"unknown job {kind!r}"


def _worker_main(conn: multiprocessing.connection.Connection, codec: Codec) -> None:
    # One core per worker: the tokenizer would otherwise fan a batch out to every core.
    envs.set_value("TOKENIZERS_PARALLELISM", "false")
    envs.set_value("RAYON_NUM_THREADS", "1")
    # Below the server's own threads: a huge prompt's tokenizing takes the CPU the event
    # loop and the model step leave, not a share of theirs (other streams never notice).
    with contextlib.suppress(OSError, AttributeError):
        os.nice(_WORKER_NICE)
    codec.encode_batch(["warm up"])
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            reply = _run_job(codec, job)
        except MemoryError:
            reply = ("err", "the tokenizer ran out of memory")
        except (KeyboardInterrupt, SystemExit):
            return
        except BaseException as e:  # a Rust panic is a BaseException
            reply = ("err", f"{type(e).__name__}: {e}"[:300])
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return
        del job, reply
        _trim_heap()


class _Worker(Worker):
    target = _worker_main
    name = "pagestream-tokenize"

    def roundtrip(self, job: tuple[Any, ...]) -> Any:
        """Send a job, wait for its reply (on an I/O thread).  Ids travel packed, and are
        packed and unpacked here, off the loop."""
        if job[0] == "decode":
            job = ("decode", [array("I", s).tobytes() for s in job[1]], job[2])
        self.conn.send(job)
        status, payload = self.conn.recv()
        if status != "ok":
            raise TokenizeFailed(payload)
        if job[0] in ("encode", "pairs"):
            return [_unpack(p) for p in payload]
        return payload


class TokenizePool(WorkerPool[_Worker]):
    """See the module docstring.  `workers` threads and `processes` worker processes (as
    many as threads by default; started in the background by `start()`; with none, every
    job runs in a thread)."""

    def __init__(
        self,
        codec: Codec,
        *,
        workers: int = 2,
        processes: int | None = None,
        timeout: float = 2.0,
        process_bytes: int = 256 << 10,
        max_queued: int = 1024,
    ) -> None:
        self.codec = codec
        self.workers = max(1, workers)
        self.processes = self.workers if processes is None else max(0, processes)
        self.timeout = timeout
        self.process_bytes = process_bytes
        self.max_queued = max_queued
        super().__init__(self.processes, "tokenize", "a tokenizer worker")
        self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="pagestream-tokenize")
        self._thread_jobs = 0  # waiting for or running on a thread

    # -- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker processes in the background: the server does not wait for them
        (only a prompt over `process_bytes` needs one, and it waits for one)."""
        self._open()
        for _ in range(self.processes):
            self._spawn_later()

    def _start_worker(self) -> _Worker:
        return _Worker(self._ctx, self.codec)

    def _respawn_backoff(self) -> tuple[float, float]:
        return _RESPAWN_BACKOFF

    async def close(self) -> None:
        await super().close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -- jobs -------------------------------------------------------------------------

    async def encode(
        self,
        texts: Sequence[str],
        add_special_tokens: bool = True,
        check: Callable[[list[int]], object] | None = None,
    ) -> list[list[int]]:
        """Token ids of each text.  `check(ids)` runs on each result where it was made
        (an exception from it reaches the caller as is)."""
        texts = list(texts)
        return await self._encode(
            sum(map(utf8_len, texts)),
            lambda: self.codec.encode_batch(texts, add_special_tokens),
            ("encode", texts, add_special_tokens),
            check,
        )

    async def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        second_max: int | None = None,
        check: Callable[[list[int]], object] | None = None,
        max_len: int | None = None,
    ) -> list[list[int]]:
        """Token ids of each text pair, one input each (Codec.encode_pairs); `check` as
        for `encode`."""
        pairs = list(pairs)
        return await self._encode(
            sum(utf8_len(a) + utf8_len(b) for a, b in pairs),
            lambda: self.codec.encode_pairs(pairs, second_max, max_len),
            ("pairs", pairs, second_max, max_len),
            check,
        )

    async def _encode(
        self,
        size: int,
        fn: Callable[[], list[list[int]]],
        job: tuple[Any, ...],
        check: Callable[[list[int]], object] | None,
    ) -> list[list[int]]:
        """`fn` inline (small), on a thread, or as `job` in a worker process (large)."""
        deadline = time.monotonic() + self.timeout

        def run() -> list[list[int]]:
            out = _guarded(fn)
            for ids in out:
                if check is not None:
                    check(ids)
            return out

        if size <= INLINE_BYTES:
            return run()
        if size <= self.process_bytes or not self.processes:
            return await self._in_thread(run, deadline)
        return await self._in_process(job, deadline, check)  # type: ignore[no-any-return]

    async def decode(
        self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """The text of each id list."""
        size = _ID_BYTES * sum(map(len, seqs))
        deadline = time.monotonic() + self.timeout
        if size <= INLINE_BYTES:
            return _guarded(self.codec.decode_batch, seqs, skip_special_tokens)
        if size <= self.process_bytes or not self.processes:
            return await self._in_thread(
                lambda: _guarded(self.codec.decode_batch, seqs, skip_special_tokens), deadline
            )
        return await self._in_process(("decode", list(seqs), skip_special_tokens), deadline)

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's own text (as `/tokenize`'s `token_strs`), off the loop when many."""
        if _ID_BYTES * len(ids) <= INLINE_BYTES:
            return _guarded(token_strs, self.codec, ids)
        deadline = time.monotonic() + self.timeout
        return await self._in_thread(lambda: _guarded(token_strs, self.codec, ids), deadline)

    async def _in_thread(self, fn: Callable[[], T], deadline: float) -> T:
        if self._thread_jobs >= self.max_queued:
            raise TokenizeBusy(f"{self._thread_jobs} tokenizations are already waiting")
        self._thread_jobs += 1
        started = False

        def job() -> T:
            nonlocal started
            started = True
            return fn()

        try:
            fut = asyncio.get_running_loop().run_in_executor(self._threads, job)
            # On the deadline wait_for cancels the future: a job still queued never runs;
            # one already running finishes in its thread (its size cap bounds it).
            return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise self._timeout(started) from None
        finally:
            self._thread_jobs -= 1

    async def _in_process(
        self,
        job: tuple[Any, ...],
        deadline: float,
        check: Callable[[list[int]], object] | None = None,
    ) -> Any:
        assert self._idle is not None, "TokenizePool.start() was not awaited"
        if self._idle.empty() and self._waiting >= 4 * self.processes:
            raise TokenizeBusy(f"{self._waiting} large prompts already wait to tokenize")
        try:
            worker = await self._take(deadline)
        except TimeoutError:
            raise self._timeout(False) from None

        def io(w: _Worker) -> Any:
            out = w.roundtrip(job)
            for ids in out if check is not None else ():
                try:
                    check(ids)
                except Exception as e:  # the caller's verdict on the ids, not a failure
                    return _Refused(e)
            return out

        # A refusal (TokenizeFailed, or `check`'s) is a clean reply: the worker stays.
        timeout = max(0.0, deadline - time.monotonic())
        try:
            out = await self._run(worker, io, timeout, keeps=(TokenizeFailed,))
        except TimeoutError:
            raise self._timeout(True) from None
        except (EOFError, OSError) as e:
            raise TokenizeFailed(f"its tokenizer worker died ({e!r})") from None
        if isinstance(out, _Refused):
            raise out.error
        return out

    def _timeout(self, started: bool) -> TokenizeTimeout:
        if started:
            return TokenizeTimeout(f"over the {self.timeout:g} s limit (--tokenize-timeout)", True)
        return TokenizeTimeout(
            f"no tokenizer was free within {self.timeout:g} s (the server is busy)", False
        )
