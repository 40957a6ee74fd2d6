"""Tool-call parsing and streaming deltas, on strings (no server)."""

from __future__ import annotations

import json

import pytest

from service.protocol_openai import decode_chat
from service.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    ToolStream,
    constraint,
    parse_output,
    tool_mode,
)

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
    # The text before the first call as it is, as a stream sends it (vLLM's parser too).
    assert content == "Let me see.\n"
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


def _pydantic_like(item_props):
    # What pydantic writes for a model with a nested one: $defs at the root, $ref into it.
    return {
        "$defs": {
            "Item": {"type": "object", "properties": item_props, "required": list(item_props)}
        },
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}, "n": {"type": "integer"}},
        "required": ["item", "n"],
    }


def _resolve(root, ref):
    node = root
    for part in ref.removeprefix("#/").split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def test_required_hoists_each_tools_defs_apart():
    a = _pydantic_like({"sku": {"type": "string"}})
    b = _pydantic_like({"qty": {"type": "integer"}})  # another "Item"
    b["properties"]["self"] = {"$ref": "#/properties/n"}  # a pointer that is not into $defs
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": a}},
        {"type": "function", "function": {"name": "b", "parameters": b}},
    ]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    spec, _ = constraint(decode_chat(json.dumps(body).encode()), "required")
    root = json.loads(spec.json)
    pa, pb = (c["properties"]["parameters"] for c in root["items"]["anyOf"])
    assert "$defs" not in pa and "$defs" not in pb
    assert _resolve(root, pa["properties"]["item"]["$ref"])["properties"] == {
        "sku": {"type": "string"}
    }
    assert _resolve(root, pb["properties"]["item"]["$ref"])["properties"] == {
        "qty": {"type": "integer"}
    }
    assert _resolve(root, pb["properties"]["self"]["$ref"]) == {"type": "integer"}
    # the schema's own key order survives (no sort): item before n
    assert list(pa["properties"]) == ["item", "n"]


def test_required_cut_short_keeps_calls_not_content():
    req = chat(tool_choice="required")
    done = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "x'
    content, calls = parse_output("required", done, None, req)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"a": 1}'),
        ("g", '{"b": "x'),  # as far as it got, as OpenAI reports a truncated call
    ]
    assert parse_output("required", '[{"name": "f", "param', None, req) == (None, [])
    assert parse_output("required", "[", None, req) == (None, [])
