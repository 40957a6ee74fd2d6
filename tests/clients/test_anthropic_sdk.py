"""Anthropic's official SDK, unchanged, against a live server's /v1/messages: a message
whole and streamed (the stream helper's text and final message), stop sequences, tools
(forced, required, and the tool result sent back), count_tokens, and its errors.  The
oracle is the chat route: the same turn through /v1/chat/completions, greedy."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.clients.conftest import MODEL_NAME as MODEL
from tests.service.live_server import live_server

SYSTEM = "Answer briefly."
MSGS = [{"role": "user", "content": "Name a Python module."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2]}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# This SDK has no sampling arguments (Anthropic's newer models take none); older clients
# send `temperature`, which the server takes: greedy here, through extra_body.
GREEDY = {"temperature": 0}


def _create(client, **kw):
    args = dict(model=MODEL, max_tokens=24, system=SYSTEM, messages=MSGS, extra_body=GREEDY)
    return client.messages.create(**(args | kw))


def test_a_message_is_the_chat_turn_whole_and_streamed(client, chat):
    msg = _create(client)
    turn = chat.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *MSGS],
    )  # fmt: skip
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == turn.choices[0].message.content
    assert (
        msg.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[turn.choices[0].finish_reason]
    )
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (
        turn.usage.prompt_tokens, turn.usage.completion_tokens,
    )  # fmt: skip

    with client.messages.stream(model=MODEL, max_tokens=24, system=SYSTEM, messages=MSGS,
                                extra_body=GREEDY) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text
    assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})

    # The system prompt as blocks (with a cache mark, as Claude Code sends it): the same.
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    assert _create(client, system=blocks).content == msg.content

    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MSGS)
    assert count.input_tokens == msg.usage.input_tokens
    assert MODEL in [m.id for m in client.models.list()]  # (OpenAI's list, Anthropic's fields)


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    text = _create(client, max_tokens=24).content[0].text
    words = [w for w in text.split() if len(w) >= 3 and text.index(w) > 0]
    assert words, text
    stop = words[0]
    msg = _create(client, stop_sequences=[stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[: text.index(stop)]


def test_tools_forced_required_and_answered(client):
    forced = _create(client, tools=[WEATHER], max_tokens=60,
                     tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    (use,) = forced.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city", "days"} and use.input["days"] in (1, 2)
    assert forced.stop_reason == "tool_use"

    # Streamed: the input arrives as input_json deltas the helper assembles.
    with client.messages.stream(model=MODEL, max_tokens=60, system=SYSTEM, messages=MSGS,
                                extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:  # fmt: skip
        kinds = {e.type for e in s}
        streamed = s.get_final_message()
    assert "input_json" in kinds
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"

    required = _create(client, tools=[WEATHER], max_tokens=80, tool_choice={"type": "any",
                       "disable_parallel_tool_use": True})  # fmt: skip
    assert [b.type for b in required.content] == ["tool_use"]

    # The result sent back, as an agent loop sends it: a tool_result block.
    history = [*MSGS, {"role": "assistant", "content": [use.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 21 C"}]}]  # fmt: skip
    answer = _create(client, tools=[WEATHER], messages=history, tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")


def test_errors_are_anthropic_errors_naming_the_field(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=MSGS)
    assert e.value.body["type"] == "error" and "max_tokens" in e.value.body["error"]["param"]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
              "media_type": "image/png", "data": "AAAA"}}]}]  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as e:
        _create(client, messages=image)
    assert e.value.body["error"]["param"] == "messages[0].content[0].type"
    with pytest.raises(anthropic.BadRequestError) as e:
        _create(client, tools=[{**WEATHER, "type": "web_search_20250305"}])
    assert e.value.body["error"]["param"] == "tools[0].type"
    with pytest.raises(anthropic.NotFoundError):
        _create(client, model="claude-none")
    with pytest.raises(anthropic.BadRequestError) as e:
        _create(client, thinking={"type": "enabled", "budget_tokens": 24})
    assert e.value.body["error"]["param"] == "thinking.budget_tokens"


def test_the_api_key_may_come_as_x_api_key(model_dir):
    with live_server(str(model_dir), served_model_name=MODEL, api_keys=["k1"]) as s:
        ok = anthropic.Anthropic(base_url=s.url, api_key="k1", max_retries=0)
        assert ok.messages.create(model=MODEL, max_tokens=2, messages=MSGS).content
        bearer = anthropic.Anthropic(base_url=s.url, auth_token="k1", max_retries=0)
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=MSGS).content
        bad = anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, max_tokens=2, messages=MSGS)
        assert json.loads(e.value.response.text)["type"] == "error"


def test_a_last_assistant_message_is_continued(client, chat):
    """Anthropic's prefill: the answer continues the last assistant message (the chat
    route's continue_final_message), and only the continuation comes back."""
    prefill = [*MSGS, {"role": "assistant", "content": "The module"}]
    msg = _create(client, messages=prefill)
    turn = chat.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *prefill],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert msg.content[0].text == turn.choices[0].message.content
    assert msg.content[0].text != _create(client).content[0].text
