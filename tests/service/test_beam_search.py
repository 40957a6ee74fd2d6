"""Beam search (`use_beam_search`, `length_penalty`) through a live server and the official
`openai` client, against the oracle: the same search run on HF transformers' float32
logprobs of the same weights (`reference` below: vLLM's algorithm, written out plainly).
A stand-in engine with chosen logprobs covers what a random model rarely shows: beams
ending in eos, with and without the eos kept, and the length penalty's ranking."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.request

import openai
import pytest
import torch
import transformers

from scheduler.contract import TokenLogprobs
from service.beam_search import BeamSearch, BeamSearchParams
from service.outputs import CompletionOutput, RequestOutput, Submitted
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, served_model_name="tiny", engine_kwargs={"max_model_len": 256}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@torch.no_grad()
def reference(hf, prompt, width, max_tokens, length_penalty=1.0, ignore_eos=True):
    """The n best beams (token lists, best first) by vLLM's rule: every step each live
    beam offers its 2 x width most likely next tokens; eos retires a beam (unless
    ignore_eos), the width best of the rest by cumulative logprob go on; at the end all
    are ranked by cumulative logprob / length ** length_penalty, the length the prompt's
    and the output's, an eos at its end not counted."""
    ids = hf.config.eos_token_id
    eos = set(ids) if isinstance(ids, list) else {ids}
    beams, done = [([], 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            lp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0, -1], -1)
            top = torch.topk(lp, 2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if t in eos and not ignore_eos:
                    done.append((toks, cum + v))
                else:
                    cands.append(([*toks, t], cum + v))
        beams = sorted(cands, key=lambda b: -b[1])[:width]

    def score(b):
        n = len(prompt) + len(b[0]) - (1 if b[0] and b[0][-1] in eos else 0)
        return b[1] / n**length_penalty

    ranked = sorted(done + beams, key=score, reverse=True)
    return [toks for toks, _ in ranked[:width]]


def tokens_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize(("width", "length_penalty"), [(3, 1.0), (2, 0.0), (4, 2.0)])
def test_completion_beams_match_transformers(client, hf, width, length_penalty):
    r = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=8, n=width, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty,
                    "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt = r.choices[0].model_extra["prompt_token_ids"]
    assert [tokens_of(c) for c in r.choices] == reference(hf, prompt, width, 8, length_penalty)
    assert [c.index for c in r.choices] == list(range(width))
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8 * width


def test_chat_beams_match_transformers_streamed_or_not(client, hf, server):
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "Name a colour"}],
        "max_tokens": 6, "n": 3, "temperature": 0,
        "extra_body": {"use_beam_search": True, "return_token_ids": True, "ignore_eos": True},
    }  # fmt: skip
    r = client.chat.completions.create(**body)
    prompt = r.model_extra["prompt_token_ids"]
    want = reference(hf, prompt, 3, 6)
    assert [c.model_extra["token_ids"] for c in r.choices] == want
    texts = {c.index: "" for c in r.choices}
    ids: dict[int, list[int]] = {c.index: [] for c in r.choices}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            ids[c.index] += (c.model_extra or {}).get("token_ids") or []
    assert [ids[i] for i in range(3)] == want
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    server.wait_kv_free(10)


def test_several_prompts_each_searched(client, hf):
    r = client.completions.create(
        model="tiny", prompt=["One two", "Alpha beta gamma"], max_tokens=5, n=2,
        extra_body={"use_beam_search": True, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert len(r.choices) == 4
    for i in range(2):
        mine = [c for c in r.choices if c.index in (2 * i, 2 * i + 1)]
        prompt = mine[0].model_extra["prompt_token_ids"]
        assert [tokens_of(c) for c in mine] == reference(hf, prompt, 2, 5)


def test_offline_llm_beam_search_as_vllms(model, hf, client):
    """`LLM.beam_search(prompts, BeamSearchParams(...))`, vLLM's offline call: the same
    beams as the server's, each sequence's tokens the prompt's and the output's, and its
    cumulative logprob the reference's sum."""
    from service import LLM, BeamSearchParams

    served = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, n=3,
        extra_body={"use_beam_search": True, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt = served.choices[0].model_extra["prompt_token_ids"]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
             max_model_len=256) as llm:  # fmt: skip
        by_text, by_ids = llm.beam_search(
            [{"prompt": "The quick brown fox"}, {"prompt_token_ids": prompt}], params
        )
        with pytest.raises(ValueError, match="max_model_len"):
            llm.beam_search(["x" * 5000], BeamSearchParams(beam_width=2, max_tokens=4))
    want = [prompt + tokens_of(c) for c in served.choices]
    for out in (by_text, by_ids):
        assert [seq.tokens for seq in out.sequences] == want
        assert [seq.text for seq in out.sequences] == [c.text for c in served.choices]
    best = by_ids.sequences[0]
    with torch.no_grad():
        logits = hf(torch.tensor([best.tokens])).logits[0]
    lps = torch.log_softmax(logits, -1)
    ref = sum(lps[i - 1, best.tokens[i]].item() for i in range(len(prompt), len(best.tokens)))
    assert best.cum_logprob == pytest.approx(ref, abs=1e-3)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)


def aborted(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^pagestream_request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                  text, re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


def test_a_client_gone_mid_search_ends_it(model):
    """The client leaves once the search streams its first chunk (the role): the step in
    flight is aborted (its requests end as "abort"), and the search takes no next step.
    (Without resume: a resumable stream runs on for its grace period, as any stream.)"""
    with live_server(model, served_model_name="tiny", resume_grace=0.0) as server:
        client_gone_mid_search(server)


def client_gone_mid_search(server) -> None:
    before = aborted(server)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Long search"}],
            "max_tokens": 400, "n": 8, "stream": True, "use_beam_search": True,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")  # the role chunk: the search is running
    deadline = time.monotonic() + 20
    while server.num_running() or not server.kv_all_free():
        assert time.monotonic() < deadline, "the search ran on without its client"
        time.sleep(0.05)
    assert aborted(server) > before


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 11}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"seed": 3}, "seed"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"max_tokens": 500}, "max_tokens"),
    ],
)
def test_refusals_name_the_field(server, extra, param):
    body = {"prompt": "hi", "max_tokens": 4, "use_beam_search": True, **extra}
    req = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == param, err
    server.wait_kv_free(10)


def test_chat_refuses_what_beams_do_not_take(client):
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param in (({"logprobs": True}, "logprobs"),
                         ({"response_format": {"type": "json_object"}}, "response_format")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny", messages=msgs, n=2, extra_body={"use_beam_search": True, **extra}
            )
        assert e.value.body["param"] == param


# ------------------------------------------------------------- a stand-in engine: eos
class FakeEngine:
    """Answers each one-token step with chosen logprobs: `table(tokens so far)` gives
    {token: logprob} (the top ones, best first)."""

    eos_token_ids = (0,)
    max_model_len = 64

    def __init__(self, table):
        self.table = table
        self.tokenizer = self
        self.released = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def resolve_max_tokens(self, prompt_len, params):
        return params.max_tokens

    def submit_many(self, prompts, params, salt, **kw):
        return [Submitted(rid, ids, params, None, 0.0) for rid, ids in prompts]

    async def generate(self, prompt, submitted, final_only):
        top = self.table(submitted.prompt_token_ids[2:])  # the prompt is 2 tokens
        ids, lps = list(top), list(top.values())
        lp = TokenLogprobs(ids[0], lps[0], ids, lps)
        o = CompletionOutput(0, [ids[0]], "length", None, [lp])
        yield RequestOutput(submitted.request_id, None, submitted.prompt_token_ids, [o])

    def release(self, sub):
        self.released += 1


def search(table, spec):
    engine = FakeEngine(table)
    bs = BeamSearch(engine, "r", [7, 7], spec, None)
    bs.start()

    async def run():
        (out,) = [out async for out in bs.run()]
        return out

    return asyncio.run(run()), engine


def test_eos_retires_a_beam_and_length_penalty_ranks_the_finished():
    # After token 5, eos (0) is likely: the beam [5, 0] finishes at step 2 with logprob
    # log(.5) + log(.6); the live beams go on with small steps.
    def table(toks):
        if toks == [5]:
            return {0: math.log(0.6), 9: math.log(0.3), 8: math.log(0.1)}
        return {5: math.log(0.5), 6: math.log(0.45), 0: math.log(0.05)}

    spec = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1.0)
    out, engine = search(table, spec)
    first = out.outputs[0]
    # The finished beam's eos is not shown (include_stop_str_in_output off) and it ranks
    # first: its score, (log .5 + log .6) / 3, beats every 4-token beam's.
    assert first.token_ids == [5] and first.finish_reason == "stop" and first.stop_reason == 0
    assert out.outputs[1].finish_reason == "length" and len(out.outputs[1].token_ids) == 4
    assert engine.released == 1 + 2 * 3  # every step's requests: one beam, then two
    kept, _ = search(
        table, BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=True)
    )
    assert kept.outputs[0].token_ids == [5, 0] and kept.outputs[0].text == "5"
    # A strong length penalty favours the long beams (a negative sum divided by a larger
    # power of the length): the short finished one drops out.
    long, _ = search(table, BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=3.0))
    assert all(o.finish_reason == "length" for o in long.outputs)
    # ignore_eos: eos is one more token, never an end.
    ign, _ = search(table, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 for o in ign.outputs)
