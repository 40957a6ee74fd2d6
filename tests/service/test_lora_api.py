"""LoRA adapters over HTTP (`serve --lora-modules`), with the official openai client:
an adapter is a model of /v1/models; a request names it as its `model` on every route,
in the HTTP process's engine and in an engine process."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch
import websockets

from tests.checkpoints import peft_adapter, tiny_checkpoint
from tests.service.live_server import live_server

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("lora") / "sea"
    return peft_adapter(model, out, 7, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def server(request, model, adapter):
    kw = {"threads": 1, "lora_modules": {"sea": adapter}}
    with live_server(
        model, served_model_name="tiny", engine_kwargs=kw,
        engine_process=request.param == "engine-process",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@torch.inference_mode()
def _peft_greedy(model: str, adapter: str, ids: list[int], n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, adapter).eval()
    out = pm.generate(
        input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_models_lists_the_adapter_with_its_parent(client, adapter):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {"tiny", "sea"}
    assert models["sea"].model_extra["parent"] == "tiny"
    assert models["sea"].model_extra["root"] == adapter


def test_completions_with_the_adapter_are_what_peft_generates(client, model, adapter):
    ids = [17, 305, 1200, 44, 9, 861, 23]
    kw = dict(prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True,
              "return_token_ids": True})  # fmt: skip
    sea = client.completions.create(model="sea", **kw).choices[0].model_extra["token_ids"]
    base = client.completions.create(model="tiny", **kw).choices[0].model_extra["token_ids"]
    assert sea == _peft_greedy(model, adapter, ids, 10)
    assert sea != base
    # Beam search's steps run the adapter too: one beam is the greedy answer.
    beam = client.completions.create(
        model="sea", prompt=ids, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True, "use_beam_search": True, "return_token_ids": True},
    )  # fmt: skip
    assert beam.choices[0].model_extra["token_ids"] == sea


def test_chat_and_responses_run_the_adapter(client, server):
    kw = dict(max_tokens=12, temperature=0)  # (Responses takes no ignore_eos)
    sea = client.chat.completions.create(model="sea", messages=MESSAGES, **kw)
    base = client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    assert sea.model == "sea" and sea.choices[0].message.content != base.choices[0].message.content
    # The same prompt through /v1/completions on the adapter: the same text.
    ids = httpx.post(server.url + "/tokenize", json={"model": "sea", "messages": MESSAGES,
                     "add_generation_prompt": True}, timeout=30).json()["tokens"]  # fmt: skip
    cmpl = client.completions.create(model="sea", prompt=ids, **kw)
    assert cmpl.choices[0].text == sea.choices[0].message.content
    r = client.responses.create(
        model="sea", input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0
    )
    assert r.output_text == sea.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="sea", messages=MESSAGES, stream=True, **kw)
        if c.choices
    )
    assert streamed == sea.choices[0].message.content


def test_adapter_requests_are_counted_by_adapter(client, server):
    def count() -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        m = re.search(
            r'^pagestream_lora_requests_total\{[^}]*adapter="sea"[^}]*\} (\S+)', text, re.M
        )
        return float(m.group(1)) if m else 0.0

    before = count()
    client.completions.create(model="sea", prompt="hi", max_tokens=2)
    client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    deadline = time.monotonic() + 10  # (counted when the request's stream ends)
    while count() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count() == before + 1


def test_an_unknown_model_is_a_404_naming_the_field(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="sea2", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and "sea2" in e.value.body["message"]
    server.wait_kv_free()


async def test_websocket_generations_name_the_adapter(server, client):
    ids = [17, 305, 1200, 44, 9, 861, 23]
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = client.completions.create(
        model="sea", prompt=ids, extra_body={"ignore_eos": True, "return_token_ids": True},
        max_tokens=8, temperature=0,
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    async with websockets.connect(server.ws_url) as ws:
        for gid, model in (("s", "sea"), ("b", None), ("x", "sea2")):
            frame = {"type": "generate", "id": gid, "prompt": ids, "params": params}
            await ws.send(json.dumps(frame | ({"model": model} if model else {})))
        frames, ended = [], set()
        async with asyncio.timeout(60):
            while len(ended) < 3:
                f = json.loads(await ws.recv())
                frames.append(f)
                if f["type"] in ("done", "error"):
                    ended.add(f["id"])
    tokens = {g: [t for f in frames if f["type"] == "delta" and f["id"] == g
                  for t in f["token_ids"]] for g in ("s", "b")}  # fmt: skip
    assert tokens["s"] == want and tokens["b"] != want
    err = next(f for f in frames if f["type"] == "error")
    assert err["id"] == "x" and err["code"] == 404 and err["param"] == "model"


def test_runtime_loading_is_off_without_the_flag(server):
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=30,
                   json={"lora_name": "x", "lora_path": "/tmp"})  # fmt: skip
    assert r.status_code == 404


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def runtime(request, model):
    kw = {"threads": 1, "allow_runtime_lora": True}
    with live_server(
        model, served_model_name="tiny", engine_kwargs=kw,
        engine_process=request.param == "engine-process",
    ) as s:  # fmt: skip
        yield s


def test_adapters_load_and_unload_while_serving(runtime, model, adapter, tmp_path):
    c = openai.OpenAI(base_url=runtime.url + "/v1", api_key="x", max_retries=0, timeout=60)
    post = lambda path, body: httpx.post(runtime.url + path, json=body, timeout=60)  # noqa: E731
    ids = [17, 305, 1200, 44, 9, 861, 23]
    kw = dict(prompt=ids, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="sea", **kw)
    r = post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter})
    assert r.status_code == 200 and "sea" in r.text
    assert "sea" in {m.id for m in c.models.list().data}
    got = c.completions.create(model="sea", **kw).choices[0].model_extra["token_ids"]
    assert got == _peft_greedy(model, adapter, ids, 8)
    # Refusals name the field: the name taken, a directory that is no adapter.
    r = post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json" in r.json()["error"]["message"]
    # Unloading waits for the requests that run it, then refuses new ones.
    stream = c.completions.create(model="sea", prompt=ids, max_tokens=120, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    first = next(iter(stream))
    r = post("/v1/unload_lora_adapter", {"lora_name": "sea"})
    assert r.status_code == 200
    rest = list(stream)
    assert first.choices and sum(1 for ch in rest if ch.choices and ch.choices[0].text) > 50
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="sea", **kw)
    assert "sea" not in {m.id for m in c.models.list().data}
    assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}).status_code == 404
    runtime.wait_kv_free()
    # Loaded again, it serves the same tokens.
    assert post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter}).is_success
    assert c.completions.create(model="sea", **kw).choices[0].model_extra["token_ids"] == got
    assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}).is_success


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"],
                         ids=["tp2", "pp2"])  # fmt: skip
def test_adapters_load_on_every_parallel_rank(model, adapter, tmp_path, layout):
    """TP=2 or PP=2: a load reaches every rank between steps (each takes its share), an
    unload too; an adapter that fails to load is loaded nowhere and the server serves on."""
    kw = {"threads": 1, "allow_runtime_lora": True, layout: 2, "tensor_parallel_timeout": 60}
    with live_server(model, served_model_name="tiny", engine_kwargs=kw) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        post = lambda path, body: httpx.post(s.url + path, json=body, timeout=60)  # noqa: E731
        ids = [17, 305, 1200, 44, 9, 861, 23]
        kw = dict(prompt=ids, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter}).is_success
        got = c.completions.create(model="sea", **kw).choices[0].model_extra["token_ids"]
        assert got == _peft_greedy(model, adapter, ids, 8)
        assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}).is_success
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="sea", **kw)
        r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        base = c.completions.create(model="tiny", **kw).choices[0].model_extra["token_ids"]
        assert base != got and len(base) == 8
        assert post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter}).is_success
        assert c.completions.create(model="sea", **kw).choices[0].model_extra["token_ids"] == got


def test_adapters_load_on_every_data_parallel_rank(model, adapter, tmp_path):
    """--data-parallel-size 2: a load reaches both engines (requests one at a time go to
    each in turn, and every one runs the adapter); a refused load, and an unload, too."""
    kw = {"threads": 1, "allow_runtime_lora": True, "data_parallel_size": 2}
    with live_server(model, served_model_name="tiny", engine_kwargs=kw) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        post = lambda path, body: httpx.post(s.url + path, json=body, timeout=60)  # noqa: E731
        assert post("/v1/load_lora_adapter", {"lora_name": "sea", "lora_path": adapter}).is_success
        r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        core = s.engine.core
        before = list(core.routed)
        for i in range(4):
            ids = [17 + i, 305, 1200, 44, 9, 861, 23]
            got = c.completions.create(
                model="sea", prompt=ids, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            ).choices[0].model_extra["token_ids"]  # fmt: skip
            assert got == _peft_greedy(model, adapter, ids, 6), i
        assert [a - b for a, b in zip(core.routed, before, strict=True)] == [2, 2]
        assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}).is_success
        for i in range(2):
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model="sea", prompt=[5 + i, 6], max_tokens=2)


def test_hostile_lora_bodies_are_refused_naming_the_field(runtime, tmp_path):
    post = lambda path, body: httpx.post(runtime.url + path, json=body, timeout=60)  # noqa: E731
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes(b" " * (2 << 20) + b"{}")
    for path, body, param in [
        ("/v1/load_lora_adapter", {"lora_name": "n" * 129, "lora_path": "/x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "n", "lora_path": "/" * 5000}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "n", "lora_path": "/x", "extra": 1}, "extra"),
        ("/v1/load_lora_adapter", {"lora_name": "bad name", "lora_path": "/x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "n", "lora_path": str(big)}, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "n" * 129}, "lora_name"),
    ]:
        r = post(path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = post("/v1/load_lora_adapter", {"lora_name": "n", "lora_path": str(big)})
    assert "larger than" in r.json()["error"]["message"]
    r = httpx.post(runtime.url + "/v1/unload_lora_adapter", content=b"[" * 100_000, timeout=60)
    assert r.status_code == 400
    assert httpx.get(runtime.url + "/health", timeout=10).status_code == 200


def test_admin_keys_alone_open_the_operator_routes(model, adapter):
    """--admin-api-key: loading and unloading adapters (and /debug) take an admin key; an
    API key gets 403 there, no key 401; the admin key opens no other route."""
    kw = {"threads": 1, "allow_runtime_lora": True}
    with live_server(model, served_model_name="tiny", engine_kwargs=kw, enable_debug_routes=True,
                     api_keys=["user"], admin_api_keys=["ops"]) as s:  # fmt: skip

        def post(path: str, body: dict, key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(s.url + path, json=body, headers=headers, timeout=60)

        body = {"lora_name": "sea", "lora_path": adapter}
        for key, status in ((None, 401), ("wrong", 401), ("user", 403)):
            r = post("/v1/load_lora_adapter", body, key)
            assert r.status_code == status, (key, r.text)
            assert httpx.get(s.url + "/debug/state", timeout=10, headers={
                "Authorization": f"Bearer {key}"} if key else {}).status_code == status  # fmt: skip
        assert post("/v1/load_lora_adapter", body, "ops").status_code == 200
        ok = httpx.get(s.url + "/debug/state", headers={"Authorization": "Bearer ops"}, timeout=10)
        assert ok.status_code == 200
        done = post("/v1/completions", {"model": "sea", "prompt": "hi", "max_tokens": 2}, "user")
        assert done.status_code == 200, done.text
        no = post("/v1/completions", {"model": "sea", "prompt": "hi", "max_tokens": 2}, "ops")
        assert no.status_code == 401
        assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}, "user").status_code == 403
        assert post("/v1/unload_lora_adapter", {"lora_name": "sea"}, "ops").status_code == 200


async def test_a_websocket_model_past_its_bound_is_an_error_frame(server):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "prompt": "hi",
                                  "model": "m" * 300}))  # fmt: skip
        async with asyncio.timeout(30):
            f = json.loads(await ws.recv())
    assert f["type"] == "error" and f["code"] == 400 and f["param"] == "model"
