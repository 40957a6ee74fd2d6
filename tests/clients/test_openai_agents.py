"""The OpenAI Agents SDK, unchanged, against a live server: its Responses-API model
(`OpenAIResponsesModel`) drives `/v1/responses` as it drives OpenAI's, whole and streamed,
with a function tool the agent calls and runs, and a conversation carried by
`previous_response_id`, by its `OpenAIConversationsSession` (the Conversations API's
items) and by a server-side `conversation_id`.  Tracing stays off (it would export to
OpenAI)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import openai
import pytest
from pydantic import BaseModel, Field

agents = pytest.importorskip("agents")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import ResponseTextDeltaEvent  # noqa: E402

from tests.clients.conftest import MODEL_NAME as MODEL  # noqa: E402

set_tracing_disabled(True)


def model(server) -> OpenAIResponsesModel:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return OpenAIResponsesModel(model=MODEL, openai_client=client)


# A tool's bounded arguments: the grammar the server builds from them always ends.
Small = Annotated[int, Field(ge=0, le=99)]


class Snippet(BaseModel):
    name: str = Field(max_length=12)
    lines: int = Field(ge=1, le=9)


def test_a_structured_agent_streamed_and_not(server):
    """An agent with an output type: the SDK sends its strict JSON schema as text.format,
    and the stream must end in response.completed (its runner fails a stream that ends
    otherwise), so the output is held to a schema that always ends."""
    agent = Agent(
        name="describer", instructions="Describe the code.", model=model(server),
        output_type=Snippet, model_settings=ModelSettings(temperature=0.0, max_tokens=80),
    )  # fmt: skip

    async def whole_and_streamed() -> tuple[Any, str, Any]:
        whole = await Runner.run(agent, "def add(a, b): return a + b")
        run = Runner.run_streamed(agent, "def add(a, b): return a + b")
        deltas = ""
        async for event in run.stream_events():
            if event.type == "raw_response_event" and isinstance(
                event.data, ResponseTextDeltaEvent
            ):
                deltas += event.data.delta
        return whole, deltas, run.final_output

    # One event loop for the agent's AsyncOpenAI client (its connections belong to it).
    whole, deltas, final = asyncio.run(whole_and_streamed())
    # The same turn asked of the server directly, through the openai SDK's own parse.
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="x").responses.parse(
        model=MODEL, instructions="Describe the code.", input="def add(a, b): return a + b",
        text_format=Snippet, temperature=0.0, max_output_tokens=80,
    )  # fmt: skip
    assert isinstance(whole.final_output, Snippet) and whole.final_output == direct.output_parsed
    assert final == whole.final_output and Snippet.model_validate_json(deltas) == final


def test_the_agent_calls_its_tool_and_runs_it(server):
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: Small, b: Small) -> str:
        """Add two numbers."""
        calls.append((a, b))
        return f"sum={a + b}"

    agent = Agent(
        name="calculator",
        instructions="Use the tool.",
        model=model(server),
        tools=[add],
        # One call: "required" is then an array of one item, so its grammar ends.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=120
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "Add 2 and 3."))
    # The server constrained the call to the tool's schema; the SDK parsed it, ran the
    # function, and (stop_on_first_tool) returned its output as the final answer.
    assert len(calls) == 1 and all(isinstance(v, int) for v in calls[0])
    assert result.final_output == f"sum={sum(calls[0])}"
    items = [i.type for i in result.new_items]
    assert items == ["tool_call_item", "tool_call_output_item"]
    raw = result.new_items[0].raw_item
    assert raw.name == "add" and json.loads(raw.arguments) == dict(zip("ab", calls[0]))


def test_previous_response_id_carries_the_conversation(server):
    settings = ModelSettings(temperature=0.0, max_tokens=80)
    agent = Agent(name="chat", model=model(server), model_settings=settings, output_type=Snippet)

    async def two_turns() -> tuple[Any, Any]:
        first = await Runner.run(agent, "import os")
        return first, await Runner.run(
            agent, "import sys", previous_response_id=first.last_response_id
        )

    first, follow = asyncio.run(two_turns())
    # The same turn sent whole: the first input and answer, then the new input.
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="x").responses.parse(
        model=MODEL, temperature=0.0, max_output_tokens=80, text_format=Snippet,
        input=[{"role": "user", "content": "import os"},
               {"role": "assistant", "content": first.final_output.model_dump_json()},
               {"role": "user", "content": "import sys"}],
    )  # fmt: skip
    assert follow.final_output == direct.output_parsed


def test_conversations_carry_the_conversation(server):
    """The SDK's session on the Conversations API (it lists the items, sends them back as
    input and adds the turn's new items) and a server-side conversation (`conversation_id`:
    the server prepends the items and appends the turn) both answer the second turn as the
    whole conversation sent at once."""
    settings = ModelSettings(temperature=0.0, max_tokens=80)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = Agent(
        name="chat", model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=settings, output_type=Snippet,
    )  # fmt: skip

    async def both() -> tuple[Any, Any, list[Any], Any, Any]:
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "import os", session=session)
        follow = await Runner.run(agent, "import sys", session=session)
        kept = await session.get_items()
        popped = await session.pop_item()
        conv = await client.conversations.create()
        server_first = await Runner.run(agent, "import os", conversation_id=conv.id)
        server_follow = await Runner.run(agent, "import sys", conversation_id=conv.id)
        assert server_first.final_output == first.final_output
        items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        return follow, server_follow, kept, popped, items

    follow, server_follow, kept, popped, items = asyncio.run(both())
    first_text = Snippet.model_validate_json(kept[1]["content"][0]["text"])
    direct = openai.OpenAI(base_url=server.url + "/v1", api_key="x").responses.parse(
        model=MODEL, temperature=0.0, max_output_tokens=80, text_format=Snippet,
        input=[{"role": "user", "content": "import os"},
               {"role": "assistant", "content": first_text.model_dump_json()},
               {"role": "user", "content": "import sys"}],
    )  # fmt: skip
    assert follow.final_output == direct.output_parsed == server_follow.final_output
    assert [i.get("role") for i in kept] == ["user", "assistant", "user", "assistant"]
    assert popped == kept[-1]
    assert [(i.role, i.content[0].text) for i in items][::2] == [
        ("user", "import os"), ("user", "import sys")
    ]  # fmt: skip


REASONING_INSTRUCTIONS = "Think, then answer."
REASONING_INPUT = "What is the sea?"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """`serve --reasoning-parser qwen3` with a thinking checkpoint that closes its thinking
    a few tokens into this agent's greedy turn."""
    from tests.checkpoints import thinking_model
    from tests.reliability.watch import serve_process

    messages = [{"role": "system", "content": REASONING_INSTRUCTIONS},
                {"role": "user", "content": REASONING_INPUT}]  # fmt: skip
    path = thinking_model(tmp_path_factory.mktemp("thinker"), messages)
    args = ("--dtype", "float32", "--served-model-name", MODEL, "--reasoning-parser", "qwen3")
    with serve_process(path, *args, log_dir=tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_reasoning_models_thinking_reaches_the_agent_as_a_reasoning_item(thinker, api):
    """The SDK's own converters turn the server's thinking into a ReasoningItem (from
    chat's `reasoning_content`, or the Responses `reasoning` item), whole and streamed,
    and replay it on the next turn (as `reasoning_content`, or the item sent back).  The
    agent's output type holds the answer after the thinking, which stays the model's own
    (the same text as without a schema), and ends the turn (the SDK fails a Responses
    turn cut off by max_tokens)."""
    from agents import OpenAIChatCompletionsModel

    client = openai.AsyncOpenAI(base_url=thinker.url + "/v1", api_key="x", max_retries=0)
    sdk_model = (
        OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        if api == "chat"
        else OpenAIResponsesModel(model=MODEL, openai_client=client)
    )
    agent = Agent(
        name="thinker", instructions=REASONING_INSTRUCTIONS, model=sdk_model,
        output_type=Snippet, model_settings=ModelSettings(temperature=0.0, max_tokens=80),
    )  # fmt: skip

    async def direct() -> tuple[str, str | None]:
        r = await client.chat.completions.create(
            model=MODEL, max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": REASONING_INSTRUCTIONS},
                      {"role": "user", "content": REASONING_INPUT}],
        )  # fmt: skip
        return r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content

    def thinking_of(result: Any) -> str:
        (item,) = [i for i in result.new_items if i.type == "reasoning_item"]
        raw = item.raw_item
        parts = raw.summary if api == "chat" else raw.content
        return "".join(p.text for p in parts)

    async def run() -> None:
        thinking, answer = await direct()
        assert thinking and answer  # the checkpoint's premise: it thinks, then answers
        whole = await Runner.run(agent, REASONING_INPUT)
        assert thinking_of(whole) == thinking and isinstance(whole.final_output, Snippet)
        streamed = Runner.run_streamed(agent, REASONING_INPUT)
        async for _ in streamed.stream_events():
            pass
        assert (thinking_of(streamed), streamed.final_output) == (thinking, whole.final_output)
        # The next turn replays the thinking to the server, which takes it.
        again = await Runner.run(agent, [*whole.to_input_list(), {"role": "user",
                                         "content": "And then?"}])  # fmt: skip
        assert isinstance(again.final_output, Snippet)

    asyncio.run(run())
