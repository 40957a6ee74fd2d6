"""Ids and tenants (issue 45): request ids never let one client touch another's request,
/tokenize and /detokenize sit behind the API key, each key has a bounded share of the
shared prefix tier, and only allowed Host names are answered (DNS rebinding).

Row 7 of the issue is replayed against a real `pagestream serve` process (watched: a
background stream and a /health poller stay within budget); the rest runs against an
in-process server with two keys and a real redis-server tier.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from scheduler.engine_core import DuplicateRequestId
from scheduler.prefix_tier import MemoryStore, RedisStore, TierConfig, encode_payload, tenant_limit
from scheduler.sampling_params import SamplingParams
from scheduler.stream import RequestStream
from service.cli import build_parser, key_share
from service.request_ids import LiveRequestIds
from service.security import AllowedHosts, check_origin, key_salt, key_tenant, parse_networks
from tests.checkpoints import tiny_checkpoint
from tests.redis_server import RedisServer
from tests.reliability.watch import (
    REPLY_BUDGET_S,
    Watch,
    assert_client_error,
    normal_chat,
    post,
    serve_process,
)
from tests.service.live_server import LiveServer, live_server

KEY_A, KEY_B = "tenancy-key-a", "tenancy-key-b"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
VICTIM_TOKENS = 1000


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


# ============================================================== units: no server
def _req(headers: dict[str, str], remote: str = "127.0.0.1"):
    return make_mocked_request("GET", "/v1/ws", headers=headers).clone(remote=remote)


def test_allowed_hosts_defaults() -> None:
    loop = AllowedHosts.build(None, "127.0.0.1")
    for ok in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "app.localhost",
               "10.1.2.3:8000", "[fe80::1]", None):  # fmt: skip
        assert loop.allows(ok), ok
    for bad in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
        assert not loop.allows(bad), bad
    # A named --host is allowed; on every interface, this machine's hostname is.
    assert AllowedHosts.build(None, "box.lan").allows("box.lan:8000")
    import socket

    wild = AllowedHosts.build(None, "0.0.0.0")
    assert wild.allows(socket.gethostname()) and wild.allows("10.0.0.7:8000")
    assert not wild.allows("evil.example")


def test_allowed_hosts_list() -> None:
    hosts = AllowedHosts.build(["chat.example.com", ".corp.example", "Upper.Example."], "0.0.0.0")
    for ok in ("chat.example.com:443", "corp.example", "a.b.corp.example", "upper.example",
               "localhost", "192.0.2.1"):  # fmt: skip
        assert hosts.allows(ok), ok
    for bad in ("example.com", "xcorp.example", "chat.example.com.evil.example"):
        assert not hosts.allows(bad), bad
    assert AllowedHosts.build(["*"]).allows("anything.example")
    assert AllowedHosts.build(["*.corp.example"]).allows("x.corp.example")


def test_origin_equal_to_a_rebound_host_is_refused() -> None:
    """DNS rebinding: Origin and Host are both the attacker's name.  Without a host list
    that passes as same-origin (the hole); with one it does not."""
    rebound = {"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}
    assert check_origin(_req(rebound), [])  # the old check alone
    assert not check_origin(_req(rebound), [], None, AllowedHosts.build(None))
    own = {"Host": "localhost:8000", "Origin": "http://localhost:8000"}
    assert check_origin(_req(own), [], None, AllowedHosts.build(None))
    # Behind a trusted proxy the forwarded host is the browser's: it must be allowed too.
    fwd = {"Host": "10.0.0.5:8000", "Origin": "https://evil.example",
           "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https"}  # fmt: skip
    nets = parse_networks(["127.0.0.1"])
    assert check_origin(_req(fwd), [], nets)
    assert not check_origin(_req(fwd), [], nets, AllowedHosts.build(None))
    assert check_origin(_req(fwd), [], nets, AllowedHosts.build(["evil.example"]))


def test_tenant_ids_are_one_way_and_distinct() -> None:
    ta, tb = key_tenant(KEY_A), key_tenant(KEY_B)
    assert ta != tb and ta == key_tenant(KEY_A)
    assert KEY_A not in ta and ta not in key_salt(KEY_A)
    assert ta.isalnum()  # safe in logs and in Redis key names


def test_live_request_ids() -> None:
    ids = LiveRequestIds()
    assert ids.claim("ta", "x") and not ids.claim("ta", "x")
    assert ids.claim("tb", "x") and ids.claim(None, "x")  # other namespaces
    ids.release("ta", "x")
    assert ids.claim("ta", "x")
    e1, e2 = ids.engine_id("cmpl-x"), ids.engine_id("cmpl-x")
    assert e1 != e2 and e1.endswith(":cmpl-x")


def test_cli_flags() -> None:
    a = build_parser().parse_args(
        ["serve", "--allowed-hosts", "a.example,b.example", "--allowed-hosts", "c.example",
         "--public-tokenize", "--prefix-tier-key-share", "0.1"]
    )  # fmt: skip
    assert a.allowed_hosts == ["a.example,b.example", "c.example"]
    assert a.public_tokenize and a.prefix_tier_key_share == 0.1
    d = build_parser().parse_args(["serve"])
    assert d.allowed_hosts is None and not d.public_tokenize and d.prefix_tier_key_share == 0.25
    # The share: the flag, but at least 1/keys, and none with one key or none.
    assert key_share(0.25, 0) == key_share(0.25, 1) == 1.0
    assert key_share(0.25, 2) == 0.5 and key_share(0.25, 10) == 0.25
    with pytest.raises(SystemExit):
        key_share(0.0, 3)


# ============================================================== prefix tier share (stores)
PAYLOAD = 64
BLOB = len(encode_payload(bytes(PAYLOAD)))


def _hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


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


async def _present(store, hashes: list[bytes]) -> int:
    if isinstance(store, MemoryStore):
        return sum(h in store.payloads for h in hashes)
    return sum([await store.client.exists(f"{store.ns}:kv:{h.hex()}") for h in hashes])


@pytest.mark.redis
@pytest.mark.parametrize("share", [1.0, 0.25])
async def test_one_tenant_cannot_evict_the_others(store_factory, share) -> None:
    """Tier of 20 payloads.  B publishes 4, then A floods 60.  With no share (1.0, the old
    behaviour) A's flood pushes all of B's out; with 0.25, A keeps at most 5 of its own
    newest and B's 4 stay."""
    c = TierConfig(namespace=f"share{share}", payload_bytes=PAYLOAD, max_kv_bytes=20 * BLOB,
                   tenant_share=share)  # fmt: skip
    store = store_factory(c)
    b_blocks, a_blocks = _hashes(1, 4), _hashes(2, 60)
    await store.put_payloads([(h, encode_payload(bytes(PAYLOAD))) for h in b_blocks], "tb")
    for i in range(0, 60, 6):
        batch = a_blocks[i : i + 6]
        await store.put_payloads([(h, encode_payload(bytes(PAYLOAD))) for h in batch], "ta")
    if share == 1.0:
        assert tenant_limit(c) is None
        assert await _present(store, b_blocks) == 0, "without a share one key evicts the rest"
        assert await _present(store, a_blocks) == 20
    else:
        assert tenant_limit(c) == 5
        assert await _present(store, b_blocks) == 4
        assert await _present(store, a_blocks[-5:]) == 5  # its own newest
        assert await _present(store, a_blocks) == 5
        # Unkeyed traffic (tenant None) has no share.
        await store.put_payloads([(h, encode_payload(bytes(PAYLOAD))) for h in _hashes(3, 8)])
        assert await _present(store, _hashes(3, 8)) == 8
    if isinstance(store, RedisStore):
        await store.close()


# ============================================================== in-process server, two keys
@pytest.fixture(scope="module")
def redis_tier() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def keyed(model, redis_tier) -> Iterator[LiveServer]:
    engine = {"redis_url": redis_tier.url, "redis_max_kv_bytes": 1 << 20,
              "prefix_tier_key_share": 0.25}  # fmt: skip
    with live_server(model, api_keys=[KEY_A, KEY_B], engine_kwargs=engine) as s:
        yield s


async def _raw(url: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    status, obj, _, _ = await post(url, path, body, headers=headers)
    return status, obj


@pytest.mark.redis  # the keyed server's tier
async def test_tokenize_needs_the_key(keyed) -> None:
    url = keyed.url
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [5, 6]})):
        status, obj = await _raw(url, path, body, {})
        assert status == 401 and obj["error"]["code"] == "invalid_api_key", (path, obj)
        status, obj = await _raw(url, path, body, {"Authorization": "Bearer nope"})
        assert status == 401, path
        status, obj = await _raw(url, path, body, AUTH_B)
        assert status == 200, (path, obj)
    keyed.state.config.public_tokenize = True  # --public-tokenize
    try:
        status, obj = await _raw(url, "/tokenize", {"prompt": "hello"}, {})
        assert status == 200 and obj["count"] >= 1
        status, obj = await _raw(url, "/detokenize", {"tokens": [5, 6]}, {})
        assert status == 200 and "prompt" in obj
        # Only those two: the API stays behind the key.
        status, _ = await _raw(url, "/v1/completions", {"prompt": "x", "max_tokens": 1}, {})
        assert status == 401
    finally:
        keyed.state.config.public_tokenize = False


@pytest.mark.redis  # the keyed server's tier
async def test_hosts_not_allowed_get_421(keyed) -> None:
    url, port = keyed.url, keyed.config.port
    async with aiohttp.ClientSession() as s:
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
            async with s.get(url + "/health", headers={"Host": host}) as r:
                assert r.status == 200, host
        t0 = time.monotonic()
        async with s.get(url + "/health", headers={"Host": f"evil.example:{port}"}) as r:
            obj = await r.json()
            assert r.status == 421 and obj["error"]["param"] == "Host", obj
            assert obj["error"]["type"] == "invalid_request_error"
        assert time.monotonic() - t0 < REPLY_BUDGET_S
        # Before the key check, on every route.
        headers = {"Host": "evil.example", **AUTH_A}
        async with s.post(url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
            assert r.status == 421
        # DNS rebinding on the WebSocket: Origin equals the (rebound) Host.
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(f"{url}/v1/ws?api_key={KEY_A}", headers=rebound)
        assert e.value.status == 421
        own = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}
        async with s.ws_connect(f"{url}/v1/ws?api_key={KEY_A}", headers=own) as ws:
            await ws.send_str('{"type": "ping"}')
            assert json.loads((await ws.receive()).data) == {"type": "pong"}
    # '*' answers any Host (what the compose file and k8s manifest pass).
    old = keyed.state.allowed_hosts
    keyed.state.allowed_hosts = AllowedHosts.build(["*"])
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(url + "/health", headers={"Host": "evil.example"}) as r,
        ):
            assert r.status == 200
    finally:
        keyed.state.allowed_hosts = old


@pytest.mark.redis  # the keyed server's tier
def test_engine_refuses_a_live_id_and_never_aborts_it(keyed) -> None:
    """The engine's own guard: an id a live request holds is refused synchronously
    (DuplicateRequestId, a 409) and an abort that names the id from any other stream (a
    refused duplicate's, a finished request's) leaves the live request alone."""

    async def go():
        eng = keyed.engine
        long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        sub = eng.submit([5, 6, 7, 8], long, "live-id")
        with pytest.raises(DuplicateRequestId):
            eng.submit([9, 10], SamplingParams(max_tokens=2), "live-id")
        eng.core.abort("live-id", RequestStream("live-id"))
        last = None
        async for out in eng.generate("", submitted=sub):
            last = out
        return last

    last = keyed.call(go())
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 200
    keyed.wait_kv_free()


@pytest.mark.redis  # the keyed server's tier
async def test_each_key_keeps_its_share_of_the_redis_tier(keyed, redis_tier) -> None:
    """Key B registers a prefix; key A then registers far more than the whole tier holds.
    A ends up with at most its share, all of B's blocks are still in Redis."""
    tier = keyed.engine.tier
    assert tier is not None and tier.name == "redis"
    limit = tenant_limit(tier.cfg)
    entries = (1 << 20) // (tier.cfg.payload_bytes + 30)
    assert limit is not None and 1 <= limit < entries
    ns = tier.cfg.namespace
    r = redis_tier.client()
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(limit * 16 + 1)]

    async def register(auth: dict[str, str]) -> None:
        status, obj = await _raw(keyed.url, "/v1/cache/prefixes", {"prompt": prompt()}, auth)
        assert status == 200, obj

    await register(AUTH_B)
    b_set = f"{ns}:tenant:{key_tenant(KEY_B)}"
    a_set = f"{ns}:tenant:{key_tenant(KEY_A)}"
    deadline = time.monotonic() + 10
    while r.zcard(b_set) < limit and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    b_blocks = [m.decode() for m in r.zrange(b_set, 0, -1)]
    assert len(b_blocks) == limit
    published = tier.stats.blocks_published
    rounds = entries // limit + 2
    for _ in range(rounds):
        await register(AUTH_A)
    # Every block of every round written (and its key's trim done): waiting for fewer let
    # the last write land between the checks below (9 payloads seen, 2 x 3 allowed).
    deadline = time.monotonic() + 10
    while tier.stats.blocks_published < published + rounds * limit and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.05)
    assert tier.stats.blocks_published >= published + entries + limit, "A published past the cap"
    assert r.zcard(a_set) <= limit
    assert all(r.exists(f"{ns}:kv:{h}") for h in b_blocks), "A's flood evicted B's prefix"
    assert len(list(r.scan_iter(f"{ns}:kv:*"))) <= 2 * limit


# ============================================================== row 7, live, watched
@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    with serve_process(
        model, "--api-key", KEY_A, "--api-key", KEY_B, "--num-kv-blocks", "512",
        "--dtype", "float32", log_dir=tmp_path_factory.mktemp("tenancy"),
    ) as s:  # fmt: skip
        yield s


class Victim:
    """A long SSE completion from key A under a chosen id, read to its end."""

    def __init__(self, url: str, headers: dict[str, str], body: dict[str, Any], path: str):
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._run(url, headers, body, path))

    async def _run(self, url, headers, body, path) -> dict[str, Any]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": VICTIM_TOKENS, "ignore_eos": True, "temperature": 0}  # fmt: skip
        out: dict[str, Any] = {"finish": None, "usage": None, "errors": [], "ids": set()}
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + path, json=body, headers=headers) as r,
        ):
            out["status"], out["header_id"] = r.status, r.headers.get("X-Request-Id")
            async for raw in r.content:
                if not raw.startswith(b"data: ") or raw.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                self.started.set()
                if "error" in chunk:
                    out["errors"].append(chunk)
                    continue
                out["ids"].add(chunk["id"])
                for c in chunk["choices"]:
                    out["finish"] = c.get("finish_reason") or out["finish"]
                out["usage"] = chunk.get("usage") or out["usage"]
        return out

    async def result(self) -> dict[str, Any]:
        self.started.set()
        return await self.task


def _intact(v: dict[str, Any], public_id: str, client_id: str) -> None:
    assert v["status"] == 200 and not v["errors"], v
    assert v["finish"] == "length" and v["usage"]["completion_tokens"] == VICTIM_TOKENS, v
    assert v["ids"] == {public_id} and v["header_id"] == client_id


async def test_row7_same_request_id_from_another_key(served) -> None:
    url = served.url
    async with Watch(url, api_key=KEY_A) as w:
        victim = Victim(url, {**AUTH_A, "X-Request-Id": "X"}, {"prompt": "once"}, "/v1/completions")
        async with asyncio.timeout(30):
            await victim.started.wait()
        assert not victim.task.done()
        short = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        # Another key, same id: its own request, its own id echoed.
        status, obj, took, _ = await post(
            url, "/v1/completions", short, headers={**AUTH_B, "X-Request-Id": "X"}
        )
        assert status == 200 and obj["id"] == "cmpl-X", obj
        assert obj["choices"][0]["finish_reason"] == "length" and took < REPLY_BUDGET_S
        # The same key, same id, while it runs: 409 naming the header; the victim runs on.
        status, obj, took, _ = await post(
            url, "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={**AUTH_A, "X-Request-Id": "X"},
        )  # fmt: skip
        assert_client_error(status, obj, took, "X-Request-Id")
        assert status == 409
        assert not victim.task.done(), "the victim should still be running here"
        _intact(await victim.result(), "cmpl-X", "X")
        # Done: the id is free again for its key.
        status, obj, _, _ = await post(
            url, "/v1/completions", short, headers={**AUTH_A, "X-Request-Id": "X"}
        )
        assert status == 200 and obj["id"] == "cmpl-X"
    w.check("row 7 (X-Request-Id)")
    served.assert_alive()
    await normal_chat(url, AUTH_B)


async def test_row7_body_request_id(served) -> None:
    url = served.url
    chat = {"messages": [{"role": "user", "content": "tell me"}], "request_id": "Y"}
    async with Watch(url, api_key=KEY_B) as w:
        victim = Victim(url, AUTH_A, chat, "/v1/chat/completions")
        async with asyncio.timeout(30):
            await victim.started.wait()
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                 "request_id": "Y"}  # fmt: skip
        status, obj, took, _ = await post(url, "/v1/chat/completions", short, headers=AUTH_B)
        assert status == 200 and obj["id"] == "chatcmpl-Y" and took < REPLY_BUDGET_S, obj
        status, obj, took, _ = await post(url, "/v1/chat/completions", short, headers=AUTH_A)
        assert_client_error(status, obj, took, "request_id")
        assert status == 409
        _intact(await victim.result(), "chatcmpl-Y", "Y")
    w.check("row 7 (body request_id)")
    served.assert_alive()


async def _frames_until(ws, pred, timeout: float = REPLY_BUDGET_S) -> list[dict[str, Any]]:
    frames = []
    async with asyncio.timeout(timeout):
        while True:
            f = json.loads((await ws.receive()).data)
            frames.append(f)
            if pred(f):
                return frames


async def test_row7_websocket_ids_belong_to_their_socket(served) -> None:
    url = served.url
    ws_url = url.replace("http", "ws") + "/v1/ws?api_key="
    gen = {"type": "generate", "id": "g", "prompt": "once",
           "params": {"max_tokens": VICTIM_TOKENS, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    short = {"type": "generate", "id": "g", "prompt": "hi",
             "params": {"max_tokens": 3, "ignore_eos": True}}  # fmt: skip
    async with (
        Watch(url, api_key=KEY_A) as w,
        aiohttp.ClientSession() as s,
        s.ws_connect(ws_url + KEY_A) as victim,
    ):
        await victim.send_str(json.dumps(gen))
        frames = await _frames_until(victim, lambda f: f["type"] == "delta", 30)
        for key in (KEY_B, KEY_A):  # another key, and the same key on another socket
            async with s.ws_connect(ws_url + key) as other:
                # It cannot cancel (or see) the victim's generation...
                await other.send_str('{"type": "cancel", "id": "g"}')
                err = (await _frames_until(other, lambda f: f["type"] == "error"))[-1]
                assert (err["id"], err["code"]) == ("g", 404), err
                # ...and its own "g" is its own.
                await other.send_str(json.dumps(short))
                mine = await _frames_until(other, lambda f: f["type"] in ("done", "error"))
                assert mine[-1]["type"] == "done", mine
                assert mine[-1]["usage"]["completion_tokens"] == 3
        # A duplicate on the victim's own socket: an error frame, the victim runs on.
        await victim.send_str(json.dumps(short))
        rest = await _frames_until(victim, lambda f: f["type"] in ("error", "done"), 30)
        frames += rest
        err = next(f for f in rest if f["type"] == "error")
        assert (err["id"], err["code"], err["param"]) == ("g", 409, "id"), err
        if rest[-1]["type"] != "done":
            frames += await _frames_until(victim, lambda f: f["type"] == "done", 60)
        done = frames[-1]
        assert done["id"] == "g" and done["finish_reason"] == "length", done
        assert done["usage"]["completion_tokens"] == VICTIM_TOKENS
        assert sum(len(f["token_ids"]) for f in frames if f["type"] == "delta") == VICTIM_TOKENS
    w.check("row 7 (WebSocket)")
    served.assert_alive()


# ============================================================== per-key admission, live
@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
async def test_a_key_past_its_waiting_share_gets_429_and_the_other_key_is_admitted(
    model, engine_process
) -> None:
    """max_waiting_per_key reads the queue as admission sees it; with the engine in a
    child process, the child's last snapshot plus the adds it has not taken yet."""
    engine = {"max_num_seqs": 1, "max_waiting_per_key": 2}
    with live_server(
        model, api_keys=[KEY_A, KEY_B], engine_kwargs=engine, engine_process=engine_process
    ) as s:
        url = s.url + "/v1/completions"
        long = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as http:
            held = [await http.post(url, json=long, headers=AUTH_A)]
            assert held[0].status == 200
            await held[0].content.readline()  # it runs: A waits for nothing
            for _ in range(2):
                held.append(await http.post(url, json=long, headers=AUTH_A))
                assert held[-1].status == 200
            async with http.post(url, json=long, headers=AUTH_A) as r:
                body = await r.json()
                assert r.status == 429, body
                assert "this API key" in body["error"]["message"], body
            held.append(await http.post(url, json=long, headers=AUTH_B))  # its own share
            assert held[-1].status == 200
            for r in held:
                r.close()
        await asyncio.to_thread(s.wait_kv_free, 30)
        status, obj, _, _ = await post(
            s.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=AUTH_A
        )
        assert status == 200, obj
