"""LangChain's ChatAnthropic, unchanged, against a live server's /v1/messages: invoke and
stream equal to the chat route's greedy turn, structured output by tool calling and by
JSON schema (`output_config.format`), and bound tools under `tool_choice="any"`."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

langchain_anthropic = pytest.importorskip("langchain_anthropic")

from tests.clients.conftest import MODEL_NAME as MODEL  # noqa: E402

PROMPT = "Refund order five, then explain."


class Refund(BaseModel):
    """Refund an order."""

    # Closed (additionalProperties false): an open object lets this model add keys until
    # max_tokens.
    model_config = ConfigDict(extra="forbid")
    order_id: int = Field(ge=1, le=999)
    reason: str = Field(max_length=16)


class Lookup(BaseModel):
    """Look an order up."""

    model_config = ConfigDict(extra="forbid")
    order_id: int = Field(ge=1, le=999)


@pytest.fixture(scope="module")
def llm(server):
    return langchain_anthropic.ChatAnthropic(
        model=MODEL, base_url=server.url, api_key="x", temperature=0, max_tokens=32,
        max_retries=0, timeout=120,
    )  # fmt: skip


def test_invoke_and_stream_are_the_chat_turn(llm, server):
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    turn = chat.chat.completions.create(
        model=MODEL, max_tokens=32, temperature=0, messages=[{"role": "user", "content": PROMPT}]
    )
    msg = llm.invoke(PROMPT)
    assert msg.content == turn.choices[0].message.content
    assert msg.usage_metadata["input_tokens"] == turn.usage.prompt_tokens
    assert msg.response_metadata["stop_reason"] == "max_tokens"
    streamed = "".join(c.text for c in llm.stream(PROMPT))
    assert streamed == msg.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output(llm, method):
    out = llm.bind(max_tokens=120).with_structured_output(Refund, method=method).invoke(PROMPT)
    assert isinstance(out, Refund)


def test_bound_tools_any(llm):
    msg = (
        llm.bind(max_tokens=120)
        .bind_tools([Refund, Lookup], tool_choice="any", parallel_tool_calls=False)
        .invoke(PROMPT)
    )
    (call,) = msg.tool_calls
    model = {"Refund": Refund, "Lookup": Lookup}[call["name"]]
    assert isinstance(model.model_validate(call["args"]), model)
    assert msg.response_metadata["stop_reason"] == "tool_use"
