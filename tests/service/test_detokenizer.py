"""Incremental detokenization and stop strings, checked against whole-text references."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from service.detokenizer import IncrementalDetokenizer, StopChecker
from service.tokenizer import Tokenizer
from tests.checkpoints import tiny_checkpoint


@cache
def _tok(arch: str) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint(arch))


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies use."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _byte_ids(arch: str) -> tuple[int, ...]:
    """Token id of every single byte (all exist: the alphabet is all 256 bytes)."""
    vocab = _tok(arch).backend.get_vocab()
    table = _byte_to_char()
    return tuple(vocab[table[b]] for b in range(256))


def _run(
    tok: Tokenizer, prompt: list[int], out: list[int], cuts: list[int], skip: bool
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    bounds = sorted({c % (len(out) + 1) for c in cuts} | {0, len(out)})
    pieces = [detok.push(out[a:b]) for a, b in itertools.pairwise(bounds)]
    pieces.append(detok.flush())
    return pieces


def _ids(arch: str) -> st.SearchStrategy[list[int]]:
    # Lone bytes (mostly >= 0x80) make split and invalid UTF-8; any id covers the rest.
    high = [i for b, i in enumerate(_byte_ids(arch)) if b >= 0x80]
    return st.lists(
        st.one_of(
            st.sampled_from(high),
            st.sampled_from(_byte_ids(arch)),
            st.integers(0, _tok(arch).vocab_size - 1),
            st.sampled_from([0, 1, 2]),
        ),
        max_size=30,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_pushes_concatenate_to_full_decode(arch: str, skip: bool, data: st.DataObject) -> None:
    tok = _tok(arch)
    out = data.draw(_ids(arch), label="out")
    prompt = data.draw(_ids(arch), label="prompt")
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=10), label="cuts")
    pieces = _run(tok, prompt, out, cuts, skip)
    full = tok.decode(out, skip_special_tokens=skip)
    assert "".join(pieces) == full
    # Nothing emitted is ever taken back: every running total is a prefix of the result.
    total = ""
    for p in pieces:
        total += p
        assert full.startswith(total)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), cuts=st.lists(st.integers(0, 64), max_size=10))
def test_valid_text_never_emits_broken_characters(arch: str, text: str, cuts: list[int]) -> None:
    tok = _tok(arch)
    prompt = tok.encode("Some prompt: ")
    out = tok.encode(text, add_special_tokens=False)
    # Special tokens kept, so that text spelling one (hypothesis finds them) round-trips.
    pieces = _run(tok, prompt, out, cuts, False)
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=False)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)
    if arch != "qwen2":  # qwen2 normalises to NFC
        assert "".join(pieces) == text


@pytest.mark.parametrize("text", ["🎉", "日本", "é", "🧑‍🚀"])
def test_multibyte_character_is_held_until_complete(text: str) -> None:
    tok = _tok("llama")
    b = _byte_ids("llama")
    ids = [b[x] for x in text.encode()]
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    got = [detok.push([i]) for i in ids]
    # Only the token that completes a character releases it.
    starts = [i for i, x in enumerate(text.encode()) if x & 0xC0 != 0x80]
    ends = [*starts[1:], len(ids)]
    assert [i for i, g in enumerate(got) if g] == [e - 1 for e in ends]
    assert "".join(got) == text
    assert detok.flush() == ""


def test_truncated_character_is_flushed_as_replacement() -> None:
    tok = _tok("llama")
    b = _byte_ids("llama")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push([b[ord("a")], *[b[x] for x in "🎉".encode()[:3]]]) == "a"
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(detok.output_token_ids) == "a\ufffd"


def test_prompt_ending_inside_a_character() -> None:
    tok = _tok("llama")
    b = _byte_ids("llama")
    head, tail = "中".encode()[:1], "中".encode()[1:]
    prompt = [*tok.encode("hi "), *(b[x] for x in head)]
    out = [b[x] for x in tail] + tok.encode(" ok", add_special_tokens=False)
    pieces = _run(tok, prompt, out, [1], True)
    assert "".join(pieces) == tok.decode(out)


def test_special_tokens() -> None:
    tok = _tok("llama")
    out = [*tok.encode("Hi", add_special_tokens=False), 2, 0]
    for skip, want in ((True, "Hi"), (False, "Hi<|im_end|><|endoftext|>")):
        detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip)
        assert "".join(detok.push([i]) for i in out) + detok.flush() == want


def test_leading_space_follows_the_prompt_for_sentencepiece_style_decoders() -> None:
    # Metaspace (Llama-2/Mistral SentencePiece) drops the space of the first token of a
    # decode; as a continuation of the prompt the output must keep it.
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world, the world says hello"] * 10, trainer=trainer)
    prompt = tok.encode("hello").ids
    out = tok.encode("hello world").ids[len(prompt) :]
    assert tok.decode(out) == "world"
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push([i]) for i in out) + detok.flush() == " world"


# ---------------------------------------------------------------------------------------
# Stop strings


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """The whole text cut at the first stop string to complete (the longer one on a tie)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (
            best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))
        ):
            best = (i, s)
    if best is None:
        return text, False
    i, s = best
    return text[: i + len(s) if include else i], True


def _feed(checker: StopChecker, deltas: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for d in deltas:
        emit, stopped = checker.push(d)
        out.append(emit)
        if stopped:
            break
    out.append(checker.flush())
    return out, stopped


@settings(max_examples=1000, deadline=None)
@given(
    deltas=st.lists(st.text(alphabet="ab c", max_size=5), max_size=12),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_stop_checker_matches_reference(deltas: list[str], stops: list[str], include: bool) -> None:
    checker = StopChecker(stops, include)
    out, stopped = _feed(checker, deltas)
    want, want_stopped = _reference("".join(deltas), stops, include)
    assert "".join(out) == want
    assert stopped == want_stopped == checker.stopped
    # No part of a stop string is emitted before it is known not to be one.
    without_stop, _ = _reference("".join(deltas), stops, False)
    total = ""
    for piece in out[:-1]:
        total += piece
        assert include or without_stop.startswith(total)
    if stopped:
        assert checker.matched in stops
        assert checker.push("more") == ("", True)


def test_stop_spanning_deltas() -> None:
    checker = StopChecker(["</end>"])
    assert checker.push("Hello </") == ("Hello ", False)
    assert checker.push("en") == ("", False)
    assert checker.push("d> tail") == ("", True)
    assert checker.matched == "</end>"


def test_held_text_released_when_it_diverges_or_at_flush() -> None:
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert checker.push("a ST") == ("a ", False)
    assert checker.push("x") == ("STx", False)
    assert checker.push(" ST") == (" ", False)
    assert checker.flush() == "ST"


def test_include_stop_string_and_several_stops() -> None:
    checker = StopChecker(["\n\n", "User:"], include_stop_str_in_output=True)
    assert checker.push("answer. Use") == ("answer. ", False)
    assert checker.push("r: more") == ("User:", True)
    checker = StopChecker(["bc", "abcd"])
    assert checker.push("xabcd") == ("xa", True)  # "bc" completes first
    assert checker.matched == "bc"


def test_no_stop_strings_pass_through() -> None:
    checker = StopChecker([])
    assert checker.push("anything") == ("anything", False)
    assert checker.flush() == ""
