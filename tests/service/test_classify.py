"""Sequence classifiers (`*ForSequenceClassification`): vLLM's /classify, and /score and
/rerank as a cross-encoder.  The oracle is HF transformers' AutoModelForSequenceClassification
on the same weights in float32 (its `logits`, the score head at the last position), whatever
the batch, the chunking or the prefix-cache hits; a pair is tokenized as transformers'
`tokenizer(text, text_pair)` builds it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import torch

from service.llm import LLM
from tests.checkpoints import classifier_checkpoint
from tests.service.live_server import live_server

transformers = pytest.importorskip("transformers")

MAX_LEN = 160
LABELS = ("negative", "positive", "neutral")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return classifier_checkpoint(tmp_path_factory.mktemp("classifier"), "llama", LABELS)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    """A one-label classifier on the Qwen3 shape: a reranker."""
    return classifier_checkpoint(tmp_path_factory.mktemp("reranker"), "qwen3", ("relevance",), 1)


def _hf(path: str):
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()


@torch.no_grad()
def logits(hf, ids: list[int]) -> np.ndarray:
    return hf(torch.tensor([ids])).logits[0].numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _inputs(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, n).tolist() for n in lengths]


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(server.url + path, json=body) as r:
            return r.status, await r.json()

    return asyncio.run(go())


@pytest.fixture(scope="module", params=["inline", "engine-process"])
def server(request, classifier):
    # A 32-token step budget: the longer inputs are prefilled in chunks, beside others.
    with live_server(
        classifier, served_model_name="clf", engine_process=request.param == "engine-process",
        engine_kwargs={"max_model_len": MAX_LEN, "max_num_batched_tokens": 32},
    ) as s:  # fmt: skip
        yield s


def test_classify_gives_the_heads_probabilities_whatever_the_batch(server, classifier):
    hf = _hf(classifier)
    inputs = _inputs(0, [1, 7, 33, 90, MAX_LEN])
    for attempt in range(2):  # the second time from the prefix cache
        status, r = _post(server, "/classify", {"model": "clf", "input": inputs})
        assert status == 200, r
        assert r["object"] == "list" and r["model"] == "clf" and r["id"].startswith("classify-")
        assert r["usage"] == {
            "prompt_tokens": sum(map(len, inputs)),
            "total_tokens": sum(map(len, inputs)),
            "completion_tokens": 0,
        }
        for i, (ids, d) in enumerate(zip(inputs, r["data"], strict=True)):
            want = softmax(logits(hf, ids))
            np.testing.assert_allclose(d["probs"], want, atol=1e-5, err_msg=f"attempt {attempt}")
            assert d["index"] == i and d["num_classes"] == 3
            assert d["label"] == LABELS[int(np.argmax(want))]
    assert len({d["label"] for d in r["data"]}) > 1, "the head should tell these inputs apart"

    # use_activation false: the raw logits; /v1/classify is the same route, and so is
    # SageMaker's /invocations with an `input` on a classifier.
    for path in ("/v1/classify", "/invocations"):
        status, raw = _post(server, path, {"input": inputs[:2], "use_activation": False})
        assert status == 200, raw
        assert raw["id"].startswith("classify-"), path
        for ids, d in zip(inputs[:2], raw["data"], strict=True):
            np.testing.assert_allclose(d["probs"], logits(hf, ids), atol=1e-4)
    # vLLM's /pooling on a classifier: the same probabilities (or logits), as `data`.
    status, r = _post(server, "/pooling", {"input": inputs[:2]})
    assert status == 200 and r["id"].startswith("pool-"), r
    for i, (ids, d) in enumerate(zip(inputs[:2], r["data"], strict=True)):
        assert d["object"] == "pooling" and d["index"] == i
        np.testing.assert_allclose(d["data"], softmax(logits(hf, ids)), atol=1e-5)
    status, r = _post(server, "/v1/pooling", {"input": inputs[:1], "use_activation": False})
    assert status == 200, r
    np.testing.assert_allclose(r["data"][0]["data"], logits(hf, inputs[0]), atol=1e-4)
    server.wait_kv_free()


def test_classify_text_and_messages(server, classifier):
    hf = _hf(classifier)
    tok = transformers.AutoTokenizer.from_pretrained(classifier)
    text = "The service was quick and the food was great."
    status, r = _post(server, "/classify", {"input": text})
    assert status == 200, r
    want = softmax(logits(hf, tok(text).input_ids))
    np.testing.assert_allclose(r["data"][0]["probs"], want, atol=1e-5)
    messages = [{"role": "user", "content": text}]
    status, r = _post(server, "/classify", {"messages": messages})
    assert status == 200 and len(r["data"]) == 1, r
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok(rendered, add_special_tokens=False).input_ids
    np.testing.assert_allclose(r["data"][0]["probs"], softmax(logits(hf, ids)), atol=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": [[10**9]]}, "input"),
        ("/classify", {"input": [[7] * (MAX_LEN + 1)]}, "input"),
        ("/classify", {"input": "x", "dimensions": 2}, "dimensions"),
        ("/classify", {"input": "x", "use_activation": "yes"}, "use_activation"),
        ("/classify", {"input": "x", "model": "other"}, "model"),
        ("/pooling", {"input": "x", "task": "embed"}, "model"),
        ("/pooling", {"input": "x", "task": "token_classify"}, "task"),
        ("/pooling", {"input": "x", "normalize": True}, "task"),
        ("/v1/embeddings", {"input": "x"}, "model"),
        ("/score", {"text_1": "a", "text_2": "b"}, "model"),  # three labels: not a cross-encoder
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "model"),
    ],
)
def test_bad_requests_name_their_field(server, path, body, param):
    status, r = _post(server, path, body)
    assert 400 <= status < 500 and r["error"]["param"] == param, r
    server.wait_kv_free()


def test_classify_refuses_a_model_that_is_not_a_classifier():
    from tests.checkpoints import tiny_checkpoint

    with live_server(str(tiny_checkpoint("llama")), engine_kwargs={"max_model_len": 64}) as s:
        status, r = _post(s, "/classify", {"input": "hello"})
        assert status == 400 and r["error"]["param"] == "model", r
        assert "not a sequence classifier" in r["error"]["message"]


def test_cross_encoder_scores_and_reranks_pairs_read_together(cross_encoder):
    hf = _hf(cross_encoder)
    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    query = "where do foxes live"
    docs = ["foxes live in dens", "the stock market fell", "a fox in the woods", "tea"]

    def relevance(a: str, b: str, **kw) -> float:
        return float(1 / (1 + np.exp(-logits(hf, tok(a, text_pair=b, **kw).input_ids)[0])))

    want = [relevance(query, d) for d in docs]
    with live_server(cross_encoder, served_model_name="rr",
                     engine_kwargs={"max_model_len": MAX_LEN, "max_num_batched_tokens": 16}) as s:  # fmt: skip
        status, r = _post(s, "/score", {"text_1": query, "text_2": docs})
        assert status == 200, r
        np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=1e-5)
        pair_tokens = sum(len(tok(query, text_pair=d).input_ids) for d in docs)
        assert r["usage"]["prompt_tokens"] == pair_tokens
        # N:N pairs in order
        status, r = _post(s, "/v1/score", {"text_1": docs[:2], "text_2": docs[2:]})
        assert status == 200, r
        np.testing.assert_allclose(
            [d["score"] for d in r["data"]],
            [relevance(docs[0], docs[2]), relevance(docs[1], docs[3])],
            atol=1e-5,
        )

        status, r = _post(s, "/v2/rerank", {"query": query, "documents": docs, "top_n": 3})
        assert status == 200, r
        order = sorted(range(len(docs)), key=lambda i: -want[i])
        assert [x["index"] for x in r["results"]] == order[:3]
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                                   [want[i] for i in order[:3]], atol=1e-5)  # fmt: skip
        assert r["results"][0]["document"] == {"text": docs[order[0]]}
        # SageMaker's /invocations: a `query` is a rerank, `text_1` a score.
        status, r = _post(s, "/invocations", {"query": query, "documents": docs, "top_n": 1})
        assert status == 200 and r["results"][0]["index"] == order[0], r
        status, r = _post(s, "/invocations", {"text_1": query, "text_2": docs[:1]})
        assert status == 200 and abs(r["data"][0]["score"] - want[0]) < 1e-5, r

        # Cohere's max_tokens_per_doc: each document keeps its first tokens, the query all.
        q_len = len(tok(query, add_special_tokens=False).input_ids)
        q_len += tok.num_special_tokens_to_add(pair=True)
        status, r = _post(
            s, "/rerank", {"query": query, "documents": docs, "max_tokens_per_doc": 2}
        )
        assert status == 200, r
        cut = {x["index"]: x["relevance_score"] for x in r["results"]}
        for i, d in enumerate(docs):
            kw = {"truncation": "only_second", "max_length": q_len + 2}
            assert abs(cut[i] - relevance(query, d, **kw)) < 1e-5, (i, d)
        assert cut != dict(enumerate(want)), "the documents should have been cut"

        status, r = _post(s, "/v1/embeddings", {"input": "x"})
        assert status == 400 and r["error"]["param"] == "model"
        # Hostile but well-formed: refused in seconds, naming the field.
        for body, param in [
            ({"query": "q", "documents": ["d"] * 100_000}, "documents"),
            ({"query": "q " * 1_000_000, "documents": ["d"]}, "query"),
            ({"query": "q", "documents": ["d " * 400]}, "documents"),
            ({"query": "q", "documents": ["d"], "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ]:
            t0 = time.monotonic()
            status, r = _post(s, "/rerank", body)
            assert 400 <= status < 500 and r["error"]["param"] == param, (param, r)
            assert time.monotonic() - t0 < 5
        # Cut to the first 20 tokens; the 600 KB pair is tokenized in a worker process.
        # Cut as transformers' truncation=True cuts (longest first, special tokens kept).
        for text in ("b " * 400, "b " * 300_000):
            status, r = _post(s, "/score", {"text_1": "a", "text_2": text,
                                            "truncate_prompt_tokens": 20})  # fmt: skip
            assert status == 200 and r["usage"]["prompt_tokens"] == 20, r
            want = relevance("a", "b " * 400, truncation=True, max_length=20)
            assert abs(r["data"][0]["score"] - want) < 1e-5
        s.wait_kv_free()


def test_llm_classify_matches_transformers(classifier):
    hf = _hf(classifier)
    prompts = _inputs(3, [4, 30, 50])
    with LLM(classifier, dtype="float32", max_num_batched_tokens=16) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts])
        raw = llm.classify([{"prompt_token_ids": p} for p in prompts], use_activation=False)
        with pytest.raises(ValueError, match="no LM head"):
            llm.generate([[5, 6, 7]])
    for ids, o, r in zip(prompts, outs, raw, strict=True):
        assert o.outputs.num_classes == 3 and o.prompt_token_ids == ids
        np.testing.assert_allclose(o.outputs.probs, softmax(logits(hf, ids)), atol=1e-5)
        np.testing.assert_allclose(r.outputs.probs, logits(hf, ids), atol=1e-4)


def test_llm_score_by_cross_encoder_and_by_cosine(cross_encoder):
    hf = _hf(cross_encoder)
    tok = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    query, docs = "where do foxes live", ["foxes live in dens", "tea"]
    with LLM(cross_encoder, dtype="float32") as llm:
        got = [o.outputs.score for o in llm.score(query, docs)]
        with pytest.raises(ValueError, match="as many as text_2"):
            llm.score(docs, [query] * 3)
    want = [1 / (1 + np.exp(-logits(hf, tok(query, text_pair=d).input_ids)[0])) for d in docs]
    np.testing.assert_allclose(got, want, atol=1e-5)

    from tests.checkpoints import tiny_checkpoint

    with LLM(str(tiny_checkpoint("llama")), dtype="float32") as llm:
        (vq,), vd = (
            [o.outputs.embedding for o in llm.embed(t)] for t in ([query], docs)
        )  # fmt: skip
        got = [o.outputs.score for o in llm.score(query, docs)]
    np.testing.assert_allclose(got, [float(np.dot(vq, v)) for v in vd], atol=1e-5)


def _two_tokens(model: str) -> tuple[str, str]:
    """Two vocabulary tokens standing for Qwen3-Reranker's "no" and "yes"."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    return tok.id_to_token(300), tok.id_to_token(301)


def test_a_causal_lm_served_as_a_reranker_through_hf_overrides():
    """vLLM's recipe for Qwen3-Reranker: --hf-overrides names a sequence-classification
    architecture and two tokens; the head is the second token's LM-head row minus the
    first's, so a pair's score is P(yes) against P(no) at the last position, as the
    model card computes it with transformers."""
    from tests.checkpoints import tiny_checkpoint

    model = str(tiny_checkpoint("qwen3"))
    no, yes = _two_tokens(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids_no, ids_yes = tok.convert_tokens_to_ids([no, yes])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": [no, yes], "is_original_qwen3_reranker": True}  # fmt: skip
    query, docs = "<Query>: where do foxes live\n", ["<Document>: in dens", "<Document>: tea"]

    @torch.no_grad()
    def p_yes(doc: str) -> float:
        last = hf(torch.tensor([tok(query, text_pair=doc).input_ids])).logits[0, -1]
        return float(torch.softmax(last[[ids_no, ids_yes]], -1)[1])

    want = [p_yes(d) for d in docs]
    # In the engine's own process: the parent's pooling rules read the child's config.
    with live_server(model, served_model_name="rr", engine_process=True,
                     engine_kwargs={"max_model_len": MAX_LEN, "hf_overrides": overrides}) as s:  # fmt: skip
        status, r = _post(s, "/score", {"text_1": query, "text_2": docs})
        assert status == 200, r
        np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=1e-5)
        status, r = _post(s, "/v1/rerank", {"query": query, "documents": docs})
        assert status == 200 and len(r["results"]) == 2, r
        status, r = _post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 400 and r["error"]["param"] == "model", r
        s.wait_kv_free()

    # The tokens' own rows, one label each (no two-way difference): a softmax over them.
    three = [no, yes, tok.convert_ids_to_tokens(302)]
    rows = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": three}
    prompts = _inputs(4, [5, 40])
    with LLM(model, dtype="float32", hf_overrides=rows) as llm:
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts])
    for ids, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        want = torch.softmax(last[tok.convert_tokens_to_ids(three)], -1).numpy()
        np.testing.assert_allclose(o.outputs.probs, want, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"classifier_from_token": ["no", "yes", "x"], "is_original_qwen3_reranker": True},
         "2 tokens"),
        ({"classifier_from_token": ["\u2603 not a token"]}, "not a vocabulary token"),
        ({"classifier_from_token": "yes"}, "list of token strings"),
    ],
)  # fmt: skip
def test_a_head_from_tokens_that_cannot_be_built_fails_at_start(overrides, words):
    from gpu.config import ModelLoadError
    from tests.checkpoints import tiny_checkpoint

    model = str(tiny_checkpoint("qwen3"))
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    with pytest.raises(ModelLoadError, match=words):
        LLM(model, dtype="float32", hf_overrides={**arch, **overrides})
