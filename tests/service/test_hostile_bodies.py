"""Issue 45's request-edge rows against a live server: deep nesting on every route (row 8),
chat-template work that cannot reach a worker (row 2), the prompt-logprob bound (row 10) and
an out-of-vocabulary logit_bias key (row 11) are 4xx in OpenAI's shape naming the field."""

from __future__ import annotations

import argparse
import json

import pytest
import websockets

from service.json_depth import MAX_JSON_DEPTH
from service.limits import Limits
from service.protocol import BadRequest
from tests.checkpoints import tiny_checkpoint
from tests.service.test_openai_api import post

LIMITS = Limits(max_prompt_logprob_entries=2000)
MSGS = [{"role": "user", "content": "hi"}]
DEEP = "[" * 990 + "]" * 990


@pytest.fixture(scope="module")
def server():
    from tests.service.live_server import live_server

    with live_server(str(tiny_checkpoint("llama")), limits=LIMITS) as s:
        yield s


def with_deep(base: dict, field: str) -> bytes:
    """`base` plus `field` nested 990 deep (past what json.dumps can write)."""
    return (json.dumps(base)[:-1] + f', "{field}": {DEEP}}}').encode()


def error_of(code: int, raw: bytes, status: int, param: str | None) -> dict:
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("path", "base", "field"),
    [
        ("/v1/chat/completions", {"messages": MSGS}, "allowed_token_ids"),
        ("/v1/chat/completions", {"messages": MSGS}, "guided_json"),
        ("/v1/chat/completions", {"messages": MSGS}, "tools"),
        ("/v1/chat/completions", {"messages": MSGS}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"messages": MSGS}, "response_format"),
        ("/v1/completions", {"prompt": "hi"}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi"}, "structured_outputs"),
        ("/tokenize", {"messages": MSGS}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "hi"}, "model"),
        ("/detokenize", {"tokens": [1]}, "model"),
        ("/v1/cache/prefixes", {"prompt": "hi"}, "cache_salt"),
    ],
)
def test_deep_nesting_is_a_400_on_every_route(server, path, base, field):
    err = error_of(*post(server, path, with_deep(base, field)), 400, field)
    assert str(MAX_JSON_DEPTH) in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_deep_json_inside_a_string_is_a_400(server, path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [*MSGS, {"role": "assistant", "tool_calls": [call]}]
    where = "messages[1].tool_calls[0].function.arguments"
    error_of(*post(server, path, {"messages": messages}), 400, where)
    body = {"messages": MSGS, "guided_json": DEEP}
    error_of(*post(server, "/v1/chat/completions", body), 400, "guided_json")


def test_the_render_pool_is_whole_after_hostile_template_input(server):
    # The replay: twice, 900 deep, to /tokenize; then every chat path still works.
    kwargs = '{"x": ' * 900 + "1" + "}" * 900
    body = (json.dumps({"messages": MSGS})[:-1] + f', "chat_template_kwargs": {kwargs}}}').encode()
    for _ in range(2):
        error_of(*post(server, "/tokenize", body), 400, "chat_template_kwargs")
    code, raw = post(server, "/tokenize", {"messages": MSGS})
    assert code == 200, raw
    code, raw = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    assert code == 200, raw
    pool = server.state.prep.pool
    assert pool.live_workers == pool.idle_workers == pool.size


async def test_websocket_frames_are_held_to_the_limit(server):
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        frame = {"type": "generate", "id": "g1", "prompt": "hi"}
        await ws.send(with_deep(frame, "params").decode())
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["code"] == 400, err
        assert err["param"] == "params" and err["id"] == "g1", err
        frame = {**frame, "id": "g2", "params": {"logit_bias": {"999999": 1.0}}}
        await ws.send(json.dumps(frame))
        err = json.loads(await ws.recv())
        assert err["code"] == 400 and err["param"] == "params.logit_bias", err
        await ws.send(json.dumps({"type": "ping"}))  # the socket is still usable
        assert json.loads(await ws.recv())["type"] == "pong"


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})],
)
def test_out_of_vocabulary_logit_bias_names_logit_bias(server, path, base):
    body = {**base, "max_tokens": 1, "logit_bias": {"999999": 1.0}}
    err = error_of(*post(server, path, body), 400, "logit_bias")
    assert "999999" in err["message"]
    body["logit_bias"] = {"5": 1.0}
    assert post(server, path, body)[0] == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # 3 prompts x 100 tokens x n=2 x (5 + 1) = 3,600 entries > 2,000
        ("/v1/completions",
         {"prompt": [list(range(3, 103))] * 3, "n": 2, "echo": True, "logprobs": 5}, "logprobs"),
        ("/v1/completions",
         {"prompt": [list(range(3, 103))] * 3, "n": 2, "prompt_logprobs": 5}, "prompt_logprobs"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "word " * 400}], "prompt_logprobs": 5},
         "prompt_logprobs"),
    ],
)  # fmt: skip
def test_prompt_logprobs_past_the_limit_are_refused(server, path, body, param):
    err = error_of(*post(server, path, {**body, "max_tokens": 1}), 400, param)
    assert "2,000" in err["message"]


def test_echo_logprobs_are_built_once_and_shared_by_the_choices(server):
    prompt = list(range(3, 103))  # 100 tokens x n=3 x (5 + 1) = 1,800 entries: allowed
    body = {"prompt": prompt, "n": 3, "echo": True, "logprobs": 5, "max_tokens": 1}
    code, raw = post(server, "/v1/completions", {**body, "n": 1})
    assert code == 200, raw
    (one,) = json.loads(raw)["choices"]
    code, raw = post(server, "/v1/completions", body)
    assert code == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 3
    for c in choices:
        lp = c["logprobs"]
        assert lp["tokens"][:100] == one["logprobs"]["tokens"][:100]
        assert lp["token_logprobs"][:100] == one["logprobs"]["token_logprobs"][:100]
        assert lp["top_logprobs"][:100] == one["logprobs"]["top_logprobs"][:100]
        assert len(lp["tokens"]) == 101  # the echoed prompt, then the one sampled token


def test_the_prompt_logprob_limit_has_a_flag():
    from service.cli import add_limit_args, limits

    p = argparse.ArgumentParser()
    add_limit_args(p)
    assert limits(p.parse_args([])).max_prompt_logprob_entries == 1_000_000
    lim = limits(p.parse_args(["--max-prompt-logprob-entries", "10"]))
    assert lim.max_prompt_logprob_entries == 10
    lim.check_prompt_logprobs({"logprobs": 4, "prompt_logprobs": 6})  # 10: at the limit
    with pytest.raises(BadRequest) as e:
        lim.check_prompt_logprobs({"logprobs": 4, "prompt_logprobs": 7})
    assert e.value.param == "prompt_logprobs" and e.value.status == 400
