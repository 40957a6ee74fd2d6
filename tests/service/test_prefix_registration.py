"""Registering a system prompt over HTTP on one replica makes another replica load it
from Redis (POST /v1/cache/prefixes)."""

from __future__ import annotations

import json
import re
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


def redis_hits(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    m = re.search(r'pagestream_prefix_cache_hits_total\{[^}]*tier="redis"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_registered_system_prompt_is_loaded_by_another_replica():
    model = str(tiny_checkpoint("llama"))
    redis = RedisServer()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where is my parcel?"},
    ]
    try:
        kw = {
            "engine_kwargs": {"redis_url": redis.url},
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
            a.wait_kv_free()
            for _ in range(200):
                if a.engine.tier.stats.blocks_published >= info["blocks"]:
                    break
                __import__("time").sleep(0.01)
        with live_server(model, **kw) as b:
            client = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.usage.prompt_tokens_details.cached_tokens >= info["blocks"] * 16 - 16
            assert redis_hits(b.url) >= info["blocks"] * 16 - 16
            text = r.choices[0].message.content
    finally:
        redis.stop()
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    try:
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert text == ref[0].outputs[0].text
    finally:
        llm.shutdown()
