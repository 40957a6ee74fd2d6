"""Tensor parallelism on CPU over gloo: TP=2 greedy output equals TP=1 and transformers
(float32) through chunked prefill, preemption and prefix hits; sharded loading holds 1/N
of the sharded weights per rank; configurations that do not split fail at start-up.

Each TP=2 engine spawns a process (seconds), so one engine per model config is shared by
the tests of that config (module-scoped, parametrized fixture)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from gpu.config import ModelConfig, ModelLoadError
from gpu.loader import read_checkpoint
from gpu.tp import TPGroup, check_tp_config
from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers")

CASES = [
    pytest.param(("llama", {}), id="llama-gqa"),
    pytest.param(("llama", {"num_key_value_heads": 1}), id="llama-mqa"),
    pytest.param(("mistral", {}), id="mistral", marks=pytest.mark.slow),
    pytest.param(("qwen2", {"tie_word_embeddings": True}), id="qwen2-bias-tied",
                 marks=pytest.mark.slow),
    pytest.param(("qwen3", {}), id="qwen3-qknorm", marks=pytest.mark.slow),
    # o_proj's bias, added once to the row-parallel sum
    pytest.param(("llama", {"attention_bias": True}), id="llama-bias", marks=pytest.mark.slow),
]  # fmt: skip

# A small cache (16 blocks of 4 tokens) and a 16-token step budget: the four requests
# below chunk their prefills, share a 12-token prefix, and do not all fit at once.
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=16, max_model_len=64, threads=1)  # fmt: skip
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [PREFIX + [100 + i] * (3 + 2 * i) for i in range(4)]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def checkpoint(case) -> str:
    arch, over = case
    return str(tiny_checkpoint(arch, num_hidden_layers=2, **over))


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def run(llm: LLM) -> list[list[int]]:
    # Twice: the second pass admits every prompt on prefix hits.
    outs = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS[::-1], GREEDY)[::-1]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=CASES)
def tp2(request):
    path = checkpoint(request.param)
    llm = LLM(path, tensor_parallel_size=2, tensor_parallel_timeout=30, **ENGINE)
    yield path, llm
    rank0 = llm.engine.runner
    llm.shutdown()
    assert rank0.kv_caches == []  # rank 0 lives in this process: its cache is given back


def test_tp2_matches_tp1_and_transformers(tp2):
    path, llm2 = tp2
    got = run(llm2)
    sched = llm2.engine.scheduler
    assert sched.num_preemptions > 0, "the workload should preempt"
    assert sched.kv.prefix_hits > 0, "the workload should hit the prefix cache"
    emb = embeddings(llm2)
    with LLM(path, **ENGINE) as llm1:
        want = run(llm1)
        want_emb = embeddings(llm1)
    assert got == want
    assert got[:4] == [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    # Embeddings (the final hidden state) gathered from the ranks are the one-rank ones.
    torch.testing.assert_close(emb, want_emb, atol=1e-5, rtol=0)


def embeddings(llm: LLM) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS)])


def test_each_rank_holds_half_the_sharded_weights(tp2):
    path, llm2 = tp2
    per_rank = llm2.engine.executor.rank_weight_bytes()
    cfg = ModelConfig.from_dir(path)
    norms = 4 * cfg.hidden_size * (2 * cfg.num_layers + 1)  # replicated, float32
    if cfg.qk_norm:
        norms += 4 * 2 * cfg.head_dim * cfg.num_layers
    if cfg.o_proj_bias:  # whole on every rank (zeros but on rank 0)
        norms += 4 * cfg.hidden_size * cfg.num_layers
    with LLM(path, **ENGINE) as llm1:
        full = llm1.engine.runner.weight_bytes
    kv_replicated = cfg.num_kv_heads < 2
    # K/V projections are copied, not split, when there are fewer KV heads than ranks.
    kv = 4 * 2 * cfg.kv_size * cfg.hidden_size * cfg.num_layers if kv_replicated else 0
    assert per_rank[0] == per_rank[1] == (full - norms - kv) // 2 + norms + kv


def test_sharded_read_is_slices_of_the_checkpoint():
    """Each rank reads only its slice; the slices put back together are the tensors, and a
    lone KV head (MQA) is on both ranks."""
    path = checkpoint(("qwen2", {"num_key_value_heads": 1}))
    cfg = ModelConfig.from_dir(path)
    full = read_checkpoint(path, cfg)
    shards = [read_checkpoint(path, cfg, TPGroup(r, 2)) for r in range(2)]
    p = "model.layers.0."
    for name, dim in [(p + "self_attn.q_proj.weight", 0), (p + "self_attn.q_proj.bias", 0),
                      (p + "self_attn.o_proj.weight", 1), (p + "mlp.gate_proj.weight", 0),
                      (p + "mlp.down_proj.weight", 1), ("model.embed_tokens.weight", 0),
                      ("lm_head.weight", 0)]:  # fmt: skip
        assert shards[0][name].shape[dim] * 2 == full[name].shape[dim], name
        assert torch.equal(torch.cat([s[name] for s in shards], dim), full[name]), name
    for name in (p + "self_attn.k_proj.weight", p + "self_attn.v_proj.bias"):
        assert torch.equal(shards[0][name], full[name]) and torch.equal(shards[1][name], full[name])
    assert torch.equal(shards[1][p + "input_layernorm.weight"], full[p + "input_layernorm.weight"])


def test_uneven_configurations_are_refused_by_name():
    cfg = ModelConfig.from_dir(checkpoint(("llama", {})))  # 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError) as e:
        check_tp_config(cfg, 3)
    msg = str(e.value)
    for field in ("num_attention_heads 4", "num_key_value_heads 2", "intermediate_size",
                  "vocab_size"):  # fmt: skip
        assert field in msg
    odd = dataclasses.replace(cfg, num_heads=6, num_kv_heads=3)
    with pytest.raises(ModelLoadError, match="num_key_value_heads 3"):
        check_tp_config(odd, 2)
    with pytest.raises(ModelLoadError, match="vocab_size 2049"):
        check_tp_config(dataclasses.replace(cfg, vocab_size=2049), 2)
    check_tp_config(dataclasses.replace(cfg, num_kv_heads=1), 4)  # MQA: replicated


def test_llm_refuses_before_spawning_anything():
    path = checkpoint(("llama", {}))
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 cannot split"):
        LLM(path, tensor_parallel_size=3, **ENGINE)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ModelLoadError, match="needs 2 CUDA devices"):
            LLM(path, tensor_parallel_size=2, **dict(ENGINE, device="cuda"))
    assert time.monotonic() - t0 < 10


def test_a_second_tp_engine_in_the_process_is_refused(tp2):
    path, _ = tp2
    with pytest.raises(ModelLoadError, match="already runs a tensor-parallel engine"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
