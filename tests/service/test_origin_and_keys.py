"""Origin checks behind a reverse proxy, secrets out of logs, several API keys, and prefix
caches isolated per key (cached_tokens reported only when the operator enables it)."""

from __future__ import annotations

import json
import logging
import re
import urllib.request

import openai
import pytest
import websockets
from aiohttp.test_utils import make_mocked_request
from websockets.exceptions import InvalidStatus

from service.cli import build_parser, read_key_file
from service.security import AccessLogger, check_origin, key_salt, parse_networks, redacted_target
from tests.checkpoints import tiny_checkpoint
from tests.redis_server import RedisServer
from tests.service.live_server import live_server

KEY_A, KEY_B = "key-of-alice", "key-of-bob"
# Long enough for several full 16-token blocks.
SYSTEM = "You answer questions about the tide tables of the northern harbour. " * 10


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


# ------------------------------------------------------------------ origin (unit)
def _req(headers: dict[str, str], remote: str = "127.0.0.1"):
    req = make_mocked_request("GET", "/v1/ws", headers=headers)
    return req.clone(remote=remote)


def test_origin_same_host_and_port() -> None:
    assert check_origin(_req({"Host": "a.example:8080", "Origin": "http://a.example:8080"}), [])
    assert not check_origin(_req({"Host": "a.example", "Origin": "http://a.example:8080"}), [])
    assert not check_origin(_req({"Host": "a.example", "Origin": "http://evil.example"}), [])
    assert not check_origin(_req({"Host": "a.example", "Origin": "null"}), [])
    # Default ports are the same origin as no port.
    assert check_origin(_req({"Host": "a.example:443", "Origin": "https://a.example"}), [])
    # Non-browser clients send no Origin.
    assert check_origin(_req({"Host": "a.example"}), [])


def test_origin_from_trusted_proxy_headers() -> None:
    # nginx rewrote Host to the replica's address; the client asked for chat.example:8443.
    fwd = {
        "Host": "10.0.0.5:8000",
        "Origin": "https://chat.example:8443",
        "X-Forwarded-Host": "chat.example",
        "X-Forwarded-Port": "8443",
        "X-Forwarded-Proto": "https",
    }
    assert not check_origin(_req(fwd), [])  # forwarded headers ignored unless trusted
    assert check_origin(_req(fwd), [], _nets(["127.0.0.0/8"]))
    assert not check_origin(_req(fwd, remote="192.0.2.9"), [], _nets(["127.0.0.0/8"]))
    assert check_origin(_req(fwd, remote="192.0.2.9"), [], _nets(["*"]))
    # The scheme counts once the proxy says which one the client used.
    assert not check_origin(_req(fwd | {"X-Forwarded-Proto": "http"}), [], _nets(["127.0.0.1"]))
    # RFC 7239.
    std = {"Host": "10.0.0.5:8000", "Origin": "https://chat.example",
           "Forwarded": 'for=192.0.2.1;host=chat.example;proto=https'}  # fmt: skip
    assert check_origin(_req(std), [], _nets(["127.0.0.1"]))
    assert not check_origin(_req(std | {"Origin": "https://evil.example"}), [], _nets(["*"]))


def test_origin_allow_list() -> None:
    h = {"Host": "10.0.0.5:8000", "Origin": "https://chat.example"}
    assert not check_origin(_req(h), ["https://other.example"])
    assert check_origin(_req(h), ["https://other.example", "https://chat.example"])
    assert check_origin(_req(h), ["*"])


def _nets(items: list[str]):
    return parse_networks(items)


def test_cli_flags() -> None:
    a = build_parser().parse_args(
        ["serve", "--api-key", "k1", "--api-key", "k2", "--allowed-origins",
         "https://a.example,https://b.example", "--allowed-origins", "https://c.example",
         "--forwarded-allow-ips", "127.0.0.1,10.0.0.0/8", "--enable-prompt-tokens-details",
         "--shared-prefix-cache"]
    )  # fmt: skip
    assert a.api_key == ["k1", "k2"]
    assert a.enable_prompt_tokens_details and a.shared_prefix_cache
    from service.cli import _split

    assert _split(a.allowed_origins) == [
        "https://a.example", "https://b.example", "https://c.example",
    ]  # fmt: skip
    assert _split(a.forwarded_allow_ips) == ["127.0.0.1", "10.0.0.0/8"]


def test_key_file(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\nkey-one\n\n  key-two  \n")
    assert read_key_file(str(f)) == ["key-one", "key-two"]
    f.write_text("# nothing\n")
    with pytest.raises(SystemExit):
        read_key_file(str(f))


# ------------------------------------------------------------------ secrets in logs
def test_access_log_redacts_api_key(caplog) -> None:
    req = make_mocked_request("GET", f"/v1/ws?session_id=s1&api_key={KEY_A}")
    assert KEY_A not in redacted_target(req)
    assert "session_id=s1" in redacted_target(req)
    assert redacted_target(make_mocked_request("GET", "/v1/models?x=1")) == "/v1/models?x=1"
    logger = logging.getLogger("test.access")
    resp = type("R", (), {"status": 101, "body_length": 0})()
    with caplog.at_level(logging.INFO, logger="test.access"):
        AccessLogger(logger, "").log(req, resp, 0.01)
    assert caplog.records and KEY_A not in caplog.text and "api_key=REDACTED" in caplog.text


# ------------------------------------------------------------------ live: origin, keys
async def test_websocket_behind_proxy_headers(model) -> None:
    # The proxy's public name must be on --allowed-hosts (the trusted proxy's
    # X-Forwarded-Host is checked like a Host: tests/service/test_tenancy.py).
    kw = {"forwarded_allow_ips": ["127.0.0.1"], "allowed_hosts": ["chat.example"]}
    with live_server(model, **kw) as s:
        hdr = {"Origin": "http://chat.example:8080", "X-Forwarded-Host": "chat.example:8080"}
        async with websockets.connect(s.ws_url, additional_headers=hdr) as ws:
            await ws.send('{"type": "ping"}')
            assert json.loads(await ws.recv()) == {"type": "pong"}
        with pytest.raises(InvalidStatus) as e:
            bad = hdr | {"Origin": "http://evil.example"}
            async with websockets.connect(s.ws_url, additional_headers=bad):
                pass
        assert e.value.response.status_code == 403


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _cached(url: str, key: str, question: str = "When is high tide?") -> int | None:
    r = _client(url, key).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
    )
    d = r.usage.prompt_tokens_details
    return None if d is None else d.cached_tokens


def test_several_keys_and_no_cached_tokens_by_default(model) -> None:
    with live_server(model, api_keys=[KEY_A, KEY_B], served_model_name="tiny") as s:
        assert _cached(s.url, KEY_A) is None
        assert _cached(s.url, KEY_B) is None
        with pytest.raises(openai.AuthenticationError):
            _cached(s.url, "key-of-mallory")


def test_prefixes_are_isolated_per_key(model) -> None:
    kw = {"api_keys": [KEY_A, KEY_B], "enable_prompt_tokens_details": True}
    with live_server(model, served_model_name="tiny", **kw) as s:
        assert _cached(s.url, KEY_A) == 0
        hit = _cached(s.url, KEY_A, "And low tide?")
        assert hit >= 4 * 16  # A's own prefix is a hit for A
        assert _cached(s.url, KEY_B, "And low tide?") == 0  # ... and not for B
        assert _cached(s.url, KEY_B, "Next spring tide?") >= 4 * 16  # B now has its own
        # A client-chosen cache_salt stays inside its key's space: B cannot name A's.
        r = _client(s.url, KEY_B).chat.completions.create(
            model="tiny", max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
            extra_body={"cache_salt": key_salt(KEY_A)},
        )  # fmt: skip
        assert r.usage.prompt_tokens_details.cached_tokens == 0


async def test_websocket_uses_the_key_salt(model) -> None:
    kw = {"api_keys": [KEY_A, KEY_B], "enable_prompt_tokens_details": True}
    with live_server(model, served_model_name="tiny", **kw) as s:
        assert _cached(s.url, KEY_A) == 0

        async def local_hits_after_ws(key: str) -> float:
            before = _metric(s.url, "local")
            async with websockets.connect(s.ws_url + "?api_key=" + key) as ws:
                await ws.send(json.dumps({
                    "type": "generate", "id": "g",
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "Tide?"}],
                    "params": {"max_tokens": 2},
                }))  # fmt: skip
                while json.loads(await ws.recv())["type"] != "done":
                    pass
            return _metric(s.url, "local") - before

        assert await local_hits_after_ws(KEY_B) == 0
        assert await local_hits_after_ws(KEY_A) >= 4 * 16


def test_shared_prefix_cache_is_opt_in(model) -> None:
    kw = {"api_keys": [KEY_A, KEY_B], "enable_prompt_tokens_details": True}
    with live_server(model, served_model_name="tiny", shared_prefix_cache=True, **kw) as s:
        assert _cached(s.url, KEY_A) == 0
        assert _cached(s.url, KEY_B, "And low tide?") >= 4 * 16


@pytest.mark.redis
def test_isolation_holds_across_replicas_through_redis(model) -> None:
    redis = RedisServer()
    kw = {
        "api_keys": [KEY_A, KEY_B],
        "enable_prompt_tokens_details": True,
        "served_model_name": "tiny",
        "engine_kwargs": {"redis_url": redis.url},
    }
    try:
        with live_server(model, **kw) as a, live_server(model, **kw) as b:
            assert _cached(a.url, KEY_A) == 0
            assert _cached(a.url, KEY_A) > 0  # a local hit: the blocks go to Redis
            a.wait_kv_free()
            _wait(lambda: a.engine.tier.stats.blocks_published >= 4)
            assert _cached(b.url, KEY_B) == 0  # B on replica b: not A's blocks
            assert _metric(b.url, "redis") == 0
            assert _cached(b.url, KEY_A, "And low tide?") >= 4 * 16  # A on b: from Redis
            assert _metric(b.url, "redis") >= 4 * 16
    finally:
        redis.stop()


def _metric(url: str, tier: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    m = re.search(r'pagestream_prefix_cache_hits_total\{[^}]*tier="' + tier + r'"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def _wait(cond, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
