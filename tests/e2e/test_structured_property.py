"""Property tests of constrained decoding: a random-weight model at temperature 1 (left
alone it never writes JSON) must produce, for any schema / regex / choice list that
hypothesis makes up, output that parses and validates.

Strings carry a maxLength and arrays a maxItems, so a random walk through the grammar
ends within max_tokens; numbers get bounds, objects additionalProperties false.
"""

from __future__ import annotations

import json
import re
import string

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint

MAX_TOKENS = 400
SAMPLES = 3  # prompts per example, decoded in one batch
PROMPTS = ["hello", "The weather today", "1 2 3"]
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()  # restored after: later modules in the run use it
    torch.set_num_threads(1)
    engine = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=512, seed=3)
    try:
        yield engine
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


def generate(llm: LLM, spec: StructuredOutputsParams, **kw) -> list:
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, structured_outputs=spec, **kw)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS[:SAMPLES], params)]
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.stop_reason, o.text)
    return outs


# ----------------------------------------------------------------------------- schemas
words = st.text(
    alphabet=string.ascii_letters + string.digits + " _-\"'\\é€", min_size=1, max_size=6
)
keys = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=6)


@st.composite
def bounded_int(draw):
    lo = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 500))}


@st.composite
def bounded_number(draw):
    lo = draw(st.integers(-100, 100))
    return {"type": "number", "minimum": lo, "maximum": lo + draw(st.integers(1, 100))}


@st.composite
def short_string(draw):
    lo = draw(st.integers(0, 2))
    return {"type": "string", "minLength": lo, "maxLength": lo + draw(st.integers(0, 5))}


leaves = st.one_of(
    short_string(),
    bounded_int(),
    bounded_number(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(words, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
)


def containers(children):
    @st.composite
    def obj(draw):
        props = draw(st.dictionaries(keys, children, min_size=1, max_size=3))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }

    @st.composite
    def arr(draw):
        lo = draw(st.integers(0, 1))
        return {
            "type": "array",
            "items": draw(children),
            "minItems": lo,
            "maxItems": lo + draw(st.integers(0, 2)),
        }

    return st.one_of(obj(), arr())


schemas = st.recursive(leaves, containers, max_leaves=6).filter(
    lambda s: s.get("type") in ("object", "array")
)


@SETTINGS
@given(schema=schemas)
def test_random_json_schemas_validate(llm, schema):
    spec = StructuredOutputsParams(json=json.dumps(schema))
    for o in generate(llm, spec):
        jsonschema.validate(json.loads(o.text), schema)


def test_json_object_and_nested_required(llm):
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 5}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "tags", "owner"],
        "additionalProperties": False,
    }
    for o in generate(llm, StructuredOutputsParams(json=json.dumps(schema)), n=2):
        jsonschema.validate(json.loads(o.text), schema)


# ----------------------------------------------------------------------------- regex
# No \d: the grammar engine's Unicode tables are newer than Python's (a digit added in
# Unicode 15 matches there and not in `re`), which would fail the oracle, not the engine.
atoms = st.one_of(
    st.sampled_from(list("abcxyz019 -_")),
    st.sampled_from([r"[a-f]", r"[0-9]", r"[A-Z]", r"[xyz]"]),
)


@st.composite
def regexes(draw, depth=0):
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        if depth < 2 and draw(st.booleans()):
            alts = [draw(regexes(depth + 1)) for _ in range(draw(st.integers(1, 3)))]
            atom = "(" + "|".join(alts) + ")"
        else:
            atom = draw(atoms)
        q = draw(st.sampled_from(["", "?", "{1,3}", "{2}", "{0,2}"]))
        parts.append(atom + q)
    return "".join(parts)


@SETTINGS
@given(pattern=regexes())
def test_random_regexes_match(llm, pattern):
    for o in generate(llm, StructuredOutputsParams(regex=pattern)):
        assert re.fullmatch(pattern, o.text), (pattern, o.text)


# ----------------------------------------------------------------------------- choice
@SETTINGS
@given(choices=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=6, unique=True))
def test_random_choices_pick_one(llm, choices):
    # The tokenizer cannot write every code point (surrogates, unassigned): keep to the
    # ones it round-trips, as a client's choices would be.
    tok = llm.get_tokenizer()
    choices = [c for c in choices if tok.decode(tok.encode(c, add_special_tokens=False)) == c]
    if not choices:
        return
    for o in generate(llm, StructuredOutputsParams(choice=tuple(choices))):
        assert o.text in choices


# ----------------------------------------------------------------------------- preemption
def test_constrained_rows_survive_preemption():
    """A KV pool too small for the batch preempts (recompute) constrained requests midway;
    each keeps its matcher and its output still validates."""
    schema = {
        "type": "array",
        "items": {"type": "string", "minLength": 3, "maxLength": 6},
        "minItems": 12,
        "maxItems": 14,
    }
    engine = LLM(
        str(tiny_checkpoint("llama")),
        dtype="float32",
        num_kv_blocks=24,
        max_model_len=256,
        block_size=16,
        seed=5,
    )
    try:
        params = SamplingParams(
            temperature=1.0,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )
        # ~12 requests of ~70 tokens each need ~50 blocks; the pool has 24.
        prompts = [f"prompt number {i} " * 4 for i in range(12)]
        outs = engine.generate(prompts, params)
        assert engine.engine.scheduler.num_preemptions > 0
        for out in outs:
            o = out.outputs[0]
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), schema)
    finally:
        engine.shutdown()
