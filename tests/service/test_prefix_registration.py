"""Registering a system prompt over HTTP on one replica makes another replica load it
from Redis (POST /v1/cache/prefixes), with the engine in the server's process or in an
engine process (where the tier lives in the child and /metrics reads it across)."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request

import openai
import pytest

from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.redis_server import RedisServer
from tests.service.live_server import live_server

pytestmark = pytest.mark.redis

SYSTEM = "You are a careful assistant for a shipping company. " * 12


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(url: str, name: str) -> float:
    """A series of `name` labelled tier="redis" on the server's /metrics (0 if absent)."""
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    m = re.search(name + r'\{[^}]*tier="redis"[^}]*\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def redis_hits(url: str) -> float:
    return metric(url, "pagestream_prefix_cache_hits_total")


@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
def test_registered_system_prompt_is_loaded_by_another_replica(engine_process):
    model = str(tiny_checkpoint("llama"))
    redis = RedisServer()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where is my parcel?"},
    ]
    try:
        kw = {
            "engine_kwargs": {"redis_url": redis.url, "engine_process": engine_process},
            "served_model_name": "tiny",
            "enable_prompt_tokens_details": True,
        }
        with live_server(model, **kw) as a:
            code, info = post(a.url + "/v1/cache/prefixes", {"messages": messages[:1]})
            assert code == 200, info
            assert info["blocks"] >= 4 and info["shared_tier"] == "redis"
            code, err = post(a.url + "/v1/cache/prefixes", {"messages": messages[:1], "x": 1})
            assert code == 400 and err["error"]["param"] == "x"
            code, err = post(a.url + "/v1/cache/prefixes", {})
            assert code == 400
            published = "pagestream_prefix_tier_blocks_published_total"
            for _ in range(500):
                if metric(a.url, published) >= info["blocks"]:
                    break
                time.sleep(0.01)
            assert metric(a.url, published) >= info["blocks"]
            assert a.engine.tier.stats.blocks_published >= info["blocks"]
            assert metric(a.url, "pagestream_prefix_tier_up") == 1
            if engine_process:
                assert a.engine.in_child and a.engine.scheduler is None
        with live_server(model, **kw) as b:
            client = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.usage.prompt_tokens_details.cached_tokens >= info["blocks"] * 16 - 16
            assert redis_hits(b.url) >= info["blocks"] * 16 - 16
            loaded = metric(b.url, "pagestream_prefix_tier_blocks_loaded_total")
            assert loaded >= info["blocks"] - 1
            assert metric(b.url, "pagestream_prefix_tier_lookups_total") >= 1
            text = r.choices[0].message.content
    finally:
        redis.stop()
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    try:
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert text == ref[0].outputs[0].text
    finally:
        llm.shutdown()


def test_serve_restarted_with_the_engine_process_loads_its_prefix_from_redis(tmp_path):
    """`serve --engine-process --redis-url`: a prefix registered before a restart is
    loaded from Redis by the next server (its engine process's tier), same greedy text;
    a clean stop closes the tier in the engine's process and leaves no process behind."""
    from tests.service.test_engine_process import engine_children, server, wait_gone

    model = str(tiny_checkpoint("llama"))
    redis = RedisServer()
    prefix = list(range(40, 40 + 16 * 6))  # six full blocks
    body = {"model": "tiny", "prompt": [*prefix, 7, 8, 9], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    args = ["--model", model, "--dtype", "float32", "--num-kv-blocks", "256",
            "--served-model-name", "tiny", "--enable-prompt-tokens-details",
            "--engine-process", "--redis-url", redis.url]  # fmt: skip
    texts, cached = [], []
    try:
        for restart in range(2):
            with server(tmp_path, "service.cli", *args) as (proc, url):
                (kid,) = engine_children(proc.pid)
                if restart == 0:
                    code, info = post(url + "/v1/cache/prefixes", {"prompt": prefix})
                    assert code == 200 and info["blocks"] == 6, info
                    assert info["shared_tier"] == "redis"
                    published = "pagestream_prefix_tier_blocks_published_total"
                    for _ in range(500):
                        if metric(url, published) >= 6:
                            break
                        time.sleep(0.01)
                    assert metric(url, published) >= 6
                code, r = post(url + "/v1/completions", body)
                assert code == 200, r
                texts.append(r["choices"][0]["text"])
                cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
                if restart == 1:
                    assert metric(url, "pagestream_prefix_tier_blocks_loaded_total") >= 5
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0
                assert wait_gone(kid, 10)
    finally:
        redis.stop()
    assert cached[1] >= 5 * 16, cached
    assert texts[0] == texts[1]
