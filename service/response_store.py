"""Where /v1/responses keeps stored responses (service/openai_responses.py): in this
process (`ResponseStore`), or in Redis (`RedisResponseStore`), where every replica of a
fleet reads what any of them stored, so a `previous_response_id` chain survives the
balancer sending a turn elsewhere, a replica restarting, and a rolling deploy.

Both keep responses per API key (its tenant id: a one-way hash of the key, the same on
every replica), within a count and a byte bound in all, and evict alike: past a bound, the
key holding the most (its larger share of either bound; ties to the smaller tenant id)
loses its least recently used response.  A key that floods the store evicts its own.

Redis key schema (under `ps:responses`; stored text does not depend on the model, so
every model a fleet serves shares it):

    <ns>:clock          STRING  a counter: the order of puts and reads (LRU), fleet-wide
    <ns>:total          HASH    count, bytes
    <ns>:tc / <ns>:tb   HASH    tenant -> its count / its bytes
    <ns>:lru:<t>        ZSET    tenant t's response ids by last use (the clock)
    <ns>:size:<t>       HASH    tenant t's response id -> its entry's bytes
    <ns>:ver:<t>        HASH    tenant t's response id -> its version (puts so far)
    <ns>:r:<t>:<id>     STRING  the entry (msgpack: response, conversation, chain root)
    <ns>:hb:<t>:<id>    STRING  a running background response's heartbeat (expires)

Every operation is one Lua script (one round trip, atomic across replicas).  An entry
whose bytes Redis itself dropped (maxmemory, FLUSHDB of one key) reads as absent and is
dropped from the accounting when it comes up for eviction."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from service.protocol import ChatMessage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]  # as served
    # The conversation through this turn, instructions left out: what a turn continuing
    # it starts from.  In memory, earlier turns' messages are shared with their entries.
    messages: list[ChatMessage]
    root: str  # the chain's first response id: its KV pin's key
    # Bytes this entry adds: in memory its own messages and response (not shared ones);
    # in Redis its whole encoded entry (the store measures it).
    size: int
    # How many times this id was put: `put(expect=...)` writes only over the version it
    # read (a conversation's items are read, extended and written back).
    version: int = 0


class StoreUnavailable(Exception):
    """The store did not answer (Redis down or slow)."""


class StoreConflict(Exception):
    """`put(expect=v)` found another version: someone wrote the entry since it was read."""


class ResponseStoreBase(Protocol):
    max_responses: int
    max_bytes: int
    shared: bool  # other replicas read and write it too
    errors: dict[str, int]  # failed calls by operation (get, put, delete)

    @property
    def enabled(self) -> bool: ...

    async def get(self, tenant: str | None, rid: str) -> Stored | None: ...

    async def put(
        self, tenant: str | None, rid: str, item: Stored, expect: int | None = None
    ) -> bool: ...

    async def delete(self, tenant: str | None, rid: str) -> bool: ...

    async def beat(self, tenant: str | None, rid: str, ttl: float) -> None: ...

    async def alive(self, tenant: str | None, rid: str) -> bool: ...

    async def close(self) -> None: ...


class _Shelf:
    """One API key's stored responses, least recently used first."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0


def _tenant(tenant: str | None) -> str:
    # Tenant ids are "t" + hex (service/security.py); unkeyed traffic is "-".
    return tenant or "-"


class ResponseStore:
    """Stored responses in this process."""

    shared = False

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self.count = 0
        self._shelves: dict[str, _Shelf] = {}
        self.errors: dict[str, int] = {}  # (nothing here fails)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return self.count

    async def get(self, tenant: str | None, rid: str) -> Stored | None:
        shelf = self._shelves.get(_tenant(tenant))
        item = shelf.items.get(rid) if shelf is not None else None
        if item is not None:
            shelf.items.move_to_end(rid)  # type: ignore[union-attr]
        return item

    async def put(
        self, tenant: str | None, rid: str, item: Stored, expect: int | None = None
    ) -> bool:
        """Keep `item` (False: the store is off or it is larger than the whole store);
        with `expect`, only over that version of the entry (0: none), else StoreConflict."""
        t = _tenant(tenant)
        shelf = self._shelves.get(t)
        old = shelf.items.get(rid) if shelf is not None else None
        version = old.version if old is not None else 0
        if expect is not None and expect != version:
            raise StoreConflict(rid)
        if not self.enabled or item.size > self.max_bytes:
            return False
        self._drop(t, rid)
        item.version = version + 1
        shelf = self._shelves.setdefault(t, _Shelf())
        shelf.items[rid] = item
        shelf.bytes += item.size
        self.bytes += item.size
        self.count += 1
        while self.count > self.max_responses or self.bytes > self.max_bytes:
            key = min(self._shelves, key=lambda k: (-self._load(self._shelves[k]), k))
            self._drop(key, next(iter(self._shelves[key].items)))
        kept = self._shelves.get(t)
        return kept is not None and rid in kept.items  # (it may have been the one to go)

    def _load(self, shelf: _Shelf) -> float:
        return max(len(shelf.items) / self.max_responses, shelf.bytes / self.max_bytes)

    async def delete(self, tenant: str | None, rid: str) -> bool:
        return self._drop(_tenant(tenant), rid)

    def _drop(self, t: str, rid: str) -> bool:
        shelf = self._shelves.get(t)
        old = shelf.items.pop(rid, None) if shelf is not None else None
        if old is None:
            return False
        assert shelf is not None
        shelf.bytes -= old.size
        self.bytes -= old.size
        self.count -= 1
        if not shelf.items:
            del self._shelves[t]
        return True

    async def beat(self, tenant: str | None, rid: str, ttl: float) -> None:
        return None  # (a replica that stops takes this store with it)

    async def alive(self, tenant: str | None, rid: str) -> bool:
        return True

    async def close(self) -> None:
        return None


# Shared by the scripts: drop one entry and its accounting (false when it is not there).
_DROP = """
local function drop(ns, t, rid)
  local s = redis.call('HGET', ns .. ':size:' .. t, rid)
  if not s then return false end
  s = tonumber(s)
  redis.call('HDEL', ns .. ':size:' .. t, rid)
  redis.call('HDEL', ns .. ':ver:' .. t, rid)
  redis.call('ZREM', ns .. ':lru:' .. t, rid)
  redis.call('DEL', ns .. ':r:' .. t .. ':' .. rid)
  if redis.call('HINCRBY', ns .. ':tc', t, -1) <= 0 then
    redis.call('HDEL', ns .. ':tc', t)
    redis.call('HDEL', ns .. ':tb', t)
  else
    redis.call('HINCRBY', ns .. ':tb', t, -s)
  end
  redis.call('HINCRBY', ns .. ':total', 'count', -1)
  redis.call('HINCRBY', ns .. ':total', 'bytes', -s)
  return true
end
"""

# KEYS: none (every key is under ARGV[1], the namespace; one Redis, not a cluster).
# ARGV: ns, tenant, id, entry, max count, max bytes, expected version ('' for any).
# Returns the new version, 0 when not kept, -1 on another version.
_PUT = (
    _DROP
    + """
local ns, t, rid, blob = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local maxc, maxb = tonumber(ARGV[5]), tonumber(ARGV[6])
local version = tonumber(redis.call('HGET', ns .. ':ver:' .. t, rid) or '0')
if ARGV[7] ~= '' and tonumber(ARGV[7]) ~= version then return -1 end
local size = #blob
if maxc <= 0 or size > maxb then return 0 end
drop(ns, t, rid)
redis.call('HSET', ns .. ':ver:' .. t, rid, version + 1)
local clock = redis.call('INCR', ns .. ':clock')
redis.call('SET', ns .. ':r:' .. t .. ':' .. rid, blob)
redis.call('HSET', ns .. ':size:' .. t, rid, size)
redis.call('ZADD', ns .. ':lru:' .. t, clock, rid)
redis.call('HINCRBY', ns .. ':tc', t, 1)
redis.call('HINCRBY', ns .. ':tb', t, size)
local count = redis.call('HINCRBY', ns .. ':total', 'count', 1)
local bytes = redis.call('HINCRBY', ns .. ':total', 'bytes', size)
while count > maxc or bytes > maxb do
  -- The key holding the most of either bound loses its least recently used.
  local counts = redis.call('HGETALL', ns .. ':tc')
  local best, load = nil, -1
  for i = 1, #counts, 2 do
    local tt = counts[i]
    local b = tonumber(redis.call('HGET', ns .. ':tb', tt) or '0')
    local l = math.max(tonumber(counts[i + 1]) / maxc, b / maxb)
    if l > load or (l == load and tt < best) then best, load = tt, l end
  end
  if best == nil then break end
  local lru = ns .. ':lru:' .. best
  local oldest = redis.call('ZRANGE', lru, 0, 0)[1]
  if oldest == nil then
    -- Counted but nothing listed (keys removed by hand): forget the tenant's counts.
    local c = tonumber(redis.call('HGET', ns .. ':tc', best))
    local b = tonumber(redis.call('HGET', ns .. ':tb', best) or '0')
    redis.call('HINCRBY', ns .. ':total', 'count', -c)
    redis.call('HINCRBY', ns .. ':total', 'bytes', -b)
    redis.call('HDEL', ns .. ':tc', best)
    redis.call('HDEL', ns .. ':tb', best)
  elseif not drop(ns, best, oldest) then
    redis.call('ZREM', lru, oldest)  -- listed without its size: not an entry
  end
  count = tonumber(redis.call('HGET', ns .. ':total', 'count'))
  bytes = tonumber(redis.call('HGET', ns .. ':total', 'bytes'))
end
if redis.call('EXISTS', ns .. ':r:' .. t .. ':' .. rid) == 0 then return 0 end
return version + 1
"""
)

# ARGV: ns, tenant, id.  {entry, version}, its use recorded; nil when absent.
_GET = """
local ns, t, rid = ARGV[1], ARGV[2], ARGV[3]
local blob = redis.call('GET', ns .. ':r:' .. t .. ':' .. rid)
if not blob then return nil end
redis.call('ZADD', ns .. ':lru:' .. t, 'XX', redis.call('INCR', ns .. ':clock'), rid)
return {blob, redis.call('HGET', ns .. ':ver:' .. t, rid) or '0'}
"""

# ARGV: ns, tenant, id.  1 when it was there.
_DELETE = (
    _DROP
    + """
local ns, t, rid = ARGV[1], ARGV[2], ARGV[3]
local there = redis.call('EXISTS', ns .. ':r:' .. t .. ':' .. rid) == 1
if drop(ns, t, rid) and there then return 1 end
return 0
"""
)

# ARGV: ns, tenant, id, ttl (ms).  A running background turn's heartbeat.
_BEAT = """
redis.call('SET', ARGV[1] .. ':hb:' .. ARGV[2] .. ':' .. ARGV[3], 1, 'PX', ARGV[4])
return 1
"""
_ALIVE = """
return redis.call('EXISTS', ARGV[1] .. ':hb:' .. ARGV[2] .. ':' .. ARGV[3])
"""

_Entry = tuple[dict[str, Any], list[ChatMessage], str]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Entry)


def encode_entry(item: Stored) -> bytes:
    return _ENCODER.encode((item.response, item.messages, item.root))


class RedisResponseStore:
    """Stored responses in Redis, shared by every replica that points at it."""

    NAMESPACE = "ps:responses"
    shared = True

    def __init__(
        self, url: str, max_responses: int, max_bytes: int, namespace: str = NAMESPACE
    ) -> None:
        import redis.asyncio as aioredis

        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ns = namespace
        self.client = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.errors = dict.fromkeys(("get", "put", "delete"), 0)
        self._put = self.client.register_script(_PUT)
        self._get = self.client.register_script(_GET)
        self._delete = self.client.register_script(_DELETE)
        self._beat = self.client.register_script(_BEAT)
        self._alive = self.client.register_script(_ALIVE)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    async def _call(self, op: str, script: Any, *args: Any) -> Any:
        import redis

        try:
            return await script(args=[self.ns, *args])
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self.errors[op] += 1
            raise StoreUnavailable(f"the response store (Redis) did not answer: {e}") from e

    async def get(self, tenant: str | None, rid: str) -> Stored | None:
        got = await self._call("get", self._get, _tenant(tenant), rid)
        if got is None:
            return None
        blob, version = got
        try:
            response, messages, root = _DECODER.decode(blob)
        except msgspec.DecodeError:
            log.warning("stored response %s is not an entry this version reads; ignored", rid)
            return None
        return Stored(response, messages, root, len(blob), int(version))

    async def put(
        self, tenant: str | None, rid: str, item: Stored, expect: int | None = None
    ) -> bool:
        blob = encode_entry(item)
        item.size = len(blob)
        got = await self._call(
            "put",
            self._put,
            _tenant(tenant),
            rid,
            blob,
            self.max_responses,
            self.max_bytes,
            "" if expect is None else expect,
        )
        if got == -1:
            raise StoreConflict(rid)
        item.version = max(int(got), 0)
        return got > 0

    async def delete(self, tenant: str | None, rid: str) -> bool:
        return bool(await self._call("delete", self._delete, _tenant(tenant), rid))

    async def beat(self, tenant: str | None, rid: str, ttl: float) -> None:
        """A background turn's replica is alive and running it, for `ttl` seconds."""
        await self._call("put", self._beat, _tenant(tenant), rid, int(ttl * 1000))

    async def alive(self, tenant: str | None, rid: str) -> bool:
        return bool(await self._call("get", self._alive, _tenant(tenant), rid))

    async def close(self) -> None:
        await self.client.aclose()


def make_response_store(
    kind: str, redis_url: str | None, max_responses: int, max_bytes: int
) -> ResponseStoreBase:
    """`kind`: memory, redis, or auto (Redis when the server has a redis:// URL)."""
    shared = (redis_url or "").startswith(("redis://", "rediss://", "unix://"))
    if kind == "redis" or (kind == "auto" and shared):
        if not shared:
            raise ValueError("--response-store redis needs --redis-url redis://...")
        return RedisResponseStore(redis_url or "", max_responses, max_bytes)
    return ResponseStore(max_responses, max_bytes)
