"""The full model with the Triton attention backend (interpreted on CPU) is token-identical
to the torch backend, through chunked prefill, decode and a preemption."""

from __future__ import annotations

import os

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"),
    [("llama", "auto"), ("qwen3", "auto"), ("llama", "int8")],
)
def test_triton_backend_token_identical_to_torch(arch, kv_cache_dtype):
    model = str(tiny_checkpoint(arch))
    prompts = [[5, 6, 7], list(range(40, 77)), [9] * 18, list(range(100, 116))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        # A 16-token budget chunks the 37-token prompt; 7 blocks of 16 force preemption.
        llm = LLM(
            model,
            dtype="float32",
            attention_backend=backend,
            num_kv_blocks=7,
            max_num_batched_tokens=16,
            max_model_len=96,
            kv_cache_dtype=kv_cache_dtype,
        )
        try:
            assert llm.engine.runner.attn_backend.name == backend
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if backend == "triton":
                assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()
    assert outs["triton"] == outs["torch"]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        LLM(str(tiny_checkpoint("llama")), attention_backend="flashinfer")


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_decode_graph_path_with_padding_matches_torch(kv_cache_dtype):
    """The CUDA-graph decode path (static buffers, batch padded to a bucket with slot -1
    and length 0), run eagerly on CPU: same tokens as the torch backend."""
    model = str(tiny_checkpoint("llama"))
    prompts = [[5, 6, 7], list(range(40, 60)), [9] * 18]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend, graphs in (("torch", False), ("triton", True)):
        llm = LLM(
            model, dtype="float32", attention_backend=backend, cuda_graphs=graphs,
            num_kv_blocks=32, max_model_len=256, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        try:
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            g = llm.engine.runner.graphs
            if graphs:
                # 3 decodes run in the bucket of 4: one padded row every step; captured
                # graphs on a GPU, the same static-buffer path run eagerly on CPU.
                assert g is not None and g.replays >= 7
                assert g.capture == torch.cuda.is_available()
            else:
                assert g is None
        finally:
            llm.shutdown()
    assert outs["triton"] == outs["torch"]
