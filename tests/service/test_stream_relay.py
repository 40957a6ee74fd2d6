"""The relay of a background response's stream through Redis (service/stream_relay.py),
against a real redis-server: events in order under the tenant's namespace, the end, a
relay stopped by its byte cap read as gone (410) where it stopped, and the key's life."""

from __future__ import annotations

import asyncio

import pytest

from service.response_store import RedisResponseStore
from service.stream_relay import EventRelay, follow_relayed
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


async def _follow(store, tenant, rid, after):
    got: list[bytes | tuple[str, str]] = []

    async def write(data: bytes) -> None:
        got.append(data)

    async def gone(why: str) -> None:
        got.append(("gone", why))

    return await follow_relayed(store, tenant, rid, after, write, gone), got


def test_events_in_order_then_the_end(redis):
    async def go():
        store = RedisResponseStore(redis.url, 16, 1 << 20, namespace="t1")
        relay = EventRelay(store, "k1", "r", cap=1 << 20, grace=5.0, kept=[(1, b"e1")])
        reader = asyncio.create_task(_follow(store, "k1", "r", 0))
        for i in range(2, 6):
            relay.add(b"e%d" % i)
            await asyncio.sleep(0.01)
        relay.close()
        ended, got = await asyncio.wait_for(reader, 10)
        assert ended and got == [b"e1", b"e2", b"e3", b"e4", b"e5"]
        # From a position: the rest; another tenant: nothing there.
        assert await _follow(store, "k1", "r", 3) == (True, [b"e4", b"e5"])
        assert await store.relay_last("k1", "r") == 5  # (the last event's, not the end's)
        assert await store.relay_last("k2", "r") is None
        assert await store.read_events("k2", "r", 0) is None
        ttl = await store.client.pttl("t1:ev:k1:r")
        assert 5000 < ttl <= 60_000  # after the end: a minute (or a longer grace)
        await store.close()

    asyncio.run(go())


def test_a_relay_past_its_cap_is_gone_where_it_stopped(redis):
    async def go():
        store = RedisResponseStore(redis.url, 16, 1 << 20, namespace="t2")
        relay = EventRelay(store, "k1", "r", cap=10, grace=5.0)
        for data in (b"aaaa", b"bbbb", b"cccc", b"dddd"):
            relay.add(data)
        relay.close()
        await asyncio.wait_for(relay.task, 10)
        ended, got = await _follow(store, "k1", "r", 0)
        assert not ended and got[:2] == [b"aaaa", b"bbbb"]
        assert got[2][0] == "gone" and len(got) == 3
        await store.close()

    asyncio.run(go())
