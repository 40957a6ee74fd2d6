"""Pipeline parallelism on CPU over gloo: PP=2 and PP=2 x TP=2 greedy output equals PP=1
and transformers (float32) through chunked prefill, preemption and prefix hits; each
stage loads only its layers (weight bytes about 1/P); a step is cut into contiguous
micro-batches; what pipeline parallelism cannot run is refused before any process starts.

Each engine spawns processes (seconds), so one engine per configuration is shared by the
tests of that configuration (module-scoped, parametrized fixture); a process runs one
such engine at a time."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from gpu.config import ModelConfig, ModelLoadError
from gpu.pp import layer_split, split_rows
from scheduler.config import ConfigError
from scheduler.contract import DecodeColumns, ScheduledRequest
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.gpu.test_tensor_parallel import ENGINE, PROMPTS, embeddings, hf_greedy, run

pytest.importorskip("transformers")

CASES = [
    # Three layers over two stages (2 + 1).
    pytest.param(("llama", {"num_hidden_layers": 3}, 2, 1), id="llama-3layers-pp2"),
    pytest.param(("llama", {}, 2, 2), id="llama-pp2xtp2"),
    # Tied embeddings: the last stage holds the embedding as its lm_head, the first as
    # its embedding.
    pytest.param(("qwen2", {"tie_word_embeddings": True, "num_hidden_layers": 3}, 2, 1),
                 id="qwen2-tied-3layers-pp2", marks=pytest.mark.slow),
    pytest.param(("qwen3", {}, 2, 2), id="qwen3-pp2xtp2", marks=pytest.mark.slow),
    # The torch path (what a GPU runs), not the fused CPU kernels; three micro-batches.
    pytest.param(("llama", {}, 2, 1, 3), id="llama-pp2-unfused-3mb", marks=pytest.mark.slow),
]  # fmt: skip


def checkpoint(arch: str, over: dict) -> str:
    return str(tiny_checkpoint(arch, **{"num_hidden_layers": 2, **over}))


@pytest.fixture(scope="module", params=CASES)
def pp(request):
    arch, over, p, t, *mb = request.param
    path = checkpoint(arch, over)
    unfused = bool(mb)
    if unfused:  # read at model load, by this process and the spawned ranks alike
        os.environ["PAGESTREAM_CPU_FUSED"] = "0"
    try:
        llm = LLM(path, pipeline_parallel_size=p, tensor_parallel_size=t,
                  pipeline_micro_batches=mb[0] if mb else 2, tensor_parallel_timeout=60,
                  **ENGINE)  # fmt: skip
        assert not (unfused and llm.engine.runner.model.fused)
        yield path, p, t, llm
        rank0 = llm.engine.runner
        llm.shutdown()
        assert rank0.kv_caches == []
    finally:
        if unfused:
            del os.environ["PAGESTREAM_CPU_FUSED"]


def test_pp_matches_pp1_and_transformers(pp):
    path, _p, _t, llm = pp
    got = run(llm)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0, "the workload should preempt"
    assert sched.kv.prefix_hits > 0, "the workload should hit the prefix cache"
    emb = embeddings(llm)
    with LLM(path, **ENGINE) as llm1:
        want = run(llm1)
        want_emb = embeddings(llm1)
    assert got == want
    assert got[:4] == [hf_greedy(path, prompt, 10) for prompt in PROMPTS]
    # The last stage pools what it sampled from: the one-stage embeddings.
    torch.testing.assert_close(emb, want_emb, atol=1e-5, rtol=0)


def _tensor_bytes(path: str) -> dict[str, int]:
    out = {}
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            out[name] = n * 4  # float32 checkpoints
    return out


def test_each_stage_holds_its_layers(pp):
    """Stage s holds exactly its layers' tensors (plus the embedding on the first stage,
    the lm_head on the last and the final norm on both): about 1/P of the weights."""
    path, p, t, llm = pp
    per_rank = llm.engine.executor.rank_weight_bytes()
    assert len(per_rank) == p * t
    cfg = ModelConfig.from_dir(path)
    sizes = _tensor_bytes(path)
    with LLM(path, **ENGINE) as llm1:
        full = llm1.engine.runner.weight_bytes
    assert sum(sizes.values()) == full or cfg.tie_word_embeddings
    embed = sizes["model.embed_tokens.weight"]
    head = embed if cfg.tie_word_embeddings else sizes["lm_head.weight"]
    norm = sizes["model.norm.weight"]
    for stage, (lo, hi) in enumerate(layer_split(cfg.num_layers, p)):
        layers = sum(
            n for name, n in sizes.items()
            if name.startswith("model.layers.") and lo <= int(name.split(".")[2]) < hi
        )  # fmt: skip
        want = layers + norm + (embed if stage == 0 else 0) + (head if stage == p - 1 else 0)
        ranks = per_rank[stage * t : (stage + 1) * t]
        if t == 1:
            assert ranks == [want], (stage, ranks, want)
        else:  # sharded as TP shards (tests/gpu/test_tensor_parallel.py): about 1/T each
            assert all(abs(r * t - want) < 0.05 * want for r in ranks), (stage, ranks, want)
    if t == 1:  # nothing held twice but the final norm (and a tied embedding's matrix)
        assert sum(per_rank) == full + (p - 1) * norm + (embed if cfg.tie_word_embeddings else 0)


def _req(rid: str, n: int) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=rid, input_ids=list(range(n)), start_pos=0, new_block_ids=[], sample=True
    )


def test_micro_batches_are_contiguous_and_balanced():
    dec = DecodeColumns(req_ids=["d0", "d1", "d2", "d3"], token_ids=[1, 2, 3, 4],
                        positions=[5, 5, 5, 5])  # fmt: skip
    chunks = [_req("b", 6), _req("a", 1), _req("c", 2)]
    parts = split_rows(dec, chunks, 2)
    assert len(parts) == 2
    flat = [rid for d, s in parts for rid in [*d.req_ids, *(r.req_id for r in s)]]
    # Scheduling order, not one forward's layout (one-token rows first): "a" may be a new
    # request whose prefix hit is a block "b" writes in this very step.
    assert flat == ["d0", "d1", "d2", "d3", "b", "a", "c"]
    tokens = [len(d.req_ids) + sum(len(r.input_ids) for r in s) for d, s in parts]
    assert tokens == [4, 9]  # 13 tokens: the cut lands nearest half
    assert [len(split_rows(dec, [], m)) for m in (1, 2, 3, 8)] == [1, 2, 3, 4]
    (one,) = split_rows(DecodeColumns(), [_req("x", 16)], 2)  # one row: one micro-batch
    assert one[1][0].req_id == "x"


def test_layer_split():
    assert layer_split(2, 2) == [(0, 1), (1, 2)]
    assert layer_split(3, 2) == [(0, 2), (2, 3)]
    assert layer_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_refused_before_spawning_anything():
    path = checkpoint("llama", {})
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers 2 \(fewer layers than stages"):
        LLM(path, pipeline_parallel_size=3, **ENGINE)
    with pytest.raises(ConfigError, match="speculative decoding with a draft proposer"):
        LLM(path, pipeline_parallel_size=2, speculative_config={"method": "draft",
            "model": "/draft"}, **ENGINE)  # fmt: skip
    with pytest.raises(ModelLoadError, match="--quantization int8"):
        LLM(path, pipeline_parallel_size=2, quantization="int8", **ENGINE)
    with pytest.raises(ModelLoadError, match="do not split evenly over --nnodes 3"):
        from scheduler.config import EngineConfig
        from service.engine_setup import tp_executor

        args = EngineConfig.from_kwargs(
            model=path, pipeline_parallel_size=2, nnodes=3, master_port=1
        )
        tp_executor(args, __import__("pathlib").Path(path), None)
