"""Tool-call parsing and streaming deltas, on strings (no server)."""

from __future__ import annotations

import json

import pytest

from service.protocol_openai import decode_chat
from service.tool_calls import HermesParser, Llama3JsonParser, ToolStream, constraint, tool_mode

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


def chat(**kw):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **kw}
    return decode_chat(json.dumps(body).encode())


def test_hermes_parser():
    p = HermesParser()
    text = 'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = p.parse(text)
    assert content == "Let me see."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert calls[0]["id"] != calls[1]["id"]
    assert p.parse("no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "f", "argu'
    assert p.parse(broken) == (broken, [])


def test_llama3_json_parser():
    p = Llama3JsonParser()
    content, calls = p.parse(
        '<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g", "parameters": {}}'
    )
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": "b"}
    assert p.parse("plain answer") == ("plain answer", [])
    assert p.parse('{"name": "f"} trailing')[1] == []


@pytest.mark.parametrize(
    "chunks",
    [
        ["Hi <tool", "_call>", '{"name": "f", "arguments": {}}</tool_call>'],
        ["Hi <", "tool_call>{", '"name": "f", "arguments": {}}'],
    ],
)
def test_stream_holds_back_a_marker_split_across_deltas(chunks):
    ts = ToolStream("auto", HermesParser(), chat())
    content = "".join(ts.feed(c).get("content", "") for c in chunks)
    last, called = ts.finish()
    assert content == "Hi " and called
    assert last["tool_calls"][0]["function"]["name"] == "f"


def test_stream_without_call_sends_all_content():
    ts = ToolStream("auto", HermesParser(), chat())
    text = "".join(ts.feed(c).get("content", "") for c in ["a <to", "ol> b <"])
    last, called = ts.finish()
    assert text + last.get("content", "") == "a <tool> b <" and not called


def test_modes_and_constraints():
    assert tool_mode(chat(tool_choice="none"), None) is None
    assert tool_mode(chat(tool_choice="required"), None) == "required"
    named = chat(tool_choice={"type": "function", "function": {"name": "g"}})
    assert tool_mode(named, None) == "named"
    spec, field = constraint(named, "named")
    assert (
        json.loads(spec.json) == {"properties": {}, "type": "object"}
        and field == "tools[1].function.parameters"
    )
    spec, field = constraint(chat(tool_choice="required", parallel_tool_calls=False), "required")
    schema = json.loads(spec.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2 and field == "tools"
