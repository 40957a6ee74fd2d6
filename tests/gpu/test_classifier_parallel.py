"""A sequence classifier's head under tensor and pipeline parallelism: every rank holds
the whole (few-row) score head, and the rank that pools applies it to the gathered final
state, so the label logits are the one-rank ones."""

from __future__ import annotations

import pytest
import torch

from service.llm import LLM
from tests.checkpoints import classifier_checkpoint
from tests.gpu.test_tensor_parallel import ENGINE, PROMPTS

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_parallel_classifier_matches_one_rank(tmp_path, layout):
    path = classifier_checkpoint(tmp_path, "llama", ("a", "b", "c"), seed=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def logits(llm: LLM) -> torch.Tensor:
        return torch.tensor([o.outputs.probs for o in llm.classify(prompts, use_activation=False)])

    with LLM(path, tensor_parallel_timeout=60, **layout, **ENGINE) as llm:
        got = logits(llm)
    with LLM(path, **ENGINE) as llm1:
        want = logits(llm1)
    assert got.shape == (len(PROMPTS), 3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_head_from_lm_head_rows_under_tensor_parallelism():
    """The LM head is split by vocabulary across the ranks; the head built from two of its
    rows (--hf-overrides, gpu/hf_labels.py) is read whole from the file on each."""
    from tokenizers import Tokenizer

    from tests.checkpoints import tiny_checkpoint

    path = str(tiny_checkpoint("llama", num_hidden_layers=2))
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    overrides = {"architectures": ["LlamaForSequenceClassification"],
                 "classifier_from_token": [tok.id_to_token(7), tok.id_to_token(900)],
                 "is_original_qwen3_reranker": True}  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def logits(llm: LLM) -> torch.Tensor:
        return torch.tensor([o.outputs.probs for o in llm.classify(prompts, use_activation=False)])

    with LLM(path, tensor_parallel_size=2, tensor_parallel_timeout=60, hf_overrides=overrides,
             **ENGINE) as llm:  # fmt: skip
        got = logits(llm)
    with LLM(path, hf_overrides=overrides, **ENGINE) as llm1:
        want = logits(llm1)
    assert got.shape == (len(PROMPTS), 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
