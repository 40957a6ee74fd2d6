"""service.tokenizer.Tokenizer against transformers' AutoTokenizer on generated checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.tokenizer import Tokenizer
from tests.checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# One per tokenizer flavour make_model writes: GPT-2 style, Llama-3 style (bos added by the
# post-processor), Qwen2 style (NFC + split regex; transformers rebuilds it from the vocab).
ARCHS = ["llama", "llama3", "qwen2"]

TEXTS = [
    "",
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces\tand a tab",
    "line one\nline two\r\n\n\nend",
    "日本語のテキスト、中文文本",
    "emoji 🎉🧑‍🚀 👍🏽 flags 🇫🇷",
    "café naïve Ångström e\u0301",  # a combining accent: NFC matters for qwen2
    "def f(x):\n    return x ** 2  # comment\n",
    "numbers 1234567 3.14159 -42",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more text",
    "almost special <|im_start and <|im_end|",
    "\u200b zero width, \x00 nul, \x7f del",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke 😀\n\nPlease."},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "  three  "},
        {"role": "assistant", "content": ""},
    ],
]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any, Path]:
    path = tiny_checkpoint(request.param)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    return Tokenizer.from_dir(path), hf, path


def _copy(path: Path, dst: Path) -> Path:
    """The tokenizer files of a cached checkpoint, copied to be edited."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(path / name, dst / name)
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    f = path / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text: str) -> None:
    ours, hf, _ = pair
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_encode_decode_random_text(pair, text: str) -> None:
    ours, hf, _ = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_decode_random_ids(pair, data: st.DataObject) -> None:
    ours, hf, _ = pair
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=40))
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )


def test_llama3_flavour_adds_bos_once(pair) -> None:
    ours, _, path = pair
    ids = ours.encode("hello")
    if path.name.startswith("llama3"):
        assert ids[0] == ours.bos_token_id
        assert ids[1] != ours.bos_token_id
    else:
        assert ours.bos_token_id not in ids
    assert ours.bos_token_id not in ours.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("second_max", [None, 3])
def test_text_pairs_are_joined_as_transformers_joins_them(pair, second_max) -> None:
    """A cross-encoder's input: tokenizer(text, text_pair) (the Llama-3 flavour's
    post-processor puts a bos before each part); second_max cuts the second part as
    truncation="only_second" does."""
    ours, hf, _ = pair
    pairs = [(TEXTS[1], TEXTS[4]), (TEXTS[6], TEXTS[9]), (TEXTS[2], "x")]
    got = ours.codec.encode_pairs(pairs, second_max)
    for (a, b), ids in zip(pairs, got, strict=True):
        kw = {}
        if second_max is not None:
            first = len(hf(a, add_special_tokens=False).input_ids)
            first += hf.num_special_tokens_to_add(pair=True)
            kw = {"truncation": "only_second", "max_length": first + second_max}
        assert ids == hf(a, text_pair=b, **kw).input_ids, (a, b)


@pytest.mark.parametrize("max_len", [6, 9, 12, 200])
def test_a_pair_cut_to_max_len_is_cut_longest_first_as_transformers_cuts(pair, max_len) -> None:
    """truncate_prompt_tokens on a cross-encoder's pair: transformers' truncation=True
    (longest first, the second part on a tie), the special tokens kept."""
    ours, hf, _ = pair
    pairs = [(TEXTS[1], TEXTS[4]), (TEXTS[6] * 3, TEXTS[9]), ("x", TEXTS[2] * 4), ("ab", "cd")]
    got = ours.codec.encode_pairs(pairs, max_len=max_len)
    for (a, b), ids in zip(pairs, got, strict=True):
        want = hf(a, text_pair=b, truncation=True, max_length=max_len).input_ids
        assert ids == want, (a, b, max_len)


def test_longest_first_lengths_are_the_tokenizers_librarys() -> None:
    """The lengths longest_first computes are the ones the Rust tokenizer's own pair
    truncation leaves, over every small case (ties and budgets under half included)."""
    from tokenizers import Tokenizer as RustTokenizer

    from service.tokenizer import longest_first

    rust = RustTokenizer.from_file(str(tiny_checkpoint("llama") / "tokenizer.json"))
    unit = "a"  # one token however often it repeats (checked)
    assert len(rust.encode(unit * 7, add_special_tokens=False).ids) == 7
    for budget in range(14):
        rust.enable_truncation(max_length=budget, strategy="longest_first")
        for la in range(1, 10):
            for lb in range(1, 10):
                e = rust.encode(unit * la, unit * lb, add_special_tokens=False)
                got = (e.sequence_ids.count(0), e.sequence_ids.count(1))
                assert longest_first(la, lb, budget) == got, (la, lb, budget)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(pair, conv, gen: bool) -> None:
    ours, hf, _ = pair
    got = ours.apply_chat_template(conv, add_generation_prompt=gen)
    want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == gen
    # A rendered chat already carries its special tokens.
    assert ours.encode(got, add_special_tokens=False) == hf.apply_chat_template(
        conv, tokenize=True, add_generation_prompt=gen, return_dict=False
    )


CUSTOM_TEMPLATES = [
    # Special-token variables, tojson (no HTML escaping, non-ASCII kept), loop controls.
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}"
    "{% endif %}{{ m | tojson }}\n{% if loop.index >= 3 %}{% break %}{% endif %}"
    "{% endfor %}{{ eos_token }}",
    # trim_blocks / lstrip_blocks whitespace handling, namespace, extra kwargs.
    """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m['role'] | upper }}: {{ m['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}
    >>> {{ 'think' if enable_thinking else 'answer' }}
{% endif %}""",
    # The {% generation %} block transformers defines, and tojson's options.
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m | tojson(indent=1, sort_keys=True) }}"
    "{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_custom_templates_match_transformers(pair, template: str) -> None:
    ours, hf, _ = pair
    conv = CONVERSATIONS[2] + [{"role": "user", "content": "<b>&'\"</b> ünï"}]
    for gen in (True, False):
        for kw in ({}, {"enable_thinking": True}):
            got = ours.apply_chat_template(conv, gen, chat_template=template, **kw)
            want = hf.apply_chat_template(
                conv, chat_template=template, tokenize=False, add_generation_prompt=gen, **kw
            )
            assert got == want


def test_system_message_must_come_first(pair) -> None:
    ours, hf, _ = pair
    conv = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ValueError, match="system message must be the first"):
        ours.apply_chat_template(conv)
    with pytest.raises(Exception, match="system message must be the first"):
        hf.apply_chat_template(conv, tokenize=False)


def test_content_parts_and_none(pair) -> None:
    ours, _, _ = pair
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    plain = [{"role": "user", "content": "a\nb"}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    with_none = [{"role": "user", "content": "x", "name": None}]
    assert ours.apply_chat_template(with_none) == ours.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )
    with pytest.raises(ValueError, match="image_url"):
        ours.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    with pytest.raises(ValueError, match="content"):
        ours.apply_chat_template([{"role": "user", "content": 42}])
    # A message without content renders as the template sees it (here: an error, not a crash).
    with pytest.raises(ValueError):
        ours.apply_chat_template([{"role": "user"}])


def test_properties(pair) -> None:
    ours, hf, _ = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == 0
    # The turn end (tokenizer eos) first, then generation_config's end of text.
    assert ours.eos_token_ids == (2, 0)
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert set(hf.all_special_ids) <= set(ours.all_special_ids) == {0, 1, 2}
    assert ours.model_max_length == hf.model_max_length
    assert ours.id_to_token(1) == "<|im_start|>"


def test_no_chat_template(tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
    _edit_config(path, chat_template=None)
    tok = Tokenizer.from_dir(path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_templates_and_template_file(tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
    msgs = [{"role": "user", "content": "hi"}]
    _edit_config(
        path,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
        ],
    )
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template(msgs) == "DEFAULT hi"
    assert tok.apply_chat_template(msgs, chat_template="tool_use") == "TOOLS"
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.apply_chat_template(msgs, tokenize=False) == "DEFAULT hi"

    _edit_config(path, chat_template=[{"name": "other", "template": "X"}])
    with pytest.raises(ValueError, match="none is named 'default'"):
        Tokenizer.from_dir(path).apply_chat_template(msgs)

    # chat_template.jinja takes precedence over tokenizer_config.json, as in transformers.
    (path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert Tokenizer.from_dir(path).apply_chat_template(msgs) == "FILE 1"
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.apply_chat_template(msgs, tokenize=False) == "FILE 1"


def test_add_bos_token(tmp_path: Path) -> None:
    # GPT-2-style tokenizer.json adds nothing: add_bos_token makes us prepend bos.
    path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
    _edit_config(path, add_bos_token=True)
    tok = Tokenizer.from_dir(path)
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [tok.bos_token_id, *plain]

    # Llama-3-style post-processor already prepends it: never a second bos.
    path3 = _copy(tiny_checkpoint("llama3"), tmp_path / "l3")
    _edit_config(path3, add_bos_token=True)
    tok3 = Tokenizer.from_dir(path3)
    ids = tok3.encode("hello")
    assert ids[0] == tok3.bos_token_id and ids.count(tok3.bos_token_id) == 1


def test_special_tokens_as_added_token_dicts(tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
    (path / "special_tokens_map.json").unlink()
    as_dict = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    _edit_config(
        path,
        eos_token=as_dict,
        bos_token=None,
        model_max_length=int(1e30),
        additional_special_tokens=None,
        extra_special_tokens={"image_token": "<|im_start|>"},
    )
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_id == 2
    assert tok.bos_token_id is None
    assert tok.model_max_length is None
    assert tok.eos_token_ids == (2,)  # no generation_config.json in this copy
    assert "bos_token" not in tok.special_tokens
    assert tok.all_special_ids == [0, 1, 2]


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
