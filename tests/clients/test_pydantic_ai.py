"""Pydantic AI's agents, unchanged, on a live server through its OpenAI chat model and
provider: a text run and a streamed one (the same text the openai client gets, greedy),
structured output as a tool call (its default: `tool_choice` required, the arguments
constrained to the model's schema) and as the server's JSON-schema output (`NativeOutput`),
each validated into the pydantic model by the agent itself."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.clients.conftest import MODEL_NAME, greedy_chat

ASK = "Tell me about the fox."


class City(BaseModel):
    # Bounded, as an agent's output type should be for a model this small: unbounded
    # strings run to max_tokens.
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**7)


@pytest.fixture(scope="module")
def model(server) -> OpenAIChatModel:
    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="x")
    return OpenAIChatModel(MODEL_NAME, provider=provider)


def _want(oai, n: int) -> str:
    return greedy_chat(oai, [{"role": "user", "content": ASK}], n)


def test_text_run_and_stream(model, oai):
    agent = Agent(model, model_settings={"max_tokens": 16, "temperature": 0})
    r = agent.run_sync(ASK)
    assert r.output == _want(oai, 16)
    assert r.usage.output_tokens == 16

    async def streamed() -> str:
        async with agent.run_stream(ASK) as s:
            return "".join([d async for d in s.stream_text(delta=True)])

    assert asyncio.run(streamed()) == _want(oai, 16)


@pytest.mark.parametrize("native", [False, True], ids=["tool output", "native output"])
def test_structured_output_is_validated(model, native):
    agent = Agent(
        model,
        output_type=NativeOutput(City) if native else City,
        model_settings={"max_tokens": 200, "temperature": 0},
        retries=0,  # a reply that fails validation fails the test, not a retry
    )
    r = agent.run_sync("Which city is the largest?")
    assert isinstance(r.output, City) and len(r.output.name) <= 12
