"""The shared prefix tier's store and actor: payload checks, caps, degradation."""

from __future__ import annotations

import asyncio
import os

import pytest

from scheduler.block_pool import hash_block
from scheduler.prefix_tier import (
    MemoryStore,
    PrefixTier,
    RedisStore,
    TierConfig,
    decode_payload,
    encode_payload,
)
from tests.redis_server import RedisServer

PAYLOAD = 64


def cfg(ns: str, **kw) -> TierConfig:
    return TierConfig(namespace=ns, payload_bytes=PAYLOAD, **kw)


def chain(n: int, salt: int = 0) -> list[bytes]:
    out, parent = [], None
    for i in range(n):
        parent = hash_block(parent, [i, salt, 3, 4], None)
        out.append(parent)
    return out


def test_payload_codec_rejects_damage():
    data = os.urandom(PAYLOAD)
    blob = encode_payload(data)
    assert decode_payload(blob, PAYLOAD) == data
    assert decode_payload(blob, PAYLOAD + 1) is None
    assert decode_payload(blob[:-1], PAYLOAD) is None
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    assert decode_payload(bytes(flipped), PAYLOAD) is None
    assert decode_payload(b"garbage" * 20, PAYLOAD) is None
    assert decode_payload(None, PAYLOAD) is None


@pytest.fixture(params=["memory", "redis"])
def store_factory(request):
    if request.param == "memory":
        MemoryStore._shared.clear()
        yield lambda c: MemoryStore.for_namespace(c)
        return
    server = RedisServer()
    try:
        yield lambda c: RedisStore(server.url, c)
    finally:
        server.stop()


async def test_publish_then_lookup_longest_intact_run(store_factory):
    c = cfg("t1")
    tier = PrefixTier(store_factory(c), c)
    tier.start()
    hashes = chain(6)
    datas = [os.urandom(PAYLOAD) for _ in hashes]
    tier.publish(list(zip(hashes[:4], datas[:4], strict=True)))
    for _ in range(100):
        if tier.stats.blocks_published == 4:
            break
        await asyncio.sleep(0.01)
    assert tier.stats.blocks_published == 4
    assert await tier.lookup(hashes) == datas[:4]
    assert await tier.lookup(hashes[1:]) == datas[1:4]
    assert await tier.lookup(chain(3, salt=9)) == []
    assert tier.stats.errors == 0
    if isinstance(tier.store, RedisStore):
        # Payloads, their LRU and the namespace's meta: no per-block index keys.
        keys = {k.decode() async for k in tier.store.client.scan_iter(f"{c.namespace}:*")}
        assert keys == {f"{c.namespace}:kvlru", f"{c.namespace}:meta"} | {
            f"{c.namespace}:kv:{h.hex()}" for h in hashes[:4]
        }
    await tier.close()


async def test_capacity_is_bounded(store_factory):
    blob_len = len(encode_payload(bytes(PAYLOAD)))
    c = cfg("t2", max_kv_bytes=10 * blob_len)
    store = store_factory(c)
    hashes = chain(40)
    for h in hashes:
        await store.put_payloads([(h, encode_payload(os.urandom(PAYLOAD)))])
    blobs = await store.get_payloads(hashes[-5:])
    assert all(b is not None for b in blobs), "the newest payloads stay"
    if isinstance(store, MemoryStore):
        assert len(store.payloads) == 10
    else:
        r = store.client
        assert await r.zcard(f"{c.namespace}:kvlru") == 10
        assert len([k async for k in r.scan_iter(f"{c.namespace}:kv:*")]) == 10
        await store.close()


async def test_unreachable_store_degrades_and_recovers():
    server = RedisServer()
    c = cfg("t3", lookup_deadline=0.5)
    tier = PrefixTier(RedisStore(server.url, c), c)
    tier.start()
    h = chain(2)
    tier.publish([(h[0], os.urandom(PAYLOAD))])
    await asyncio.sleep(0.1)
    server.stop()
    assert await tier.lookup(h) == []  # fails fast, no exception
    assert tier.stats.errors >= 1 and not tier.healthy
    # While backing off, look-ups do not even try.
    before = tier.stats.lookups
    assert await tier.lookup(h) == []
    assert tier.stats.lookups == before
    await tier.close()


async def test_garbage_under_namespace_is_dropped():
    server = RedisServer()
    try:
        c = cfg("t4")
        store = RedisStore(server.url, c)
        tier = PrefixTier(store, c)
        h = chain(3)
        good = [os.urandom(PAYLOAD) for _ in h]
        await store.put_payloads([(x, encode_payload(d)) for x, d in zip(h, good, strict=True)])
        r = server.client()
        r.set(f"t4:kv:{h[1].hex()}", b"not a payload at all")
        assert await tier.lookup(h) == good[:1]
        assert tier.stats.bad_payloads == 1
        await store.close()
    finally:
        server.stop()
