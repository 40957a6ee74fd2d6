"""vLLM's request extensions beyond OpenAI's: allowed_token_ids, truncate_prompt_tokens,
continue_final_message and return_tokens_as_token_ids, through a live server and the
official `openai` client (their vLLM names travel in `extra_body`, as with vLLM).

The oracles: transformers' own `apply_chat_template(continue_final_message=True)` for the
prompt a continued message renders to, and the same server's plain requests (the kept
prompt tokens sent as they are) for truncation."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import websockets
from transformers import AutoTokenizer

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

MSGS = [{"role": "user", "content": "Name three colours, please."}]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model):
    with live_server(
        model, served_model_name="tiny", engine_kwargs={"max_model_len": MAX_MODEL_LEN}
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refused(server, path: str, body: dict, param: str) -> str:
    code, obj = post(server, path, body)
    # The decoder names a list's element (`allowed_token_ids[0]`), the checks the field.
    assert code == 400 and obj["error"]["param"].split("[")[0] == param, obj
    return obj["error"]["message"]


GREEDY = {"temperature": 0.0, "max_tokens": 12}


# ------------------------------------------------------------------------- allowed_token_ids
def test_allowed_token_ids_confine_every_sampled_token(client):
    allowed = [11, 57, 300, 1201]
    for extra in ({"temperature": 0.0}, {"temperature": 1.3, "seed": 5}):
        r = client.completions.create(
            model="tiny", prompt="The sky is", max_tokens=16, **extra,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        ids = r.choices[0].model_extra["token_ids"]
        assert len(ids) == 16 and set(ids) <= set(allowed), ids
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, stream=True, max_tokens=10, temperature=0.0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    streamed = [
        t for c in stream for ch in c.choices for t in ch.model_extra.get("token_ids") or []
    ]
    assert len(streamed) == 10 and set(streamed) <= set(allowed), streamed


def test_allowed_token_ids_pick_the_best_allowed_token_by_the_raw_logprobs(client):
    """Greedy under the mask is the argmax over the allowed ids: of five ids ranked 6-10
    by an unconstrained run's raw logprobs, the first token is the one ranked 6."""
    ranked = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=1, temperature=0.0, logprobs=20,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0].logprobs.top_logprobs[0]  # fmt: skip
    order = sorted(ranked, key=ranked.get, reverse=True)
    allowed = [int(t.split(":")[1]) for t in order[5:10]]
    r = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=1, temperature=0.0,
        extra_body={"allowed_token_ids": allowed[::-1], "return_token_ids": True},
    )  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == [allowed[0]]


def test_allowed_token_ids_refusals_name_the_field(server):
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                                {"messages": MSGS})):  # fmt: skip
        for bad in ([], [-1], [2048], [1.5], "1", [0] * 2049):
            refused(server, path, {**base, "allowed_token_ids": bad}, "allowed_token_ids")
    code, obj = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 200, obj


def test_allowed_token_ids_that_leave_no_token_are_refused(server, model):
    """Every allowed id banned (a one-token bad word), or min_tokens holding back the only
    allowed ids (eos, a stop token id): no token could be sampled, so a 400 at admission
    rather than a row that samples whatever the empty mask leaves (id 0)."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    tok = AutoTokenizer.from_pretrained(model)
    the = tok.encode("the", add_special_tokens=False)
    eos = tok.eos_token_id
    cases = [
        {"allowed_token_ids": [eos, 5], "stop_token_ids": [5], "min_tokens": 2},
        {"allowed_token_ids": [eos], "min_tokens": 1},
    ]
    assert len(the) == 1  # a one-token word: banned whatever came before
    cases.append({"allowed_token_ids": the, "bad_words": ["the"]})
    for extra in cases:
        msg = refused(server, "/v1/completions", {"prompt": "hi", **extra}, "allowed_token_ids")
        assert "no token could be generated" in msg
    # Still taken: another allowed id left, or min_tokens without the eos-only list.
    ok = {"prompt": "hi", "max_tokens": 2, "allowed_token_ids": [eos, 7], "min_tokens": 1}
    code, obj = post(server, "/v1/completions", ok)
    assert code == 200 and obj["choices"][0]["text"] is not None, obj
    with (
        LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
            max_model_len=MAX_MODEL_LEN) as llm,
        pytest.raises(ValueError, match="no token could be generated"),
    ):  # fmt: skip
        llm.generate("x", SamplingParams(allowed_token_ids=[eos], min_tokens=1))


# ---------------------------------------------------------------------- truncate_prompt_tokens
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server):
    prompt = list(range(100, 160))
    r = client.completions.create(
        model="tiny", prompt=prompt, **GREEDY,
        extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True},
    )  # fmt: skip
    assert r.usage.prompt_tokens == 10
    assert r.choices[0].model_extra["prompt_token_ids"] == prompt[-10:]
    same = client.completions.create(
        model="tiny", prompt=prompt[-10:], **GREEDY, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == same.choices[0].model_extra["token_ids"]
    # echo gives the text of the tokens kept
    e = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 10},
    )  # fmt: skip
    kept = post(server, "/detokenize", {"tokens": prompt[-10:]})[1]["prompt"]
    assert e.choices[0].text.startswith(kept)


def test_truncate_prompt_tokens_lets_a_too_long_prompt_in(client, server):
    long_text = "red green blue " * (4 * MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=long_text, max_tokens=2)
    r = client.completions.create(
        model="tiny", prompt=long_text, max_tokens=2, extra_body={"truncate_prompt_tokens": 32}
    )
    assert r.usage.prompt_tokens == 32
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": long_text}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 40},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 40
    # -1 keeps max_model_len's worth: no room left for an output (as in vLLM), a 400
    msg = refused(server, "/v1/completions",
                  {"prompt": long_text, "max_tokens": 2, "truncate_prompt_tokens": -1},
                  "prompt")  # fmt: skip
    assert str(MAX_MODEL_LEN) in msg
    for bad in (0, -2, MAX_MODEL_LEN + 1, "4"):
        refused(server, "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": bad},
                "truncate_prompt_tokens")  # fmt: skip


# ---------------------------------------------------------------------- continue_final_message
def test_continue_final_message_renders_as_transformers_does(client, model):
    messages = [*MSGS, {"role": "assistant", "content": "Red, green and"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, **GREEDY,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True},
    )  # fmt: skip
    hf = AutoTokenizer.from_pretrained(model)
    want = hf.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert r.model_extra["prompt_token_ids"] == list(want)
    # The continuation is what a plain completion of those tokens gives.
    plain = client.completions.create(
        model="tiny", prompt=list(want), **GREEDY, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert r.choices[0].message.content == plain.choices[0].text


def test_continue_final_message_refusals(server):
    cont = [*MSGS, {"role": "assistant", "content": "Red"}]
    msg = refused(
        server,
        "/v1/chat/completions",
        {"messages": cont, "continue_final_message": True},
        "continue_final_message",
    )
    assert "add_generation_prompt" in msg
    for last in ("", "   "):
        refused(server, "/v1/chat/completions",
                {"messages": [*MSGS, {"role": "assistant", "content": last}],
                 "continue_final_message": True, "add_generation_prompt": False},
                "messages")  # fmt: skip


# -------------------------------------------------------------------- return_tokens_as_token_ids
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, logprobs=True, top_logprobs=3, **GREEDY,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    ids = r.choices[0].model_extra["token_ids"]
    assert [c.token for c in content] == [f"token_id:{i}" for i in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)

    c = client.completions.create(
        model="tiny", prompt="Colours:", logprobs=2, echo=True, **GREEDY,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )  # fmt: skip
    lp, extra = c.choices[0].logprobs, c.choices[0].model_extra
    all_ids = extra["prompt_token_ids"] + extra["token_ids"]
    assert lp.tokens == [f"token_id:{i}" for i in all_ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs if top for k in top)
    # Offsets still index the text: each token starts where the texts before it end.
    plain = client.completions.create(model="tiny", prompt="Colours:", logprobs=2, echo=True,
                                      **GREEDY)  # fmt: skip
    assert lp.text_offset == plain.choices[0].logprobs.text_offset
    assert c.choices[0].text == plain.choices[0].text


async def _ws_generate(server, frame: dict) -> list[dict]:
    frames = []
    async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/ws") as ws:
        await ws.send(json.dumps(frame))
        while True:
            frames.append(f := json.loads(await ws.recv()))
            if f["type"] in ("done", "error"):
                return frames


async def test_allowed_token_ids_in_websocket_params(server):
    allowed = [11, 57, 300]
    frames = await _ws_generate(server, {
        "type": "generate", "id": "w1", "prompt": "The sky is",
        "params": {"max_tokens": 8, "temperature": 0.9, "seed": 3, "ignore_eos": True,
                   "allowed_token_ids": allowed},
    })  # fmt: skip
    ids = [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
    assert frames[-1]["type"] == "done" and len(ids) == 8 and set(ids) <= set(allowed), frames
    bad = await _ws_generate(server, {"type": "generate", "id": "w2", "prompt": "x",
                                      "params": {"allowed_token_ids": [2048]}})  # fmt: skip
    assert bad[-1]["type"] == "error" and bad[-1]["param"] == "params.allowed_token_ids", bad


# --------------------------------------------------------------------------------- bad_words
def _spelled(server, text: str) -> list[int]:
    code, obj = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert code == 200, obj
    return obj["tokens"]


async def test_bad_words_keep_a_generated_word_out(client, server):
    """A word the free greedy run generates, banned: the run is the same up to it, then
    takes another token there and never generates it."""
    free = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    text_of = {t: post(server, "/detokenize", {"tokens": [t]})[1]["prompt"] for t in set(free)}
    # A token that is a whole spelling of its word, so the word bans it outright.
    found = next(
        (
            (p, tok, w)
            for p, tok in enumerate(free)
            if (w := text_of[tok].strip())
            and [tok] in (_spelled(server, w), _spelled(server, " " + w))
        ),
        None,
    )
    assert found, f"no generated token spells a word: {[text_of[t] for t in free]}"
    p, tok, word = found
    out = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "bad_words": [word]},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    assert out[:p] == free[:p] and out[p] != tok and tok not in out, (word, free, out)
    # chat takes them too
    chat = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0.0,
        extra_body={"bad_words": [word], "return_token_ids": True},
    )  # fmt: skip
    assert tok not in chat.choices[0].model_extra["token_ids"]
    # and the WebSocket's params
    frames = await _ws_generate(server, {
        "type": "generate", "id": "b1", "prompt": "Once upon a time",
        "params": {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "bad_words": [word]},
    })  # fmt: skip
    ws_ids = [t for f in frames if f["type"] == "delta" for t in f["token_ids"]]
    assert ws_ids == out, frames[-1]
    bad = await _ws_generate(server, {"type": "generate", "id": "b2", "prompt": "x",
                                      "params": {"bad_words": ["  "]}})  # fmt: skip
    assert bad[-1]["type"] == "error" and bad[-1]["param"] == "params.bad_words", bad


def test_bad_words_refusals_name_the_field(server):
    for bad in (["  "], [""], ["x"] * 129, ["word " * 600], "x", [3]):
        refused(server, "/v1/completions", {"prompt": "hi", "bad_words": bad}, "bad_words")


def test_offline_llm_takes_bad_words_as_the_server_does(client, model):
    """`LLM.generate` with SamplingParams(bad_words=...) tokenizes the words in the engine
    and bans what the server bans for the same request."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    words = ["the", "and"]
    served = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "bad_words": words},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=words)
    with LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, threads=1,
             max_model_len=MAX_MODEL_LEN) as llm:  # fmt: skip
        (out,) = llm.generate("Once upon a time", params)
        assert list(out.outputs[0].token_ids) == served
        with pytest.raises(ValueError, match="bad_words"):
            llm.generate("x", SamplingParams(bad_words=["  "]))
