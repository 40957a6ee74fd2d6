"""echo, best_of and prompt_logprobs on a live server."""

from __future__ import annotations

import math

import openai
import pytest

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server


@pytest.fixture(scope="module")
def client():
    model = str(tiny_checkpoint("llama"))
    with live_server(model, served_model_name="tiny", engine_kwargs={"threads": 1}) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_prompt_logprobs_agree_with_sampled_logprobs(client):
    """The logprob of a token as part of the prompt equals its logprob when it was
    generated: the same model distribution, read at the same position."""
    gen = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=4, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    c = gen.choices[0]
    ids = c.model_extra["prompt_token_ids"] + c.model_extra["token_ids"]
    again = client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = again.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, want, entry in zip(ids[-4:], c.logprobs.token_logprobs, plp[-4:], strict=True):
        assert math.isclose(entry[str(tid)]["logprob"], want, abs_tol=1e-3)
        assert entry[str(tid)]["rank"] == 1  # greedy tokens: the most likely ones
    # vLLM's shape: the prompt token first with its rank over the whole vocabulary (1 + the
    # tokens more likely), then the top 2, ranked 1 and 2.
    for tid, entry in zip(ids[1:], plp[1:], strict=True):
        (key, mine), *_ = entry.items()
        assert key == str(tid) and {1, 2} <= {v["rank"] for v in entry.values()}
        if mine["rank"] > 2:
            assert len(entry) == 3
            assert all(v["logprob"] >= mine["logprob"] for v in entry.values())
        else:
            assert len(entry) == 2


def test_echo_text_and_logprobs(client):
    r = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    c = r.choices[0]
    assert c.text.startswith("hello world") and len(c.text) > len("hello world")
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    plain = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=3, temperature=0
    )
    assert c.text == "hello world" + plain.choices[0].text
    stream = client.completions.create(
        model="tiny", prompt=[[5, 6, 7]], max_tokens=3, temperature=0, echo=True, stream=True
    )
    text = "".join(ch.choices[0].text for ch in stream)
    assert text.startswith(
        client.post("/../detokenize", body={"tokens": [5, 6, 7]}, cast_to=object)["prompt"]
    )


def test_detokenize_long_token_list_matches_short_pieces(client):
    """Past 512 ids /detokenize decodes off the loop (service/tokenize_pool.py); the text
    is the same.  More ids than max_model_len are refused (no output is that long)."""
    ids = [5, 6, 7, 8] * 500  # 2,000 ids; max_model_len is 2,048

    def detok(t):
        return client.post("/../detokenize", body={"tokens": t}, cast_to=object)["prompt"]

    assert detok(ids) == detok([5, 6, 7, 8]) * 500
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        detok(ids * 2)


def test_best_of_returns_the_most_likely_n(client):
    r = client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=1.0, n=2, best_of=6, seed=11,
        logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6 * 6  # every candidate was generated
    scores = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert scores[0] >= scores[1]
    # Compare against all six candidates, drawn with the same seed.
    every = client.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=1.0, n=6, seed=11,
        logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    all_scores = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)
    assert scores == pytest.approx(all_scores[:2], abs=1e-4)
    hidden = client.completions.create(model="tiny", prompt="hello", max_tokens=3, best_of=3)
    assert hidden.choices[0].logprobs is None  # ranked by logprobs nobody asked to see
