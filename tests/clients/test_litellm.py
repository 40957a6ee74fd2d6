"""LiteLLM's SDK, unchanged, against a live server through its `hosted_vllm/` provider (what
a LiteLLM proxy in front of a vLLM fleet runs) and its generic `openai/` one: chat (plain,
streamed, async), a forced tool call, JSON-schema output, completions and embeddings, and
the server's 4xx as LiteLLM's own exception classes.

The oracle is the official openai client on the same server: greedy, the same messages give
the same text whichever client sent them."""

from __future__ import annotations

import asyncio
import json
import os

# The model price map is fetched from GitHub at import unless told to use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import numpy as np
import pytest

from tests.clients.conftest import MODEL_NAME, greedy_chat

MSGS = [{"role": "user", "content": "Tell me about the fox."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def kw(server) -> dict:
    return {"api_base": server.url + "/v1", "api_key": "x", "temperature": 0, "timeout": 120,
            "num_retries": 0}  # fmt: skip


def _want(oai, n: int) -> str:
    return greedy_chat(oai, MSGS, n)


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_chat_is_the_servers_answer(kw, oai, provider):
    r = litellm.completion(model=f"{provider}/{MODEL_NAME}", messages=MSGS, max_tokens=16, **kw)
    assert r.choices[0].message.content == _want(oai, 16)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 0


def test_streamed_chat_and_its_usage(kw, oai):
    chunks = list(litellm.completion(
        model=f"hosted_vllm/{MODEL_NAME}", messages=MSGS, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, **kw,
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _want(oai, 16)
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 16


def test_async_streams_run_concurrently(kw, oai):
    async def one(n: int) -> str:
        stream = await litellm.acompletion(
            model=f"hosted_vllm/{MODEL_NAME}", messages=MSGS, max_tokens=n, stream=True, **kw
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def both() -> list[str]:
        return await asyncio.gather(one(8), one(12))

    assert asyncio.run(both()) == [_want(oai, 8), _want(oai, 12)]


def test_a_forced_tool_call_comes_back_parsed(kw):
    r = litellm.completion(
        model=f"hosted_vllm/{MODEL_NAME}", messages=MSGS, tools=[WEATHER], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    # (LiteLLM's hosted_vllm provider drops the tool's `additionalProperties: false` from
    # what it sends, so other keys may follow the required ones)
    assert {"city", "unit"} <= set(args) and args["unit"] in ("celsius", "fahrenheit")
    assert len(args["city"]) <= 12


def test_json_schema_output(kw):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    r = litellm.completion(
        model=f"hosted_vllm/{MODEL_NAME}", messages=MSGS, max_tokens=40, **kw,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )  # fmt: skip
    assert 0 <= json.loads(r.choices[0].message.content)["n"] <= 9


def test_text_completion_and_embeddings(kw, oai):
    r = litellm.text_completion(
        model=f"hosted_vllm/{MODEL_NAME}", prompt="The quick brown", max_tokens=8, **kw
    )
    want = oai.completions.create(model=MODEL_NAME, prompt="The quick brown", max_tokens=8,
                                  temperature=0)  # fmt: skip
    assert r.choices[0].text == want.choices[0].text
    e = litellm.embedding(
        model=f"hosted_vllm/{MODEL_NAME}", input=["a fox", "a dog"],
        api_base=kw["api_base"], api_key="x",
    )  # fmt: skip
    ours = oai.embeddings.create(model=MODEL_NAME, input=["a fox", "a dog"]).data
    got = np.asarray([d["embedding"] for d in e.data])
    np.testing.assert_allclose(got, np.asarray([d.embedding for d in ours]), atol=1e-6)


def test_errors_are_litellms_classes(kw):
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(model="hosted_vllm/nope", messages=MSGS, max_tokens=4, **kw)
    with pytest.raises(litellm.BadRequestError) as e:
        litellm.completion(model=f"hosted_vllm/{MODEL_NAME}", messages=MSGS, max_tokens=4,
                           **{**kw, "temperature": -1})  # fmt: skip
    assert "temperature" in str(e.value)
