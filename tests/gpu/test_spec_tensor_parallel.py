"""Speculative decoding under tensor parallelism (CPU, gloo): n-gram drafts (the
scheduler's), a draft model's (run on rank 0 alone, its drafts broadcast so every rank
verifies the same tokens) and Medusa trees (rank 0's candidates and accepted paths
broadcast, so every rank verifies the same tree and moves the same K/V) keep greedy
output token-identical with HF transformers' float32 generate(), with drafts both
accepted and rejected, and under grammars with one rank's output without speculation;
sampling runs too.  Pipeline parallelism runs n-gram drafts, and refuses a draft model's
and Medusa's by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.config import ConfigError
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.llm import LLM
from tests.e2e.test_medusa_parity import medusa_config, medusa_dir
from tests.e2e.test_spec_parity import (
    GRAMMARS,
    assert_speculated,
    check,
    force_speculation,
    spec_config,
    target_dir,
    workload,
)

ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=96,
              max_num_batched_tokens=32, max_model_len=128, threads=1)  # fmt: skip


def _case(method: str, tmp: Path) -> tuple[str, list[tuple[list[int], int]], dict]:
    """n-gram: a random model on prompts that repeat themselves; Medusa: heads at
    Medusa's initialisation plus noise on that model; a draft model: the shipped trained
    pair (a random draft agrees with its target too rarely for every run to accept
    some), on Python-like prompts."""
    name = "llama-gqa"
    if method == "ngram":
        return target_dir(name), workload(11, 6, shared_prefix=8), spec_config(method, name)
    if method == "medusa":
        cfg = medusa_config(medusa_dir(name, tmp))
        return target_dir(name), workload(11, 6, shared_prefix=8), cfg
    from service.engine_setup import default_draft_dir, default_model_dir
    from service.tokenizer import Tokenizer

    model = str(default_model_dir())
    tok = Tokenizer.from_dir(model)
    texts = ["def main():\n    import os\n", "class Foo:\n    def __init__(self):\n",
             "for i in range(10):\n", "import sys\nimport os\n"]  # fmt: skip
    cfg = spec_config("ngram", "llama-gqa") | {"method": "draft", "model": str(default_draft_dir())}
    return model, [(tok.encode(t), 24) for t in texts], cfg


def _greedy_and_grammars(llm: LLM, model: str, work: list[tuple[list[int], int]]) -> None:
    """Greedy output equals transformers' with drafts accepted and rejected; under
    grammars (drafted under each request's grammar), the tokens of one rank without
    speculation."""
    outs = llm.generate(
        [p for p, _ in work],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work],
    )
    check(model, work, [[o.outputs[0].token_ids] for o in outs])
    assert_speculated(llm.engine)
    constrained = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(**spec))
        for _, spec in GRAMMARS
    ]  # fmt: skip
    prompts = [p for p, _ in GRAMMARS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, constrained)]
    with LLM(model, **ENGINE) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, constrained)]
    assert got == want


def _kv_free(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks, "leaked KV blocks"


@pytest.mark.parametrize("method", ["ngram", "draft", "medusa"])
def test_tp2_speculation_matches_transformers(method: str, tmp_path: Path) -> None:
    model, work, cfg = _case(method, tmp_path)
    llm = LLM(model, tensor_parallel_size=2, tensor_parallel_timeout=60,
              speculative_config=cfg, **ENGINE)  # fmt: skip
    force_speculation(llm.engine)
    try:
        _greedy_and_grammars(llm, model, work)
        # Sampling (rank 0's draw is the one returned; the others verify the same drafts).
        sampled = llm.generate(
            [p for p, _ in work[:3]],
            SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
        )
        assert [len(o.outputs[0].token_ids) for o in sampled] == [12, 12, 12]
        _kv_free(llm)
    finally:
        llm.shutdown()


def test_pp2_ngram_speculation_matches_transformers() -> None:
    """Pipeline parallelism: the last stage verifies each micro-batch's chunks after its
    samples; n-gram drafts (the scheduler's) reach every stage in the step."""
    model, work, cfg = _case("ngram", Path("."))
    llm = LLM(model, pipeline_parallel_size=2, tensor_parallel_timeout=60,
              speculative_config=cfg, **ENGINE)  # fmt: skip
    force_speculation(llm.engine)
    try:
        _greedy_and_grammars(llm, model, work)
        _kv_free(llm)
    finally:
        llm.shutdown()


def test_pipeline_parallel_refuses_model_drafts() -> None:
    model = target_dir("llama-gqa")
    for method in ("draft", "medusa"):
        with pytest.raises(ConfigError, match="pipeline-parallel-size"):
            LLM(model, pipeline_parallel_size=2,
                speculative_config={"method": method, "model": "/x"}, **ENGINE)  # fmt: skip
