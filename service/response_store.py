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
    <ns>:size:<t>       HASH    tenant t's response id -> its head's bytes
    <ns>:ver:<t>        HASH    tenant t's response id -> its version (puts so far)
    <ns>:r:<t>:<id>     STRING  the head (msgpack: response, chain root, parent id)
    <ns>:m:<t>:<id>     HASH    its messages: d (msgpack), p (the parent's id, '' at a chain's
                                start), n (references: its entry, its children), b (bytes)
    <ns>:hb:<t>:<id>    STRING  a running background response's heartbeat (expires)

A response that continued another (`previous_response_id`) keeps only its own messages and
links to its parent's, so a chain of n turns holds n turns' messages, not n(n+1)/2 copies;
a read walks the links (one script, one round trip).  Messages outlive their entry while a
later turn links to them, and count toward their key's bytes until the last one goes, so
the bytes bound is exact; past a bound eviction drops entries (least recently used of the
key holding the most) until it holds.

Every operation is one Lua script (one round trip, atomic across replicas).  An entry
whose bytes Redis itself dropped (maxmemory, FLUSHDB of one key) reads as absent and is
dropped from the accounting when it comes up for eviction."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
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
    # The stored response this one continued (its previous_response_id) and how many of
    # `messages` came from it: Redis keeps only the rest with this entry, linked to the
    # parent's (the memory store shares the objects instead).
    parent: str | None = None
    base: int = 0


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

    async def peek(self, tenant: str | None, rid: str) -> dict[str, Any] | None: ...

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

    async def peek(self, tenant: str | None, rid: str) -> dict[str, Any] | None:
        """The stored object alone, its use not recorded (a watcher's or a check's read)."""
        shelf = self._shelves.get(_tenant(tenant))
        item = shelf.items.get(rid) if shelf is not None else None
        return None if item is None else item.response

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


# Shared by the scripts.  charge: a tenant's bytes (and the total) change by b.  release:
# one reference fewer to a tenant's messages sid; the last takes them, and their link to
# the parent's, away.  drop: one entry and its accounting (false when it is not there).
_DROP = """
local function charge(ns, t, b)
  if redis.call('HEXISTS', ns .. ':tc', t) == 1 then
    redis.call('HINCRBY', ns .. ':tb', t, b)
  end
  redis.call('HINCRBY', ns .. ':total', 'bytes', b)
end
local function release(ns, t, sid)
  while sid and sid ~= '' do
    local key = ns .. ':m:' .. t .. ':' .. sid
    if redis.call('EXISTS', key) == 0 then return end
    if redis.call('HINCRBY', key, 'n', -1) > 0 then return end
    local got = redis.call('HMGET', key, 'b', 'p')
    redis.call('DEL', key)
    charge(ns, t, -tonumber(got[1] or '0'))
    sid = got[2]
  end
end
local function drop(ns, t, rid)
  local s = redis.call('HGET', ns .. ':size:' .. t, rid)
  if not s then return false end
  redis.call('HDEL', ns .. ':size:' .. t, rid)
  redis.call('HDEL', ns .. ':ver:' .. t, rid)
  redis.call('ZREM', ns .. ':lru:' .. t, rid)
  redis.call('DEL', ns .. ':r:' .. t .. ':' .. rid)
  charge(ns, t, -tonumber(s))
  release(ns, t, rid)
  if redis.call('HINCRBY', ns .. ':tc', t, -1) <= 0 then
    redis.call('HDEL', ns .. ':tc', t)
    redis.call('HDEL', ns .. ':tb', t)
  end
  redis.call('HINCRBY', ns .. ':total', 'count', -1)
  return true
end
"""

# KEYS: none (every key is under ARGV[1], the namespace; one Redis, not a cluster).
# ARGV: ns, tenant, id, head, messages, max count, max bytes, expected version ('' for
# any), parent id ('' for none).  Returns the new version, 0 when not kept, -1 on another
# version, -2 when the parent's messages are gone (put the whole conversation instead).
_PUT = (
    _DROP
    + """
local ns, t, rid, head, seg = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local maxc, maxb, par = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[9]
local version = tonumber(redis.call('HGET', ns .. ':ver:' .. t, rid) or '0')
if ARGV[8] ~= '' and tonumber(ARGV[8]) ~= version then return -1 end
if maxc <= 0 or #head + #seg > maxb then return 0 end
if par ~= '' then
  local pk = ns .. ':m:' .. t .. ':' .. par
  if redis.call('EXISTS', pk) == 0 then return -2 end
  redis.call('HINCRBY', pk, 'n', 1)  -- before the drop below, which may release it
end
drop(ns, t, rid)
redis.call('HINCRBY', ns .. ':tc', t, 1)
local sk = ns .. ':m:' .. t .. ':' .. rid
if redis.call('EXISTS', sk) == 1 then
  -- Kept by a later turn's link: the same conversation (a parent is never in progress),
  -- already linked to its own parent.
  redis.call('HINCRBY', sk, 'n', 1)
  release(ns, t, par)
else
  redis.call('HSET', sk, 'd', seg, 'p', par, 'n', 1, 'b', #seg)
  charge(ns, t, #seg)
end
redis.call('HSET', ns .. ':ver:' .. t, rid, version + 1)
local clock = redis.call('INCR', ns .. ':clock')
redis.call('SET', ns .. ':r:' .. t .. ':' .. rid, head)
redis.call('HSET', ns .. ':size:' .. t, rid, #head)
redis.call('ZADD', ns .. ':lru:' .. t, clock, rid)
charge(ns, t, #head)
local count = redis.call('HINCRBY', ns .. ':total', 'count', 1)
local bytes = tonumber(redis.call('HGET', ns .. ':total', 'bytes'))
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

# ARGV: ns, tenant, id.  {head, version, its messages, its parent's, ...}, its use
# recorded; nil when absent, {head, version} when a link is missing.
_GET = """
local ns, t, rid = ARGV[1], ARGV[2], ARGV[3]
local head = redis.call('GET', ns .. ':r:' .. t .. ':' .. rid)
if not head then return nil end
redis.call('ZADD', ns .. ':lru:' .. t, 'XX', redis.call('INCR', ns .. ':clock'), rid)
local version = redis.call('HGET', ns .. ':ver:' .. t, rid) or '0'
local out = {head, version}
local sid = rid
while sid ~= '' do
  local got = redis.call('HMGET', ns .. ':m:' .. t .. ':' .. sid, 'd', 'p')
  if not got[1] then return {head, version} end
  out[#out + 1] = got[1]
  sid = got[2]
end
return out
"""

# ARGV: ns, tenant, id.  The head alone, its use not recorded; nil when absent.
_PEEK = """
return redis.call('GET', ARGV[1] .. ':r:' .. ARGV[2] .. ':' .. ARGV[3])
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

_Head = tuple[dict[str, Any], str, str]  # response, chain root, parent id ('' for none)
_ENCODER = msgspec.msgpack.Encoder()
_HEAD = msgspec.msgpack.Decoder(_Head)
_MESSAGES = msgspec.msgpack.Decoder(list[ChatMessage])
# Entries written before the links (response, conversation, root) still read, so chains
# survive a rolling deploy; a head whose messages went (maxmemory) fails this and is absent.
_WHOLE = msgspec.msgpack.Decoder(tuple[dict[str, Any], list[ChatMessage], str])


def encode_entry(item: Stored, linked: bool = True) -> tuple[bytes, bytes]:
    """(head, messages) as Redis keeps them: linked, only the messages after the parent's."""
    head = _ENCODER.encode((item.response, item.root, item.parent if linked else ""))
    own = item.messages[item.base :] if linked and item.parent else item.messages
    return head, _ENCODER.encode(own)


# A relayed stream (service/stream_relay.py): its key, the entries one read takes, and
# the field an event (not the end or a lost mark) is stored under.
RELAY_BATCH = 512
RELAY_EVENT = b"d"


def relay_key(ns: str, tenant: str, rid: str) -> str:
    return f"{ns}:ev:{tenant}:{rid}"


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
        self._peek = self.client.register_script(_PEEK)
        self._delete = self.client.register_script(_DELETE)
        self._beat = self.client.register_script(_BEAT)
        self._alive = self.client.register_script(_ALIVE)

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    @contextlib.contextmanager
    def _answering(self, op: str | None = None) -> Iterator[None]:
        """Redis not answering, as StoreUnavailable (counted under `op`)."""
        import redis

        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            if op is not None:
                self.errors[op] += 1
            raise StoreUnavailable(f"the response store (Redis) did not answer: {e}") from e

    async def _call(self, op: str, script: Any, *args: Any) -> Any:
        with self._answering(op):
            return await script(args=[self.ns, *args])

    async def get(self, tenant: str | None, rid: str) -> Stored | None:
        got = await self._call("get", self._get, _tenant(tenant), rid)
        if got is None:
            return None
        head, version, *parts = got
        try:
            if not parts:  # an entry of the layout before links: whole, under one key
                response, messages, root = _WHOLE.decode(head)
                return Stored(response, messages, root, len(head), int(version))
            response, root, parent = _HEAD.decode(head)
            # Root first: the chain's oldest messages come first.
            chunks = [_MESSAGES.decode(p) for p in reversed(parts)]
        except msgspec.DecodeError as e:
            log.warning("stored response %s is not an entry this version reads (%s)", rid, e)
            return None
        messages = [m for c in chunks for m in c]
        size = len(head) + len(parts[0])
        base = len(messages) - len(chunks[-1])
        return Stored(response, messages, root, size, int(version), parent or None, base)

    async def peek(self, tenant: str | None, rid: str) -> dict[str, Any] | None:
        """The stored object alone (its head: no messages read or decoded), its use not
        recorded."""
        head = await self._call("get", self._peek, _tenant(tenant), rid)
        if head is None:
            return None
        for decoder in (_HEAD, _WHOLE):
            with contextlib.suppress(msgspec.DecodeError):
                return decoder.decode(head)[0]  # type: ignore[no-any-return]
        return None

    async def put(
        self, tenant: str | None, rid: str, item: Stored, expect: int | None = None
    ) -> bool:
        linked = item.parent is not None
        while True:
            head, own = encode_entry(item, linked)
            got = await self._call(
                "put",
                self._put,
                _tenant(tenant),
                rid,
                head,
                own,
                self.max_responses,
                self.max_bytes,
                "" if expect is None else expect,
                item.parent if linked else "",
            )
            if got != -2 or not linked:
                break
            linked = False  # the parent's messages went meanwhile: keep them all here
        item.size = len(head) + len(own)
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

    async def relay_events(
        self, tenant: str | None, rid: str, events: list[tuple[int, bytes, bytes]], ttl: float
    ) -> None:
        """Append (seq, kind, data) entries to a response's relayed stream
        (service/stream_relay.py), its key kept `ttl` seconds from now."""
        import redis

        key = relay_key(self.ns, _tenant(tenant), rid)
        pipe = self.client.pipeline(transaction=False)
        for seq, kind, data in events:
            pipe.xadd(key, {kind: data}, id=f"0-{seq}")
        pipe.pexpire(key, max(1, int(ttl * 1000)))
        try:
            with self._answering():
                await pipe.execute()
        except redis.ResponseError as e:  # an id out of order: a relay restarted over it
            raise StoreUnavailable(f"the relayed stream refused an event: {e}") from e

    async def read_events(
        self, tenant: str | None, rid: str, after: int, block_ms: int = 0
    ) -> list[tuple[int, bytes, bytes]] | None:
        """A relayed stream's entries after position `after` (waiting up to `block_ms`
        for one), or None when the stream is not (or no longer) there."""
        key = relay_key(self.ns, _tenant(tenant), rid)
        with self._answering():
            got = await self.client.xread(
                {key: f"0-{after}"}, count=RELAY_BATCH, block=block_ms or None
            )
            if not got and not await self.client.exists(key):
                return None
        out = []
        for _key, entries in got or ():
            for eid, fields in entries:
                seq = int(eid.split(b"-")[1])
                ((kind, data),) = fields.items()
                out.append((seq, kind, data))
        return out

    async def relay_last(self, tenant: str | None, rid: str) -> int | None:
        """The position of a relayed stream's newest event (not of its end or lost mark),
        or None when there is no such stream."""
        key = relay_key(self.ns, _tenant(tenant), rid)
        with self._answering():
            got = await self.client.xrevrange(key, count=1)
        if not got:
            return None
        eid, fields = got[0]
        seq = int(eid.split(b"-")[1])
        return seq if RELAY_EVENT in fields else seq - 1

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
