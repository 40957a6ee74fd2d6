"""The compiled layer stack (gpu/cpu/layer_stack.py): a step's decoder layers in one call
must give the bits of the fused Python path it replaces, on every packed kernel it takes,
and leave the steps and models it does not take to that path."""

from __future__ import annotations

import os

import pytest
import torch

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.layer_stack import KINDS, LayerStack

if not cpu_kernels.available():
    if os.environ.get("CI") == "true":
        pytest.fail("the CPU kernels must build in CI (a C++ compiler is installed)")
    pytest.skip("no C++ compiler: the CPU kernels are unavailable", allow_module_level=True)

# kernel (PAGESTREAM_DECODE_GEMM), dtype, built here
KERNELS = {
    "dpbf16": ("bfloat16", cpu_kernels.dpbf16_available),
    "sgemm512": ("float32", cpu_kernels.sgemm512_available),
    "sgemm": ("float32", cpu_kernels.sgemm_available),
    "amx": ("bfloat16", cpu_kernels.amx_available),
}


def run_llm(model: str, dtype: str, stack: str, prompts, params, monkeypatch):
    """Outputs of `prompts`, the engine's layer stack, and how many steps it ran."""
    from service.llm import LLM

    used = []
    real_run = LayerStack.run

    def counted(self, *a, **k):
        h = real_run(self, *a, **k)
        used.append(h is not None)
        return h

    monkeypatch.setattr(LayerStack, "run", counted)
    monkeypatch.setenv("PAGESTREAM_LAYER_STACK", stack)
    llm = LLM(model, dtype=dtype, num_kv_blocks=64, threads=2)
    try:
        outs = llm.generate(prompts, params)
        got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        return got, llm.engine.runner.model.layer_stack, used
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_layer_stack_gives_the_python_paths_bits(kernel, monkeypatch):
    """Greedy tokens and their logprobs (float32 values of the logits, so any difference
    in a hidden state shows) equal with the stack and without it; the stack ran every
    step, the prompts' and the decodes'."""
    from scheduler.sampling_params import SamplingParams
    from tests.checkpoints import tiny_checkpoint

    dtype, built = KERNELS[kernel]
    if not built():
        pytest.skip(f"the {kernel} kernel is not built on this CPU")
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", kernel)
    # qwen2: a bias on qkv (the stack adds it in the kernel); prompts of several lengths,
    # contexts that cross blocks.
    model = str(tiny_checkpoint("qwen2"))
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 18, list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    on, stack, used = run_llm(model, dtype, "1", prompts, params, monkeypatch)
    off, none, unused = run_llm(model, dtype, "0", prompts, params, monkeypatch)
    assert isinstance(stack, LayerStack) and none is None and unused == []
    # All four prompts fit the first step (taken unless this backend sends chunks to SDPA:
    # AMX bf16), then 19 steps of decodes only, all taken.
    assert used == [stack.prefill] + [True] * 19, used
    assert on == off


def test_layer_stack_on_weights_held_in_bf16(monkeypatch):
    """A bf16 checkpoint in float32 on the AVX2 sgemm holds its weights in bf16: the stack
    runs them (kind sgemm_w16) and gives the bits of the float32-held weights, with and
    without the stack."""
    from scheduler.sampling_params import SamplingParams
    from tests.checkpoints import tiny_checkpoint

    if not cpu_kernels.sgemm_available():
        pytest.skip("the sgemm kernel is not built on this CPU")
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "sgemm")
    model = str(tiny_checkpoint("llama", dtype="bfloat16"))
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 18]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = {}
    for held in ("1", "0"):
        monkeypatch.setenv("PAGESTREAM_BF16_WEIGHTS", held)
        for stack in ("1", "0"):
            got, built, used = run_llm(model, "float32", stack, prompts, params, monkeypatch)
            runs[held, stack] = got
            if stack == "1":
                assert built.kind == KINDS["sgemm_w16" if held == "1" else "sgemm"]
                assert all(used)
    want = runs["0", "0"]
    assert all(got == want for got in runs.values())


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
def test_steps_with_prompt_rows(prefill, monkeypatch):
    """Requests arriving while others decode, a long prompt in chunks beside them: with
    every chunk on the compiled prefill kernel the stack runs the mixed steps too (decode
    rows, then the chunks); with SDPA for chunks (PAGESTREAM_PREFILL_ATTENTION=sdpa) it
    declines them.  The tokens and logprobs match the stack-free run either way."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", prefill)
    dtype = "bfloat16" if cpu_kernels.dpbf16_available() else "float32"
    model = str(tiny_checkpoint("qwen2"))
    # A 64-token budget: the long prompt is fed in chunks beside the short ones' decodes.
    prompts = [[5, 6, 7], list(range(40, 240)), [9] * 18]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = {}
    mixed = []
    real_run = LayerStack.run

    def counted(self, residual, positions, kv_caches, meta, keep=None):
        h = real_run(self, residual, positions, kv_caches, meta, keep)
        if meta.num_decodes < meta.num_seqs:
            mixed.append((meta.num_decodes > 0, h is not None))
        return h

    monkeypatch.setattr(LayerStack, "run", counted)
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGESTREAM_LAYER_STACK", flag)
        llm = LLM(model, dtype=dtype, num_kv_blocks=64, threads=2, max_num_batched_tokens=64)
        try:
            got = llm.generate(prompts, params)
            outs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
        finally:
            llm.shutdown()
    # Steps with decode rows beside a chunk happened, and the stack took all or none.
    assert any(with_decodes for with_decodes, _ in mixed)
    assert all(taken == (prefill == "kernel") for _, taken in mixed), mixed
    assert outs["1"] == outs["0"]


def test_models_it_does_not_take_keep_the_python_path(monkeypatch):
    """Per-head q/k norms (qwen3) and a quantized K/V cache are not in the stack."""
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    dtype = "bfloat16" if cpu_kernels.dpbf16_available() else "float32"
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype=dtype, num_kv_blocks=16, threads=1)
    try:
        assert llm.engine.runner.model.fused and llm.engine.runner.model.layer_stack is None
    finally:
        llm.shutdown()
    monkeypatch.setenv("PAGESTREAM_LAYER_STACK", "1")
    model = str(tiny_checkpoint("llama"))
    llm = LLM(model, dtype=dtype, num_kv_blocks=16, threads=1, kv_cache_dtype="int8")
    try:
        stack = llm.engine.runner.model.layer_stack
        kv = llm.engine.runner.kv_caches
        t = 2
        residual = torch.zeros(t, llm.engine.runner.model.config.hidden_size,
                               dtype=getattr(torch, dtype))  # fmt: skip
        from gpu.attention.base import AttentionMetadata

        meta = AttentionMetadata(
            num_tokens=t, num_seqs=t, num_decodes=t,
            query_start_loc=torch.arange(t + 1, dtype=torch.int32),
            seq_lens=torch.ones(t, dtype=torch.int32),
            block_tables=torch.zeros(t, 1, dtype=torch.int32),
            slot_mapping=torch.arange(t, dtype=torch.int64), max_query_len=1, max_seq_len=1,
            query_lens_cpu=[1] * t, seq_lens_cpu=[1] * t, block_size=16,
        )  # fmt: skip
        assert stack is not None
        assert stack.run(residual, torch.zeros(t, dtype=torch.int64), kv, meta) is None
    finally:
        llm.shutdown()


def test_last_layer_carries_only_the_rows_that_sample(monkeypatch):
    """Past the last layer's K/V store a step carries only the rows it samples from (every
    decode row, each finished prompt chunk's last row): steps with prompt chunks return
    fewer rows, a chunk that ends mid-prompt none, with the stack (where it takes prompt
    steps: not on AMX bf16, whose long chunks go to SDPA) and without it, and the tokens,
    logprobs and later steps (which read every row's K/V) match a run that cuts nothing,
    forks (n = 2, two samples from one row) and seeded sampling included.  A request with
    prompt logprobs reads every prompt row: its steps carry them all."""
    from gpu.model import CausalLM
    from gpu.step_rows import SampleRows
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    dtype = "bfloat16" if cpu_kernels.dpbf16_available() else "float32"
    model = str(tiny_checkpoint("qwen2"))
    # The long prompt first: the first step is a chunk of it alone, which samples nothing.
    prompts = [list(range(40, 240)), [5, 6, 7], [9] * 18, list(range(3, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    forked = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    steps: list[tuple[int, int]] = []  # (rows fed, rows returned) of steps with prompt rows
    real_forward = CausalLM.forward
    real_kept = SampleRows.kept_rows

    def counted(self, input_ids, positions, kv_caches, meta, keep=None):
        h = real_forward(self, input_ids, positions, kv_caches, meta, keep)
        if meta.num_decodes < meta.num_seqs:
            steps.append((meta.num_tokens, h.shape[0]))
        return h

    monkeypatch.setattr(CausalLM, "forward", counted)

    def outputs(flag: str, params, prune: bool = True) -> tuple[list, list]:
        monkeypatch.setenv("PAGESTREAM_LAYER_STACK", flag)
        if not prune:  # the runner asks for every row: no path cuts any
            monkeypatch.setattr(SampleRows, "kept_rows", lambda self, t, nd: None)
        else:
            monkeypatch.setattr(SampleRows, "kept_rows", real_kept)
        steps.clear()
        llm = LLM(model, dtype=dtype, num_kv_blocks=64, threads=2, max_num_batched_tokens=64)
        try:
            got = llm.generate(prompts, params)
            return [
                ([c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs],
                 o.prompt_logprobs)
                for o in got
            ], list(steps)  # fmt: skip
        finally:
            llm.shutdown()

    for params in (greedy, forked):
        whole, full_steps = outputs("0", params, prune=False)
        assert full_steps and all(rows == fed for fed, rows in full_steps), full_steps
        for flag in ("1", "0"):
            got, cut_steps = outputs(flag, params)
            assert got == whole, flag
            # Every prompt step returned fewer rows than it fed; some none at all (the
            # 64-token budget cuts the 200-token prompt into chunks).
            assert cut_steps and all(rows < fed for fed, rows in cut_steps), cut_steps
            assert any(rows == 0 for _, rows in cut_steps), cut_steps
    scored_on, scored_steps = outputs("1", scored)
    assert scored_on == outputs("0", scored, prune=False)[0]
    assert scored_steps and all(rows == fed for fed, rows in scored_steps), scored_steps
