"""The request edge against a live server: every limit answers a 4xx in OpenAI's shape
naming the field, a looping chat template cannot stall the loop, and a full waiting queue
answers 429 with Retry-After (HTTP) or an error frame (WebSocket)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request

import aiohttp
import pytest
import websockets

from service.limits import Limits
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server
from tests.service.test_openai_api import post

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LIMITS = Limits(
    max_stop_strings=4,
    max_stop_string_chars=64,
    max_prompts_per_request=8,
    max_choices_per_request=16,
    max_logprobs=5,
    max_ws_frame_bytes=64 * 1024,
    max_ws_generations=3,
    max_websockets=6,
    trust_request_chat_template=True,
    template_timeout=1.5,
)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, limits=LIMITS) as s:
        yield s


@pytest.fixture(scope="module")
def strict(model):
    """Default limits: request-supplied templates are refused."""
    with live_server(model) as s:
        yield s


def chat(content: str = "hi", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def error_of(code: int, raw: bytes, status: int, param: str | None) -> dict:
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


def health_ms(server) -> float:
    t0 = time.monotonic()
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    return (time.monotonic() - t0) * 1000


def test_looping_template_is_stopped_and_the_loop_keeps_serving(server):
    result: dict = {}

    def hostile() -> None:
        t0 = time.monotonic()
        body = chat(chat_template_kwargs={"chat_template": LOOP})
        result["resp"] = post(server, "/v1/chat/completions", body)
        result["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=hostile)
    t.start()
    worst = 0.0
    while t.is_alive():
        worst = max(worst, health_ms(server))
        # Other clients are served meanwhile, not only /health.
        code, raw = post(server, "/v1/chat/completions", chat())
        assert code == 200, raw
        time.sleep(0.05)
    t.join()
    assert worst < 1000, f"/health took {worst:.0f} ms during the hostile render"
    err = error_of(*result["resp"], 400, "chat_template_kwargs.chat_template")
    assert "longer than" in err["message"]
    assert result["seconds"] < 15
    # The killed worker is replaced: templated requests keep working.
    code, raw = post(server, "/v1/chat/completions", chat())
    assert code == 200, raw
    server.wait_kv_free()


def test_trusted_request_template_is_used(server):
    tmpl = "{% for m in messages %}<{{ m.content }}>{% endfor %}{{ suffix }}"
    body = chat(chat_template=tmpl, chat_template_kwargs={"suffix": "!"}, return_token_ids=True)
    code, raw = post(server, "/v1/chat/completions", body)
    assert code == 200, raw
    ids = json.loads(raw)["prompt_token_ids"]
    assert ids == server.engine.tokenizer.encode("<hi>!", add_special_tokens=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(chat_template_kwargs={"chat_template": "X"}), "chat_template_kwargs.chat_template"),
        (chat(chat_template="X"), "chat_template"),
        (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
        (chat(chat_template_kwargs={"add_generation_prompt": False}),
         "chat_template_kwargs.add_generation_prompt"),
    ],
)  # fmt: skip
def test_request_templates_refused_by_default(strict, body, param):
    error_of(*post(strict, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"chat_template": "X"}, "chat_template_kwargs.chat_template"),
        ({"messages": []}, "chat_template_kwargs.messages"),
    ],
)
def test_tokenize_route_follows_the_same_template_rules(strict, kwargs, param):
    """/tokenize renders through the same sandboxed pool as chat completions."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    error_of(*post(strict, "/tokenize", body), 400, param)
    code, raw = post(strict, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 200 and json.loads(raw)["count"] > 0, raw


def test_unknown_template_kwargs_are_dropped(strict):
    code, raw = post(strict, "/v1/chat/completions", chat(chat_template_kwargs={"zzz": 1}))
    assert code == 200, raw


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * 65}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * 100_000, "n": 8}, 400, "stop"),
        ("/v1/completions", {"prompt": ["x"] * 9}, 413, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 200_000}, 413, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 4, "n": 5}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=6), 400, "top_logprobs"),
        ("/v1/chat/completions", chat(stop=["a"] * 5), 400, "stop"),
        ("/v1/chat/completions", chat(max_tokens=100_000), 400, "max_tokens"),
        ("/v1/chat/completions", chat(max_completion_tokens=100_000), 400,
         "max_completion_tokens"),
        ("/v1/chat/completions", chat("x " * 5000), 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
         400, "messages[1].content"),
        ("/v1/cache/prefixes", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/v1/cache/prefixes", {"messages": [{"role": "system"}]}, 400, "messages[0].content"),
    ],
)  # fmt: skip
def test_limits_answer_4xx_naming_the_field(server, path, body, status, param):
    t0 = time.monotonic()
    error_of(*post(server, path, body), status, param)
    assert time.monotonic() - t0 < 10


def test_text_prompt_range_checked_against_the_model_vocabulary(server):
    # A tokenizer may know more ids (added tokens) than the model embeds.
    ids = server.engine.tokenizer.encode("hello world")
    engine = server.engine
    vocab = engine.vocab_size
    server.on_loop(lambda: setattr(engine, "vocab_size", max(ids)))
    try:
        error_of(*post(server, "/v1/completions", {"prompt": "hello world"}), 400, "prompt")
        body = {"messages": [{"role": "user", "content": "hello world"}]}
        err = error_of(*post(server, "/v1/chat/completions", body), 400, "messages")
        assert "vocabulary" in err["message"]
    finally:
        server.on_loop(lambda: setattr(engine, "vocab_size", vocab))
    code, _ = post(server, "/v1/completions", {"prompt": "hello world", "max_tokens": 1})
    assert code == 200


async def test_websocket_limits(server):
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        # Generations in flight per socket.
        for i in range(4):
            frame = {"type": "generate", "id": f"g{i}", "prompt": "hi",
                     "params": {"max_tokens": 200, "ignore_eos": True}}  # fmt: skip
            await ws.send(json.dumps(frame))
        errors = []
        while not errors:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if f["type"] == "error":
                errors.append(f)
        assert errors[0]["id"] == "g3" and errors[0]["code"] == 429
        for i in range(3):
            await ws.send(json.dumps({"type": "cancel", "id": f"g{i}"}))
        done = set()
        while len(done) < 3:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if f["type"] == "done":
                done.add(f["id"])
        # Per-field limits name the field under params.
        bad = {"type": "generate", "id": "s", "prompt": "x", "params": {"stop": ["a"] * 5}}
        await ws.send(json.dumps(bad))
        while (f := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "error":
            pass
        assert (f["id"], f["code"], f["param"]) == ("s", 400, "params.stop")
        bad = {"type": "generate", "id": "m", "messages": [{"role": "user"}]}
        await ws.send(json.dumps(bad))
        while (f := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] != "error":
            pass
        assert (f["id"], f["param"]) == ("m", "messages[0].content")
    # A frame over the size limit closes the socket with 1009.
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await ws.send("x" * (65 * 1024))
        with pytest.raises(websockets.ConnectionClosed) as e:
            while True:
                await asyncio.wait_for(ws.recv(), 30)
        assert e.value.rcvd.code == 1009
    server.wait_kv_free()


async def test_websockets_per_server(server):
    socks = []
    try:
        for _ in range(LIMITS.max_websockets):
            socks.append(await websockets.connect(server.ws_url))
        with pytest.raises(websockets.InvalidStatus) as e:
            await websockets.connect(server.ws_url)
        assert e.value.response.status_code == 429
    finally:
        for s in socks:
            await s.close()
    for _ in range(100):  # the server notices the closes
        if not server.state.websockets:
            break
        await asyncio.sleep(0.05)
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "pong"


# With the engine in a child process too: admission reads the child's queue as its
# last frame gave it, plus the adds it has not taken yet.
@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
async def test_full_waiting_queue_answers_429(model, engine_process):
    engine = {"max_num_seqs": 1, "max_waiting_requests": 2}
    with live_server(model, engine_kwargs=engine, engine_process=engine_process) as s:
        long = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as http:
            streams = []
            r = await http.post(s.url + "/v1/completions", json=long)
            assert r.status == 200
            await r.content.readline()  # it is running: the queue is empty again
            streams.append(r)
            for _ in range(2):
                r = await http.post(s.url + "/v1/completions", json=long)
                assert r.status == 200
                streams.append(r)
            r = await http.post(s.url + "/v1/completions", json=long)
            body = await r.json()
            assert r.status == 429, body
            assert int(r.headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"
            r = await http.post(s.url + "/v1/chat/completions", json=chat())
            assert r.status == 429
            async with websockets.connect(s.ws_url) as ws:
                frame = {"type": "generate", "id": "w", "prompt": "hi"}
                await ws.send(json.dumps(frame))
                f = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert (f["type"], f["id"], f["code"]) == ("error", "w", 429)
            async with http.get(s.url + "/metrics") as m:
                text = await m.text()
            line = next(
                x for x in text.splitlines() if x.startswith("pagestream_requests_rejected_total")
            )
            assert 'reason="overloaded"' in line and float(line.split()[-1]) >= 3
            for r in streams:
                r.close()
        s.wait_kv_free(30)
        # Room again once the queue drains.
        code, raw = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 200, raw


def test_openapi_document(server):
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/cache/prefixes"):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert "$ref" in schema["schema"]
    comps = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ClientFrame", "WSGenerate"} <= set(comps)
    assert "chat_template_kwargs" in comps["ChatCompletionRequest"]["properties"]
    # Every route the app serves is in it, those behind a flag included.
    from service.app import create_app

    cfg = server.state.config
    engine = cfg.engine.replace(allow_runtime_lora=True)
    app = create_app(dataclasses.replace(cfg, engine=engine, enable_debug_routes=True))
    served = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    unlisted = {"/", "/openapi.json", "/static"}
    assert served - unlisted <= set(doc["paths"]), served - unlisted - set(doc["paths"])
