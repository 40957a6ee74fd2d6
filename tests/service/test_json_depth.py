"""The nesting limit on client JSON (issue 45, row 8): the raw-bytes scan agrees with a
reference parser, and every decoder an edge uses refuses a body past the limit with a
BadRequest naming the top-level field, before msgspec (or anything later) recurses."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.json_depth import MAX_JSON_DEPTH, TooDeep, check_depth
from service.protocol import BadRequest, ChatMessage, check_messages, decode_prefix
from service.protocol_openai import decode_chat, decode_completion
from service.protocol_structured import StructuredOutputsRequest, structured_spec
from service.protocol_ws import decode_ws

MSGS = [{"role": "user", "content": "hi"}]


def nested(depth: int, leaf: object = 1) -> object:
    """`depth` levels of alternating objects and arrays around `leaf`."""
    value = leaf
    for i in range(depth):
        value = {"a[": value} if i % 2 else [value, ']}\\"']
    return value


def depth_of(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text('[]{}"\\:,ab é'),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text('[]{}"\\:ab'), kids, max_size=3)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(1, 6))
def test_scan_agrees_with_a_parser(value, limit):
    text = json.dumps(value, ensure_ascii=False)
    deep = depth_of(value) > limit
    for form in (text, text.encode()):
        if deep:
            with pytest.raises(TooDeep):
                check_depth(form, limit)
        else:
            check_depth(form, limit)


def test_brackets_inside_strings_and_escapes_do_not_count():
    tricky = json.dumps({"s": "[[[[{{{{" * 50 + '\\"' + "[[[" * 50, "t": ["\\", '"[', "\\\\"]})
    check_depth(tricky)
    assert depth_of(json.loads(tricky)) == 2


def test_the_limit_is_exact():
    check_depth(json.dumps({"x": nested(MAX_JSON_DEPTH - 1)}))
    with pytest.raises(TooDeep) as e:
        check_depth(json.dumps({"x": nested(MAX_JSON_DEPTH)}))
    assert e.value.field == "x"


def test_the_top_level_field_is_named():
    body = json.dumps({"model": "m", "n": [[1]], "chat_template_kwargs": {"k": nested(200)}})
    with pytest.raises(TooDeep) as e:
        check_depth(body)
    assert e.value.field == "chat_template_kwargs"
    with pytest.raises(TooDeep) as e:
        check_depth(json.dumps(nested(201)))  # an array outermost: no field to name
    assert e.value.field is None


def deep_body(field: str, base: dict, depth: int = 990) -> bytes:
    """`base` with `field` holding JSON nested `depth` deep, written by hand: json.dumps
    itself recurses, and 990 levels is past what it can write."""
    head = json.dumps(base)[:-1]
    sep = ", " if base else ""
    return f'{head}{sep}"{field}": {"[" * depth}{"]" * depth}}}'.encode()


CHAT = {"messages": MSGS}
COMPLETION = {"prompt": "hi"}
WS = {"type": "generate", "id": "g1", "prompt": "hi"}


@pytest.mark.parametrize(
    ("decoder", "base", "field"),
    [
        (decode_chat, CHAT, "allowed_token_ids"),
        (decode_chat, CHAT, "guided_json"),
        (decode_chat, CHAT, "chat_template_kwargs"),
        (decode_chat, CHAT, "tools"),
        (decode_chat, CHAT, "response_format"),
        (decode_chat, CHAT, "logit_bias"),
        (decode_chat, CHAT, "metadata"),
        (decode_completion, COMPLETION, "logit_bias"),
        (decode_completion, COMPLETION, "structured_outputs"),
        (decode_completion, {}, "prompt"),
        (decode_prefix, {}, "messages"),
        (decode_ws, WS, "params"),
        (decode_ws, {"type": "generate", "id": "g1"}, "messages"),
    ],
)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 100_000])
def test_every_decoder_refuses_deep_nesting_naming_the_field(decoder, base, field, depth):
    with pytest.raises(BadRequest) as e:
        decoder(deep_body(field, base, depth))
    assert e.value.param == field
    assert e.value.status == 400
    assert str(MAX_JSON_DEPTH) in e.value.message


def test_websocket_frames_arrive_as_text():
    with pytest.raises(BadRequest) as e:
        decode_ws(deep_body("params", WS).decode())
    assert e.value.param == "params"


def test_json_inside_strings_is_held_to_the_same_limit():
    deep_text = "[" * 990 + "]" * 990
    req = decode_chat(json.dumps({**CHAT, "guided_json": deep_text}).encode())
    with pytest.raises(BadRequest) as e:
        req.structured()
    assert e.value.param == "guided_json"
    with pytest.raises(BadRequest) as e:
        structured_spec(None, StructuredOutputsRequest(json=deep_text), {})
    assert e.value.param == "structured_outputs.json"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_text}}
    messages = msgspec.convert(
        [*MSGS, {"role": "assistant", "tool_calls": [call]}], list[ChatMessage]
    )
    with pytest.raises(BadRequest) as e:
        check_messages(messages)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    # A caller that skipped the check still cannot make the template see a deep value.
    assert messages[1].as_template_dict()["tool_calls"][0]["function"]["arguments"] == deep_text


def test_ordinary_bodies_are_untouched():
    body = {**CHAT, "guided_json": nested(20), "chat_template_kwargs": {"k": nested(30)}}
    req = decode_chat(json.dumps(body).encode())
    assert req.chat_template_kwargs == {"k": nested(30)}
    assert req.structured() is not None
