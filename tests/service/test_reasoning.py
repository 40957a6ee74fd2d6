"""Reasoning models (`serve --reasoning-parser`): the thinking between `<think>` and
`</think>` reaches clients as `reasoning` (and `reasoning_content`), the rest as the
answer; a grammar holds the answer, not the thinking.  The oracle is the model's own
token ids decoded by the tokenizers library and split at the closing tag."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import openai
import orjson
import pytest
import websockets
from tokenizers import Tokenizer as HFTokenizer

from scheduler.config import ConfigError
from scheduler.sampling_params import StructuredOutputsParams
from scheduler.structured import AfterReasoning
from service.cli import build_parser, server_config
from service.protocol import BadRequest
from service.protocol_anthropic import SIGNATURE_PREFIX, decode_messages, sign_thinking
from service.reasoning import ReasoningParser, ReasoningStream, ThinkingCount, split
from service.tokenizer import Tokenizer
from tests.checkpoints import THINK_PROMPT as MESSAGES
from tests.checkpoints import thinking_model, tiny_checkpoint
from tests.service.live_server import live_server

transformers = pytest.importorskip("transformers")

START, END = "<think>", "</think>"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> str:
    return thinking_model(tmp_path_factory.mktemp("thinker"))


def _oracle(model: str, token_ids: list[int]) -> tuple[str, str]:
    """(thinking, answer) of an output whose prompt opened `<think>`, from its ids."""
    text = HFTokenizer.from_file(str(Path(model) / "tokenizer.json")).decode(token_ids)
    thinking, _, answer = text.partition(END)
    return thinking, answer.lstrip()


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def server(request, thinker):
    with live_server(
        thinker, served_model_name="thinker", reasoning_parser="qwen3",
        tool_call_parser="hermes", engine_process=request.param == "engine-process",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _chat(client, **kw):
    args = dict(model="thinker", messages=MESSAGES, max_tokens=40, temperature=0)
    return client.chat.completions.create(**(args | kw))


def test_chat_answers_apart_from_the_thinking(client, thinker):
    r = _chat(client, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    thinking, answer = _oracle(thinker, ids)
    assert 2 <= ids.index(Tokenizer.from_dir(thinker).backend.token_to_id(END)) < 20
    assert thinking and answer  # the checkpoint's premise
    msg = choice.message.model_extra
    assert msg["reasoning"] == msg["reasoning_content"] == thinking
    assert choice.message.content == answer
    end = Tokenizer.from_dir(thinker).backend.token_to_id(END)
    assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(end) + 1

    # Streamed: the same text, thinking first, in deltas of their own.
    parts = {"reasoning": [], "reasoning_content": [], "content": []}
    usage = None
    stream = _chat(client, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta.model_dump()
            for k in parts:
                if d.get(k):
                    parts[k].append(d[k])
    assert "".join(parts["reasoning"]) == "".join(parts["reasoning_content"]) == thinking
    assert "".join(parts["content"]) == answer
    assert usage.completion_tokens_details.reasoning_tokens == ids.index(end) + 1

    # reasoning_effort goes to the template (this one does not read it: the same turn).
    low = _chat(client, reasoning_effort="low").choices[0].message
    assert (low.model_extra["reasoning"], low.content) == (thinking, answer)

    # include_reasoning false drops the thinking; the answer stays.
    r2 = _chat(client, extra_body={"include_reasoning": False})
    assert "reasoning" not in r2.choices[0].message.model_extra
    assert r2.choices[0].message.content == answer

    # The assistant turn sent back as the SDK returned it (its thinking fields included).
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True), {"role": "user",
               "content": "And then?"}]  # fmt: skip
    assert _chat(client, messages=history, max_tokens=4).choices[0].finish_reason


def test_thinking_off_is_all_answer(client, thinker):
    r = _chat(
        client, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                            "return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    text = HFTokenizer.from_file(str(Path(thinker) / "tokenizer.json")).decode(
        choice.model_extra["token_ids"]
    )
    assert "reasoning" not in choice.message.model_extra
    assert choice.message.content == text  # a `</think>` in it is the answer's own text
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


SCHEMA = {
    "type": "object",
    "properties": {"sea": {"type": "string", "maxLength": 12}},
    "required": ["sea"],
    "additionalProperties": False,
}


def test_grammar_holds_the_answer_not_the_thinking(client, thinker):
    free = _chat(client).choices[0].message.model_extra["reasoning"]
    r = _chat(
        client, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    )  # fmt: skip
    msg = r.choices[0].message
    # The thinking is the model's own (unconstrained: the same tokens as without the
    # grammar, and not JSON); the answer after it is the schema's.
    assert msg.model_extra["reasoning"] == free
    assert set(json.loads(msg.content)) == {"sea"}
    assert r.choices[0].finish_reason == "stop"

    # A required tool call: its arguments after the thinking.
    tools = [{"type": "function", "function": {"name": "tide", "parameters": {
        "type": "object", "properties": {"h": {"enum": [1, 2, 3]}},
        "required": ["h"], "additionalProperties": False}}}]  # fmt: skip
    t = _chat(client, max_tokens=80, tools=tools, tool_choice="required",
              parallel_tool_calls=False).choices[0]  # fmt: skip
    assert t.message.model_extra["reasoning"] == free
    (call,) = t.message.tool_calls
    assert call.function.name == "tide" and set(json.loads(call.function.arguments)) == {"h"}
    assert t.finish_reason == "tool_calls"


def test_responses_api_returns_a_reasoning_item(client, thinker):
    chat = _chat(client, max_tokens=30).choices[0].message
    kw = dict(model="thinker", input=MESSAGES[0]["content"], max_output_tokens=30,
              temperature=0)  # fmt: skip
    r = client.responses.create(**kw, reasoning={"effort": "low", "summary": "auto"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.model_extra["reasoning"]
    assert r.output_text == chat.content
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    kinds = []
    with client.responses.stream(**kw) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response  # (cut off at max_output_tokens: incomplete)
    assert [(o.type, o.model_dump(exclude={"id"})) for o in final.output] == [
        (o.type, o.model_dump(exclude={"id"})) for o in r.output
    ]
    first = kinds.index("response.output_item.added")
    thinking = [k for k in kinds[first:] if k != "response.reasoning_text.delta"][:5]
    assert thinking == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
    ]  # fmt: skip
    assert "response.reasoning_text.delta" in kinds

    # Its output sent back as input (as the Agents SDK does), and continued by id.
    back = [o.model_dump(exclude_none=True) for o in r.output]
    more = client.responses.create(
        model="thinker", input=[{"role": "user", "content": "Hi"}, *back,
                                {"role": "user", "content": "More"}], max_output_tokens=4,
        include=["reasoning.encrypted_content"],
    )  # fmt: skip
    assert more.status in ("completed", "incomplete")
    nxt = client.responses.create(
        model="thinker", previous_response_id=r.id, input="More", max_output_tokens=4
    )
    assert nxt.status in ("completed", "incomplete")


def test_websocket_deltas_carry_the_thinking_apart(server, client):
    chat = _chat(client, max_tokens=30).choices[0].message

    async def run() -> tuple[str, str, dict]:
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "g", "messages": MESSAGES,
                                      "params": {"max_tokens": 30, "temperature": 0}}))  # fmt: skip
            thinking, answer = [], []
            while True:
                f = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if f["type"] == "delta":
                    thinking.append(f.get("reasoning", ""))
                    answer.append(f["text"])
                elif f["type"] == "done":
                    return "".join(thinking), "".join(answer), f["usage"]
                else:
                    raise AssertionError(f)

    thinking, answer, usage = asyncio.run(run())
    assert (thinking, answer) == (chat.model_extra["reasoning"], chat.content)
    assert usage["reasoning_tokens"] > 0


# ------------------------------------------------------------------ the parts alone


class _Parser:
    p = ReasoningParser("qwen3", START, END, 100, 101, implicit=False)
    r1 = ReasoningParser("deepseek_r1", START, END, 100, 101, implicit=True)


TEXTS = [
    ("plan it</think>\n\nThe answer.", True, ("plan it", "The answer.")),
    ("  <think>a < b</thin k></think>ok</think>", None, ("a < b</thin k>", "ok</think>")),
    ("no tags at all <think>", None, ("", "no tags at all <think>")),
    ("cut off while thinking </thi", True, ("cut off while thinking </thi", "")),
    ("plain</think>", False, ("", "plain</think>")),
    ("</think>\n\n", True, ("", "")),
    ("<thi", None, ("", "<thi")),
]


@pytest.mark.parametrize(("text", "opening", "want"), TEXTS)
def test_stream_split_is_the_whole_split_however_cut(text, opening, want):
    thinking, answer, _ = split(_Parser.p, opening, text)
    assert (thinking, answer) == want
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s = ReasoningStream(_Parser.p, opening)
        got = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(g[0] for g in got), "".join(g[1] for g in got)) == want, pieces


def test_where_the_output_starts_is_read_from_the_prompt():
    def tail(ids):
        return "".join({7: "\n", 8: "x"}[i] for i in ids)

    p, r1 = _Parser.p, _Parser.r1
    assert p.opening_state([5, 100, 7], tail) is True  # the template opened it
    assert p.opening_state([5, 100, 7, 101, 7, 7], tail) is False  # opened and closed: off
    assert p.opening_state([5, 6], tail) is None  # the output may open it
    assert r1.opening_state([5, 6], tail) is True  # R1 thinks without the opening tag
    assert r1.opening_state([100, 101, 8, 8, 8], tail) is True  # closed long before
    counts = []
    for opening, ids in ((True, [1, 2, 101, 3]), (None, [100, 1, 101, 3]), (None, [1, 100]),
                         (False, [1, 101])):  # fmt: skip
        c = ThinkingCount(p, opening)
        c.feed(ids[:1])
        c.feed(ids[1:])
        counts.append(c.count)
    assert counts == [3, 3, 0, 0]


class _Grammar:
    """A matcher that accepts only token 7, with a mask allowing only it."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def bitmask(self) -> bytes:
        return bytes([1 << 7] + [0] * 15)

    def accept(self, t: int) -> bool:
        if t != 7:
            return False
        self.accepted.append(t)
        return True

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]

    terminated = False

    def error(self) -> None:
        return None


def test_the_grammar_starts_after_the_closing_token():
    m = AfterReasoning(_Grammar(), end=101)
    assert m.bitmask() is None and m.accept(3) and m.accept(5)  # thinking: anything
    assert m.accept(101) and m.bitmask() == bytes([1 << 7] + [0] * 15)
    assert m.accept(7) and not m.accept(3)
    m.rollback(2)  # back past the closing token: thinking again
    assert m.bitmask() is None and m.inner.accepted == []

    # May open: the first token is the opening tag or already the grammar's.
    m = AfterReasoning(_Grammar(), end=101, start=100)
    mask = m.bitmask()
    assert mask[100 // 8] & (1 << 100 % 8) and mask[0] == 1 << 7
    assert m.accept(7) and m.bitmask() == bytes([1 << 7] + [0] * 15)  # no thinking now
    m = AfterReasoning(_Grammar(), end=101, start=100)
    assert m.accept(100) and m.bitmask() is None and m.accept(101) and m.accept(7)
    m.rollback(3)
    assert m.bitmask()[100 // 8]  # all the way back: may open again


def test_a_grammar_spec_compiles_once_whatever_its_reasoning_tags():
    spec = StructuredOutputsParams(json_object=True)
    moved = ReasoningParser("qwen3", START, END, 100, 101, False).constrain(spec, None)
    assert (moved.reasoning_end, moved.reasoning_start) == (101, 100)
    assert ReasoningParser("qwen3", START, END, 100, 101, False).constrain(spec, False) is spec


def test_a_parser_the_tokenizer_cannot_serve_is_refused_at_start():
    plain = str(tiny_checkpoint("qwen3"))
    argv = ["serve", "--model", plain, "--reasoning-parser", "qwen3"]
    with pytest.raises(ConfigError, match="no '<think>' token"):
        server_config(build_parser().parse_args(argv))


def test_reasoning_effort_is_a_template_variable():
    from service.protocol_openai import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[], reasoning_effort="high")
    assert req.template_request() == (None, "chat_template", {"reasoning_effort": "high"})
    req = ChatCompletionRequest(
        messages=[], reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
    )
    assert req.template_request()[2] == {"reasoning_effort": "low"}  # the explicit one wins


def test_anthropic_messages_carry_thinking_blocks(server, client):
    """/v1/messages through Anthropic's SDK: the thinking as a thinking block, whole and
    streamed; `thinking: disabled` reaches the template; output_config.format holds the
    answer after the thinking."""
    anthropic = pytest.importorskip("anthropic")
    chat = _chat(client, max_tokens=30).choices[0].message
    sdk = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="thinker", max_tokens=30, messages=MESSAGES, extra_body={"temperature": 0})
    m = sdk.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 20})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (chat.model_extra["reasoning"],
                                                          chat.content)  # fmt: skip
    with sdk.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and _blocks(final) == _blocks(m)

    off = sdk.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]

    j = sdk.messages.create(
        **{**kw, "max_tokens": 80},
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert j.content[0].thinking == chat.model_extra["reasoning"]
    assert set(json.loads(j.content[1].text)) == {"sea"} and j.stop_reason == "end_turn"


def test_anthropic_thinking_omitted_keeps_its_signature(server):
    """display "omitted": the thinking blocks are there with empty text, and their
    signature holds the thinking (as Anthropic's encrypted one does), so the block sent
    back in the next request gives the template its thinking."""
    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="thinker", max_tokens=30, messages=MESSAGES, extra_body={"temperature": 0})
    shown = sdk.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 20})
    thought = shown.content[0].thinking
    assert thought and shown.content[0].signature == sign_thinking(thought)
    omitted = {"type": "enabled", "budget_tokens": 20, "display": "omitted"}
    m = sdk.messages.create(**kw, thinking=omitted)
    assert _blocks(m) == [("thinking", ""), ("text", shown.content[1].text)]
    assert m.content[0].signature == sign_thinking(thought)
    with sdk.messages.stream(**kw, thinking=omitted) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" not in deltas and deltas.count("signature_delta") == 1
    assert _blocks(final) == _blocks(m) and final.content[0].signature == sign_thinking(thought)
    with sdk.messages.stream(**kw) as stream:  # shown: its signature streamed too
        assert stream.get_final_message().content[0].signature == sign_thinking(thought)

    # Sent back: the signature stands for the omitted text.
    turn = {"role": "assistant", "content": [b.model_dump() for b in m.content]}
    history = [*MESSAGES, turn, {"role": "user", "content": "more"}]
    body = {"model": "thinker", "max_tokens": 4, "messages": history}
    assert decode_messages(orjson.dumps(body)).chat_messages()[1].reasoning_content == thought
    more = sdk.messages.create(**{**kw, "messages": history}, thinking=omitted)
    assert more.content[-1].type == "text"


def test_a_thinking_signature_from_elsewhere_is_read_past_and_a_broken_one_refused():
    def first_thought(block: dict) -> str | None:
        body = {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": [block]},
            {"role": "user", "content": "q"}]}  # fmt: skip
        return decode_messages(orjson.dumps(body)).chat_messages()[1].reasoning_content

    assert first_thought({"type": "thinking", "thinking": "", "signature": "EqQBCkgIAR"}) == ""
    assert first_thought({"type": "thinking", "thinking": "shown", "signature": "x"}) == "shown"
    with pytest.raises(BadRequest) as e:
        first_thought({"type": "thinking", "thinking": "", "signature": SIGNATURE_PREFIX + "!"})
    assert e.value.param == "messages[1].content[0].signature"


def _blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_a_thinking_budget_closes_the_thinking(client, thinker, server):
    """thinking_token_budget (vLLM's; Anthropic's budget_tokens): after that many tokens
    of thinking the closing tag is forced, whatever the model would have written."""
    end = Tokenizer.from_dir(thinker).backend.token_to_id(END)
    free = _chat(client, extra_body={"return_token_ids": True}).choices[0]
    assert free.model_extra["token_ids"].index(end) > 2  # (it would think longer)
    r = _chat(client, extra_body={"return_token_ids": True, "thinking_token_budget": 2})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids[:2] == free.model_extra["token_ids"][:2] and ids[2] == end
    thinking, answer = _oracle(thinker, ids)
    assert r.choices[0].message.model_extra["reasoning"] == thinking
    assert r.choices[0].message.content == answer
    assert r.usage.completion_tokens_details.reasoning_tokens == 3

    # With a grammar: the budget ends the thinking, the schema holds the answer.
    j = _chat(client, max_tokens=80, extra_body={"thinking_token_budget": 1,
              "return_token_ids": True}, response_format={"type": "json_schema",
              "json_schema": {"name": "s", "schema": SCHEMA}})  # fmt: skip
    assert j.choices[0].model_extra["token_ids"][1] == end
    assert set(json.loads(j.choices[0].message.content)) == {"sea"}

    anthropic = pytest.importorskip("anthropic")
    sdk = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    m = sdk.messages.create(model="thinker", max_tokens=40, messages=MESSAGES,
                            thinking={"type": "enabled", "budget_tokens": 2},
                            extra_body={"temperature": 0})  # fmt: skip
    assert m.content[0].thinking == thinking


def test_a_thinking_budget_needs_a_reasoning_parser(thinker):
    with live_server(thinker, served_model_name="thinker") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            _chat(c, extra_body={"thinking_token_budget": 4})
        assert e.value.body["param"] == "thinking_token_budget"


def test_the_budget_forces_the_closing_token():
    m = AfterReasoning(None, end=101, budget=2, mask_bytes=16)
    assert m.bitmask() is None and m.accept(3) and m.bitmask() is None and m.accept(4)
    only = m.bitmask()
    assert sum(bin(b).count("1") for b in only) == 1 and only[101 // 8] == 1 << (101 % 8)
    assert not m.accept(5) and m.accept(101)
    assert m.bitmask() is None and m.accept(9) and not m.terminated and m.error() is None

    # May open: the opening tag is not counted; no opening, no thinking to bound.
    m = AfterReasoning(None, end=101, start=100, budget=1, mask_bytes=16)
    assert m.accept(100) and m.bitmask() is None and m.accept(7) and m.bitmask() is not None
    m = AfterReasoning(None, end=101, start=100, budget=0, mask_bytes=16)
    assert m.bitmask() is None and m.accept(7) and m.bitmask() is None


def test_each_choice_splits_its_own_stream(client):
    one = _chat(client).choices[0].message
    parts: dict[int, dict[str, list[str]]] = {0: {"r": [], "c": []}, 1: {"r": [], "c": []}}
    for chunk in _chat(client, n=2, stream=True):
        for c in chunk.choices:
            d = c.delta.model_dump()
            parts[c.index]["r"].append(d.get("reasoning") or "")
            parts[c.index]["c"].append(d.get("content") or "")
    for i in (0, 1):
        assert "".join(parts[i]["r"]) == one.model_extra["reasoning"]
        assert "".join(parts[i]["c"]) == one.content
