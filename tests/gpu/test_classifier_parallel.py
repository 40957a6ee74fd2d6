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
