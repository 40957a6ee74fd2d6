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


def _recording_forward(forward, eager_prefills: list[int]):
    """The model's forward, noting each step with a prompt chunk that reaches it."""

    def recorded(input_ids, positions, kv_caches, meta, keep=None):
        if meta.max_query_len > 1:  # (the decode graphs' own path calls it on a CPU)
            eager_prefills.append(meta.num_tokens)
        return forward(input_ids, positions, kv_caches, meta, keep)

    return recorded


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype", "largest"), [("llama", "auto", None), ("qwen3", "int8", 16)]
)
def test_piecewise_graph_path_matches_torch(monkeypatch, arch, kv_cache_dtype, largest):
    """Prefill chunks and mixed prefill + decode steps through the piecewise graphs' static
    buffers (padded to a token bucket; captured on a GPU, run eagerly here): same tokens
    as the torch backend, and the eager model forward never runs, unless a step has more
    tokens than the largest bucket (`largest`: 16, under the 24-token budget)."""
    # The pieces are the generic layers a GPU runs; so is the reference, on a CPU too.
    monkeypatch.setenv("PAGESTREAM_CPU_FUSED", "0")
    model = str(tiny_checkpoint(arch))
    # A 24-token budget: the long prompts arrive in chunks beside the others' decodes.
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 30, list(range(100, 137))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs, embs = {}, {}
    for backend, graphs in (("torch", False), ("triton", True)):
        llm = LLM(
            model, dtype="float32", attention_backend=backend, cuda_graphs=graphs,
            num_kv_blocks=48, max_model_len=256, kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=24,
        )  # fmt: skip
        runner = llm.engine.runner
        eager_prefills: list[int] = []
        runner.model.forward = _recording_forward(runner.model.forward, eager_prefills)
        if graphs and largest:
            runner.piecewise.sizes = [b for b in runner.piecewise.sizes if b <= largest]
        try:
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            pw = runner.piecewise
            if graphs:
                assert pw is not None and pw.capture == torch.cuda.is_available()
                if largest:  # the larger steps ran eagerly, the others in pieces
                    assert pw.replays >= 1
                    assert eager_prefills and all(n > largest for n in eager_prefills)
                else:
                    assert pw.replays >= 5  # every prefill chunk (and the mixed steps)
                    assert eager_prefills == []
            else:
                assert pw is None and eager_prefills
            # An embedding is the row its one token samples from, through the pieces too.
            embs[backend] = torch.tensor([o.outputs.embedding for o in llm.embed(prompts)])
        finally:
            llm.shutdown()
    assert outs["triton"] == outs["torch"]
    torch.testing.assert_close(embs["triton"], embs["torch"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_backend_runs_fused_norm_and_rotary(monkeypatch, dtype):
    """With the Triton backend the model's RMSNorm (bf16) and rotary (every dtype) are the
    Triton kernels; PAGESTREAM_TRITON_ELEMENTWISE=0 keeps torch's ops.  Rotary rounds
    where torch rounds, so float32 tokens equal the torch backend's (test above); in bf16
    RMSNorm's reduction order differs, so the check is tokens and close logprobs."""
    from gpu.kernels import norm_rope

    calls = {"rope": 0, "norm": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    # The generic path a GPU runs: on a CPU the compiled elementwise kernels would take over.
    monkeypatch.setenv("PAGESTREAM_CPU_FUSED", "0")
    monkeypatch.setattr(norm_rope, "apply_rotary", counted("rope", norm_rope.apply_rotary))
    monkeypatch.setattr(norm_rope, "rms_norm", counted("norm", norm_rope.rms_norm))
    model = str(tiny_checkpoint("llama"))
    prompts = [[5, 6, 7], list(range(40, 60))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGESTREAM_TRITON_ELEMENTWISE", flag)
        before = dict(calls)
        llm = LLM(
            model, dtype=dtype, attention_backend="triton", max_model_len=64, num_kv_blocks=16
        )
        try:
            outs = [o.outputs[0] for o in llm.generate(prompts, params)]
            layers = llm.engine.runner.model.config.num_layers
        finally:
            llm.shutdown()
        runs[flag] = outs
        rope, norm = calls["rope"] - before["rope"], calls["norm"] - before["norm"]
        if flag == "0":
            assert rope == norm == 0
        else:
            assert rope > 0 and rope % layers == 0  # once per layer per forward
            # 2 per layer + the final one, per forward; float32 keeps F.rms_norm
            want = (rope // layers) * (2 * layers + 1) if dtype == "bfloat16" else 0
            assert norm == want, (rope, norm, layers)
    for on, off in zip(runs["1"], runs["0"], strict=True):
        assert on.token_ids == off.token_ids
        lp_on = [t.logprob for t in on.logprobs]
        lp_off = [t.logprob for t in off.logprobs]
        assert lp_on == pytest.approx(lp_off, abs=0 if dtype == "float32" else 0.05)


def test_shutdown_releases_kv_cache():
    """A stopped engine gives its KV cache back at once (on a GPU the cache is sized to
    most of the free memory, so the next engine in the process would not fit while the
    stopped one waits for the garbage collector)."""
    model = str(tiny_checkpoint("llama"))
    cuda = torch.cuda.is_available()
    llm = LLM(model, dtype="float32", max_model_len=64, num_kv_blocks=64)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    kv_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
    assert kv_bytes > 0
    before = torch.cuda.memory_allocated() if cuda else 0
    llm.shutdown()
    assert runner.kv_caches == [] and runner.graphs is None
    if cuda:  # weights stay with the object; the cache is what was returned
        assert before - torch.cuda.memory_allocated() >= kv_bytes


def test_draft_decode_graphs_give_the_eager_logits():
    """The draft model's one-token rounds through its decode graphs (captured on a GPU;
    the same padded static buffers interpreted on a CPU) give the eager forward's logits,
    row for row, over the same draft KV."""
    from gpu.model_runner import ModelRunner

    target = tiny_checkpoint("llama")
    draft_dir = tiny_checkpoint("llama", seed=7, num_hidden_layers=1)
    runner = ModelRunner(
        target, dtype="float32", attention_backend="triton", cuda_graphs=True,
        speculative_config={"method": "draft", "model": str(draft_dir)}, num_kv_blocks=32,
        max_model_len=128,
    )  # fmt: skip
    draft = runner.spec.draft
    assert draft.graphs is not None
    tables = [[3, 9], [5], [12, 1, 7]]
    prompts = [list(range(10, 30)), [4, 5, 6], list(range(50, 83))]
    draft._forward([(i, p, 0) for i, p in enumerate(prompts)], tables)  # fill draft KV
    feeds = [(i, [7 + i], len(p)) for i, p in enumerate(prompts)]
    saved = [tuple(t.clone() for t in kv) for kv in draft.kv_caches]
    replays = draft.graphs.replays
    with_graphs = draft._forward(feeds, tables)
    assert draft.graphs.replays == replays + 1
    draft.kv_caches[:] = saved
    graphs, draft.graphs = draft.graphs, None
    eager = draft._forward(feeds, tables)
    draft.graphs = graphs
    torch.testing.assert_close(with_graphs, eager, atol=1e-5, rtol=1e-5)
    runner.release()
