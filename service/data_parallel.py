"""Data parallelism (`serve --data-parallel-size N`, vLLM's flag): N whole engines, each in
its own process (service/engine_proc.py) on its own cores or GPU, behind one API server.

The server sees one engine core (`DataParallelCore`, ProcessCore's face) and this core
sends each request group to one rank:

- a conversation (a WebSocket session's or a Responses chain's key) stays on the rank it
  first went to, where its KV is pinned;
- otherwise the rank whose recently routed prompts share the longest run of leading KV
  blocks with this one (SGLang's cache-aware routing, on the block hashes the ranks' own
  prefix caches key by), where that run is at least `CACHE_SHARE` of the prompt and the
  rank is not loaded past the least-loaded one by more than `BALANCE_SLACK` requests;
- else the least-loaded rank (ties in turn).

Load is what vLLM's DP coordinator weighs: requests waiting x 4 + in flight, here read at
once from the ranks' own counts (no stats round trip).  A rank that dies fails the whole
engine, as in vLLM: the server answers 503 and exits for its supervisor to restart it.
Metrics and /debug/state add the ranks up; runtime LoRA loads go to every rank."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.config import ConfigError, EngineConfig
from scheduler.engine_core import DuplicateRequestId, EngineCore, EngineDeadError
from scheduler.request import Request
from scheduler.scheduler import check_group
from scheduler.stream import RequestStream
from service.engine_proc import EngineProcessError, ProcessCore

if TYPE_CHECKING:
    from scheduler.engine_core import StepInfo
    from scheduler.scheduler_types import SchedulerStats

# service.async_engine.AsyncEngine, which imports this module: named, not imported.
AsyncEngine = Any

log = logging.getLogger(__name__)

# A rank whose prompts share a prefix with the request takes it unless it carries more
# than this many requests beyond the least-loaded rank (then spreading the load is worth
# more than the cached prefix: SGLang's router uses the same kind of bound).
BALANCE_SLACK = 8
# The share of a prompt a rank must hold cached for the prompt to go there regardless of
# load (SGLang's router's cache_threshold).
CACHE_SHARE = 0.5
# Leading blocks of a prompt hashed for routing: a longer shared prefix than this is not
# told apart (4,096 tokens at block size 16), and routing stays well under a millisecond.
ROUTE_BLOCKS = 256
# Conversations remembered (key -> rank) past their release; the oldest go first.
MAX_CONVERSATIONS = 65536


def rank_builder(
    rank: int,
    cores: list[int] | None,
    device: str | None,
    builder: Callable[[EngineConfig], AsyncEngine],
    config: EngineConfig,
) -> AsyncEngine:
    """What a rank's process runs to build its engine: pinned to its own cores (on CPU)
    or GPU, then built as one engine is (pickled by name with its arguments).  Its log
    lines say which rank wrote them."""
    fmt = f"%(asctime)s %(levelname)s %(name)s [engine {rank}]: %(message)s"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(fmt))
    kw: dict[str, Any] = {}
    if cores:
        # The calling thread, before the executor's thread and torch's OpenMP team exist:
        # they inherit it.
        os.sched_setaffinity(0, cores)
        kw["threads"] = config.device.threads or len(cores)
    if device is not None:
        kw["device"] = device
    return builder(config.replace(**kw) if kw else config)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[list[int]]:
    """The host's NUMA nodes' CPUs (Linux sysfs), in node order; [] where it says none."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            text = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        cpus: list[int] = []
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        nodes.append(cpus)
    return nodes


def core_split(cores: list[int], nodes: list[list[int]], size: int) -> list[list[int]] | None:
    """Disjoint core sets for `size` ranks out of the allowed `cores`: whole NUMA nodes
    each where the nodes divide among the ranks (a rank then reads only its own socket's
    memory, as vLLM's CPU backend binds a DP rank to a node), else cores / size each in
    order; None when there are fewer cores than ranks."""
    allowed = set(cores)
    nodes = [c for c in ([x for x in n if x in allowed] for n in nodes) if c]
    if len(nodes) >= size and len(nodes) % size == 0:
        per = len(nodes) // size
        return [sorted(x for n in nodes[r * per : (r + 1) * per] for x in n) for r in range(size)]
    if len(cores) < size:
        return None
    per = len(cores) // size
    return [cores[r * per : (r + 1) * per] for r in range(size)]


def rank_placement(config: EngineConfig, size: int) -> list[tuple[list[int] | None, str | None]]:
    """(cores, device) of each rank: disjoint core sets on CPU (core_split; all cores
    shared when there are fewer cores than ranks), `cuda:r` on CUDA (N GPUs needed)."""
    device = config.device.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < size:
            raise ConfigError(
                f"data_parallel_size (--data-parallel-size): {size} ranks need {size} GPUs, "
                f"{torch.cuda.device_count()} are visible"
            )
        return [(None, f"cuda:{r}") for r in range(size)]
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return [(None, None)] * size
    split = core_split(cores, numa_nodes(), size)
    if split is None:
        log.warning("%d data-parallel ranks share %d cores", size, len(cores))
        return [(None, None)] * size
    return [(c, None) for c in split]


def block_hashes(ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """Chained hashes of the prompt's leading full blocks (ROUTE_BLOCKS at most): equal
    lists mean an equal prefix, as the ranks' prefix caches see it (the salt too)."""
    out: list[int] = []
    h = hash(salt)
    end = min(len(ids) // block_size, ROUTE_BLOCKS) * block_size
    for i in range(0, end, block_size):
        h = hash((h, *ids[i : i + block_size]))
        out.append(h)
    return out


class _PrefixIndex:
    """The block hashes of the prompts routed to one rank, least recently routed first,
    bounded by the rank's KV blocks (what it could still hold)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, ROUTE_BLOCKS)
        self.seen: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.seen:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        seen = self.seen
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


class _AllIdle:
    """core.idle for the server's memory trimmer: idle when every rank is."""

    def __init__(self, ranks: list[ProcessCore]) -> None:
        self._ranks = ranks

    def is_set(self) -> bool:
        return all(r.idle.is_set() for r in self._ranks)


class _TierSum:
    """The shared prefix tier as the server's metrics read it: every rank has its own
    connections to it; their counters added, healthy while all are."""

    def __init__(self, ranks: list[ProcessCore]) -> None:
        self._tiers = [r.tier for r in ranks if r.tier is not None]
        self.name = self._tiers[0].name

    @property
    def stats(self) -> Any:
        first = self._tiers[0].stats
        return replace(first, **{f.name: sum(getattr(t.stats, f.name) for t in self._tiers)
                                 for f in fields(first)})  # fmt: skip

    @property
    def healthy(self) -> bool:
        return all(t.healthy for t in self._tiers)


def _add_stats(all_stats: list[SchedulerStats]) -> SchedulerStats:
    """One SchedulerStats for the ranks: counts and counters added, KV usage averaged
    (the ranks' pools are alike)."""

    def add(objs: list[Any]) -> Any:
        first = objs[0]
        out = {}
        for f in fields(first):
            vals = [getattr(o, f.name) for o in objs]
            v0 = vals[0]
            if isinstance(v0, bool) or v0 is None:
                out[f.name] = v0
            elif isinstance(v0, int | float):
                out[f.name] = sum(vals)
            elif isinstance(v0, list):  # a counter per position
                width = max(len(v) for v in vals)
                out[f.name] = [sum(v[i] for v in vals if i < len(v)) for i in range(width)]
            elif isinstance(v0, dict):
                out[f.name] = {k: sum(v.get(k, 0) for v in vals) for k in set().union(*vals)}
            elif all(v is not None for v in vals):
                out[f.name] = add(vals)
            else:
                out[f.name] = next((v for v in vals if v is not None), None)
        return replace(first, **out)

    total = add(all_stats)
    total.kv_usage = sum(s.kv_usage for s in all_stats) / len(all_stats)
    return total


class DataParallelCore:
    """N ProcessCores behind the interface AsyncEngine and the server use of one."""

    own_thread = False
    admit = EngineCore.admit
    _admit_tenant = EngineCore._admit_tenant
    run_guarded = EngineCore.run_guarded

    def __init__(self, config: EngineConfig, ranks: list[ProcessCore]) -> None:
        self.ranks = ranks
        self.size = len(ranks)
        f0 = ranks[0].facts
        # The first rank's facts, with the KV capacity of all (metrics, /debug/state).
        self.facts = {**f0, "num_kv_blocks": sum(r.facts["num_kv_blocks"] for r in ranks)}
        self.async_scheduling = ranks[0].async_scheduling
        self.block_size = int(f0["block_size"])
        s = config.scheduler
        # The waiting bounds are each rank's; the server as a whole holds N times them,
        # checked here alone (a multi-prompt request is admitted whole, before any of its
        # prompts is routed): the ranks' own checks are off.
        n = self.size
        for r in ranks:
            r.max_waiting_requests = r.max_waiting_tokens = r.max_waiting_per_tenant = None
        self.max_waiting_requests = s.max_waiting_requests and s.max_waiting_requests * n
        self.max_waiting_tokens = s.max_waiting_tokens and s.max_waiting_tokens * n
        self.max_waiting_per_tenant = s.max_waiting_per_key and s.max_waiting_per_key * n
        self.num_rejected = 0
        self.hook_errors: dict[str, int] = {}  # this process's, the ranks' views' too
        for r in ranks:
            r.hook_errors = self.hook_errors
        self.child_hook_errors: dict[str, int] = {}
        self.idle = _AllIdle(ranks)
        self.tier = _TierSum(ranks) if ranks[0].tier is not None else None
        self.dead: BaseException | None = None
        self._task: asyncio.Future[None] | None = None
        self._index = [_PrefixIndex(int(r.facts["num_kv_blocks"])) for r in ranks]
        self._conversations: OrderedDict[str, int] = OrderedDict()
        self.routed = [0] * n  # request groups sent to each rank (tests, /debug/state)
        # Requests a cached prefix drew away from the least-loaded rank (/debug/state).
        self.routed_by_prefix = 0
        # Each rank's stats as of the last /metrics scrape (its per-rank gauges).
        self.rank_stats: list[SchedulerStats] = []
        self._turn = 0  # the rank a tie goes to next

    # ------------------------------------------------------------ start-up
    @classmethod
    def spawn(
        cls, config: EngineConfig, builder: Callable[[EngineConfig], AsyncEngine]
    ) -> DataParallelCore:
        """Start every rank's process and wait until all are built (at once: each loads
        its own copy of the model); one that fails stops the others."""
        size = config.parallel.data_parallel_size
        places = rank_placement(config, size)

        def start(rank: int) -> ProcessCore:
            cores, device = places[rank]
            b = functools.partial(rank_builder, rank, cores, device, builder)
            return ProcessCore.spawn(config, b)

        with ThreadPoolExecutor(size, thread_name_prefix="pagestream-dp-spawn") as pool:
            futures = [pool.submit(start, r) for r in range(size)]
            ranks, errors = [], []
            for r, fut in enumerate(futures):
                try:
                    ranks.append(fut.result())
                except BaseException as e:
                    errors.append(f"rank {r}: {e}")
        if errors:
            for core in ranks:
                core.kill()
            raise EngineProcessError("data parallel: " + "; ".join(errors))
        log.info("data parallel: %d engine processes ready", size)
        return cls(config, ranks)

    def start(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self._task = loop.create_future()
        for i, r in enumerate(self.ranks):
            r.start().add_done_callback(functools.partial(self._rank_done, i))
        return self._task

    async def connect(self) -> None:
        await asyncio.gather(*(r.connect() for r in self.ranks))

    def _rank_done(self, i: int, fut: asyncio.Future[None]) -> None:
        e = None if fut.cancelled() else fut.exception()
        if e is not None and self.dead is None:
            self.dead = e
            why = EngineProcessError(f"data-parallel rank {i} failed: {e}")
            for j, r in enumerate(self.ranks):  # the server goes down whole, as vLLM's
                if j != i and r.dead is None:
                    r._die(why)
            if self._task is not None and not self._task.done():
                self._task.set_exception(e)
        elif (
            self._task is not None
            and not self._task.done()
            and all(r._task is not None and r._task.done() for r in self.ranks)
        ):
            self._task.set_result(None)

    @property
    def on_step(self) -> Callable[[StepInfo], None] | None:
        return self.ranks[0].on_step

    @on_step.setter
    def on_step(self, hook: Callable[[StepInfo], None] | None) -> None:
        for r in self.ranks:
            r.on_step = hook

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.ranks)

    @property
    def streams(self) -> dict[str, RequestStream]:
        out: dict[str, RequestStream] = {}
        for r in self.ranks:
            out.update(r.streams)
        return out

    @property
    def _inbox(self) -> dict[int, Any]:  # /debug/state's server_inbox: adds not yet taken
        out: dict[int, Any] = {}
        for i, r in enumerate(self.ranks):
            out.update({(i, sid): v for sid, v in r._inbox.items()})  # type: ignore[misc]
        return out

    # ------------------------------------------------------------ requests
    def _check_id(self, group: list[Request]) -> None:
        """The id free on every rank: a rank checks only its own streams."""
        gid = group[0].group_id
        if any(gid in r.streams for r in self.ranks):
            raise DuplicateRequestId(f"request id {gid!r} is already in use")

    def validate(self, group: list[Request]) -> None:
        self._check_id(group)
        check_group(group, self.facts["max_model_len"], self.facts["max_num_seqs"])

    def queued(self) -> tuple[int, int]:
        seqs = tokens = 0
        for r in self.ranks:
            s, t = r.queued()
            seqs, tokens = seqs + s, tokens + t
        return seqs, tokens

    def tenant_queued(self, tenant: str) -> int:
        return sum(r.tenant_queued(tenant) for r in self.ranks)

    def load(self, i: int) -> int:
        r = self.ranks[i]
        return 4 * r.queued()[0] + len(r.streams)

    def _least(self, loads: list[int]) -> int:
        """The least-loaded rank; ties in turn (round robin), so one-at-a-time traffic
        alternates: both ranks' caches warm, and neither idles when the load comes."""
        n = self.size
        order = [(self._turn + k) % n for k in range(n)]
        return min(order, key=loads.__getitem__)

    def route(self, group: list[Request]) -> tuple[int, list[int]]:
        """The rank for a group, and its prompt's block hashes (to remember there)."""
        p = group[0]
        hashes = block_hashes(p.token_ids, self.block_size, p.cache_salt)
        if p.conversation is not None:
            rank = self._conversations.get(p.conversation)
            if rank is not None:
                self._conversations.move_to_end(p.conversation)
                return rank, hashes
        loads = [self.load(i) for i in range(self.size)]
        least = self._least(loads)
        rank = least
        if hashes:
            matches = [ix.match(hashes) for ix in self._index]
            best = max(range(self.size), key=lambda i: (matches[i], -loads[i]))
            # Only where most of the prompt is cached there: a short system prompt that
            # every request shares would otherwise draw them all to one rank (both ranks
            # cache it after one miss each).
            routed_len = min(len(p.token_ids), ROUTE_BLOCKS * self.block_size)
            share = matches[best] * self.block_size / routed_len
            if share >= CACHE_SHARE and loads[best] - loads[least] <= BALANCE_SLACK:
                rank = best
                self.routed_by_prefix += best != least
        if p.conversation is not None:
            self._conversations[p.conversation] = rank
            while len(self._conversations) > MAX_CONVERSATIONS:
                self._conversations.popitem(last=False)
        return rank, hashes

    def add(self, group: list[Request], wake_on_tokens: bool = True) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        self._check_id(group)  # (the rank's add checks the group itself)
        self.admit([group])
        rank, hashes = self.route(group)
        stream = self.ranks[rank].add(group, wake_on_tokens)
        self._index[rank].add(hashes)
        self.routed[rank] += 1
        self._turn = (rank + 1) % self.size
        return stream

    def _rank_of(self, group_id: str) -> ProcessCore | None:
        for r in self.ranks:
            if group_id in r.streams:
                return r
        return None

    def abort(self, group_id: str, stream: RequestStream | None = None) -> None:
        r = self._rank_of(group_id)
        if r is not None:
            r.abort(group_id, stream)
        elif stream is None:  # not (or no longer) here: any rank may still hold it
            for r in self.ranks:
                r.abort(group_id)

    def finish_sequence(self, req_id: str) -> None:
        gid = req_id if self._rank_of(req_id) else req_id.rpartition("#")[0]
        r = self._rank_of(gid)
        if r is not None:
            r.finish_sequence(req_id)

    def release_conversation(self, key: str) -> None:
        rank = self._conversations.get(key)
        if rank is not None:
            self.ranks[rank].release_conversation(key)
        else:
            for r in self.ranks:
                r.release_conversation(key)

    def post(self, msg: Any) -> None:
        raise NotImplementedError("the engines run in other processes")

    call_in_loop = ProcessCore.call_in_loop

    async def query(self, what: str, *args: str | float) -> Any:
        """Every rank's answer to the query, combined: stats added, LoRA loads on all."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        results = await asyncio.gather(
            *(r.query(what, *args) for r in self.ranks), return_exceptions=True
        )
        failed = [e for e in results if isinstance(e, BaseException)]
        if what == "load_lora" and failed:
            # All or none: a rank that loaded it unloads it again.
            for r, res in zip(self.ranks, results, strict=True):
                if not isinstance(res, BaseException):
                    with contextlib.suppress(Exception):
                        await r.query("unload_lora", args[0], 30.0)
        if failed:
            raise failed[0]
        if what == "stats_for_server":
            hooks: dict[str, int] = {}
            for _, _, h in results:
                for k, v in h.items():
                    hooks[k] = hooks.get(k, 0) + v
            self.rank_stats = [s for s, _, _ in results]
            stats = _add_stats(self.rank_stats)
            return stats, sum(u for _, u, _ in results), hooks
        if what == "debug_counts":
            total: dict[str, Any] = {}
            for counts in results:
                for k, v in counts.items():
                    if isinstance(v, int) and not isinstance(v, bool):
                        total[k] = total.get(k, 0) + v
                    elif isinstance(v, dict):
                        d = total.setdefault(k, {})
                        for kk, vv in v.items():
                            d[kk] = d.get(kk, 0) + vv
                    else:
                        total.setdefault(k, v)
            total["data_parallel_routed_by_prefix"] = self.routed_by_prefix
            dead = [c["engine_dead"] for c in results if c.get("engine_dead")]
            total["engine_dead"] = dead[0] if dead else None
            total["data_parallel_ranks"] = [
                {"routed": self.routed[i], "running": c["running"], "waiting": c["waiting"],
                 "kv_blocks_used": c["kv_blocks_used"], "conversation_pins":
                 c["conversation_pins"], "pid": self.ranks[i].pid}
                for i, c in enumerate(results)
            ]  # fmt: skip
            return total
        return results[0]

    # ------------------------------------------------------------ shutdown
    async def stop(self, finally_in_loop: Callable[[], Any] | None = None) -> None:
        await asyncio.gather(*(r.stop() for r in self.ranks), return_exceptions=True)
        if finally_in_loop is not None:
            await self.call_in_loop(finally_in_loop)

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()
