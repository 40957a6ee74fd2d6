"""service/structured.py on a real tokenizer: compile, cache, batch masks, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from scheduler.sampling_params import StructuredOutputsParams
from service.structured import MAX_SOURCE_BYTES, GrammarCompiler, GrammarError, LLGuidanceMatcher
from service.tokenizer import Tokenizer
from tests.checkpoints import tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def compiler():
    path = Path(tiny_checkpoint("llama"))
    c = GrammarCompiler(path / "tokenizer.json", 2048, (2,))
    yield c, Tokenizer.from_dir(path)
    c.shutdown()


def test_cache_and_batch_masks_equal_single(compiler):
    c, tok = compiler
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    asyncio.run(c.compile(spec))
    asyncio.run(c.compile(spec))
    assert c.compiles == 1
    ms = c.matchers(spec, 3)
    assert ms[1].accept(tok.encode('{"', add_special_tokens=False)[0])
    single = [m.bitmask() for m in ms]
    batch = LLGuidanceMatcher.batch_bitmasks(ms)
    words = ms[0].words
    assert [s[: 4 * words] for s in single] == batch
    assert single[0] != single[1]  # the advanced matcher allows other tokens


def test_dead_end_is_terse_and_sticky(compiler):
    c, tok = compiler
    spec = StructuredOutputsParams(regex="ab")
    asyncio.run(c.compile(spec))
    m, ok = c.matchers(spec, 2)
    assert not m.accept(tok.encode("zz", add_special_tokens=False)[0])
    err = m.error()
    assert err and "doesn't satisfy the grammar" in err and "<grammar>" not in err
    assert m.bitmask() is None
    masks = LLGuidanceMatcher.batch_bitmasks([m, ok])
    assert masks[0] is None and masks[1] is not None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputsParams(regex="(a"), "regex"),
        (StructuredOutputsParams(json='{"type": "nope"}'), "json"),
        (StructuredOutputsParams(grammar="start: missing"), "unknown name"),
        (StructuredOutputsParams(regex="a" * (MAX_SOURCE_BYTES + 1)), "limit"),
    ],
)
def test_compile_errors(compiler, spec, words):
    c, _ = compiler
    with pytest.raises(GrammarError, match=words):
        asyncio.run(c.compile(spec))


def test_gbnf_is_converted(compiler):
    c, tok = compiler
    spec = StructuredOutputsParams(grammar='root ::= "yes" | "no"')
    asyncio.run(c.compile(spec))
    (m,) = c.matchers(spec, 1)
    for t in tok.encode("no", add_special_tokens=False):
        assert m.accept(t)
    assert m.terminated
