"""/v1/embeddings and `LLM.embed`: each input's embedding is the last position's final
hidden state (last-token pooling), L2-normalized.  The oracle is HF transformers' base
model on the same weights in float32 (`last_hidden_state[-1]`), whatever the batch, the
chunking or the prefix-cache hits; the official openai client reads it unchanged."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time

import aiohttp
import numpy as np
import openai
import pytest
import torch

from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from service.tokenizer import Tokenizer
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

transformers = pytest.importorskip("transformers")

MAX_LEN = 160


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()


@torch.no_grad()
def oracle(hf, ids: list[int], normalize: bool = True) -> np.ndarray:
    h = hf(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return h / np.linalg.norm(h) if normalize else h


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def server(request, model):
    # A 32-token step budget: the longer inputs are prefilled in chunks, beside others.
    with live_server(
        model, served_model_name="tiny", engine_process=request.param == "engine-process",
        engine_kwargs={"max_model_len": MAX_LEN, "max_num_batched_tokens": 32},
    ) as s:  # fmt: skip
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _inputs(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in lengths]


def _post(server, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(server.url + path, json=body) as r:
            return r.status, await r.json()

    return asyncio.run(go())


def test_each_input_is_its_last_hidden_state_whatever_the_batch(client, server, hf):
    # Lengths across the 32-token budget: one-token, in-budget and chunked inputs together.
    inputs = _inputs(0, [1, 7, 33, 90, MAX_LEN])  # the last fills max_model_len
    r = client.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    assert [d.index for d in r.data] == list(range(5))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, inputs))
    for ids, d in zip(inputs, r.data, strict=True):
        got = np.asarray(d.embedding)
        assert got.shape == (hf.config.hidden_size,)
        np.testing.assert_allclose(got, oracle(hf, ids), atol=2e-5)
        assert abs(np.linalg.norm(got) - 1) < 1e-5

    # Again: every input's prompt is now in the prefix cache (all but the recomputed
    # last token); the SDK's default encoding (base64 float32) decodes to the same vectors.
    again = client.embeddings.create(model="tiny", input=inputs)
    for a, b in zip(r.data, again.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=2e-5)
    server.wait_kv_free()


def test_text_input_is_tokenized_as_completions_are(client, model, hf):
    texts = ["The quick brown fox", "jumps over the lazy dog, again and again."]
    tok = Tokenizer.from_dir(model)
    r = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    for text, d in zip(texts, r.data, strict=True):
        np.testing.assert_allclose(d.embedding, oracle(hf, tok.encode(text)), atol=2e-5)
    one = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, r.data[0].embedding, atol=2e-5)


def test_base64_is_little_endian_float32(server):
    ids = _inputs(1, [12])
    status, f = _post(server, {"input": ids, "encoding_format": "float"})
    assert status == 200
    status, b = _post(server, {"input": ids, "encoding_format": "base64"})
    assert status == 200
    raw = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw, f["data"][0]["embedding"], atol=1e-6)
    assert f["object"] == "list" and f["model"] == "tiny" and f["id"].startswith("embd-")


def test_normalize_false_returns_the_hidden_state_itself(server, hf):
    ids = _inputs(2, [20])
    status, r = _post(server, {"input": ids, "normalize": False})
    assert status == 200
    np.testing.assert_allclose(r["data"][0]["embedding"], oracle(hf, ids[0], False), atol=1e-4)


def test_messages_go_through_the_chat_template(server):
    messages = [{"role": "system", "content": "Represent this."}, {"role": "user", "content": "hi"}]
    status, r = _post(server, {"messages": messages})
    assert status == 200

    async def ids():
        async with aiohttp.ClientSession() as s:
            body = {"messages": messages, "add_generation_prompt": False}
            async with s.post(server.url + "/tokenize", json=body) as resp:
                return (await resp.json())["tokens"]

    status, same = _post(server, {"input": [asyncio.run(ids())]})
    assert status == 200
    np.testing.assert_allclose(r["data"][0]["embedding"], same["data"][0]["embedding"], atol=2e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = _inputs(3, [60])[0]
    status, cut = _post(server, {"input": [ids], "truncate_prompt_tokens": 10})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 10
    status, tail = _post(server, {"input": [ids[-10:]]})
    np.testing.assert_allclose(cut["data"][0]["embedding"], tail["data"][0]["embedding"], atol=2e-5)
    # -1 keeps what fits: max_model_len.
    status, r = _post(server, {"input": [ids * 3], "truncate_prompt_tokens": -1})
    assert status == 200 and r["usage"]["prompt_tokens"] == MAX_LEN


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": []}, "input", 400),
        ({"input": [[]]}, "input", 400),
        ({"input": [[1, 2], "text"]}, "input", 400),
        ({}, "input", 400),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input", 400),
        ({"input": [[7] * (MAX_LEN + 1)]}, "input", 400),
        ({"input": [[10**9]]}, "input", 400),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", 400),
        ({"input": "x", "dimensions": 8}, "dimensions", 400),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", 400),
        ({"input": "x", "chat_template": "{{ 1 }}"}, "chat_template", 400),
        ({"input": "x", "model": "nope"}, "model", 404),
        ({"input": "x", "stream": True}, "stream", 400),
        ({"input": ["x"] * 257}, "input", 413),
    ],
)
def test_bad_requests_name_their_field_and_leak_nothing(server, body, param, status):
    got, r = _post(server, body)
    assert got == status, r
    assert r["error"]["param"] == param, r
    server.wait_kv_free()


def test_generation_beside_embeddings_is_unchanged(client, server):
    """An embedding request is one more row of the batch: a greedy chat answer streamed
    beside a stream of embedding requests is the one it gives alone."""
    kw = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=24, temperature=0)
    alone = client.completions.create(**kw).choices[0].text

    async def both():
        async with aiohttp.ClientSession() as s:

            async def embed_many():
                for i in range(6):
                    body = {"input": _inputs(10 + i, [40, 3, 70])}
                    async with s.post(server.url + "/v1/embeddings", json=body) as r:
                        assert r.status == 200

            async def complete():
                async with s.post(server.url + "/v1/completions", json=kw) as r:
                    return (await r.json())["choices"][0]["text"]

            _, text = await asyncio.gather(embed_many(), complete())
            return text

    assert asyncio.run(both()) == alone
    server.wait_kv_free()


def test_matryoshka_dimensions_cut_then_normalize(tmp_path, hf):
    src = tiny_checkpoint("llama")
    model = tmp_path / "m"
    shutil.copytree(src, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"matryoshka_dimensions": [16, 32]}))
    ids = _inputs(4, [9])
    with live_server(str(model), engine_kwargs={"max_model_len": MAX_LEN}) as s:
        status, r = _post(s, {"input": ids, "dimensions": 16})
        assert status == 200
        full = oracle(hf, ids[0], normalize=False)[:16]
        np.testing.assert_allclose(
            r["data"][0]["embedding"], full / np.linalg.norm(full), atol=2e-5
        )
        status, r = _post(s, {"input": ids, "dimensions": 24})
        assert status == 400 and r["error"]["param"] == "dimensions"


def test_offline_embed_matches_the_oracle(model, hf):
    inputs = _inputs(5, [3, 45])
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
             max_num_batched_tokens=32) as llm:  # fmt: skip
        outs = llm.embed(inputs)
        raw = llm.embed([{"prompt_token_ids": inputs[0]}], normalize=False)
        # Generation on the same engine afterwards is untouched.
        gen = llm.generate([inputs[0]], SamplingParams(temperature=0, max_tokens=4))
    for ids, o in zip(inputs, outs, strict=True):
        assert o.prompt_token_ids == ids and o.finished
        np.testing.assert_allclose(o.outputs.embedding, oracle(hf, ids), atol=2e-5)
    np.testing.assert_allclose(raw[0].outputs.embedding, oracle(hf, inputs[0], False), atol=1e-4)
    assert len(gen[0].outputs[0].token_ids) == 4


def _cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_is_the_cosine_of_the_pairs_embeddings(server, model, hf):
    tok = Tokenizer.from_dir(model)
    a, docs = "what is a fox", ["a fox is an animal", "the sky is blue", "what is a fox"]
    emb = {t: oracle(hf, tok.encode(t)) for t in [a, *docs]}

    def score(body):
        return _post(server, body, "/v1/score")

    status, r = score({"model": "tiny", "text_1": a, "text_2": docs})  # 1:N
    assert status == 200 and r["object"] == "list"
    got = [d["score"] for d in r["data"]]
    np.testing.assert_allclose(got, [_cos(emb[a], emb[d]) for d in docs], atol=1e-5)
    assert got[2] == pytest.approx(1.0, abs=1e-5)
    # Each distinct text is embedded once: the query's repeat in docs counts once.
    assert r["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in [a, *docs[:2]])

    status, r = score({"text_1": docs[:2], "text_2": [a, docs[1]]})  # N:N, in order
    assert status == 200
    np.testing.assert_allclose([d["score"] for d in r["data"]],
                               [_cos(emb[docs[0]], emb[a]), 1.0], atol=1e-5)  # fmt: skip

    status, r = score({"text_1": docs, "text_2": [a, a]})
    assert status == 400 and r["error"]["param"] == "text_2"
    status, r = score({"text_1": [], "text_2": a})
    assert status == 400 and r["error"]["param"] == "text_1"
    server.wait_kv_free()


def test_rerank_orders_documents_by_similarity(server, model, hf):
    tok = Tokenizer.from_dir(model)
    query = "the lazy dog"
    docs = ["a quick brown fox", "the lazy dog", "jumps over", "the lazy cat"]
    want = [_cos(oracle(hf, tok.encode(query)), oracle(hf, tok.encode(d))) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -want[i])

    def go(path, body):
        return _post(server, body, path)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, r = go(path, {"query": query, "documents": docs, "top_n": 3})
        assert status == 200, r
        assert [x["index"] for x in r["results"]] == order[:3]
        assert r["results"][0]["document"] == {"text": "the lazy dog"}
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                                   [want[i] for i in order[:3]], atol=1e-5)  # fmt: skip
    status, r = go("/rerank", {"query": query, "documents": docs, "return_documents": False})
    assert status == 200 and len(r["results"]) == 4 and "document" not in r["results"][0]
    status, r = go("/rerank", {"query": query, "documents": []})
    assert status == 400 and r["error"]["param"] == "documents"
    server.wait_kv_free()


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3-as-causal-lm"])
def base_model(request, tmp_path_factory) -> str:
    """A base model saved on its own (architectures ["LlamaModel"], tensors without the
    `model.` prefix, no LM head), as embedding checkpoints are: the tiny checkpoint's body.
    The last keeps its CausalLM architecture name over the same tensors (as
    sentence-transformers saves some)."""
    arch = request.param.split("-")[0]
    src = tiny_checkpoint(arch)
    out = tmp_path_factory.mktemp(f"base-{request.param}")
    full = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    full.model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    if request.param.endswith("causal-lm"):
        cfg = json.loads((out / "config.json").read_text())
        cfg["architectures"] = [f"{cfg['architectures'][0][: -len('Model')]}ForCausalLM"]
        cfg["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
def test_a_base_model_checkpoint_embeds_and_refuses_generation(base_model, engine_process):
    from safetensors import safe_open

    with safe_open(f"{base_model}/model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    hf = transformers.AutoModel.from_pretrained(base_model, dtype=torch.float32).eval()
    assert type(hf).__name__.endswith("Model")
    ids = _inputs(6, [17, 60])
    with live_server(base_model, engine_process=engine_process,
                     engine_kwargs={"max_model_len": MAX_LEN}) as s:  # fmt: skip
        status, r = _post(s, {"input": ids})
        assert status == 200, r
        for got, want in zip(r["data"], ids, strict=True):
            np.testing.assert_allclose(got["embedding"], oracle(hf, want), atol=2e-5)
        status, r = _post(s, {"prompt": "hi", "max_tokens": 4}, "/v1/completions")
        assert status == 400 and r["error"]["param"] == "model", r
        assert "embedding model" in r["error"]["message"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, r = _post(s, body, "/v1/chat/completions")
        assert status == 400 and r["error"]["param"] == "model", r
        s.wait_kv_free()


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async def go():
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            return await r.text()

    out = {}
    for fam in text_string_to_metric_families(asyncio.run(go())):
        for smp in fam.samples:
            reason = smp.labels.get("finished_reason")
            out[smp.name + (f"[{reason}]" if reason else "")] = smp.value
    return out


def test_embeddings_count_as_pooling_requests_in_the_metrics(server):
    """Prompt tokens and a finished request ("stop", as vLLM counts pooling), but no
    generated token and no time-to-first-token: the token the pass samples is nobody's."""
    server.wait_kv_free()
    before = _metrics(server)
    inputs = _inputs(9, [5, 12, 30])
    status, _ = _post(server, {"input": inputs})
    assert status == 200
    deadline = time.monotonic() + 10
    while (after := _metrics(server))["pagestream_prompt_tokens_total"] < before[
        "pagestream_prompt_tokens_total"
    ] + 47:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["pagestream_prompt_tokens_total"] == before["pagestream_prompt_tokens_total"] + 47
    assert (
        after["pagestream_generation_tokens_total"] == before["pagestream_generation_tokens_total"]
    )
    stop = "pagestream_request_success_total[stop]"
    assert after[stop] == before.get(stop, 0) + 3
    ttft = "pagestream_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft]
    e2e = "pagestream_e2e_request_latency_seconds_count"
    assert after[e2e] == before[e2e] + 3
