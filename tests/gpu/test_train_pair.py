"""`pagestream train-pair`: reproducible, HF-loadable checkpoints; the shipped pair loads
in transformers and our engine agrees with it token for token."""

from __future__ import annotations

import json

import pytest
import torch

from modelkit.train import PAIR_DIR, train_pair
from scheduler.sampling_params import SamplingParams
from service.llm import LLM

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow
def test_training_is_reproducible_and_loads_in_transformers(tmp_path):
    a = train_pair(tmp_path / "a", scale=0.01, threads=1, eval_windows=4)
    b = train_pair(tmp_path / "b", scale=0.01, threads=1, eval_windows=4)
    for name in ("target", "draft"):
        wa = (tmp_path / "a" / name / "model.safetensors").read_bytes()
        wb = (tmp_path / "b" / name / "model.safetensors").read_bytes()
        assert wa == wb, f"{name} weights differ between two runs"
        assert a[name]["held_out_perplexity"] == b[name]["held_out_perplexity"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / name)
        assert hf.config.vocab_size == a["vocab_size"]
    assert a["target"]["params"] > 4 * a["draft"]["params"]


@pytest.mark.slow  # ~15 CPU-seconds, most of it tokenizing the corpus
def test_time_budget_scales_training_down_and_writes_loadable_checkpoints(tmp_path):
    """`--minutes`: a budget far below the default plans' cost trains a handful of steps
    (timed on this machine) and still writes a pair the engine serves, with perplexity."""
    report = train_pair(tmp_path, minutes=0.2, eval_windows=2)
    assert report["budget_minutes"] == 0.2 and 0 <= report["scale"] < 0.2
    for name, full in (("target", 1000), ("draft", 750)):
        assert 1 <= report[name]["steps"] < full * 0.2
        assert 1 < report[name]["held_out_perplexity"] < float("inf")
    llm = LLM(str(tmp_path / "target"), dtype="float32", num_kv_blocks=16, threads=1,
              speculative_config={"model": str(tmp_path / "draft"), "num_speculative_tokens": 2})  # fmt: skip
    try:
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 4


def test_shipped_pair_matches_transformers():
    """The committed pair: a chat template, loads in transformers, and our greedy output
    equals HF's float32 generate() for the target."""
    target = PAIR_DIR / "target"
    report = json.loads((PAIR_DIR / "report.json").read_text())
    assert report["target"]["held_out_perplexity"] < report["draft"]["held_out_perplexity"] * 2
    tok = transformers.AutoTokenizer.from_pretrained(target)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write a function."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat.endswith("<|im_start|>assistant\n")
    prompt = tok("import os\n\n\ndef main(", add_special_tokens=False)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    llm = LLM(str(target), dtype="float32", num_kv_blocks=64, threads=1)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finally:
        llm.shutdown()
    assert out[0].outputs[0].token_ids == ref
    draft = transformers.AutoModelForCausalLM.from_pretrained(PAIR_DIR / "draft")
    assert draft.config.vocab_size == hf.config.vocab_size
