"""A model's recommended sampling (`generation_config.json`) as the defaults for what a
request leaves out, and its `max_new_tokens` as a cap (`--generation-config`, vLLM's).
The checkpoint's config sets top_k 1, which makes any sampling greedy: a request that
leaves top_k out answers as temperature 0 does; one that sets it samples."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
import websockets

from scheduler.config import ConfigError
from scheduler.sampling_params import SamplingParams
from service.cli import build_parser, server_config
from service.generation_defaults import GenerationDefaults
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

CAP = 6
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("gencfg") / "m"
    shutil.copytree(tiny_checkpoint("llama"), out)
    cfg = json.loads((out / "generation_config.json").read_text())
    cfg |= {"do_sample": True, "top_k": 1, "max_new_tokens": CAP}
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, served_model_name="m") as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _chat(client, **kw):
    args = dict(model="m", messages=PROMPT, extra_body={"ignore_eos": True})
    return client.chat.completions.create(**(args | kw)).choices[0]


def test_left_out_fields_take_the_models_recommendation(client):
    greedy = _chat(client, temperature=0, max_tokens=CAP)
    # Temperature 1 (the API's default) and a seed, top_k from the config: greedy.
    assert _chat(client, seed=5).message.content == greedy.message.content
    # A request's own top_k wins: sampled now.
    sampled = [_chat(client, seed=s, extra_body={"top_k": 0, "ignore_eos": True}) for s in (5, 6)]
    assert any(c.message.content != greedy.message.content for c in sampled)

    # max_new_tokens caps every request, asked or not (completions' default 16 too).
    assert len(_chat(client, extra_body={"return_token_ids": True,
                     "ignore_eos": True}).model_extra["token_ids"]) == CAP  # fmt: skip
    long = _chat(client, max_tokens=40, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert (len(long.model_extra["token_ids"]), long.finish_reason) == (CAP, "length")
    short = _chat(client, max_tokens=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(short.model_extra["token_ids"]) == 3
    c = client.completions.create(model="m", prompt="The sea", extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == CAP


def test_websocket_params_left_out_take_it_too(server, client):
    greedy = _chat(client, temperature=0, max_tokens=CAP).message.content

    async def run() -> str:
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "g", "messages": PROMPT,
                                      "params": {"seed": 5, "ignore_eos": True}}))  # fmt: skip
            text = []
            while (f := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] == "delta":
                text.append(f["text"])
            assert f["type"] == "done" and f["usage"]["completion_tokens"] == CAP, f
            return "".join(text)

    assert asyncio.run(run()) == greedy


def test_vllm_mode_and_overrides(model):
    with live_server(model, served_model_name="m", generation_config="vllm") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = _chat(c, max_tokens=10, extra_body={"return_token_ids": True, "ignore_eos": True})
        assert len(r.model_extra["token_ids"]) == 10  # no cap: the file is not read
    d = GenerationDefaults.load("auto", model, {"temperature": 0.5, "max_new_tokens": 3})
    assert (d.values, d.max_tokens) == ({"top_k": 1, "temperature": 0.5}, 3)
    assert GenerationDefaults.load("vllm", model, {"top_p": 0.9}).values == {"top_p": 0.9}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--override-generation-config", '{"temperature": -1}'], "temperature"),
        (["--override-generation-config", '{"top_k": 1.5}'], "top_k"),
        (["--override-generation-config", '{"max_new_tokens": 0}'], "max_new_tokens"),
        (["--override-generation-config", '{"seed": 3}'], "'seed' is not one of"),
        (["--generation-config", "/nonexistent"], "no generation_config.json"),
    ],
)
def test_a_config_no_request_could_carry_is_refused_at_start(model, argv, match):
    with pytest.raises(ConfigError, match=match):
        server_config(build_parser().parse_args(["serve", "--model", model, *argv]))


def test_offline_llm_default_params(model):
    from service.llm import LLM

    llm = LLM(model, dtype="float32", num_kv_blocks=64, threads=1)
    try:
        params = llm.get_default_sampling_params()
        assert (params.top_k, params.max_tokens) == (1, CAP)
        (out,) = llm.generate(["The sea"])
        greedy = llm.generate(["The sea"], SamplingParams(temperature=0, max_tokens=CAP))
        assert out.outputs[0].token_ids == greedy[0].outputs[0].token_ids
    finally:
        llm.shutdown()
