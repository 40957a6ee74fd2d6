"""The tensor-parallel executor: rank 0 in this process, ranks 1..N-1 in spawned processes.

Process picture (N = 2):

    server process                                  rank-1 process (spawned)
    engine actor -> TPExecutor (thread pagestream-exec)
                    rank 0: ModelRunner (shard 0)   ModelRunner (shard 1)
                    --- step bytes over a pipe --->  decode, execute_model
                    <==== gloo / NCCL collectives (all-reduce, all-gather) ====>
                    returns ModelOutput             discards its (identical) output

Each step's SchedulerOutput is msgspec-encoded and written to every worker's pipe, then
every rank runs the same `execute_model`; the collectives inside the forward keep them in
lock step.  The step travels over a pipe rather than a collective because an idle server
waits for its next step indefinitely, and a collective would time out; the pipe also
tells a worker when the server is gone (EOF).  A rank that dies makes rank 0's next
collective (or pipe write) fail at once; one that hangs makes it time out after
`timeout_s`.  Either way the step raises, the engine fails, and the server exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait as wait_any
from typing import Any

import msgspec

from gpu.config import ModelLoadError
from gpu.tp import core_sets, free_port, init_group, pin_thread
from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.executor import ThreadExecutor

log = logging.getLogger(__name__)

_STOP = b"X"
_STATS = b"?"
_STEP = b"S"


def _backend(device: str | None) -> str:
    import torch

    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    return "nccl" if cuda else "gloo"


def _rank_device(device: str | None, rank: int) -> str | None:
    """One CUDA device per rank; CPU ranks share the device 'cpu' (on their own cores)."""
    if _backend(device) == "nccl":
        return f"cuda:{rank}"
    return device


def _worker_main(
    rank: int,
    size: int,
    port: int,
    runner_kwargs: dict[str, Any],
    cores: list[int] | None,
    threads: int | None,
    timeout_s: float,
    conn: Any,
    faults: Any,
) -> None:
    """A rank > 0: build its shard, then run every step the pipe brings until told to
    stop or until the server process goes away."""
    from gpu.model_runner import ModelRunner

    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(f"pagestream-tp{rank}")  # so ps / top name the rank (Linux)
    try:
        pin_thread(cores, threads)
        device = runner_kwargs.get("device")
        tp = init_group(rank, size, port, _backend(device), timeout_s)
        kwargs = dict(runner_kwargs, device=_rank_device(device, rank))
        runner = ModelRunner(**kwargs, faults=faults, tp=tp)
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(("error", f"rank {rank} failed to start: {e!r}"))
        raise SystemExit(1) from e
    conn.send(("ready", runner.weight_bytes))
    decode = msgspec.msgpack.Decoder(SchedulerOutput).decode
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the server is gone; nothing to clean up that matters
        if msg == _STOP:
            break
        if msg == _STATS:
            conn.send(("stats", runner.weight_bytes))
            continue
        try:
            runner.execute_model(decode(memoryview(msg)[1:]))
        except BaseException:
            log.exception("tensor-parallel rank %d failed a step", rank)
            # Exiting closes this rank's sockets: rank 0's collective fails at once
            # instead of waiting out the timeout.
            os._exit(1)
    import torch.distributed as dist

    dist.destroy_process_group()


class _Rank0Runner:
    """Rank 0's ModelRunner behind the engine's Runner interface: sends each step to the
    other ranks first.  Attribute reads (config, num_kv_blocks, ...) go to the runner."""

    def __init__(self, runner: Any, executor: TPExecutor) -> None:
        self._runner = runner
        self._executor = executor
        self._encode = msgspec.msgpack.Encoder().encode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        self._executor.broadcast(_STEP + self._encode(so))
        return self._runner.execute_model(so)


class TPExecutor(ThreadExecutor):
    """N ranks; the engine talks to it exactly as to a ThreadExecutor."""

    def __init__(
        self,
        size: int,
        runner_kwargs: dict[str, Any],
        *,
        faults: Any = None,
        threads: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        from gpu.model_runner import ModelRunner

        self.size = size
        self.timeout_s = timeout_s
        self._closing = False
        if _backend(runner_kwargs.get("device")) == "nccl":
            import torch

            if torch.cuda.device_count() < size:
                raise ModelLoadError(
                    f"tensor_parallel_size {size} needs {size} CUDA devices, "
                    f"{torch.cuda.device_count()} visible"
                )
        import torch.distributed as dist

        if dist.is_initialized():  # rank 0 joins this process's default group
            raise ModelLoadError(
                "this process already runs a tensor-parallel engine; shut it down first"
            )
        port = free_port()
        cores = core_sets(size) or [None] * size  # type: ignore[list-item]
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        for rank in range(1, size):
            # Every rank gets the fault plan: a fault that drops a request's rows on rank
            # 0 only would leave the ranks' collectives different sizes.
            self._spawn(rank, port, runner_kwargs, cores[rank], threads, faults)

        def build() -> _Rank0Runner:
            pin_thread(cores[0], threads)
            device = runner_kwargs.get("device")
            tp = init_group(0, size, port, _backend(device), timeout_s)
            kwargs = dict(runner_kwargs, device=_rank_device(device, 0))
            return _Rank0Runner(ModelRunner(**kwargs, faults=faults, tp=tp), self)

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagestream-exec")
        try:
            self.runner = self._start(self._pool.submit(build))
        except BaseException:
            self.shutdown(wait=False)
            raise
        log.info("tensor parallel: %d ranks (worker pids %s)", size, self.worker_pids)

    def watch(self, on_failure: Callable[[BaseException], None]) -> None:
        """Call on_failure (from a watcher thread) when a rank exits while serving, so an
        idle engine fails at once instead of at its next step."""

        def watcher() -> None:
            by_sentinel = {p.sentinel: p for p in self._procs}
            dead = by_sentinel[wait_any(list(by_sentinel))[0]]
            if self._closing:
                return
            dead.join(timeout=1)  # the sentinel closes a moment before the exit status is set
            on_failure(
                RuntimeError(
                    f"tensor-parallel {dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
                )
            )

        threading.Thread(target=watcher, name="pagestream-tp-watch", daemon=True).start()

    def _spawn(
        self,
        rank: int,
        port: int,
        runner_kwargs: dict[str, Any],
        cores: list[int] | None,
        threads: int | None,
        faults: Any,
    ) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        args = (rank, self.size, port, runner_kwargs, cores, threads, self.timeout_s, child, faults)
        p = ctx.Process(target=_worker_main, args=args, name=f"pagestream-tp{rank}", daemon=True)
        p.start()
        child.close()
        self._procs.append(p)
        self._conns.append(parent)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _start(self, fut: Any) -> _Rank0Runner:
        """Wait for rank 0's build while watching the workers, so that a worker that
        fails to load is reported with its own message, not as a collective timeout."""
        # Start-up (spawn, import torch, read the shards) is not a collective: on a loaded
        # machine it takes minutes, so it gets its own allowance beside the collective timeout.
        deadline = time.monotonic() + self.timeout_s + 300
        ready: set[int] = set()
        while True:
            for i, conn in enumerate(self._conns):
                if i not in ready and conn.poll():
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        kind, value = "error", f"tensor-parallel rank {i + 1} exited at start-up"
                    if kind == "error":
                        raise ModelLoadError(value)
                    ready.add(i)
            dead = [p for i, p in enumerate(self._procs) if i not in ready and not p.is_alive()]
            if dead:
                raise ModelLoadError(f"tensor-parallel {dead[0].name} exited at start-up")
            if fut.done() and (fut.exception() is not None or len(ready) == len(self._conns)):
                return fut.result()  # rank 0's own failure raises here, without waiting
            if time.monotonic() > deadline:
                raise ModelLoadError("tensor-parallel ranks did not start in time")
            with contextlib.suppress(FutureTimeout):
                fut.result(timeout=0.05)

    def broadcast(self, msg: bytes) -> None:
        for p, conn in zip(self._procs, self._conns, strict=True):
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                )
            conn.send_bytes(msg)

    def rank_weight_bytes(self) -> list[int]:
        """Bytes of weights each rank holds, rank order.  Asks the workers from the
        executor thread, so the question never interleaves with a step on the pipes."""
        return self.call(self._rank_weight_bytes)

    def _rank_weight_bytes(self) -> list[int]:
        out = [self.runner.weight_bytes]
        for conn in self._conns:
            conn.send_bytes(_STATS)
            if not conn.poll(self.timeout_s):
                raise RuntimeError("a tensor-parallel rank did not answer")
            out.append(conn.recv()[1])
        return out

    def shutdown(self, wait: bool = True) -> None:
        """wait=True: a clean stop (every rank leaves the group).  wait=False, after a
        failure: kill the workers, which also unblocks rank 0 if it is inside a
        collective, and do not wait for the executor thread."""
        self._closing = True
        if wait:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(_STOP)
            with contextlib.suppress(Exception):
                self._pool.submit(_leave_group).result(timeout=self.timeout_s)
        for p in self._procs:
            p.join(timeout=5 if wait else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if wait:  # the other ranks' memory went with their processes; rank 0's is here
            self._release_runner()
        else:
            _leave_group()


def _leave_group() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
