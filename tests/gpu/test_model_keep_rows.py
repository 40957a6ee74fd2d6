"""CausalLM.forward's `keep`: past the last layer's attention only the rows a step reads
go on.  On every forward path (the generic one the GPU runs, the fused CPU one, the
compiled layer stack) the kept rows' hidden states are the bits of the full forward's
where every projection runs on one of pagestream's packed kernels (each row's sums do not
depend on the batch there; oneDNN's may, so on its products they are only close), and
the K/V every row leaves in the cache are the same."""

from __future__ import annotations

import random

import pytest
import torch

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu import linear as cpu_linear
from gpu.cpu.layer_stack import linear_kind
from gpu.model_runner import ModelRunner
from gpu.sampler import RequestSamplingState
from scheduler.contract import NewRequestData, ScheduledRequest, apply_block_delta
from scheduler.sampling_params import SamplingParams
from tests.checkpoints import tiny_checkpoint


def _paths(dtype: str) -> list[str]:
    paths = ["generic"]
    if cpu_kernels.available():
        paths += ["fused", "stack"]
    return paths


def _set_path(runner: ModelRunner, path: str, stack) -> None:
    model = runner.model
    fused = path != "generic"
    model.fused = fused
    for layer in model.layers:
        layer.mlp.fused = fused
    model.layer_stack = stack if path == "stack" else None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_kept_rows_have_the_full_forwards_bits(arch, dtype):
    if dtype == "bfloat16" and not (
        cpu_kernels.dpbf16_available() or cpu_linear.use_sgemm(torch.bfloat16)
    ):
        pytest.skip("bf16 projections run on oneDNN here: not held to per-row bits")
    runner = ModelRunner(
        tiny_checkpoint(arch), dtype=dtype, device="cpu", block_size=16, num_kv_blocks=64
    )
    stack = runner.model.layer_stack
    rng = random.Random(3)
    vocab = runner.config.vocab_size
    # Two decodes (one token after a cached context), a finished prompt, a chunk in the
    # middle of a prompt (samples nothing) and another finished prompt.
    shapes = [(1, 20), (1, 33), (11, 0), (24, 16), (5, 0)]  # (fed, cached before)
    tables = [[4 * i + j for j in range(4)] for i in range(len(shapes))]
    scheduled = [
        ScheduledRequest(
            req_id=f"r{i}", input_ids=[rng.randrange(3, vocab) for _ in range(n)],
            start_pos=c, new_block_ids=tables[i], sample=i != 3,
        )
        for i, (n, c) in enumerate(shapes)
    ]  # fmt: skip
    for r in scheduled:
        apply_block_delta(runner.block_tables, r)
        new = NewRequestData(
            req_id=r.req_id, prompt_len=r.start_pos + len(r.input_ids),
            token_ids=[3] * r.start_pos + r.input_ids, sampling=SamplingParams(temperature=0),
        )  # fmt: skip
        runner.requests[r.req_id] = RequestSamplingState.create(new, runner.device)
    # Whatever the cached contexts hold, it is the same for every forward below.
    for kv in runner.kv_caches:
        for t in kv:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype))
    inputs = runner._prepare(scheduled)
    keep = inputs.keep
    # The decode rows, then the last rows of the finished prompts (1 + 1 + 11, 1 + 1 + 11 +
    # 24 + 5) - not the chunk's.
    assert keep == [0, 1, 12, 41], keep
    assert inputs.samples.among(keep).rows.tolist() == [0, 1, 2, 3]
    model = runner.model
    exact = all(
        linear_kind(lin) is not None
        for layer in model.layers
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj)
    )  # fmt: skip
    for path in _paths(dtype):
        if path == "stack" and stack is None:
            continue
        _set_path(runner, path, stack)
        with torch.inference_mode():
            full = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
            cache = [[t.clone() for t in kv] for kv in runner.kv_caches]
            cut = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, keep)
            # A step that reads no row (here: the stack declines it, as it leaves decode
            # rows out; the Python paths carry one row and return none).
            none = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, [])
        assert none.shape == (0, full.shape[1]), path
        assert full.shape[0] == inputs.meta.num_tokens and cut.shape[0] == len(keep), path
        if exact:
            assert torch.equal(cut, full[keep]), path
        else:
            torch.testing.assert_close(cut, full[keep], rtol=2e-2, atol=2e-2)
        for a, b in zip(cache, runner.kv_caches, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), path
