"""Cohere's official SDK, unchanged, against a live server's /v2/rerank (vLLM serves
Cohere's and Jina's rerank shape): its results are the server's own ranking, the cosine of
the query's and each document's embedding, with `top_n` and `max_tokens_per_doc`."""

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
