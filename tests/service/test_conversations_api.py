"""/v1/conversations through a live server and the official `openai` client: the
conversation object and its items (create, list with OpenAI's paging, retrieve, delete),
responses that name a conversation, and refusals that name the field.

The oracle for a response in a conversation is the same server's chat completion of the
conversation's messages followed by the turn's input, greedy."""

from __future__ import annotations

import openai
import pytest

from tests.service.live_server import live_server
from tests.service.test_responses_api import KEYS, TOOLS, chat, make_client, post
from tests.service.test_structured_api import hermes_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(
        hermes_checkpoint(tmp_path_factory),
        served_model_name="tiny",
        api_keys=KEYS,
        engine_kwargs={"max_model_len": 512, "threads": 1},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


def test_conversation_and_items(server, client):
    conv = client.conversations.create(
        items=[
            {"type": "message", "role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        metadata={"topic": "greeting"},
    )
    assert conv.object == "conversation" and conv.id.startswith("conv_")
    assert conv.metadata == {"topic": "greeting"}
    got = client.conversations.retrieve(conv.id)
    assert got.id == conv.id and got.created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"k": "v"}).metadata == {"k": "v"}
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        ],
    )
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"]
    items = list(client.conversations.items.list(conv.id, order="asc", limit=2))  # pages
    assert [i.type for i in items] == ["message"] * 3 + ["function_call", "function_call_output"]
    assert items[0].role == "system" and items[0].content[0].text == "You are terse."
    assert items[1].content[0].type == "input_text" and items[1].content[0].text == "Hi"
    assert items[2].content[0].type == "output_text" and items[2].id == added.data[0].id
    assert items[3].call_id == "call_1" and items[4].output == "3"
    newest = client.conversations.items.list(conv.id, limit=1)
    assert [i.id for i in newest.data] == [items[4].id] and newest.has_more
    one = client.conversations.items.retrieve(items[3].id, conversation_id=conv.id)
    assert one.type == "function_call" and one.name == "add"
    after = client.conversations.items.delete(items[3].id, conversation_id=conv.id)
    assert after.id == conv.id
    left = [i.id for i in client.conversations.items.list(conv.id, order="asc")]
    assert left == [i.id for i in items if i.id != items[3].id]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(items[3].id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):  # another API key's conversation
        make_client(server, KEYS[1]).conversations.retrieve(conv.id)
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):  # a conversation is no response, and back
        client.responses.retrieve(conv.id)


def test_responses_in_a_conversation(server, client):
    """Each turn sees the conversation's items before its input (the chat oracle), its
    input and output are appended, and the conversation's KV stays pinned between turns
    under its id."""
    conv = client.conversations.create(items=[{"role": "developer", "content": "Answer briefly."}])
    pins = server.conversation_pins()
    msgs = [{"role": "developer", "content": "Answer briefly."}]
    for text in ("Name a river.", "And a mountain?"):
        r = client.responses.create(
            model="tiny", input=text, conversation=conv.id, max_output_tokens=6, temperature=0
        )
        msgs.append({"role": "user", "content": text})
        msg, usage = chat(client, msgs, 6)
        assert r.output_text == msg.content and r.usage.input_tokens == usage.prompt_tokens
        assert r.conversation.id == conv.id
        msgs.append({"role": "assistant", "content": r.output_text})
        assert server.conversation_pins() == pins + 1  # one pin, the conversation's
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [(i.role, i.content[0].text) for i in items] == [
        (m["role"], m["content"]) for m in msgs
    ]  # fmt: skip
    # The output item keeps the id it had in the response.
    assert items[-1].id == r.output[0].id
    # Streamed turns and function calls are appended alike ({"id": ...} names it too).
    events = list(
        client.responses.create(
            model="tiny", input="Weather in Paris?", conversation={"id": conv.id}, tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    final = events[-1].response
    (call,) = final.output
    tail = client.conversations.items.list(conv.id, limit=2).data
    assert [i.type for i in tail] == ["function_call", "message"]
    assert tail[0].call_id == call.call_id and tail[0].arguments == call.arguments


def test_a_turn_in_a_conversation_counts_its_copy_of_the_history(server, client):
    """A response made in a conversation keeps the conversation's messages decoded for its
    turn (its own copy, unlike a chain's, shared with the parent entry): the memory
    store's bytes bound counts them."""
    history = [{"role": "user", "content": "river " * 80}, {"role": "assistant", "content": "ok"}]
    conv = client.conversations.create(items=history)
    kw = {"model": "tiny", "input": "Name one.", "max_output_tokens": 4, "temperature": 0}
    inside = client.responses.create(conversation=conv.id, **kw)
    alone = client.responses.create(**kw)

    def sizes() -> list[int]:
        shelves = server.state.serving.store._shelves.values()
        return [s.items[r].size for r in (inside.id, alone.id) for s in shelves if r in s.items]

    counted_inside, counted_alone = server.on_loop(sizes)
    assert counted_inside - counted_alone >= 480, (counted_inside, counted_alone)


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items", 400),
        ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
        ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata", 400),
        ("/v1/conversations", {"items": [{"type": "web_search_call", "status": "completed"}]},
         "items[0].type", 400),
        ("/v1/conversations", {"items": [{"id": "a", "role": "user", "content": "x"},
                                         {"id": "a", "role": "user", "content": "y"}]},
         "items[1].id", 400),
        ("/v1/conversations", {"items": [], "extra": 1}, "extra", 400),
        ("/v1/conversations/conv_nope/items", {"items": [{"role": "user", "content": "x"}]},
         "items", 404),
        ("/v1/conversations/conv_nope", {"metadata": {}}, "conversation_id", 404),
        ("/v1/responses", {"input": "x", "conversation": "conv_nope"}, "conversation", 404),
        ("/v1/responses", {"input": "x", "conversation": "c", "previous_response_id": "r"},
         "conversation", 400),
        ("/v1/responses", {"input": "x", "conversation": {"id": 3}}, "conversation", 400),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, path, body, param, status):
    code, reply = post(server, path, body)
    assert code == status and reply["error"]["param"] == param, reply


def test_a_conversation_is_bounded(server, client):
    conv = client.conversations.create()
    big = [{"role": "user", "content": "x" * 100_000}] * 20  # 2 MB a request
    code, _ = post(server, f"/v1/conversations/{conv.id}/items", {"items": big[:10]})
    assert code == 200
    code, reply = post(server, f"/v1/conversations/{conv.id}/items", {"items": big})
    assert code == 400 and reply["error"]["param"] == "items", reply
    assert "at most 2,097,152" in reply["error"]["message"]
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 10  # unchanged


def test_item_ids_stay_unique(server, client):
    conv = client.conversations.create(items=[{"id": "msg_mine", "role": "user", "content": "x"}])
    code, reply = post(
        server,
        f"/v1/conversations/{conv.id}/items",
        {"items": [{"id": "msg_mine", "role": "user", "content": "y"}]},
    )
    assert code == 400 and reply["error"]["param"] == "items[0].id", reply
    code, reply = post(
        server,
        "/v1/responses",
        {"input": [{"id": "msg_mine", "role": "user", "content": "y"}], "conversation": conv.id},
    )
    assert code == 400 and reply["error"]["param"] == "input[0].id", reply
    assert len(client.conversations.items.list(conv.id).data) == 1
