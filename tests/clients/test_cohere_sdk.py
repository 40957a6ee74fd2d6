"""Cohere's official SDK, unchanged, against a live server's /v2/rerank (vLLM serves
Cohere's and Jina's rerank shape): its results are the server's own ranking, the cosine of
the query's and each document's embedding, with `top_n` and `max_tokens_per_doc`; on a
cross-encoder, its score of each pair."""

from __future__ import annotations

import cohere
import httpx
import numpy as np
import openai
import pytest

from tests.clients.conftest import MODEL_NAME as MODEL

QUERY = "Which animal is quick?"
DOCS = ["The quick brown fox.", "A lazy dog sleeps all day.", "Stocks fell on Monday.",
        "The fox ran quickly across the field."]  # fmt: skip


@pytest.fixture(scope="module")
def co(server) -> cohere.ClientV2:
    return cohere.ClientV2(api_key="x", base_url=server.url, timeout=60, max_retries=0)


def _embeddings(server, texts):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    data = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
    return np.asarray([d.embedding for d in data])


def test_rerank_is_the_cosine_ranking(co, server):
    r = co.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=3)
    e = _embeddings(server, [QUERY, *DOCS])
    cos = e[1:] @ e[0]  # unit vectors
    want = np.argsort(-cos)[:3]
    assert [x.index for x in r.results] == want.tolist()
    np.testing.assert_allclose([x.relevance_score for x in r.results], cos[want], atol=1e-5)


def test_max_tokens_per_doc_keeps_each_documents_start(co, server):
    r = co.rerank(model=MODEL, query=QUERY, documents=DOCS, max_tokens_per_doc=3)
    with httpx.Client() as h:
        toks = [h.post(server.url + "/tokenize", json={"prompt": d}).json()["tokens"][:3]
                for d in DOCS]  # fmt: skip
    e = _embeddings(server, [QUERY])[0]
    cut = _embeddings(server, toks)
    scores = {x.index: x.relevance_score for x in r.results}
    np.testing.assert_allclose([scores[i] for i in range(4)], cut @ e, atol=1e-5)


def test_errors_are_the_sdks_classes(co):
    with pytest.raises(cohere.errors.BadRequestError):
        co.rerank(model=MODEL, query=QUERY, documents=[])
    with pytest.raises(cohere.errors.NotFoundError):
        co.rerank(model="nope", query=QUERY, documents=DOCS)


def test_a_cross_encoder_ranks_through_the_sdk(tmp_path):
    """On a one-label classifier the SDK's rerank is the cross-encoder's: each (query,
    document) pair read together, scored by its logit's sigmoid, as HF computes it."""
    import torch
    import transformers

    from tests.checkpoints import classifier_checkpoint
    from tests.service.live_server import live_server

    path = classifier_checkpoint(tmp_path, "qwen3", ("relevance",), seed=3)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = [
            float(torch.sigmoid(hf(torch.tensor([tok(QUERY, text_pair=d).input_ids])).logits[0, 0]))
            for d in DOCS
        ]
    with live_server(path, served_model_name="rr") as s:
        co = cohere.ClientV2(api_key="x", base_url=s.url, timeout=60, max_retries=0)
        r = co.rerank(model="rr", query=QUERY, documents=DOCS)
    order = np.argsort(-np.asarray(want))
    assert [x.index for x in r.results] == order.tolist()
    np.testing.assert_allclose([x.relevance_score for x in r.results],
                               np.asarray(want)[order], atol=1e-5)  # fmt: skip
