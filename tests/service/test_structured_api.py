"""Structured outputs and tool calls through a live server: the official openai client,
raw HTTP for error shapes, and the WebSocket.  The model has random weights, so every
valid result here is the grammar's doing."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest
import websockets.sync.client

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server
from tests.service.test_openai_api import post

# A Hermes-style template (as Qwen2.5's): tools in a system block, calls in <tool_call>,
# results in <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def hermes_checkpoint(tmp_path_factory) -> str:
    """The tiny checkpoint with HERMES_TEMPLATE as its chat template (a copy)."""
    dst = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return hermes_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model):
    with live_server(
        model, served_model_name="tiny", tool_call_parser="hermes", engine_kwargs={"threads": 1}
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}


# ----------------------------------------------------------------------------- response_format
def test_json_schema_non_streaming(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format=json_schema_format(WEATHER),
        max_tokens=200, temperature=1.0, n=3, seed=7,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), WEATHER)


def test_json_schema_streaming(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, response_format=json_schema_format(WEATHER),
        max_tokens=200, temperature=1.0, stream=True,
    )  # fmt: skip
    pieces, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop" and len(pieces) > 3  # streamed token by token, not at the end
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_tgi_response_formats(client, kind):
    """TGI's forms, which huggingface_hub's InferenceClient sends: a schema as `value` of
    "json" (or of "json_object", its translation of OpenAI's json_schema), a regex."""
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, temperature=1.0, seed=3,
        extra_body={"response_format": {"type": kind, "value": WEATHER}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=20, temperature=1.0,
        extra_body={"response_format": {"type": "regex", "value": r"[A-Z]{3}-\d{2}"}},
    )  # fmt: skip
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.choices[0].message.content)


def test_json_object_and_completions_endpoint(client):
    r = client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=300, temperature=0.0,
        extra_body={"guided_json": WEATHER},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)
    r = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )  # fmt: skip
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, temperature=1.0,
        extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"},
    )  # fmt: skip
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=40, temperature=1.0,
        extra_body={"guided_grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,2}/'},
    )  # fmt: skip
    text = r.choices[0].message.content
    assert text in ("yes", "no") or (text.startswith("maybe ") and text[6:].isdigit())


def test_grammar_compiled_once_per_schema(server, client):
    compiler = server.engine.grammars
    schema = {"type": "object", "properties": {"q": {"enum": [1, 2]}}, "required": ["q"]}
    before = compiler.compiles
    for _ in range(3):
        client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=20, response_format=json_schema_format(schema)
        )
    assert compiler.compiles == before + 1


# ----------------------------------------------------------------------------- tools
def test_tool_choice_required_makes_valid_calls(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
        max_tokens=300, temperature=1.0, n=3, seed=1,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_named_streaming_and_not(client):
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named, max_tokens=100
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named, max_tokens=100,
        stream=True, temperature=1.0,
    )  # fmt: skip
    args, names, ids = "", [], set()
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                args += tc.function.arguments or ""
                names += [tc.function.name] if tc.function.name else []
                ids |= {tc.id} if tc.id else set()
    assert names == ["add"] and len(ids) == 1
    jsonschema.validate(json.loads(args), SCHEMAS["add"])


def test_tool_choice_auto_parses_hermes_calls(client):
    # A random model never writes a call on its own: a regex makes it write one, and the
    # hermes parser (not the grammar) must turn it into tool_calls.
    call = (
        '<tool_call>\n\\{"name": "add", "arguments": \\{"a": [1-9], "b": [1-9]\\}\\}\n</tool_call>'
    )
    body = {"structured_outputs": {"regex": r"Sure\. " + call}}
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, max_tokens=80, extra_body=body
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), SCHEMAS["add"])
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, max_tokens=80, extra_body=body, stream=True
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content == c.message.content  # streamed or not, the same content
    assert finish == "tool_calls" and calls[0].function.name == "add"


def test_multi_turn_with_tool_results(server, client):
    first = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=300,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = first.choices[0].message.tool_calls
    assert len(calls) == 1  # parallel_tool_calls=False
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
        },
        *(
            {"role": "tool", "tool_call_id": c.id, "content": f"result-{i}: 21 degrees"}
            for i, c in enumerate(calls)
        ),
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The template saw the tools, the call and its result.
    code, raw = post(server, "/tokenize", {"messages": history, "tools": TOOLS})
    assert code == 200, raw
    code, raw = post(server, "/detokenize", {"tokens": json.loads(raw)["tokens"]})
    text = json.loads(raw)["prompt"]
    assert '"name": "get_weather"' in text and "<tool_response>\nresult-0: 21 degrees" in text
    assert f'"name": "{calls[0].function.name}", "arguments": {{' in text


def test_auto_without_parser_is_refused(model):
    with live_server(model, served_model_name="tiny", engine_kwargs={"threads": 1}) as s:
        code, raw = post(s, "/v1/chat/completions", {"messages": MSGS, "tools": TOOLS})
        err = json.loads(raw)["error"]
        assert (
            code == 400 and err["param"] == "tool_choice" and "--tool-call-parser" in err["message"]
        )


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": json_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})}, "response_format.json_schema.schema", "compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "schema"),
        ({"response_format": json_schema_format({"type": "object", "description": "x" * 300_000})}, "response_format.json_schema.schema", "limit"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "compile"),
        ({"structured_outputs": {"grammar": "start: nope_rule"}}, "structured_outputs.grammar", "compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not among"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "regex"}}, "response_format.value", "needs a value"),
        ({"response_format": {"type": "regex", "value": {"a": 1}}}, "response_format.value", "pattern"),
        ({"response_format": {"type": "text", "value": "a"}}, "response_format.value", "takes no value"),
        ({"response_format": {"type": "json", "value": "{not json"}}, "response_format.value", "not valid JSON"),
    ],
)  # fmt: skip
def test_structured_errors_name_the_field(server, body, param, words):
    code, raw = post(server, "/v1/chat/completions", {"messages": MSGS, **body})
    assert code == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and words in err["message"], err


def test_finished_grammar_ends_the_request(server):
    # ignore_eos and min_tokens would keep going, but a complete grammar admits nothing
    # more: the request stops at once rather than hang or write past the grammar.
    body = {
        "prompt": "x",
        "max_tokens": 20,
        "guided_regex": "ab",
        "min_tokens": 5,
        "ignore_eos": True,
    }
    code, raw = post(server, "/v1/completions", body)
    assert code == 200, raw
    c = json.loads(raw)["choices"][0]
    assert c["text"] == "ab" and c["finish_reason"] == "stop"


# ----------------------------------------------------------------------------- the rest
def test_logit_bias_steers_greedy(client):
    r = client.completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, logit_bias={"77": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == [77] * 4


def test_request_id_header_version_detokenize(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MSGS, max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "chatcmpl-trace-42"
    stream = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s-1"}
    )
    assert stream.headers["x-request-id"] == "s-1"
    code, raw = post(server, "/version", b"")
    code, raw = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    out = json.loads(raw)
    assert code == 200 and out["count"] == len(out["tokens"]) == len(out["token_strs"])
    code, raw = post(server, "/detokenize", {"tokens": out["tokens"]})
    assert json.loads(raw)["prompt"] == "hello world"
    code, raw = post(server, "/detokenize", {"tokens": [10**7]})
    assert code == 400 and json.loads(raw)["error"]["param"] == "tokens"


def test_websocket_structured_outputs(server):
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 4,
    }
    with websockets.sync.client.connect(server.ws_url) as ws:
        ws.send(json.dumps({
            "type": "generate", "id": "g1", "prompt": "list:",
            "params": {"max_tokens": 60, "structured_outputs": {"json": schema}},
        }))  # fmt: skip
        ws.send(json.dumps({
            "type": "generate", "id": "g2", "prompt": "x",
            "params": {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}},
        }))  # fmt: skip
        text, errors, done = "", {}, False
        for _ in range(200):
            f = json.loads(ws.recv(timeout=60))
            if f["type"] == "delta":
                text += f["text"]
            elif f["type"] == "error":
                errors[f["id"]] = f
            elif f["type"] == "done":
                done = True
            if done and errors:
                break
        jsonschema.validate(json.loads(text), schema)
        assert errors["g2"]["param"] == "params.response_format.json_schema.schema"


REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "verbosity": "low",
    "service_tier": "flex",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "documents": [{"text": "x"}],
    # chat_template: refused unless the operator trusts request templates (test_request_limits)
    "mm_processor_kwargs": {},
    "echo": True,
    "add_special_tokens": True,
    "guided_whitespace_pattern": " ",
    "logits_processors": ["x"],
    "kv_transfer_params": {},
    "vllm_xargs": {"a": 1},
    "spaces_between_special_tokens": False,
}
# (suffix on a model without fill-in-the-middle tokens: tests/service/test_fim.py)
REFUSED_COMPLETIONS = {"prompt_embeds": "AAAA", "add_special_tokens": False}


@pytest.mark.parametrize(("field", "value"), list(REFUSED_CHAT.items()))
def test_documented_but_refused_chat_fields(server, field, value):
    code, raw = post(server, "/v1/chat/completions", {"messages": MSGS, field: value})
    err = json.loads(raw)["error"]
    assert code == 400 and err["param"] == field and "not supported" in err["message"], err


@pytest.mark.parametrize(("field", "value"), list(REFUSED_COMPLETIONS.items()))
def test_documented_but_refused_completion_fields(server, field, value):
    code, raw = post(server, "/v1/completions", {"prompt": "x", field: value})
    err = json.loads(raw)["error"]
    assert code == 400 and err["param"] == field and "not supported" in err["message"], err


def test_accepted_hint_fields(server):
    body = {"messages": MSGS, "max_tokens": 2, "prompt_cache_key": "k", "safety_identifier": "u",
            "service_tier": "auto", "parallel_tool_calls": True, "store": False}  # fmt: skip
    code, raw = post(server, "/v1/chat/completions", body)
    assert code == 200, raw
