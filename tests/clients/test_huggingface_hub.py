"""huggingface_hub's InferenceClient, unchanged, against a live server given as its
`base_url` (how its docs point it at a self-hosted OpenAI-compatible server): chat
completions plain and streamed, its OpenAI-style `chat.completions.create` alias, a forced
tool call and JSON-schema output, and the server's 4xx as the hub's HTTP error.

The oracle is the official openai client on the same server (greedy, the same text).
The client names the model: without one it sends the placeholder `dummy`, which this server
refuses with a 404 naming `model`, as vLLM's does (TGI and llama.cpp's server ignore it)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from huggingface_hub import InferenceClient, constants
from huggingface_hub.errors import HfHubHTTPError

from tests.clients.conftest import MODEL_NAME, greedy_chat
from tests.clients.test_litellm import MSGS, WEATHER


@pytest.fixture(scope="module", autouse=True)
def _online_to_loopback() -> Iterator[None]:
    """The package runs with HF_HUB_OFFLINE (nothing may reach the Hub), which stops this
    client's every request, to loopback too; it talks only to the server here."""
    was, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    yield
    constants.HF_HUB_OFFLINE = was


@pytest.fixture(scope="module")
def hf(server) -> InferenceClient:
    return InferenceClient(base_url=server.url, api_key="x", timeout=120)


def _want(oai, n: int) -> str:
    return greedy_chat(oai, MSGS, n)


def test_chat_completion_plain_streamed_and_aliased(hf, oai):
    r = hf.chat_completion(MSGS, model=MODEL_NAME, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == _want(oai, 16)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    chunks = hf.chat_completion(MSGS, model=MODEL_NAME, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _want(oai, 16)
    alias = hf.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=8, temperature=0)
    assert alias.choices[0].message.content == _want(oai, 8)


def test_forced_tool_call_and_json_schema(hf):
    r = hf.chat_completion(
        MSGS, model=MODEL_NAME, max_tokens=120, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    args = call.function.arguments
    args = json.loads(args) if isinstance(args, str) else args
    assert args["unit"] in ("celsius", "fahrenheit")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = hf.chat_completion(
        MSGS, model=MODEL_NAME, max_tokens=20, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def test_errors_reach_the_client(hf, server):
    with pytest.raises(HfHubHTTPError) as e:
        hf.chat_completion(MSGS, model=MODEL_NAME, max_tokens=4, temperature=-1)
    assert e.value.response.status_code == 400
    with pytest.raises(HfHubHTTPError) as e:  # no model: the hub's placeholder
        InferenceClient(base_url=server.url, api_key="x").chat_completion(MSGS, max_tokens=4)
    assert e.value.response.status_code == 404
    assert e.value.response.json()["error"]["param"] == "model"
