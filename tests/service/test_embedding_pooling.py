"""Embeddings pooled as the checkpoint says: a sentence-transformers checkpoint's Pooling
modes (mean, CLS, max, ...; several concatenated), its Dense projections and Normalize,
and vLLM's --pooler-config over a plain checkpoint.  The oracle is sentence-transformers
itself (or transformers for --pooler-config) on the same weights in float32, on the same
token ids, whatever the chunking, the batch or an earlier request's cached prefix."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import torch

from service.llm import LLM
from service.pooling import Pooler, check_pooler_config
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

MAX_LEN = 160
# Longer inputs than the 32-token step budget: pooled over several prefill chunks.
LENGTHS = [1, 5, 45, 100]


def st_checkpoint(
    out: Path, modes: str | tuple[str, ...], dense: tuple[tuple[int, str], ...] = ()
) -> st.SentenceTransformer:
    """The tiny Llama as a sentence-transformers model (Transformer, Pooling, Dense...,
    Normalize), saved to `out` as sentence-transformers saves it."""
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(0)
    t = modules.Transformer(str(tiny_checkpoint("llama")))
    p = modules.Pooling(t.get_embedding_dimension(), pooling_mode=modes)
    mods: list[torch.nn.Module] = [t, p]
    width = p.get_embedding_dimension()
    for n_out, act in dense:
        fn = {"tanh": torch.nn.Tanh(), "identity": torch.nn.Identity()}[act]
        mods.append(modules.Dense(width, n_out, activation_function=fn))
        width = n_out
    mods.append(modules.Normalize())
    model = st.SentenceTransformer(modules=mods, device="cpu").float().eval()
    model.save(str(out))
    return model


@torch.no_grad()
def st_oracle(model: st.SentenceTransformer, ids: list[int]) -> np.ndarray:
    feats = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }
    return model(feats)["sentence_embedding"][0].numpy()


def _inputs(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize(
    "modes",
    ["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", ("max", "mean")],
    ids=str,
)
def test_offline_embed_pools_as_sentence_transformers(tmp_path, modes):
    oracle = st_checkpoint(tmp_path / "m", modes)
    inputs = _inputs(1)
    with LLM(str(tmp_path / "m"), dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
             max_num_batched_tokens=32) as llm:  # fmt: skip
        first = llm.embed(inputs)
        # Again: the prompts' blocks are cached now, and a pool must not skip them.
        again = llm.embed(inputs[::-1])[::-1]
    for ids, a, b in zip(inputs, first, again, strict=True):
        want = st_oracle(oracle, ids)
        assert len(a.outputs.embedding) == want.shape[0]
        np.testing.assert_allclose(a.outputs.embedding, want, atol=3e-5)
        np.testing.assert_allclose(b.outputs.embedding, want, atol=3e-5)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory) -> tuple[str, st.SentenceTransformer]:
    out = tmp_path_factory.mktemp("st-dense") / "m"
    return str(out), st_checkpoint(out, "mean", dense=((48, "tanh"), (24, "identity")))


def _post(url: str, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
            return r.status, await r.json()

    return asyncio.run(go())


@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
def test_served_mean_pooling_with_dense_layers(dense_model, engine_process):
    path, oracle = dense_model
    inputs = _inputs(2)
    with live_server(path, served_model_name="st", engine_process=engine_process,
                     engine_kwargs={"max_model_len": MAX_LEN, "max_num_batched_tokens": 32},
                     ) as s:  # fmt: skip
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def concurrently():
            aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            one = [aclient.embeddings.create(model="st", input=[ids]) for ids in inputs]
            return await asyncio.gather(*one, aclient.embeddings.create(model="st", input=inputs))

        *singles, batch = asyncio.run(concurrently())
        for ids, single, in_batch in zip(inputs, singles, batch.data, strict=True):
            want = st_oracle(oracle, ids)
            assert len(single.data[0].embedding) == 24
            np.testing.assert_allclose(single.data[0].embedding, want, atol=3e-5)
            np.testing.assert_allclose(in_batch.embedding, want, atol=3e-5)
        # The Dense layers' output, unnormalized: sentence-transformers without Normalize.
        status, r = _post(s.url, {"input": inputs[2], "normalize": False})
        assert status == 200
        raw = np.asarray(r["data"][0]["embedding"])
        np.testing.assert_allclose(raw / np.linalg.norm(raw), st_oracle(oracle, inputs[2]),
                                   atol=3e-5)  # fmt: skip
        assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
        # Text goes through the server's tokenizer, as completions' does.
        text = client.embeddings.create(model="st", input="a fox jumps over the lazy dog")
        status, r = _post(s.url, {"prompt": "a fox jumps over the lazy dog"}, "/tokenize")
        ids = r["tokens"]
        np.testing.assert_allclose(text.data[0].embedding, st_oracle(oracle, ids), atol=3e-5)
        # vLLM's /pooling: the same vectors as each item's `data` (base64 as the SDK's).
        status, r = _post(s.url, {"model": "st", "input": inputs[:2]}, "/pooling")
        assert status == 200 and r["id"].startswith("pool-"), r
        assert r["usage"]["prompt_tokens"] == sum(map(len, inputs[:2]))
        for i, (ids, d) in enumerate(zip(inputs[:2], r["data"], strict=True)):
            assert d["object"] == "pooling" and d["index"] == i
            np.testing.assert_allclose(d["data"], st_oracle(oracle, ids), atol=3e-5)
        body = {"input": inputs[3:], "encoding_format": "base64", "task": "embed"}
        status, r = _post(s.url, body, "/v1/pooling")
        assert status == 200, r
        got = np.frombuffer(base64.b64decode(r["data"][0]["data"]), dtype="<f4")
        np.testing.assert_allclose(got, st_oracle(oracle, inputs[3]), atol=3e-5)
        for body, param in (
            ({"input": "x", "task": "classify"}, "model"),  # not a classifier
            ({"input": "x", "task": "token_embed"}, "task"),
            ({"input": "x", "use_activation": False}, "use_activation"),
            ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ):
            status, r = _post(s.url, body, "/pooling")
            assert status == 400 and r["error"]["param"] == param, (body, r)
        s.wait_kv_free()


@torch.no_grad()
def test_pooler_config_pools_a_plain_checkpoint_by_mean():
    model = str(tiny_checkpoint("llama"))
    hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    inputs = _inputs(3)
    cfg = {"pooling_type": "MEAN", "normalize": False}
    with live_server(model, pooler_config=cfg, engine_kwargs={"max_model_len": MAX_LEN,
                     "max_num_batched_tokens": 32}) as s:  # fmt: skip
        status, r = _post(s.url, {"input": inputs})
        assert status == 200, r
        for ids, got in zip(inputs, r["data"], strict=True):
            want = hf(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
            np.testing.assert_allclose(got["embedding"], want, atol=3e-5)
        # A request's own `normalize` still wins over the configured default.
        status, r = _post(s.url, {"input": inputs[:1], "normalize": True})
        assert np.linalg.norm(r["data"][0]["embedding"]) == pytest.approx(1.0, abs=1e-5)
        s.wait_kv_free()


def test_pooler_config_is_checked_at_start():
    assert check_pooler_config({"pooling_type": "cls"}) == {"pooling_type": "cls"}
    for bad, word in (
        ({"pooling_type": "STEP"}, "pooling_type"),
        ({"normalize": "yes"}, "normalize"),
        ({"softmax": True}, "softmax"),
    ):
        with pytest.raises(ValueError, match=word):
            check_pooler_config(bad)


def _st_dir(tmp_path: Path, modules: list[str], pooling: dict | None = None) -> Path:
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), model)
    entries = [{"idx": i, "name": str(i), "path": f"{i}_{t.rsplit('.', 1)[-1]}" if i else "",
                "type": t} for i, t in enumerate(modules)]  # fmt: skip
    (model / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (model / "1_Pooling").mkdir()
        (model / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return model


def test_older_pooling_files_and_refusals(tmp_path):
    older = _st_dir(tmp_path, ["sentence_transformers.models.Transformer",
                               "sentence_transformers.models.Pooling"],
                    {"pooling_mode_max_tokens": True, "pooling_mode_cls_token": True})  # fmt: skip
    p = Pooler(older)
    # The switches concatenate in sentence-transformers' fixed order: CLS before max.
    assert p.modes == ("cls", "max") and p.unsupported is None
    assert p.hidden_size == 2 * 256 and p.params.pooling == ("cls", "max")
    assert Pooler(older, {"pooling_type": "MEAN"}).modes == ("mean",)
    shutil.rmtree(older)
    odd = _st_dir(tmp_path, ["sentence_transformers.models.Transformer",
                             "sentence_transformers.models.WeightedLayerPooling"])  # fmt: skip
    assert "WeightedLayerPooling" in (Pooler(odd).unsupported or "")
    (odd / "modules.json").write_text('["not an object"]')
    assert "not an object" in (Pooler(odd).unsupported or "")


def test_a_checkpoint_this_server_cannot_pool_is_refused_by_name(tmp_path):
    model = _st_dir(tmp_path, ["sentence_transformers.models.Transformer",
                               "sentence_transformers.models.Pooling"],
                    {"pooling_mode": "median"})  # fmt: skip
    with live_server(str(model), engine_kwargs={"max_model_len": MAX_LEN}) as s:
        status, r = _post(s.url, {"input": "hello"})
        assert status == 400 and r["error"]["param"] == "model"
        assert "median" in r["error"]["message"]
        s.wait_kv_free()
