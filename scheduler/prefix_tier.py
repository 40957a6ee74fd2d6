"""The shared prefix tier: an index of prefix-block hashes and the KV bytes of hot blocks,
kept in Redis (shared by every replica) or in process memory.

The engine asks it, when a request arrives, for KV of the prompt blocks it does not hold
locally; it answers under a deadline, and the request waits (without holding up anyone
else) until the answer comes.  Full blocks are published to it in batches, off the step
path.  Whatever goes wrong here (Redis down, slow, flushed, garbage under our keys) only
costs recomputation: a payload that fails its checks is dropped, the tier backs off and
reconnects, and requests never fail because of it.

Redis key schema, under a namespace `pagestream:<fingerprint>` that fingerprints the
model weights, dtype, block size and tokenizer (so incompatible caches never mix):

    <ns>:meta           HASH   what the namespace holds (model, dtype, block size, ...)
    <ns>:kv:<hash>      STRING KV payload of a hot block (header + bytes); TTL
    <ns>:kvlru          ZSET   payload keys by last use, to enforce the byte cap
    <ns>:tenant:<t>     ZSET   payload keys tenant <t> published, by publication time

Per-tenant share (`TierConfig.tenant_share`, `--prefix-tier-key-share`): without one, a
single API key that publishes many distinct prefixes pushes every other key's out of the
tier's LRU.  Each publication carries its tenant (a one-way hash of the API key, never
the key; None for unkeyed traffic, which no share applies to), and each tenant may hold
at most `tenant_share x max_kv_bytes` of the tier (payloads are all one size, so that is
a count of entries).  A publication past a tenant's share evicts *that tenant's own*
oldest publications first, never another's; the tier-wide LRU cap still applies on top.
The count lives in the store (Redis), so the share holds across every replica.  A
tenant's set may keep members whose payloads the global LRU or a TTL already removed:
they only make its live share smaller, and as its oldest they are the first it pops.

There is no separate index of which replica caches which block: the payload keys are the
index a look-up needs (EXISTS on the chain), and routing is the balancer's consistent
hash.  An index written on every block event was most of all Redis commands and nothing
read it (docs/DEPLOY.md, "Key schema").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.block_pool import BlockHash

log = logging.getLogger(__name__)

_MAGIC = b"PSKV"
_VERSION = 1
# magic, version, payload length, blake2b-16 of the payload
_HEADER = struct.Struct("<4sHQ16s")


def encode_payload(data: bytes) -> bytes:
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return _HEADER.pack(_MAGIC, _VERSION, len(data), digest) + data


def decode_payload(blob: bytes | None, expected_len: int) -> bytes | None:
    """The payload if the blob is intact and of the expected size, else None."""
    if blob is None or len(blob) != _HEADER.size + expected_len:
        return None
    magic, version, length, digest = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != _VERSION or length != expected_len:
        return None
    data = blob[_HEADER.size :]
    if hashlib.blake2b(data, digest_size=16).digest() != digest:
        return None
    return data


@dataclass
class TierConfig:
    namespace: str
    payload_bytes: int  # exact size of one block's KV payload
    lookup_deadline: float = 1.0  # seconds a look-up may take before we give up
    hit_threshold: int = 1  # local hits before a block's KV is published
    max_kv_bytes: int = 1 << 30  # cap on payload bytes this namespace keeps
    # Fraction of max_kv_bytes one tenant's publications may hold (1.0: no share).
    tenant_share: float = 1.0
    ttl_seconds: int = 24 * 3600
    max_lookup_blocks: int = 512
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class TierStats:
    lookups: int = 0
    lookup_blocks_hit: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    blocks_published: int = 0
    bytes_published: int = 0
    errors: int = 0
    bad_payloads: int = 0
    timeouts: int = 0


def tenant_limit(cfg: TierConfig) -> int | None:
    """Most payloads one tenant may hold in the tier (None: no share applies)."""
    if cfg.tenant_share >= 1.0:
        return None
    entries = max(1, cfg.max_kv_bytes // (cfg.payload_bytes + _HEADER.size))
    return max(1, int(entries * cfg.tenant_share))


class KVStore(Protocol):
    """Where the tier keeps its index and payloads."""

    async def get_payloads(self, hashes: Sequence[BlockHash]) -> list[bytes | None]: ...
    async def put_payloads(
        self, items: Sequence[tuple[BlockHash, bytes]], tenant: str | None = None
    ) -> None: ...
    async def ping(self) -> None: ...
    async def close(self) -> None: ...


class MemoryStore:
    """In-process store with the Redis store's semantics (bounded, LRU).  Engines in one
    process that share a namespace share it, like replicas sharing a Redis."""

    _shared: dict[str, MemoryStore] = {}  # noqa: RUF012 (a process-wide registry)

    def __init__(self, cfg: TierConfig) -> None:
        self.cfg = cfg
        self.payloads: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.bytes = 0
        # Each tenant's publications, oldest first (see "Per-tenant share" above).
        self.tenants: dict[str, OrderedDict[BlockHash, None]] = {}
        self.tenant_max = tenant_limit(cfg)

    @classmethod
    def for_namespace(cls, cfg: TierConfig) -> MemoryStore:
        store = cls._shared.get(cfg.namespace)
        if store is None:
            store = cls._shared[cfg.namespace] = cls(cfg)
        return store

    async def get_payloads(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out = []
        for h in hashes:
            blob = self.payloads.get(h)
            if blob is not None:
                self.payloads.move_to_end(h)
            out.append(blob)
        return out

    async def put_payloads(
        self, items: Sequence[tuple[BlockHash, bytes]], tenant: str | None = None
    ) -> None:
        for h, blob in items:
            old = self.payloads.pop(h, None)
            self.bytes -= len(old) if old else 0
            self.payloads[h] = blob
            self.bytes += len(blob)
        if tenant is not None and self.tenant_max is not None:
            own = self.tenants.setdefault(tenant, OrderedDict())
            for h, _ in items:
                own[h] = None
                own.move_to_end(h)
            while len(own) > self.tenant_max:
                h, _ = own.popitem(last=False)
                old = self.payloads.pop(h, None)
                self.bytes -= len(old) if old else 0
        while self.bytes > self.cfg.max_kv_bytes and self.payloads:
            _, blob = self.payloads.popitem(last=False)
            self.bytes -= len(blob)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisStore:
    """The shared store: pipelined commands on one redis.asyncio client."""

    def __init__(self, url: str, cfg: TierConfig) -> None:
        import redis.asyncio as aioredis

        self.cfg = cfg
        self.ns = cfg.namespace
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=max(cfg.lookup_deadline, 1.0), socket_connect_timeout=2.0
        )
        self._meta_written = False
        self._max_entries = max(1, cfg.max_kv_bytes // (cfg.payload_bytes + _HEADER.size))
        self._tenant_max = tenant_limit(cfg)

    def _kv(self, h: BlockHash) -> str:
        return f"{self.ns}:kv:{h.hex()}"

    async def get_payloads(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        if not hashes:
            return []
        # Round trip 1: which payloads exist (and refresh their LRU score: ZADD XX only
        # touches members that are there).  Round trips 2..: fetch the leading run in
        # chunks, so one look-up never pulls an unbounded reply.
        now = time.time()
        lru = f"{self.ns}:kvlru"
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self._kv(h))
        for h in hashes:
            pipe.zadd(lru, {h.hex(): now}, xx=True)
        present = (await pipe.execute())[: len(hashes)]
        n = 0
        while n < len(hashes) and present[n]:
            n += 1
        out: list[bytes | None] = []
        for i in range(0, n, 32):
            out += await self.client.mget([self._kv(h) for h in hashes[i : min(n, i + 32)]])
        return out + [None] * (len(hashes) - len(out))

    async def put_payloads(
        self, items: Sequence[tuple[BlockHash, bytes]], tenant: str | None = None
    ) -> None:
        if not items:
            return
        ttl = self.cfg.ttl_seconds
        now = time.time()
        lru = f"{self.ns}:kvlru"
        own = f"{self.ns}:tenant:{tenant}" if tenant and self._tenant_max else None
        pipe = self.client.pipeline(transaction=False)
        if not self._meta_written:
            pipe.hset(f"{self.ns}:meta", mapping=self.cfg.meta or {"created": str(now)})
            self._meta_written = True
        for h, blob in items:
            pipe.set(self._kv(h), blob, ex=ttl)
            pipe.zadd(lru, {h.hex(): now})
        if own is not None:
            pipe.zadd(own, {h.hex(): now for h, _ in items})
            pipe.expire(own, ttl)
            pipe.zcard(own)
        pipe.expire(lru, ttl)
        pipe.zcard(lru)
        res = await pipe.execute()
        if own is not None and self._tenant_max is not None:
            over = int(res[-3]) - self._tenant_max
            if over > 0:
                # Past the tenant's share: drop its own oldest publications, no one else's.
                oldest = [m.decode() for m, _ in await self.client.zpopmin(own, over)]
                if oldest:
                    pipe = self.client.pipeline(transaction=False)
                    pipe.delete(*[f"{self.ns}:kv:{m}" for m in oldest])
                    pipe.zrem(lru, *oldest)
                    pipe.zcard(lru)
                    res = await pipe.execute()
        excess = int(res[-1]) - self._max_entries
        if excess > 0:
            # Over the byte cap: drop the least recently used payloads.
            oldest = await self.client.zpopmin(lru, excess)
            if oldest:
                await self.client.delete(*[f"{self.ns}:kv:{m.decode()}" for m, _ in oldest])

    async def ping(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()


class PrefixTier:
    """The prefix-tier actor: batches publications, answers look-ups under a deadline, and degrades to doing nothing while its store is unreachable."""

    def __init__(self, store: KVStore, cfg: TierConfig, name: str = "redis") -> None:
        self.store = store
        self.cfg = cfg
        self.name = name
        self.stats = TierStats()
        self._publish: list[tuple[BlockHash, bytes, str | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.healthy = True
        self._retry_at = 0.0
        self._backoff = 0.5
        self._warned = False
        # Hashes this replica already published (bounded), so hot blocks go out once.
        self.published: OrderedDict[BlockHash, None] = OrderedDict()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._writer(), name=f"prefix-tier-{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.store.close()

    # ---------------------------------------------------------------- health
    @property
    def available(self) -> bool:
        return self.healthy or time.monotonic() >= self._retry_at

    def _failed(self, what: str, e: BaseException) -> None:
        self.stats.errors += 1
        if self.healthy or not self._warned:
            log.warning(
                "prefix tier %s: %s failed (%s); caching locally only, retrying in %.1fs",
                self.name, what, e, self._backoff,
            )  # fmt: skip
            self._warned = True
        self.healthy = False
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 30.0)

    def _succeeded(self) -> None:
        if not self.healthy:
            log.warning("prefix tier %s: reachable again", self.name)
        self.healthy = True
        self._warned = False
        self._backoff = 0.5

    # ---------------------------------------------------------------- engine side
    def should_publish(self, h: BlockHash) -> bool:
        return self.available and h not in self.published

    def publish(
        self, items: Sequence[tuple[BlockHash, bytes] | tuple[BlockHash, bytes, str | None]]
    ) -> None:
        """Queue KV payloads of full blocks, each (hash, payload[, tenant]); written by the
        actor, never on the step path.  A tenant's publications count against its share."""
        for item in items:
            h, data = item[0], item[1]
            if h in self.published:
                continue
            self.published[h] = None
            if len(self.published) > 65536:
                self.published.popitem(last=False)
            self._publish.append((h, data, item[2] if len(item) > 2 else None))
        self._wake.set()

    async def lookup(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the longest leading run of `hashes` the tier holds intact."""
        hashes = list(hashes)[: self.cfg.max_lookup_blocks]
        if not hashes or not self.available:
            return []
        self.stats.lookups += 1
        try:
            blobs = await asyncio.wait_for(
                self.store.get_payloads(hashes), self.cfg.lookup_deadline
            )
        except TimeoutError as e:
            self.stats.timeouts += 1
            self._failed("look-up (deadline)", e)
            return []
        except Exception as e:
            self._failed("look-up", e)
            return []
        self._succeeded()
        out: list[bytes] = []
        for blob in blobs:
            data = decode_payload(blob, self.cfg.payload_bytes)
            if data is None:
                if blob is not None:
                    self.stats.bad_payloads += 1
                    log.warning("prefix tier %s: dropped a corrupt KV payload", self.name)
                break
            out.append(data)
        self.stats.lookup_blocks_hit += len(out)
        return out

    # ---------------------------------------------------------------- actor loop
    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Let a burst of events pile up into one pipeline.
            await asyncio.sleep(0.002)
            publish, self._publish = self._publish, []
            if not self.available:
                # Unreachable: drop what accumulated (it is only cache metadata) and wait.
                for h, _, _ in publish:
                    self.published.pop(h, None)
                continue
            if not publish:
                continue
            by_tenant: dict[str | None, list[tuple[BlockHash, bytes]]] = {}
            for h, d, tenant in publish:
                by_tenant.setdefault(tenant, []).append((h, d))
            try:
                for tenant, items in by_tenant.items():
                    blobs = [(h, encode_payload(d)) for h, d in items]
                    await self.store.put_payloads(blobs, tenant)
                    self.stats.blocks_published += len(blobs)
                    self.stats.bytes_published += sum(len(d) for _, d in items)
                self._succeeded()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                for h, _, _ in publish:
                    self.published.pop(h, None)
                self._failed("write", e)


def make_store(url: str, cfg: TierConfig) -> tuple[KVStore, str]:
    """`memory://` for the in-process store, `redis://` / `rediss://` / `unix://` for Redis."""
    if url.startswith("memory://"):
        return MemoryStore.for_namespace(cfg), "memory"
    return RedisStore(url, cfg), "redis"
