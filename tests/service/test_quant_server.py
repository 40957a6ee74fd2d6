"""A server with an int8 KV cache and int8 weights: the flags, the OpenAI API (greedy
output equal to the offline LLM with the same settings), the KV capacity the cache dtype
buys, and what /metrics reports."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest

from gpu.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams
from service.cli import build_parser, engine_config
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

QUANT = {"kv_cache_dtype": "int8", "quantization": "int8"}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


def test_cli_flags_reach_engine_config():
    a = build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "fp8", "--quantization", "int8", "--kv-cache-memory", "0.5"]
    )
    e = engine_config(a)
    assert (e.cache.kv_cache_dtype, e.model.quantization) == ("fp8", "int8")
    assert e.cache.kv_cache_bytes == 1 << 29
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_same_memory_holds_about_twice_the_blocks(model, kv):
    # Bytes, not elements: vs a 16-bit cache, 1-byte values plus a 2-byte scale per 64-dim
    # head row give 128 / 66 = 1.94x the blocks (vs float32: 3.88x).
    budget = 8 << 20
    blocks = {
        (dtype, kvd): ModelRunner(
            model, dtype=dtype, device="cpu", kv_cache_bytes=budget, kv_cache_dtype=kvd
        ).num_kv_blocks
        for dtype in ("bfloat16", "float32")
        for kvd in ("auto", kv)
    }
    assert blocks[("bfloat16", kv)] / blocks[("bfloat16", "auto")] == pytest.approx(128 / 66, 0.01)
    assert blocks[("float32", kv)] / blocks[("float32", "auto")] == pytest.approx(256 / 66, 0.01)


def test_quantized_server_streams_and_matches_offline(model):
    prompts = ["the quick brown fox", "pagestream serves quantized models", "a b c d e f"]
    llm = LLM(model, dtype="float32", num_kv_blocks=256, **QUANT)
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    with live_server(model, engine_kwargs=QUANT, served_model_name="tiny-q") as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        for prompt, text in zip(prompts, want, strict=True):
            stream = client.completions.create(
                model="tiny-q", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert "".join(c.choices[0].text for c in stream) == text
        server.wait_kv_free()
        runner = server.engine.runner
        assert runner.kv_cache_dtype == "int8" and runner.quantization == "int8"
        with urllib.request.urlopen(server.url + "/metrics") as r:
            body = r.read().decode()
    labels = 'kv_cache_dtype="int8",model_name="tiny-q",quantization="int8"'
    m = re.search(r"pagestream_kv_cache_num_blocks\{" + labels + r"\} (\S+)", body)
    assert m and float(m.group(1)) == 256
    m = re.search(r"pagestream_kv_cache_bytes_per_token\{" + labels + r"\} (\S+)", body)
    # 4 layers x K and V x 2 kv heads x (64 int8 values + a 2-byte bf16 scale)
    assert m and float(m.group(1)) == 4 * 2 * 2 * 66
