"""Issue 45's rows replayed against a real `pagestream serve` process: each hostile request
gets a 4xx in OpenAI's shape (or a bounded 200) within 3 s, while a background stream and a
`/health` poller (tests/reliability/watch.py) see no stall, and the server then still
serves a normal chat request."""

from __future__ import annotations

import json
import random
import time

import pytest
import websockets

from tests.reliability.watch import (
    REPLY_BUDGET_S,
    Watch,
    assert_client_error,
    normal_chat,
    post,
    tiny_server,
)

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_server(tmp_path_factory, "hostile-edge") as s:
        yield s


def deep_array(levels: int) -> str:
    return "[" * levels + "]" * levels


def deep_object(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


def with_raw(base: dict, field: str, raw: str) -> str:
    """`base` plus `field` set to the JSON text `raw` (too deep for json.dumps to write)."""
    return json.dumps(base)[:-1] + f', "{field}": {raw}}}'


async def ws_chat(url: str, frame: dict) -> list[dict]:
    """One WebSocket `generate`; every frame up to its `done` or `error`."""
    frames = []
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        await ws.send(json.dumps(frame))
        while True:
            f = json.loads(await ws.recv())
            frames.append(f)
            if f["type"] in ("done", "error"):
                return frames


async def test_row2_deep_template_kwargs_cannot_wedge_the_render_pool(server):
    """Row 2: chat_template_kwargs 900 deep, twice, to /tokenize: a 400 naming the field,
    and chat, chat /tokenize and WebSocket chat all keep working."""
    body = with_raw({"messages": MSGS}, "chat_template_kwargs", '{"x": ' + deep_object(900) + "}")
    async with Watch(server.url) as w:
        for _ in range(2):
            assert_client_error(*(await post(server.url, "/tokenize", body))[:3],
                                "chat_template_kwargs")  # fmt: skip
        status, obj, took, _ = await post(server.url, "/tokenize", {"messages": MSGS})
        assert status == 200 and obj["count"] > 0 and took < REPLY_BUDGET_S, obj
        frames = await ws_chat(server.url, {"type": "generate", "id": "c1", "messages": MSGS,
                                            "params": {"max_tokens": 4}})  # fmt: skip
        assert frames[-1]["type"] == "done", frames[-1]
        await normal_chat(server.url)
        w.check("row 2")
    server.assert_alive()


ROW8 = [
    ("/v1/chat/completions", {"messages": MSGS}, "allowed_token_ids", deep_array(990)),
    ("/v1/chat/completions", {"messages": MSGS}, "guided_json", deep_object(990)),
    ("/v1/chat/completions", {"messages": MSGS}, "chat_template_kwargs", deep_object(990)),
    ("/v1/chat/completions", {"messages": MSGS}, "logit_bias", deep_object(990)),
    ("/v1/chat/completions", {"messages": MSGS}, "tools",
     '[{"type": "function", "function": {"name": "f", "parameters": '
     + deep_object(990) + "}}]"),
    ("/v1/chat/completions", {"messages": MSGS}, "response_format",
     '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
     + deep_object(990) + "}}"),
    ("/v1/completions", {"prompt": "hi"}, "structured_outputs", '{"json": '
     + deep_object(990) + "}"),
    ("/v1/completions", {"prompt": "hi"}, "logit_bias", deep_object(990)),
    ("/tokenize", {"messages": MSGS}, "tools", deep_array(990)),
    ("/detokenize", {"tokens": [1]}, "model", deep_array(990)),
]  # fmt: skip


async def test_row8_deep_nesting_anywhere_is_a_400(server):
    """Row 8: ~990 levels of nesting in any free-form field, on every route (and JSON text
    in a string: a tool call's arguments, a schema sent as a string; and a WebSocket
    frame): a 400 naming the field, never a 500."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_array(990)}}
    in_strings = [
        ("/v1/chat/completions",
         {"messages": [*MSGS, {"role": "assistant", "tool_calls": [call]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ("/v1/chat/completions", {"messages": MSGS, "guided_json": deep_object(990)},
         "guided_json"),
    ]  # fmt: skip
    async with Watch(server.url) as w:
        for path, base, field, raw in ROW8:
            reply = await post(server.url, path, with_raw(base, field, raw))
            assert_client_error(*reply[:3], field)
        for path, body, field in in_strings:
            assert_client_error(*(await post(server.url, path, body))[:3], field)
        t0 = time.monotonic()
        frame = with_raw({"type": "generate", "id": "d1", "prompt": "hi"}, "params",
                         '{"logit_bias": ' + deep_object(990) + "}")  # fmt: skip
        async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.send(frame)
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["code"] == 400, err
            assert err["param"] == "params" and err["id"] == "d1", err
        assert time.monotonic() - t0 < REPLY_BUDGET_S
        await normal_chat(server.url)
        w.check("row 8")
    server.assert_alive()


@pytest.fixture(scope="module")
def process_server(tmp_path_factory):
    with tiny_server(tmp_path_factory, "hostile-edge-proc", "--engine-process", "on") as s:
        yield s


# With the engine core in a child process too: 64 samples' prompt logprobs cross the
# boundary in the child's frames.
@pytest.mark.parametrize("mode", ["inline", "engine-process"])
async def test_row10_echo_logprobs_are_bounded(server, process_server, mode):
    """Row 10: echo + logprobs 20, 4 prompts x n=64 x 1,900 tokens (a 45 KB body asking for
    a 265 MB answer): a 400 naming `logprobs`.  Under the limit, a bounded 200 (each
    prompt's echo built once for its n choices) that no one else notices."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(1900)] for _ in range(4)]
    hostile = {"prompt": prompts, "n": 64, "echo": True, "logprobs": 20, "max_tokens": 1}
    # 1 prompt x 150 tokens x n=64 x 21 = 201,600 entries: under the 1,000,000 default.
    bounded = {**hostile, "prompt": [prompts[0][:150]]}
    server = process_server if mode == "engine-process" else server
    async with Watch(server.url) as w:
        status, obj, took, size = await post(server.url, "/v1/completions", hostile)
        assert_client_error(status, obj, took, "logprobs")
        status, obj, took, size = await post(server.url, "/v1/completions", bounded)
        assert status == 200, obj
        assert len(obj["choices"]) == 64 and size < 20 << 20, size
        assert took < REPLY_BUDGET_S, f"{took:.2f} s"
        await normal_chat(server.url)
        w.check("row 10")
    server.assert_alive()


async def test_row11_out_of_vocabulary_logit_bias_names_logit_bias(server):
    """Row 11: a logit_bias key outside the vocabulary is a 400 naming `logit_bias`."""
    async with Watch(server.url) as w:
        for path, base in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": MSGS})):  # fmt: skip
            body = {**base, "max_tokens": 1, "logit_bias": {"999999": 5}}
            assert_client_error(*(await post(server.url, path, body))[:3], "logit_bias")
        await normal_chat(server.url)
        w.check("row 11")
    server.assert_alive()


async def test_row12_whole_vocabulary_bias_and_stop_ids_at_n_64_are_cheap_per_step(server):
    """A logit_bias over the whole vocabulary and as many stop_token_ids held back by
    min_tokens, at n = 64: each sample's lists become tensors once, not every step (they
    were rebuilt in Python per step: this request took 3.8 s instead of 0.2 s, and a
    plain request beside it 3.3 s instead of 0.05 s)."""
    vocab = range(3, 2000)
    body = {"prompt": "hi", "n": 64, "max_tokens": 64, "min_tokens": 64, "ignore_eos": True,
            "logit_bias": {str(t): -1.0 for t in vocab}, "stop_token_ids": list(vocab)}  # fmt: skip
    async with Watch(server.url) as w:
        status, obj, took, _ = await post(server.url, "/v1/completions", body)
        assert status == 200, obj
        assert len(obj["choices"]) == 64 and took < REPLY_BUDGET_S / 2, f"{took:.2f} s"
        assert all(len(c["text"]) for c in obj["choices"])
        await normal_chat(server.url)
        w.check("row 12")
    server.assert_alive()


async def test_row13_a_megabyte_of_stop_token_ids_at_n_64_is_one_set(server):
    """300,000 stop_token_ids (a 1.8 MB body) at n = 64: one set for the request's samples,
    made once (64 of them held the event loop 0.3 s: /health waited as long)."""
    body = {"prompt": "hi", "n": 64, "max_tokens": 4, "stop_token_ids": list(range(3, 2003)) * 150}
    async with Watch(server.url) as w:
        status, obj, took, _ = await post(server.url, "/v1/completions", body)
        assert status == 200, obj
        assert len(obj["choices"]) == 64 and took < REPLY_BUDGET_S, f"{took:.2f} s"
        w.check("row 13")
    assert w.health_max < 0.15, f"/health took {w.health_max:.2f} s"
    server.assert_alive()
