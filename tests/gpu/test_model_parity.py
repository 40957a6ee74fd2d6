"""The model against HF transformers (float32) for every supported architecture.

Same weights on both sides (checkpoints written by `pagestream make-model`); ours runs
through the paged KV cache with scattered block tables, chunked prefill and a mixed
decode/prefill batch.  Tiny checkpoints have well-separated logits, so any greedy
mismatch is a bug.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from gpu.model_runner import ModelRunner
from scheduler.contract import NewRequestData, ScheduledRequest, apply_block_delta
from scheduler.sampling_params import SamplingParams
from tests.checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers")

CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama3", {}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "llama-bias": ("llama", {"attention_bias": True}),  # o_proj's too
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
    "qwen3-qknorm": ("qwen3", {}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # A bf16 checkpoint run in float32: on the AVX2 sgemm its weights stay in bf16.
    "llama-bf16-weights": ("llama", {"dtype": "bfloat16"}),
}

_hf_cache: dict[str, object] = {}


def hf_model(path):
    key = str(path)
    if key not in _hf_cache:
        _hf_cache[key] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
    return _hf_cache[key]


@torch.inference_mode()
def hf_logits(path, ids: list[int]) -> torch.Tensor:  # [len, V]
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


def runner_for(path, block_size=16, num_blocks=96) -> ModelRunner:
    return ModelRunner(
        path, dtype="float32", device="cpu", block_size=block_size, num_kv_blocks=num_blocks
    )


@torch.inference_mode()
def step_logits(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """Logits of every fed token of every request for one forward pass."""
    for r in scheduled:
        apply_block_delta(runner.block_tables, r)
    inputs = runner._prepare(scheduled)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    logits = runner.model.compute_logits(hidden)
    # _prepare orders decodes first; map rows back by request.
    ordered = [r for r in scheduled if len(r.input_ids) == 1]
    ordered += [r for r in scheduled if len(r.input_ids) != 1]
    out, start = {}, 0
    for r in ordered:
        out[r.req_id] = logits[start : start + len(r.input_ids)]
        start += len(r.input_ids)
    return out


def scattered_tables(rng: random.Random, num_blocks: int, needs: list[int]) -> list[list[int]]:
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in needs:
        tables.append(pool[:n])
        pool = pool[n:]
    return tables


TOL = 2e-4


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=TOL)
    # Argmax must agree wherever the reference's choice is not a near-tie: two logits
    # within the tolerance may legitimately swap order under another summation order
    # (ISA, thread count), and that is no bug.
    # Each logit may be off by atol + rtol*|x|, so only a gap wider than twice that decides.
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * (TOL + TOL * top2[:, 0].abs())
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_prefill_logits_match(case):
    arch, over = CASES[case]
    path = tiny_checkpoint(arch, **over)
    runner = runner_for(path)
    # A stable seed: hash(str) changes with PYTHONHASHSEED, so prompts would differ per run.
    rng = random.Random(zlib.crc32(case.encode()))
    vocab = runner.config.vocab_size
    lengths = [37, 5, 16, 1, 50]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    tables = scattered_tables(rng, 96, [-(-n // 16) for n in lengths])
    scheduled = [
        ScheduledRequest(req_id=f"p{i}", input_ids=p, start_pos=0, new_block_ids=t, sample=False)
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    got = step_logits(runner, scheduled)
    for i, p in enumerate(prompts):
        assert_close_logits(got[f"p{i}"], hf_logits(path, p))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [16, 8])
def test_chunked_prefill_and_decode_through_paged_cache(case, block_size):
    """Two requests share every step: A is prefilled in 7-token chunks while B decodes;
    then both decode.  Each step's logits equal HF's at the same positions."""
    arch, over = CASES[case]
    path = tiny_checkpoint(arch, **over)
    num_blocks = 64
    runner = runner_for(path, block_size=block_size, num_blocks=num_blocks)
    rng = random.Random(block_size)
    vocab = runner.config.vocab_size
    seqs = {
        "A": [rng.randrange(3, vocab) for _ in range(45)],
        "B": [rng.randrange(3, vocab) for _ in range(3)],
    }
    total = {"A": 45 + 12, "B": 3 + 30}
    tables = dict(
        zip(
            seqs,
            scattered_tables(rng, num_blocks, [-(-total[k] // block_size) for k in seqs]),
            strict=True,
        )
    )
    # Reference continuations: HF greedy over the full sequence.
    for k in seqs:
        while len(seqs[k]) < total[k]:
            seqs[k].append(int(hf_logits(path, seqs[k])[-1].argmax()))
    ref = {k: hf_logits(path, seqs[k]) for k in seqs}
    computed = {"A": 0, "B": 0}
    prompt_len = {"A": 45, "B": 3}
    while any(computed[k] < total[k] - 1 for k in seqs):
        scheduled = []
        for k in seqs:
            c = computed[k]
            if c >= total[k] - 1:
                continue
            n = min(7, prompt_len[k] - c) if c < prompt_len[k] else 1
            scheduled.append(
                ScheduledRequest(
                    req_id=k,
                    input_ids=seqs[k][c : c + n],
                    start_pos=c,
                    new_block_ids=tables[k],
                    sample=False,
                )
            )
        got = step_logits(runner, scheduled)
        for r in scheduled:
            c, n = r.start_pos, len(r.input_ids)
            assert_close_logits(got[r.req_id], ref[r.req_id][c : c + n])
            computed[r.req_id] += n


@pytest.mark.parametrize("case", ["llama", "qwen3-qknorm", "qwen2-bias", "llama-tied"])
def test_greedy_generation_identical_to_generate(case):
    from service import LLM

    arch, over = CASES[case]
    path = tiny_checkpoint(arch, **over)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32)
    try:
        rng = random.Random(7)
        vocab = llm.engine.runner.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 23, 40)]
        prompts.append(llm.get_tokenizer().encode("def fibonacci(n):\n    return"))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompts, params)
        hf = hf_model(path)
        for p, o in zip(prompts, outs, strict=True):
            g = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert o.outputs[0].token_ids == g[0, len(p) :].tolist()
    finally:
        llm.shutdown()


def test_runner_caches_sampling_params_and_drops_finished():
    path = tiny_checkpoint("llama")
    runner = runner_for(path)
    from scheduler.contract import SchedulerOutput

    new = NewRequestData(
        req_id="x", prompt_len=3, token_ids=[5, 6, 7], sampling=SamplingParams(temperature=0)
    )
    so = SchedulerOutput(
        step=1,
        new_requests=[new],
        scheduled=[
            ScheduledRequest(
                req_id="x", input_ids=[5, 6, 7], start_pos=0, new_block_ids=[3], sample=True
            )
        ],
        finished_req_ids=[],
    )
    out = runner.execute_model(so)
    assert out.req_ids == ["x"] and len(out.sampled_token_ids) == 1
    assert runner.requests["x"].token_ids == [5, 6, 7, out.sampled_token_ids[0]]
    # A delta keeps the first block and adds one; a delta on a table the runner does not
    # hold drops that request alone, with the reason.
    y = NewRequestData(req_id="y", prompt_len=1, token_ids=[5], sampling=SamplingParams())
    out = runner.execute_model(
        SchedulerOutput(
            step=2,
            new_requests=[y],
            scheduled=[
                ScheduledRequest(
                    req_id="x",
                    input_ids=[out.sampled_token_ids[0]],
                    start_pos=3,
                    new_block_ids=[9],
                    num_kept_blocks=1,
                    sample=True,
                ),
                ScheduledRequest(
                    req_id="y",
                    input_ids=[5],
                    start_pos=0,
                    new_block_ids=[4],
                    num_kept_blocks=2,
                    sample=True,
                ),
            ],
            finished_req_ids=[],
        )
    )
    assert out.req_ids == ["x"] and runner.block_tables["x"] == [3, 9]
    assert "block table delta" in out.errors["y"]
    runner.execute_model(
        SchedulerOutput(step=3, new_requests=[], scheduled=[], finished_req_ids=["x"])
    )
    assert "x" not in runner.requests and "x" not in runner.block_tables


@pytest.mark.parametrize("case", ["llama", "qwen2-bias"])
def test_prefill_through_mkl_matches(case, monkeypatch):
    """Float32 prefill chunks of MKL_FROM_ROWS rows or more run on MKL's sgemm (on CPUs
    without AVX-512 by default): forced here, with a low threshold, on any CPU."""
    from gpu.cpu import linear as cpu_linear

    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "mkl")
    monkeypatch.setattr(cpu_linear, "MKL_FROM_ROWS", 32)
    test_varlen_prefill_logits_match(case)
