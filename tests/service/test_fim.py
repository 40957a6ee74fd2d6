"""Fill in the middle: a completion's `suffix` on a code model whose tokenizer holds
fill-in-the-middle tokens.  The prompt the server builds is transformers' tokenization of
"<|fim_prefix|>" + prompt + "<|fim_suffix|>" + suffix + "<|fim_middle|>", and the middle it
writes is transformers' greedy continuation of it, through the official client; a model
without such tokens, and suffix beside echo, get a 400 naming the field."""

from __future__ import annotations

import openai
import pytest
import torch

from service.fim import FORMATS, FimLayout, fim_layout
from service.tokenizer import Tokenizer
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

transformers = pytest.importorskip("transformers")

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\n\ndef sub(a, b):\n    return a - b\n"
N = 12


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("qwen2", fim=True))


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, served_model_name="coder", engine_kwargs={"max_model_len": 256}) as s:
        yield s


@torch.no_grad()
def hf_middle(model: str, text: str) -> tuple[list[int], list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = tok(text, add_special_tokens=False).input_ids
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = lm.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N,
                      do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return ids, out[0, len(ids) :].tolist()


def test_the_middle_is_transformers_greedy_continuation_of_the_fim_prompt(model, server):
    want_prompt, want = hf_middle(
        model, f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    body = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=N,
                                  temperature=0, extra_body=body)  # fmt: skip
    c = r.model_dump()["choices"][0]
    assert c["prompt_token_ids"] == want_prompt
    assert c["token_ids"] == want
    assert r.usage.prompt_tokens == len(want_prompt)
    # Streamed, and with the prefix as token ids: the same middle.
    stream = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=N,
                                       temperature=0, stream=True, extra_body=body)  # fmt: skip
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c["text"]
    ids = Tokenizer.from_dir(model).encode(PREFIX, add_special_tokens=False)
    r2 = client.completions.create(model="coder", prompt=ids, suffix=SUFFIX, max_tokens=N,
                                   temperature=0, extra_body=body)  # fmt: skip
    assert r2.model_dump()["choices"][0]["token_ids"] == want
    server.wait_kv_free()


def test_suffix_with_echo_or_truncation_is_refused(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for extra, param in (({"echo": True}, "echo"),
                         ({"extra_body": {"truncate_prompt_tokens": 4}}, "truncate_prompt_tokens")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=2,
                                      **extra)  # fmt: skip
        assert e.value.body["param"] == param
    server.wait_kv_free()


def test_a_model_without_fim_tokens_refuses_suffix_by_name():
    with live_server(str(tiny_checkpoint("llama")), engine_kwargs={"max_model_len": 128}) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=s.state.serving.names[0], prompt="a", suffix="b",
                                      max_tokens=2)  # fmt: skip
        assert e.value.body["param"] == "suffix"
        assert "fill-in-the-middle" in e.value.body["message"]
        s.wait_kv_free()


def test_each_family_is_found_by_its_tokens_and_laid_out_in_its_order():
    class Vocab:
        def __init__(self, tokens):
            self.ids = {t: 100 + i for i, t in enumerate(tokens)}

        def token_to_id(self, t):
            return self.ids.get(t)

    class Tok:
        def __init__(self, tokens, bos=None):
            self.backend, self.leading_bos = Vocab(tokens), bos

    for f in FORMATS:
        tokens = [t for t in (f.first, f.second, f.last) if t is not None]
        layout = fim_layout(Tok(tokens, bos=1))  # type: ignore[arg-type]
        assert isinstance(layout, FimLayout) and layout.format == f
        got = layout.ids([7, 8], [9])
        a, b = ([9], [7, 8]) if f.suffix_first else ([7, 8], [9])
        assert got == [1, 100, *a, 101, *b] + ([102] if f.last else [])
    assert fim_layout(Tok(["<|fim_prefix|>"])) is None  # type: ignore[arg-type]
