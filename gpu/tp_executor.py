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

Pipeline parallelism (gpu/pp.py) runs in the same processes: P stages of T ranks, every
rank still gets every step over its pipe.  Several hosts: node 0 (this process) holds
global ranks 0..L-1 (L = P x T / nnodes), node k spawns ranks kL..kL+L-1
(`run_worker_node`), which rendezvous through torch.distributed at master_addr:master_port
and take their steps over a TCP connection to master_port + 1 instead of a pipe (the same
byte protocol: msgspec, never pickle, since the peer is on the network).
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
from pathlib import Path
from typing import Any

import msgspec

from gpu.config import ModelConfig, ModelLoadError, with_hf_overrides
from gpu.pp import DEFAULT_MICRO_BATCHES, make_stage
from gpu.tp import core_sets, free_port, init_group, pin_thread
from scheduler.config import EngineConfig, ParallelSettings
from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.executor import ThreadExecutor

log = logging.getLogger(__name__)

_STOP = b"X"
_STATS = b"?"
_STEP = b"S"
_LORA = b"L"  # an adapter loaded or unloaded while serving: ("load" | "unload", name, path)

_encode = msgspec.msgpack.Encoder().encode
_decode_msg = msgspec.msgpack.Decoder(tuple[str, Any]).decode


class Topology(msgspec.Struct, frozen=True):
    """How the ranks are laid out: T x P ranks (stage-major) over nnodes hosts."""

    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free loopback port (one host)
    timeout_s: float = 60.0
    micro_batches: int = DEFAULT_MICRO_BATCHES

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def step_port(self) -> int:
        """Where node 0 takes the other nodes' ranks' step connections."""
        return self.master_port + 1

    @classmethod
    def from_settings(cls, par: ParallelSettings, master_port: int | None = None) -> Topology:
        return cls(
            par.tensor_parallel_size, par.pipeline_parallel_size, par.nnodes, par.master_addr,
            par.master_port if master_port is None else master_port,
            par.tensor_parallel_timeout, par.pipeline_micro_batches,
        )  # fmt: skip

    def check(self) -> None:
        if self.nnodes < 1 or self.world % self.nnodes:
            raise ModelLoadError(
                f"{self.world} ranks (tensor x pipeline parallel size) do not split evenly "
                f"over --nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and not self.master_port:
            raise ModelLoadError("--nnodes > 1 needs --master-addr and --master-port")


def _backend(device: str | None) -> str:
    import torch

    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    return "nccl" if cuda else "gloo"


def _rank_device(device: str | None, rank: int) -> str | None:
    """One CUDA device per rank; CPU ranks share the device 'cpu' (on their own cores)."""
    if _backend(device) == "nccl":
        return f"cuda:{rank}"
    return device


class RunnerSpec(msgspec.Struct, frozen=True):
    """What every rank builds its runner from: the engine's whole config, and the model
    directory node 0 resolved (msgspec, so it crosses to other nodes without pickle)."""

    config: EngineConfig
    model_dir: str


def _build_runner(
    rank: int,
    local_rank: int,
    topo: Topology,
    spec: RunnerSpec,
    faults: Any,
) -> Any:
    """Join the group as `rank` and load this rank's part of the model: its tensor
    shard of its pipeline stage's layers."""
    from gpu.model_runner import ModelRunner

    device = spec.config.device.device
    port = topo.master_port
    group = init_group(
        rank, topo.world, port, _backend(device), topo.timeout_s,
        addr=topo.master_addr, local_rank=local_rank, tp_size=topo.tp_size,
    )  # fmt: skip
    tp = group if topo.tp_size > 1 else None
    # --hf-overrides' config, made here (on another node, in its own cache).
    model_dir = with_hf_overrides(Path(spec.model_dir), spec.config.model.hf_overrides)
    pp = None
    if topo.pp_size > 1:
        cfg = ModelConfig.from_dir(model_dir)
        pp = make_stage(cfg, rank, topo.pp_size, topo.tp_size, topo.micro_batches, group.device)
    config = spec.config.replace(device=_rank_device(device, local_rank))
    return ModelRunner(model_dir, config, faults=faults, tp=tp, pp=pp)


def _worker_main(
    rank: int,
    local_rank: int,
    topo: Topology,
    spec: RunnerSpec | None,
    cores: list[int] | None,
    threads: int | None,
    conn: Any,
    faults: Any,
) -> None:
    """A rank > 0: build its shard, then run every step the pipe brings until told to
    stop or until the server process goes away.  conn None / spec None: a rank
    on another node, which connects to node 0 for both first (_connect)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(f"pagestream-tp{rank}")  # so ps / top name the rank (Linux)
    remote = conn is None
    try:
        if conn is None:
            conn, spec, topo = _connect(rank, topo)
        assert spec is not None
        pin_thread(cores, threads)
        runner = _build_runner(rank, local_rank, topo, spec, faults)
    except BaseException as e:
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send_bytes(_encode(("error", f"rank {rank} failed to start: {e!r}")))
        log.error("rank %d failed to start: %r", rank, e)
        raise SystemExit(1) from e
    conn.send_bytes(_encode(("ready", runner.weight_bytes)))
    decode = msgspec.msgpack.Decoder(SchedulerOutput).decode
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            # The server is gone; nothing to clean up that matters.  A remote node's rank
            # says so in its exit code: its node exits non-zero and is restarted with
            # node 0 (a clean stop comes as _STOP instead).
            os._exit(1 if remote else 0)
        if msg == _STOP:
            break
        if msg == _STATS:
            conn.send_bytes(_encode(("stats", runner.weight_bytes)))
            continue
        if msg[:1] == _LORA:
            conn.send_bytes(_encode(("lora", _lora_op(runner, msg[1:]))))
            continue
        try:
            runner.execute_model(decode(memoryview(msg)[1:]))
        except BaseException:
            log.exception("rank %d failed a step", rank)
            # Exiting closes this rank's sockets: rank 0's collective fails at once
            # instead of waiting out the timeout.
            os._exit(1)
    import torch.distributed as dist

    dist.destroy_process_group()


def _lora_op(runner: Any, msg: bytes) -> str | None:
    """A rank's part of loading or unloading an adapter (rank 0 did its own first, so the
    request is valid): None, or why it failed here."""
    op, name, path = msgspec.msgpack.decode(msg)
    try:
        if op == "load":
            runner.add_lora(name, path)
        elif name in runner.lora.adapters:  # (one this rank failed to load is not there)
            runner.lora.unload(name)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class _Hello(msgspec.Struct, frozen=True):
    rank: int
    topology: Topology


class _Setup(msgspec.Struct, frozen=True):
    spec: RunnerSpec
    topology: Topology


def _connect(rank: int, topo: Topology) -> tuple[Any, RunnerSpec, Topology]:
    """A remote rank's step connection to node 0, retried while node 0 starts; node 0
    answers with the engine's config (one configuration, from node 0's flags)."""
    from multiprocessing.connection import Client

    deadline = time.monotonic() + topo.timeout_s + 300
    while True:
        try:
            conn = Client((topo.master_addr, topo.step_port), family="AF_INET")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    conn.send_bytes(msgspec.msgpack.encode(_Hello(rank, topo)))
    if not conn.poll(topo.timeout_s + 300):
        raise ModelLoadError("node 0 did not answer")
    setup = msgspec.msgpack.decode(conn.recv_bytes(), type=_Setup)
    mine, theirs = topo, setup.topology
    if (mine.tp_size, mine.pp_size, mine.nnodes) != (theirs.tp_size, theirs.pp_size, theirs.nnodes):
        raise ModelLoadError(
            f"this node has tensor/pipeline/nodes {mine.tp_size}/{mine.pp_size}/{mine.nnodes}, "
            f"node 0 {theirs.tp_size}/{theirs.pp_size}/{theirs.nnodes}"
        )
    return conn, setup.spec, theirs


def run_worker_node(topo: Topology, node_rank: int, threads: int | None = None) -> int:
    """A node other than 0 (`serve --node-rank k`): spawn its ranks, wait for them; an
    exit code other than 0 if one failed (the others are then killed)."""
    import signal

    topo.check()
    if not 0 < node_rank < topo.nnodes:
        raise ModelLoadError(f"--node-rank {node_rank} is not in 1..{topo.nnodes - 1}")
    ctx = mp.get_context("spawn")
    per = topo.per_node
    cores = core_sets(per) or [None] * per  # type: ignore[list-item]
    procs = []
    for local in range(per):
        rank = node_rank * per + local
        args = (rank, local, topo, None, cores[local], threads, None, None)
        p = ctx.Process(target=_worker_main, args=args, name=f"pagestream-tp{rank}", daemon=True)
        p.start()
        procs.append(p)

    def stop(_sig: int, _frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    log.info("node %d: ranks %s (pids %s)", node_rank,
             [node_rank * per + i for i in range(per)], [p.pid for p in procs])  # fmt: skip
    try:
        live = list(procs)
        while live:
            sentinel = wait_any([p.sentinel for p in live])[0]
            dead = next(p for p in live if p.sentinel == sentinel)
            dead.join(timeout=1)
            live.remove(dead)
            if dead.exitcode != 0:
                log.error("%s exited with code %s", dead.name, dead.exitcode)
                return 1
        return 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


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

    def add_lora(self, name: str, path: str, files: Any = None) -> None:
        """Load an adapter on every rank, between steps: rank 0's share first (which
        checks it), then each other rank's; one that fails leaves it loaded nowhere."""
        from gpu.lora import LoRAError

        self._runner.add_lora(name, path, files)
        errors = self._executor.lora_op("load", name, path)
        if errors:
            self._runner.lora.unload(name)
            self._executor.lora_op("unload", name, "")
            raise LoRAError(f"LoRA adapter {name!r}: a tensor-parallel rank: {errors[0]}")

    def remove_lora(self, name: str) -> None:
        self._runner.remove_lora(name)  # (refuses an adapter requests still run)
        self._executor.lora_op("unload", name, "")


class TPExecutor(ThreadExecutor):
    """N ranks (tensor x pipeline parallel, over one or more nodes); the engine talks to
    it exactly as to a ThreadExecutor."""

    def __init__(
        self, config: EngineConfig, model_dir: str | os.PathLike, *, faults: Any = None
    ) -> None:
        """Ranks laid out as config.parallel says, each building its runner from the
        whole config (RunnerSpec)."""
        par, threads = config.parallel, config.device.threads
        self.size = par.tensor_parallel_size
        self.timeout_s = par.tensor_parallel_timeout
        self._closing = False
        topo = Topology.from_settings(par, par.master_port or free_port())
        topo.check()
        self.topology = topo
        spec = RunnerSpec(config, str(model_dir))
        local = topo.per_node
        if _backend(config.device.device) == "nccl":
            import torch

            if torch.cuda.device_count() < local:
                raise ModelLoadError(
                    f"{local} tensor x pipeline parallel ranks on this node: needs {local} "
                    f"CUDA devices, {torch.cuda.device_count()} visible"
                )
        import torch.distributed as dist

        if dist.is_initialized():  # rank 0 joins this process's default group
            raise ModelLoadError(
                "this process already runs a tensor-parallel engine; shut it down first"
            )
        cores = core_sets(local) or [None] * local  # type: ignore[list-item]
        self._procs: list[Any] = []
        # Ranks 1..world-1's step connections: pipes to this node's, sockets to the others'.
        self._conns: list[Any] = [None] * (topo.world - 1)
        self._listener: Any = None
        self._remote_error: str | None = None
        if topo.nnodes > 1:
            self._listen(spec)
        for rank in range(1, local):
            # Every rank gets the fault plan: a fault that drops a request's rows on rank
            # 0 only would leave the ranks' collectives different sizes.
            self._spawn(rank, spec, cores[rank], threads, faults)

        def build() -> _Rank0Runner:
            pin_thread(cores[0], threads)
            return _Rank0Runner(_build_runner(0, 0, topo, spec, faults), self)

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagestream-exec")
        try:
            self.runner = self._start(self._pool.submit(build))
        except BaseException:
            self.shutdown(wait=False)
            raise
        log.info(
            "parallel: tensor %d x pipeline %d ranks over %d node(s) (local worker pids %s)",
            topo.tp_size, topo.pp_size, topo.nnodes, self.worker_pids,
        )  # fmt: skip

    def _listen(self, spec: RunnerSpec) -> None:
        """Take the other nodes' ranks' step connections (in a thread: rank 0's build
        waits for them inside init_process_group meanwhile)."""
        from multiprocessing.connection import Listener

        topo = self.topology
        self._listener = Listener(("0.0.0.0", topo.step_port), family="AF_INET", backlog=64)
        setup = msgspec.msgpack.encode(_Setup(spec, topo))
        remote = range(topo.per_node, topo.world)

        def accept() -> None:
            waiting = set(remote)
            while waiting:
                try:
                    conn = self._listener.accept()
                except OSError:
                    return  # closed: shutting down
                try:
                    if not conn.poll(30):
                        raise ValueError("no hello")
                    hello = msgspec.msgpack.decode(conn.recv_bytes(), type=_Hello)
                    if hello.rank not in waiting:
                        raise ValueError(f"rank {hello.rank} is not awaited")
                    conn.send_bytes(setup)
                except (ValueError, OSError, EOFError, msgspec.DecodeError) as e:
                    log.warning("refused a step connection: %s", e)
                    conn.close()
                    continue
                waiting.discard(hello.rank)
                self._conns[hello.rank - 1] = conn

        threading.Thread(target=accept, name="pagestream-tp-accept", daemon=True).start()

    def watch(self, on_failure: Callable[[BaseException], None]) -> None:
        """Call on_failure (from a watcher thread) when a rank exits while serving, so an
        idle engine fails at once instead of at its next step."""

        def watcher() -> None:
            by_sentinel = {p.sentinel: p for p in self._procs}
            per = self.topology.per_node
            # Other nodes' ranks: their step connection closing is their exit.
            remote = {id(c): (r, c) for r, c in enumerate(self._conns, 1) if r >= per and c}
            waited = [*by_sentinel, *(c for _, c in remote.values())]
            while waited:
                ready = wait_any(waited)
                if self._closing:
                    return
                for r in ready:
                    if r in by_sentinel:
                        dead = by_sentinel[r]
                        dead.join(timeout=1)  # the sentinel closes just before the status is set
                        on_failure(RuntimeError(
                            f"tensor-parallel {dead.name} (pid {dead.pid}) exited with code "
                            f"{dead.exitcode}"
                        ))  # fmt: skip
                        return
                    rank, conn = remote[id(r)]
                    if _peer_closed(conn):
                        on_failure(RuntimeError(
                            f"tensor-parallel rank {rank} (node {rank // per}) closed its "
                            "connection"
                        ))  # fmt: skip
                        return
                # A reply that a stats call is about to read: look again shortly.
                time.sleep(0.05)

        threading.Thread(target=watcher, name="pagestream-tp-watch", daemon=True).start()

    def _spawn(
        self,
        rank: int,
        spec: RunnerSpec,
        cores: list[int] | None,
        threads: int | None,
        faults: Any,
    ) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        args = (rank, rank, self.topology, spec, cores, threads, child, faults)
        p = ctx.Process(target=_worker_main, args=args, name=f"pagestream-tp{rank}", daemon=True)
        p.start()
        child.close()
        self._procs.append(p)
        self._conns[rank - 1] = parent

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
                if i not in ready and conn is not None and conn.poll():
                    try:
                        kind, value = _decode_msg(conn.recv_bytes())
                    except (EOFError, OSError):
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
        for p in self._procs:
            if not p.is_alive():
                raise RuntimeError(
                    f"tensor-parallel {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                )
        for conn in self._conns:  # a remote rank gone: its socket write fails here
            conn.send_bytes(msg)

    def rank_weight_bytes(self) -> list[int]:
        """Bytes of weights each rank holds, rank order.  Asks the workers from the
        executor thread, so the question never interleaves with a step on the pipes."""
        return self.call(self._rank_weight_bytes)

    def lora_op(self, op: str, name: str, path: str) -> list[str]:
        """Tell every other rank to load or unload an adapter (the executor thread,
        between steps: the step pipes carry nothing else meanwhile); their failures."""
        msg = _LORA + _encode((op, name, path))
        for conn in self._conns:
            conn.send_bytes(msg)
        errors = []
        for conn in self._conns:
            if not conn.poll(self.timeout_s):
                raise RuntimeError("a tensor-parallel rank did not answer")
            error = _decode_msg(conn.recv_bytes())[1]
            if error is not None:
                errors.append(error)
        return errors

    def _rank_weight_bytes(self) -> list[int]:
        out = [self.runner.weight_bytes]
        for conn in self._conns:
            conn.send_bytes(_STATS)
            if not conn.poll(self.timeout_s):
                raise RuntimeError("a tensor-parallel rank did not answer")
            out.append(_decode_msg(conn.recv_bytes())[1])
        return out

    def shutdown(self, wait: bool = True) -> None:
        """wait=True: a clean stop (every rank leaves the group).  wait=False, after a
        failure: kill the workers, which also unblocks rank 0 if it is inside a
        collective, and do not wait for the executor thread."""
        self._closing = True
        if wait:
            for conn in self._conns:
                with contextlib.suppress(OSError, AttributeError):
                    conn.send_bytes(_STOP)
            with contextlib.suppress(Exception):
                self._pool.submit(_leave_group).result(timeout=self.timeout_s)
        for p in self._procs:
            p.join(timeout=5 if wait else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        if self._listener is not None:
            self._listener.close()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if wait:  # the other ranks' memory went with their processes; rank 0's is here
            self._release_runner()
        else:
            _leave_group()


def _peer_closed(conn: Any) -> bool:
    """Whether a readable step connection's peer has closed it (rather than sent bytes
    that a reader will take)."""
    import socket

    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        s.setblocking(False)
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.close()


def _leave_group() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
