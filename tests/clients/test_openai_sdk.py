"""The official openai SDK's helpers, unchanged, against a live server: `parse` with
pydantic models, the `stream` helper's events, `pydantic_function_tool`, and the
completions shapes lm-eval and other scorers read."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field, create_model

from tests.clients.conftest import MODEL_NAME as MODEL

MSGS = [{"role": "user", "content": "Order two widgets, then explain."}]


class Answer(BaseModel):
    # Declared reasoning first: the model must reason before it answers.  Sorted keys
    # would put "answer" first.
    reasoning: str = Field(max_length=40)
    answer: int = Field(ge=0, le=99)


# Two tools whose nested models share the name "Item" but not the shape: pydantic puts
# each under its schema's $defs as "Item".
OrderItem = create_model("Item", sku=(str, Field(max_length=8)), qty=(int, Field(ge=1, le=9)))
RefundItem = create_model("Item", order_id=(int, Field(ge=1, le=999)))


class PlaceOrder(BaseModel):
    """Place an order."""

    items: list[OrderItem] = Field(min_length=1, max_length=2)  # type: ignore[valid-type]
    note: str = Field(max_length=16)


class Refund(BaseModel):
    """Refund an item."""

    item: RefundItem  # type: ignore[valid-type]
    reason: str = Field(max_length=16)


TOOLS = [openai.pydantic_function_tool(PlaceOrder), openai.pydantic_function_tool(Refund)]
MODELS = {"PlaceOrder": PlaceOrder, "Refund": Refund, "Answer": Answer}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_tools_carry_nested_defs_as_pydantic_writes_them():
    # What the server must take: each tool's own $defs, both named "Item".
    defs = [t["function"]["parameters"]["$defs"] for t in TOOLS]
    assert [list(d) for d in defs] == [["Item"], ["Item"]] and defs[0] != defs[1]


def test_parse_keeps_the_schemas_key_order(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=MSGS, response_format=Answer, max_tokens=200, temperature=0
    )
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Answer)
    assert list(json.loads(msg.content)) == ["reasoning", "answer"]


def test_parse_required_tools_with_nested_models(client):
    # One call each (parallel_tool_calls false): this model would go on adding calls to
    # the array until max_tokens.
    r = client.chat.completions.parse(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=3, n=2,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert isinstance(call.function.parsed_arguments, MODELS[call.function.name])
            # the arguments keep the model's field order too
            assert list(json.loads(call.function.arguments)) == list(
                MODELS[call.function.name].model_fields
            )


def test_parse_named_tool_with_nested_models(client):
    named = {"type": "function", "function": {"name": "Refund"}}
    r = client.chat.completions.parse(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Refund)


def _stream_events(client, **kw):
    with client.chat.completions.stream(model=MODEL, messages=MSGS, **kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    return events, final


def _check_tool_stream(events, final):
    calls = final.choices[0].message.tool_calls
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert calls and [e.index for e in done] == list(range(len(calls)))
    for e, call in zip(done, calls, strict=True):
        assert e.name == call.function.name and e.arguments == call.function.arguments
        assert isinstance(e.parsed_arguments, MODELS[e.name])
    # A tool-call stream never opens with an empty content string.
    first = next(e for e in events if e.type == "chunk").chunk.choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert not any(e.type == "content.delta" for e in events)


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        (TOOLS, "required"),
        (TOOLS, {"type": "function", "function": {"name": "PlaceOrder"}}),
        ([openai.pydantic_function_tool(Answer)], "required"),  # no $defs
    ],
    ids=["required", "named", "required-flat"],
)
def test_stream_helper_closes_the_tool_call(client, tools, tool_choice):
    events, final = _stream_events(
        client, tools=tools, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=300, temperature=1.0, seed=5,
    )  # fmt: skip
    _check_tool_stream(events, final)


def test_stream_helper_closes_each_of_several_calls(client):
    # Left to itself this model adds calls until max_tokens (the helper then raises
    # LengthFinishReasonError); among a few seeds some close the array after two or more.
    for seed in range(8):
        try:
            events, final = _stream_events(
                client, tools=TOOLS, tool_choice="required", max_tokens=400,
                temperature=1.0, seed=seed,
            )  # fmt: skip
        except openai.LengthFinishReasonError:
            continue
        if len(final.choices[0].message.tool_calls) >= 2:
            _check_tool_stream(events, final)
            return
    pytest.fail("no seed gave a stream of several complete calls")


def test_stream_helper_parses_content_as_parse_does(client):
    kw = {"response_format": Answer, "max_tokens": 200, "temperature": 0}
    events, final = _stream_events(client, **kw)
    (done,) = [e for e in events if e.type == "content.done"]
    whole = client.chat.completions.parse(model=MODEL, messages=MSGS, **kw)
    assert done.parsed == whole.choices[0].message.parsed == final.choices[0].message.parsed


def test_auto_hermes_content_is_the_same_streamed_or_not(client):
    # The model would never write a call on its own: a regex makes it, and the hermes
    # parser (not the grammar) turns it into tool_calls.
    call = r'<tool_call>\n\{"name": "Refund", "arguments": \{"item": \{"order_id": [1-9]\}, "reason": "late"\}\}\n</tool_call>'
    body = {"structured_outputs": {"regex": r"Sure\. " + call}}
    kw = {"tools": TOOLS, "max_tokens": 80, "temperature": 0, "extra_body": body}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Sure. "
    events, final = _stream_events(client, **kw)
    streamed = final.choices[0].message
    assert streamed.content == msg.content
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert isinstance(done.parsed_arguments, Refund)
    assert done.arguments == msg.tool_calls[0].function.arguments


def test_required_call_cut_short_is_a_truncated_call_not_content(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required",
        max_tokens=24, temperature=0,
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    # As OpenAI reports a call max_tokens cut: the name, and the arguments as far as
    # they got (not JSON yet).
    (call,) = c.message.tool_calls
    assert call.function.name in MODELS
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=24
        )


def test_grammar_blocked_top_logprobs_are_numbers(client):
    # Only "yes" or "no" may follow: the other top alternatives are forbidden tokens,
    # reported at vLLM's floor, so max() over them (lm-eval's greedy check) works.
    kw = {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}
    r = client.completions.create(
        model=MODEL, prompt="Is it?", max_tokens=4, logprobs=5, temperature=0, **kw
    )
    tops = r.choices[0].logprobs.top_logprobs
    values = [v for top in tops for v in top.values()]
    assert all(isinstance(v, float) for v in values) and -9999.0 in values
    assert all(max(top.values()) > -9999.0 for top in tops)
    chat = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, logprobs=True, top_logprobs=5, **kw
    )
    alts = [a.logprob for t in chat.choices[0].logprobs.content for a in t.top_logprobs]
    assert all(isinstance(v, float) for v in alts) and -9999.0 in alts


def test_echo_with_max_tokens_zero_returns_the_prompt(client):
    prompt = "import os\nimport sys\n"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text == prompt and "".join(c.logprobs.tokens) == prompt
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0
    lps = c.logprobs.token_logprobs
    assert lps[0] is None and all(isinstance(v, float) for v in lps[1:])
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True
    )
    chunks = [ch.choices[0] for ch in stream]
    assert "".join(ch.text for ch in chunks) == prompt
    assert [t for ch in chunks if ch.logprobs for t in ch.logprobs.token_logprobs] == lps
    # Without echo there is nothing to return: a 400, as vLLM answers.
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_prompt_logprobs_carry_vllms_rank(client):
    r = client.completions.create(
        model=MODEL, prompt="def main():\n    return", max_tokens=1,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    plp, ids = c.model_extra["prompt_logprobs"], c.model_extra["prompt_token_ids"]
    assert plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:], strict=True):
        assert all(isinstance(v["rank"], int) and v["rank"] >= 1 for v in entry.values())
        mine = entry[str(tid)]
        # rank 1 is the top alternative; a prompt token ranked lower is less likely
        top = next(v for v in entry.values() if v["rank"] == 1)
        assert (mine["rank"] == 1) == (mine is top)
        assert mine["logprob"] <= top["logprob"]
