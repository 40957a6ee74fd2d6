"""Every route that tokenizes or detokenizes client text goes through the tokenize pool
(service/tokenize_pool.py) and the prompt-length bound (service/prep.py): chat-rendered
prompts, completions prompts (a string and a list), WebSocket `generate` frames, `/tokenize`
(text and chat) and `/detokenize`, and `echo` of token-id prompts."""

from __future__ import annotations

import json

import pytest
import websockets

from service.tokenize_pool import TokenizePool
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server
from tests.service.test_openai_api import post
from tests.service.test_tokenize_pool import text_of


@pytest.fixture(scope="module")
def server():
    with live_server(str(tiny_checkpoint("llama"))) as s:
        yield s


@pytest.fixture
def encoded(server, monkeypatch):
    """The sizes (UTF-8 bytes) of every text the server hands the tokenize pool."""
    sizes: list[int] = []
    real = TokenizePool.encode

    async def spy(self, texts, *args, **kw):
        sizes.extend(len(t.encode()) for t in texts)
        return await real(self, texts, *args, **kw)

    monkeypatch.setattr(TokenizePool, "encode", spy)
    return sizes


def error_of(code: int, raw: bytes, status: int, param: str | None) -> str:
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param, err
    return err["message"]


def test_the_bound_comes_from_the_tokenizer_and_max_model_len(server):
    prep = server.state.prep
    per_token = server.engine.tokenizer.max_bytes_per_token
    assert per_token is not None
    assert prep.max_prompt_bytes == server.engine.max_model_len * per_token
    # Every text that passes the bound fits the thread tier: no worker processes.
    assert prep.max_prompt_bytes <= prep.limits.tokenize_process_bytes
    assert prep.tokens.processes == 0


@pytest.mark.parametrize("unit", ["a", "日", "🎉"])  # 1, 3 and 4 UTF-8 bytes a character
def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(server, encoded, unit):
    bound = server.state.prep.max_prompt_bytes
    long = unit * (bound // len(unit.encode()) + 1)
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 2}
    cases = [
        ("/tokenize", {"prompt": long}, "prompt"),
        ("/tokenize", {"messages": chat["messages"]}, "messages"),
        ("/v1/completions", {"prompt": long, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", long], "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", chat, "messages"),
    ]
    for path, body, param in cases:
        msg = error_of(*post(server, path, body), 400, param)
        assert "max_model_len" in msg, msg
    assert all(n <= bound for n in encoded), encoded  # none of them reached the tokenizer


async def test_a_websocket_prompt_too_long_to_fit_is_refused(server, encoded):
    long = "a" * (server.state.prep.max_prompt_bytes + 1)
    async with websockets.connect(server.ws_url) as ws:
        for frame in (
            {"type": "generate", "id": "p", "prompt": long, "params": {"max_tokens": 2}},
            {"type": "generate", "id": "m", "messages": [{"role": "user", "content": long}],
             "params": {"max_tokens": 2}},
        ):  # fmt: skip
            await ws.send(json.dumps(frame))
            reply = json.loads(await ws.recv())
            assert reply["type"] == "error" and reply["code"] == 400, reply
            assert reply["param"] == ("prompt" if frame["id"] == "p" else "messages"), reply
        # Text under the bound is tokenized (off the loop) and generates.
        await ws.send(json.dumps({"type": "generate", "id": "ok", "prompt": text_of(20_000),
                                  "params": {"max_tokens": 2}}))  # fmt: skip
        while (reply := json.loads(await ws.recv()))["type"] == "delta":
            pass
        # 20 KB of text is more tokens than max_model_len: refused after tokenizing.
        assert reply["type"] in ("done", "error"), reply
    assert 20_000 - 4 <= max(encoded) <= 20_000


def test_tokenize_under_the_bound_counts_every_token(server, encoded):
    """/tokenize still counts a text longer than max_model_len (as vLLM does) when its
    length alone does not prove it too long; off the loop, token_strs included."""
    text = text_of(server.state.prep.max_prompt_bytes - 10)
    code, raw = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert code == 200, raw
    out = json.loads(raw)
    tok = server.engine.tokenizer
    assert out["tokens"] == tok.encode(text)
    assert out["count"] == len(out["tokens"]) > server.engine.max_model_len
    assert out["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in out["tokens"]]
    chat = {"messages": [{"role": "user", "content": text[:-200]}]}  # room for the template
    code, raw = post(server, "/tokenize", chat)
    assert code == 200, raw
    assert json.loads(raw)["count"] > server.engine.max_model_len


def test_detokenize_is_bounded_by_max_model_len(server):
    tok = server.engine.tokenizer
    n = server.engine.max_model_len
    ids = (tok.encode(text_of(20_000)) * 2)[:n]
    code, raw = post(server, "/detokenize", {"tokens": ids})
    assert code == 200, raw
    assert json.loads(raw)["prompt"] == tok.decode(ids)
    msg = error_of(*post(server, "/detokenize", {"tokens": [*ids, 5]}), 400, "tokens")
    assert "max_model_len" in msg
    error_of(*post(server, "/detokenize", {"tokens": [*[5] * 10, 10**7]}), 400, "tokens")


def test_echo_decodes_token_id_prompts(server):
    tok = server.engine.tokenizer
    prompts = [tok.encode(text_of(2000, seed=i)) for i in range(3)]  # > 2 KiB of ids: a thread
    body = {"prompt": prompts, "max_tokens": 1, "echo": True, "temperature": 0}
    code, raw = post(server, "/v1/completions", body)
    assert code == 200, raw
    choices = json.loads(raw)["choices"]
    for c in choices:
        assert c["text"].startswith(tok.decode(prompts[c["index"]])), c
