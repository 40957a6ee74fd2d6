"""/v1/responses through a live server and the official `openai` client: the response
object, the typed stream events (the SDK's own stream accumulator checks their order and
identities), function tools, structured text, the store (GET, DELETE, previous_response_id,
per API key) and refusals that name the field.

The oracle: a response is a chat turn, so the same server's chat completion of the same
messages (instructions as a system message, a previous response's input and output
before the new input) gives the same prompt tokens and, greedy, the same text."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pydantic
import pytest

from tests.service.live_server import live_server
from tests.service.test_structured_api import SCHEMAS, WEATHER, hermes_checkpoint

KEYS = ["key-a", "key-b"]
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    {"type": "function", "name": "add", "parameters": SCHEMAS["add"]},
]
BOOL_FORMAT = {
    "format": {
        "type": "json_schema",
        "name": "yes_no",
        "schema": {
            "type": "object",
            "properties": {"yes": {"type": "boolean"}},
            "required": ["yes"],
            "additionalProperties": False,
        },
        "strict": True,
    }
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return hermes_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model):
    with live_server(
        model,
        served_model_name="tiny",
        tool_call_parser="hermes",
        api_keys=KEYS,
        enable_prompt_tokens_details=True,
        engine_kwargs={"max_model_len": 512, "threads": 1},
    ) as s:
        yield s


def make_client(server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


def chat(client, messages, n_tokens: int, **kw):
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=n_tokens, temperature=0, **kw
    )
    return r.choices[0].message, r.usage


def post(server, path: str, body: dict, key: str = KEYS[0]) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --------------------------------------------------------------------------- the object
def test_response_is_the_chat_turn(client):
    r = client.responses.create(
        model="tiny", input="Name a colour.", instructions="Be brief.",
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    msg, usage = chat(
        client, [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Name a colour."}], 12,
    )  # fmt: skip
    assert r.object == "response" and r.model == "tiny" and r.instructions == "Be brief."
    assert r.output_text == msg.content
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Cut short by max_output_tokens: incomplete, as OpenAI's.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")


def test_input_items_render_as_chat_messages(client):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Again?"},
    ]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    msgs = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again?"},
    ]
    msg, usage = chat(client, msgs, 6)
    assert r.output_text == msg.content and r.usage.input_tokens == usage.prompt_tokens


def test_structured_text_completes(client):
    r = client.responses.create(model="tiny", input="Is it?", text=BOOL_FORMAT, temperature=0)
    assert r.status == "completed" and r.incomplete_details is None
    assert isinstance(json.loads(r.output_text)["yes"], bool)

    class Verdict(pydantic.BaseModel):
        yes: bool
        score: int

    parsed = client.responses.parse(
        model="tiny", input="Is it?", text_format=Verdict, temperature=1.0, max_output_tokens=60
    )
    assert isinstance(parsed.output_parsed, Verdict)


def test_logprobs_when_included(client):
    r = client.responses.create(
        model="tiny", input="Hi", max_output_tokens=4, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 4 and all(len(lp.top_logprobs) == 2 for lp in lps)
    # Greedy: each token is its step's most likely one.
    assert all(lp.logprob >= lp.top_logprobs[0].logprob - 1e-5 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text


# --------------------------------------------------------------------------- streaming
def test_stream_events_accumulate_to_the_response(client):
    whole = client.responses.create(
        model="tiny", input="Is it?", text=BOOL_FORMAT, temperature=0, store=False
    )
    with client.responses.stream(
        model="tiny", input="Is it?", text=BOOL_FORMAT, temperature=0, store=False
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") > 2  # token by token
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == "completed" and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_cut_short_ends_incomplete(client):
    events = list(
        client.responses.create(
            model="tiny", input="Hi", max_output_tokens=5, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output[0].content[0].text == text


# ----------------------------------------------------------------------------- tools
def test_named_function_call_and_its_output(client):
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(
        model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
        max_output_tokens=80, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = {e.type for e in events}
    assert {
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    } <= kinds
    assert final.output[0].arguments == call.arguments
    # The call's result goes back as an item: the next turn renders it as the chat route
    # renders an assistant tool call and a tool message.
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]  # fmt: skip
    r2 = client.responses.create(
        model="tiny", input=follow, tools=TOOLS, max_output_tokens=6, temperature=0,
        tool_choice="none",
    )  # fmt: skip
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]  # fmt: skip
    msg, usage = chat(client, msgs, 6, tools=chat_tools, tool_choice="none")
    assert r2.output_text == msg.content and r2.usage.input_tokens == usage.prompt_tokens


def test_required_function_calls_are_valid(client):
    r = client.responses.create(
        model="tiny", input="Do something.", tools=TOOLS, tool_choice="required",
        max_output_tokens=150, temperature=1.0,
    )  # fmt: skip
    assert r.output and all(o.type == "function_call" for o in r.output)
    for call in r.output:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id.startswith("call_")


# ------------------------------------------------------------------------------ store
def test_previous_response_continues_the_conversation(server, client):
    pins = server.conversation_pins()
    first = client.responses.create(
        model="tiny", input="Tell me a story.", instructions="Be brief.",
        max_output_tokens=10, temperature=0,
    )  # fmt: skip
    second = client.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    # Instructions are not carried over; the first turn's input and output are.
    msgs = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    msg, usage = chat(client, msgs, 8)
    assert second.previous_response_id == first.id
    assert second.output_text == msg.content
    assert second.usage.input_tokens == usage.prompt_tokens
    # A stored turn's KV is pinned for the next one (scheduler/pins.py), under the chain's
    # key: one pin for the chain, whichever turn holds it.
    assert server.conversation_pins() == pins + 1
    third = client.responses.create(
        model="tiny", input="Fine.", previous_response_id=second.id, max_output_tokens=4,
        temperature=0,
    )  # fmt: skip
    msgs += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Fine."},
    ]
    msg, usage = chat(client, msgs, 4)
    assert third.output_text == msg.content and third.usage.input_tokens == usage.prompt_tokens
    # Its prompt starts with the second turn's whole conversation (the first turn's
    # instructions are not in either), so most of it was cached.
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16
    assert server.conversation_pins() == pins + 1


def test_input_items_list_the_chain(server, client):
    """GET /v1/responses/{id}/input_items: every item the model was given (earlier turns'
    input and output, tool calls and their outputs; not instructions), newest first by
    default, paged by the SDK's cursor, each item's id the same in every response of the
    chain."""
    first = client.responses.create(
        model="tiny", input="Weather in Paris?", instructions="Be brief.", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
        temperature=0,
    )  # fmt: skip
    (call,) = first.output
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    third = client.responses.create(
        model="tiny", input="Thanks!", previous_response_id=second.id, max_output_tokens=3
    )
    (only,) = client.responses.input_items.list(first.id).data
    assert only.type == "message" and only.role == "user"
    assert only.content[0].type == "input_text" and only.content[0].text == "Weather in Paris?"
    items = list(client.responses.input_items.list(third.id, order="asc", limit=1))
    assert [i.type for i in items] == [
        "message", "function_call", "function_call_output", "message", "message"
    ]  # fmt: skip
    assert items[0].id == only.id  # the same item, the same id, in a later response
    assert (items[1].call_id, items[1].name, items[1].arguments) == (
        call.call_id, call.name, call.arguments,
    )  # fmt: skip
    assert items[2].call_id == call.call_id and items[2].output == "Sunny"
    assert items[3].role == "assistant" and items[3].content[0].text == second.output_text
    assert items[4].role == "user" and items[4].content[0].text == "Thanks!"
    page = client.responses.input_items.list(third.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more
    assert page.first_id == items[4].id and page.last_id == items[3].id
    rest = client.responses.input_items.list(third.id, after=page.last_id)
    assert [i.id for i in rest.data] == [i.id for i in items[2::-1]] and not rest.has_more
    before = client.responses.input_items.list(
        third.id, order="asc", extra_query={"before": items[2].id}
    )
    assert [i.id for i in before.data] == [items[0].id, items[1].id]
    for query, param in [
        ("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
        ("after=msg_nope", "after"), ("include=file_search_call.results", "include"),
    ]:  # fmt: skip
        req = urllib.request.Request(
            f"{server.url}/v1/responses/{third.id}/input_items?{query}",
            headers={"Authorization": f"Bearer {KEYS[0]}"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        make_client(server, KEYS[1]).responses.input_items.list(third.id)


def test_input_tokens_count_what_the_response_is_given(server, client):
    """POST /v1/responses/input_tokens (the SDK's `responses.input_tokens.count`): the
    oracle is the response's own `usage.input_tokens` for the same body, with
    instructions, tools, a stored chain and a conversation."""
    bodies = [
        {"input": "Name a colour."},
        {"input": "Weather in Paris?", "instructions": "Be brief.", "tools": TOOLS},
        {"input": [{"role": "developer", "content": "Terse."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
    ]  # fmt: skip
    first = client.responses.create(model="tiny", input="Tell me.", max_output_tokens=4)
    bodies.append({"input": "More?", "previous_response_id": first.id})
    conv = client.conversations.create(items=[{"role": "user", "content": "Earlier"}])
    bodies.append({"input": "Now?", "conversation": conv.id})
    for body in bodies:
        counted = client.responses.input_tokens.count(model="tiny", **body)
        assert counted.object == "response.input_tokens"
        r = client.responses.create(model="tiny", max_output_tokens=1, **body)
        assert counted.input_tokens == r.usage.input_tokens, body
    # Nothing generated, nothing stored or appended: the conversation holds what it held
    # plus the one turn created above.
    assert len(client.conversations.items.list(conv.id).data) == 3
    for body, param in [
        ({}, "input"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 3}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ]:
        code, obj = post(server, "/v1/responses/input_tokens", body)
        assert code in (400, 404) and obj["error"]["param"] == param, obj


def test_stored_streamed_response_is_retrievable(client):
    with client.responses.stream(model="tiny", input="Is it?", text=BOOL_FORMAT) as stream:
        final = stream.get_final_response()
    got = client.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == final.output_text and got.store


def test_store_get_delete_and_keys(server, client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.usage.output_tokens == 3
    other = make_client(server, KEYS[1])
    # Another API key sees nothing of it, nor can it continue or delete it.
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model="tiny", input="x", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # Without a key: 401, as every /v1 route.
    with pytest.raises(openai.AuthenticationError):
        make_client(server, "wrong").responses.retrieve(r.id)
    # store=false: answered, never kept.
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "web_search_call", "id": "w", "status": "completed"}]}, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
        ({"input": "hi", "truncation": "most"}, "truncation"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": []}, "input"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, body, param):
    code, obj = post(server, "/v1/responses", body)
    assert code in (400, 404) and obj["error"]["param"] == param, obj
    if not param.startswith("input"):
        assert param.split("[")[0].split(".")[0] in obj["error"]["message"], obj
    server.wait_kv_free(10)
