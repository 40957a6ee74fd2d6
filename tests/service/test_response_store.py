"""Where /v1/responses keeps what it stores (service/response_store.py): in memory or in a
real redis-server shared by replicas.  The two evict alike, so the oracle for the Redis
store's bounds and fairness is the in-memory store run through the same operations; then
two live servers on one Redis continue each other's chains, and a Redis that goes away
costs 503s naming the field, never a lost answer or a stuck loop."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import msgspec
import openai
import pytest

from service.protocol import ChatMessage, FunctionCall, TextPart, ToolCall
from service.response_store import (
    RedisResponseStore,
    ResponseStore,
    StoreConflict,
    Stored,
    StoreUnavailable,
    encode_entry,
    make_response_store,
)
from tests.redis_server import RedisServer
from tests.service.live_server import live_server
from tests.service.test_structured_api import hermes_checkpoint


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def sized(size: int, tag: str = "") -> Stored:
    """An entry whose encoded bytes (what the Redis store counts) are exactly `size`; the
    in-memory store is given the same size."""
    for pad in range(size):
        item = Stored({"id": tag, "p": "x" * pad}, [], "root", 0)
        if sum(map(len, encode_entry(item))) == size:
            item.size = size
            return item
    raise AssertionError(f"no entry of {size} bytes")


async def stores(kind: str, redis, max_responses: int, max_bytes: int):
    if kind == "memory":
        return ResponseStore(max_responses, max_bytes)
    return RedisResponseStore(redis.url, max_responses, max_bytes)


async def present(store, tenant: str, rid: str) -> bool:
    return await store.get(tenant, rid) is not None


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_peek_reads_the_object_alone_and_records_no_use(kind, request):
    """What a background turn's watcher and a delete read: the stored object, without
    its conversation and without making it recently used."""
    redis = request.getfixturevalue("redis") if kind == "redis" else None

    async def main() -> None:
        store = await stores(kind, redis, 2, 1 << 20)
        messages = [ChatMessage(role="user", content="hi")]
        await store.put("t", "a", Stored({"id": "a", "status": "queued"}, messages, "root", 10))
        await store.put("t", "b", Stored({"id": "b"}, [], "root", 10))
        assert await store.peek("t", "a") == {"id": "a", "status": "queued"}
        assert await store.peek("t", "x") is None and await store.peek("u", "a") is None
        await store.put("t", "c", Stored({"id": "c"}, [], "root", 10))  # a is still oldest
        assert not await present(store, "t", "a") and await present(store, "t", "b")
        await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_bounds_and_fairness(kind, request):
    redis = request.getfixturevalue("redis") if kind == "redis" else None

    async def main() -> None:
        store = await stores(kind, redis, 3, 1000)
        for i in range(4):
            await store.put("t", f"r{i}", sized(100))
        assert not await present(store, "t", "r0")
        await store.get("t", "r1")  # used: r2 is now the oldest
        await store.put("t", "big", sized(700))  # 1,000 bytes but 4 entries: the oldest goes
        assert not await present(store, "t", "r2")
        await store.put("t", "small", sized(150))  # 1,050 bytes: r3 goes (r1 used after it)
        assert not await present(store, "t", "r3")
        for k in ("r1", "big", "small"):
            assert await present(store, "t", k)
        await store.put("t", "huge", sized(1001))  # larger than the whole store: not kept
        assert not await present(store, "t", "huge")
        assert not await present(store, "u", "r1")  # another tenant's key
        assert await store.delete("t", "r1") and not await store.delete("t", "r1")
        await store.close()
        # A key flooding the store evicts its own oldest, not a key that holds less.
        fair = await stores(kind, redis, 10, 10_000)
        if kind == "redis":
            fair.ns += ":fair"
        for i in range(3):
            await fair.put("quiet", f"q{i}", sized(100))
        for i in range(50):
            await fair.put("flood", f"f{i}", sized(100))
        for i in range(3):
            assert await present(fair, "quiet", f"q{i}")
        kept = [k for k in range(50) if await present(fair, "flood", f"f{k}")]
        assert kept == list(range(43, 50))
        for i in range(20):  # by bytes too: the big holder goes first
            await fair.put("bytes", f"b{i}", sized(1500))
        for i in range(3):
            assert await present(fair, "quiet", f"q{i}")
        await fair.close()
        off = await stores(kind, redis, 0, 1 << 20)
        await off.put("t", "a", sized(50))
        assert not off.enabled and not await present(off, "t", "a")
        await off.close()

    asyncio.run(main())


def test_redis_evicts_as_memory_does(redis):
    """Random puts, reads and deletes from three keys, some to ids that exist and some
    not, with sizes that hit the byte bound as often as the count bound: the Redis store
    answers every call as the in-memory one does and holds the same entries after."""

    async def main() -> None:
        rng = random.Random(7)
        mem = ResponseStore(12, 4000)
        red = RedisResponseStore(redis.url, 12, 4000)
        tenants, ids = ["ta", "tb", None], [f"r{i}" for i in range(30)]
        sizes = [sized(s) for s in (60, 120, 300, 700, 1500)]
        for _ in range(600):
            op, t, rid = rng.random(), rng.choice(tenants), rng.choice(ids)
            if op < 0.5:
                # Half of the puts are conditional, on the version read or a stale one.
                item = rng.choice(sizes)
                expect = None
                if rng.random() < 0.5:
                    seen = await mem.get(t, rid)
                    assert (seen is None) == (await red.get(t, rid) is None)
                    expect = (seen.version if seen else 0) - (rng.random() < 0.3)
                outcome = []
                for store, size in ((mem, item.size), (red, 0)):
                    try:
                        kept = await store.put(
                            t, rid, Stored(item.response, [], "root", size), expect
                        )
                        outcome.append(kept)
                    except StoreConflict:
                        outcome.append("conflict")
                assert outcome[0] == outcome[1], outcome
            elif op < 0.85:
                a, b = await mem.get(t, rid), await red.get(t, rid)
                assert (a is None) == (b is None)
                assert a is None or (a.size, a.response, a.version) == (
                    b.size,
                    b.response,
                    b.version,
                )
            else:
                assert await mem.delete(t, rid) == await red.delete(t, rid)
        for t in tenants:
            for rid in ids:
                assert (await mem.get(t, rid) is None) == (await red.get(t, rid) is None)
        total = {k.decode(): int(v) for k, v in redis.client().hgetall(f"{red.ns}:total").items()}
        assert total == {"count": mem.count, "bytes": mem.bytes}
        await red.close()

    asyncio.run(main())


def accounted(redis, ns: str) -> tuple[int, int, int]:
    """(count, bytes) as the store's totals say, and the bytes its keys really hold
    (heads and messages), from a scan of the namespace."""
    c = redis.client()
    total = {k.decode(): int(v) for k, v in c.hgetall(f"{ns}:total").items()}
    held = sum(c.strlen(k) for k in c.scan_iter(f"{ns}:r:*"))
    held += sum(int(c.hget(k, "b")) for k in c.scan_iter(f"{ns}:m:*"))
    return total.get("count", 0), total.get("bytes", 0), held


def test_redis_chains_link_their_turns(redis):
    """A chain keeps each turn's own messages once, linked to its parent's: 40 turns of
    1 KB take 48 KB, not the 963 KB of a copy per turn; a turn reads back its whole
    conversation after its parents are evicted or deleted; the bytes bound counts what
    Redis really holds; and nothing is left when the last entry goes."""

    def say(i: int, n: int = 1000) -> list[ChatMessage]:
        return [
            ChatMessage(role="user", content=f"{i} " + "u" * n),
            ChatMessage(role="assistant", content=f"{i} " + "a" * 20),
        ]

    async def main() -> None:
        store = RedisResponseStore(redis.url, 1000, 10 << 20)
        parent, messages = None, []
        for i in range(40):
            prev = await store.get("t", parent) if parent else None
            history = prev.messages if prev else []
            messages = [*history, *say(i)]
            item = Stored({"id": f"r{i}"}, messages, "root", 0, parent=parent, base=len(history))
            assert await store.put("t", f"r{i}", item)
            parent = f"r{i}"
        count, counted, held = accounted(redis, store.ns)
        assert count == 40 and counted == held < 40 * 1300
        got = await store.get("t", "r39")
        assert got is not None and got.messages == messages and got.parent == "r38"
        assert got.base == 78 and got.root == "root"
        # The parents' entries go; their messages stay for the turns that link to them.
        for i in range(0, 39, 2):
            assert await store.delete("t", f"r{i}")
        assert (await store.get("t", "r39")).messages == messages
        assert (await store.get("t", "r17")).messages == messages[: 2 * 18]
        count, counted, held = accounted(redis, store.ns)
        assert count == 20 and counted == held
        # A background turn stored again over its version keeps its children readable.
        r21 = await store.get("t", "r21")
        done = Stored({"id": "r21", "status": "cancelled"}, r21.messages, "root", 0,
                      r21.version, r21.parent, r21.base)  # fmt: skip
        assert await store.put("t", "r21", done, expect=r21.version)
        assert (await store.get("t", "r39")).messages == messages
        assert (await store.get("t", "r21")).response["status"] == "cancelled"
        # A parent gone before its child was put: the child keeps its whole conversation.
        orphan = Stored({"id": "o"}, messages[:4], "root", 0, parent="gone", base=2)
        assert await store.put("t", "o", orphan)
        got = await store.get("t", "o")
        assert got.messages == messages[:4] and got.parent is None
        for rid in [f"r{i}" for i in range(1, 40, 2)] + ["o"]:
            assert await store.delete("t", rid)
        assert accounted(redis, store.ns) == (0, 0, 0)
        assert not list(redis.client().scan_iter(f"{store.ns}:m:*"))
        # An entry of the earlier layout (the whole conversation under its key) still reads.
        await store.put("t", "old", Stored({"id": "old"}, [], "root", 0))
        whole = msgspec.msgpack.encode(({"id": "old"}, messages[:2], "root"))
        redis.client().set(f"{store.ns}:r:t:old", whole)
        redis.client().delete(f"{store.ns}:m:t:old")
        got = await store.get("t", "old")
        assert got is not None and got.messages == messages[:2] and got.parent is None
        assert await store.delete("t", "old")
        await store.close()

    asyncio.run(main())


def test_redis_chain_eviction_is_exact(redis):
    """Random chains under a tight bound: every entry still stored reads back the
    conversation it was put with, the totals equal the bytes Redis holds after every
    step, and the bound holds on them."""

    async def main() -> None:
        rng = random.Random(11)
        store = RedisResponseStore(redis.url, 15, 9000)
        put: dict[tuple[str, str], list[ChatMessage]] = {}
        for step in range(400):
            t = rng.choice(["ta", "tb"])
            rid = f"r{step}"
            mine = [ChatMessage(role="user", content="m" * rng.randrange(20, 400))]
            op = rng.random()
            live = [k for k in put if k[0] == t]
            if op < 0.6 and live:
                pt, pid = rng.choice(live)
                prev = await store.get(pt, pid)
                if prev is None:  # evicted by the bound
                    del put[(pt, pid)]
                    continue
                assert prev.messages == put[(pt, pid)]
                msgs = [*prev.messages, *mine]
                item = Stored({"id": rid}, msgs, "root", 0, parent=pid, base=len(prev.messages))
            elif op < 0.8 or not live:
                msgs, item = mine, Stored({"id": rid}, mine, "root", 0)
            else:
                pt, pid = rng.choice(live)
                await store.delete(pt, pid)
                del put[(pt, pid)]
                continue
            if await store.put(t, rid, item):
                put[(t, rid)] = msgs
            count, counted, held = accounted(redis, store.ns)
            assert counted == held <= 9000 and count <= 15
        for (t, rid), msgs in put.items():
            got = await store.get(t, rid)
            assert got is None or got.messages == msgs
        for t, rid in list(put):
            await store.delete(t, rid)
        assert accounted(redis, store.ns) == (0, 0, 0)
        await store.close()

    asyncio.run(main())


def test_redis_entries_shared_between_replicas(redis):
    """What one replica stores another reads whole (the conversation's messages, tool
    calls and parts included) and deletes for both."""

    async def main() -> None:
        a = make_response_store("auto", redis.url, 100, 1 << 20)
        b = make_response_store("redis", redis.url, 100, 1 << 20)
        assert isinstance(a, RedisResponseStore) and isinstance(b, RedisResponseStore)
        messages = [
            ChatMessage(role="user", content=[TextPart(text="What is 2+2?")]),
            ChatMessage(
                role="assistant",
                tool_calls=[ToolCall(id="c1", function=FunctionCall(name="add", arguments="{}"))],
            ),
            ChatMessage(role="tool", tool_call_id="c1", content="4"),
            ChatMessage(role="assistant", content="4"),
        ]
        await a.put("tk", "resp_1", Stored({"id": "resp_1", "output": []}, messages, "root1", 0))
        got = await b.get("tk", "resp_1")
        assert got is not None and got.messages == messages and got.root == "root1"
        assert got.response == {"id": "resp_1", "output": []}
        assert await b.get("other", "resp_1") is None
        assert await b.delete("tk", "resp_1") and await a.get("tk", "resp_1") is None
        # Garbage under an entry's key (another version, a hand edit) reads as absent.
        await a.put("tk", "resp_2", Stored({"id": "resp_2"}, [], "r", 0))
        redis.client().set(f"{a.ns}:r:tk:resp_2", b"\xc1garbage")
        assert await b.get("tk", "resp_2") is None
        # In memory when there is no Redis URL; refused when Redis is asked for without one.
        assert isinstance(make_response_store("auto", "memory://", 1, 1), ResponseStore)
        with pytest.raises(ValueError, match="--redis-url"):
            make_response_store("redis", None, 1, 1)
        # Redis gone: each call fails fast as StoreUnavailable, not a hang.
        redis.kill()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for call in (
            a.get("tk", "x"),
            a.put("tk", "x", Stored({}, [], "r", 0)),
            a.delete("tk", "x"),
        ):
            with pytest.raises(StoreUnavailable):
                await call
        assert loop.time() - t0 < 10
        for s in (a, b):
            await s.close()

    asyncio.run(main())


# ------------------------------------------------------------------ two live replicas
def post(url: str, path: str, body: dict, key: str = "key-a") -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_two_replicas_share_chains(tmp_path_factory, redis):
    """Turns of one chain alternate between two servers that share only Redis; each turn
    equals the chat completion of the whole conversation (the Responses oracle), a delete
    on one is seen by the other, and with Redis down a continuation is a 503 naming
    previous_response_id while a new response is still answered (stored: false)."""
    model = hermes_checkpoint(tmp_path_factory)
    common = {
        "served_model_name": "tiny",
        "api_keys": ["key-a", "key-b"],
        "engine_kwargs": {"max_model_len": 512, "threads": 1, "redis_url": redis.url},
    }
    with live_server(model, **common) as a, live_server(model, **common) as b:
        ca, cb = (
            openai.OpenAI(base_url=s.url + "/v1", api_key="key-a", max_retries=0, timeout=120)
            for s in (a, b)
        )
        messages: list[dict] = []
        prev = None
        for turn, (client, text) in enumerate(
            [(ca, "Hello there"), (cb, "Tell me more"), (ca, "And then?")]
        ):
            r = client.responses.create(
                model="tiny",
                input=text,
                previous_response_id=prev,
                max_output_tokens=6,
                temperature=0,
            )
            messages.append({"role": "user", "content": text})
            oracle = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, temperature=0
            )
            assert r.output_text == oracle.choices[0].message.content, turn
            assert r.usage.input_tokens == oracle.usage.prompt_tokens, turn
            messages.append({"role": "assistant", "content": r.output_text})
            prev = r.id
        # Streamed on one, read back on the other: the final event came after the store.
        events = list(
            cb.responses.create(
                model="tiny",
                input="Last one",
                previous_response_id=prev,
                max_output_tokens=4,
                stream=True,
            )
        )
        assert events[-1].type in ("response.completed", "response.incomplete")
        final = events[-1].response
        assert ca.responses.retrieve(final.id).output_text == final.output_text
        # Keys stay apart across replicas; a delete on one is a 404 on the other.
        kb = openai.OpenAI(base_url=a.url + "/v1", api_key="key-b", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            kb.responses.retrieve(prev)
        cb.responses.delete(prev)
        with pytest.raises(openai.NotFoundError):
            ca.responses.retrieve(prev)
        # Redis down.
        redis.kill()
        status, body = post(
            a.url,
            "/v1/responses",
            {"model": "tiny", "input": "x", "previous_response_id": final.id},
        )
        assert status == 503 and body["error"]["param"] == "previous_response_id", body
        status, body = post(
            a.url, "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2}
        )
        assert status == 200 and body["status"] in ("completed", "incomplete"), body
        assert body["store"] is False
        stream = ca.responses.create(model="tiny", input="y", max_output_tokens=2, stream=True)
        assert list(stream)[-1].response.store is False
        with urllib.request.urlopen(a.url + "/health", timeout=5) as h:
            assert h.status == 200
        with pytest.raises(openai.InternalServerError) as e:
            ca.responses.retrieve(final.id)
        assert e.value.status_code == 503
        with urllib.request.urlopen(a.url + "/metrics", timeout=10) as m:
            scrape = m.read().decode()
        for op, at_least in (("get", 2), ("put", 2)):
            line = f'pagestream_response_store_errors_total{{model_name="tiny",op="{op}"}}'
            (value,) = [float(x.split()[-1]) for x in scrape.splitlines() if x.startswith(line)]
            assert value >= at_least, scrape
        # Back (empty, as a Redis without persistence restarts): storing works again.
        redis.restart()
        r = ca.responses.create(model="tiny", input="again", max_output_tokens=2)
        assert r.store and cb.responses.retrieve(r.id).id == r.id


def test_concurrent_conversation_writers_lose_nothing(redis):
    """Forty appends to one conversation from two replicas' stores at once: each reads,
    extends and writes back over the version it read, so every item lands once, and the
    version counts the writes."""
    from service import openai_conversations as conversations

    async def main() -> None:
        a = RedisResponseStore(redis.url, 100, 1 << 20)
        b = RedisResponseStore(redis.url, 100, 1 << 20)
        conv = {"id": "conv_x", "object": "conversation", "created_at": 0, "metadata": {}}
        assert await a.put("tk", "conv_x", conversations._entry(conv, []))

        async def add(store, i: int) -> None:
            item = conversations.new_items([{"role": "user", "content": f"m{i}"}], "items")
            await conversations.append(store, "tk", "conv_x", item, "items")

        await asyncio.gather(*(add(a if i % 2 else b, i) for i in range(40)))
        got = await b.get("tk", "conv_x")
        texts = sorted(int(i["content"][0]["text"][1:]) for i in got.response["items"])
        assert texts == list(range(40)) and got.version == 41
        # The in-memory store under the same writers (one loop: no interleaving to lose).
        mem = ResponseStore(100, 1 << 20)
        await mem.put("tk", "conv_x", conversations._entry(conv, []))
        await asyncio.gather(*(add(mem, i) for i in range(40)))
        assert len((await mem.get("tk", "conv_x")).response["items"]) == 40
        for s in (a, b):
            await s.close()

    asyncio.run(main())
