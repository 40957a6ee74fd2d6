"""The whole engine (scheduler + runner + actors) against HF transformers, float32.

32+ concurrent requests of mixed lengths must produce greedy tokens identical to
`generate()` whatever the batching does to them: tiny token budgets (chunked prefill),
a cache too small for everyone (preemption and recompute), a shared system prompt
(prefix-cache hits), n > 1 (forks with copy-on-write), and requests arriving while
others hold the blocks they need.
"""

from __future__ import annotations

import asyncio
import os
import random
from unittest import mock

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine
from tests.checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers")

N_REQ = 34


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


_oracle: dict[tuple[tuple[int, ...], int], list[int]] = {}


@torch.inference_mode()
def oracle(hf, prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _oracle:
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        _oracle[key] = out[0, len(prompt) :].tolist()
    return _oracle[key]


def workload(
    seed: int, shared_prefix: int = 0, max_prompt: int = 70
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 2000) for _ in range(shared_prefix)]
    return [
        (
            prefix + [rng.randrange(3, 2000) for _ in range(rng.randint(1, max_prompt))],
            rng.randint(1, 40),
        )
        for _ in range(N_REQ)
    ]


async def run_engine(engine: AsyncEngine, work, n: int = 1, stagger_steps: int = 0):
    """Submit every request (request i once the engine has run i * stagger_steps steps)
    and collect each sample's tokens."""
    await engine.start()

    async def one(i: int, prompt: list[int], max_tokens: int):
        while engine.core.num_steps < i * stagger_steps:
            await asyncio.sleep(0.001)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
        last = None
        async for out in engine.generate(prompt, params, request_id=f"r{i}"):
            last = out
        return [o.token_ids for o in last.outputs]

    try:
        return await asyncio.wait_for(
            asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(work))), 600
        )
    finally:
        sched = engine.scheduler
        await asyncio.sleep(0.05)
        assert not sched.has_unfinished() and not sched.requests, sched.requests
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks, "leaked KV blocks"
        assert not engine.core.streams
        await engine.shutdown()


def make_engine(model: str, **kw) -> AsyncEngine:
    args = EngineConfig.from_kwargs(model=model, dtype="float32", **kw)
    return AsyncEngine.from_config(args)


def check(hf, work, results, n: int = 1) -> None:
    for (prompt, max_tokens), outs in zip(work, results, strict=True):
        ref = oracle(hf, prompt, max_tokens)
        assert len(outs) == n
        for o in outs:
            assert o == ref


async def check_quantized(model: str, kv_cache_dtype: str, work, results, n: int = 1) -> None:
    """A quantized KV cache cannot match transformers token for token; its oracle is the
    same quantization in a roomy engine (whole prompts in one step, no preemption, no
    prefix sharing, one sample each).  Scales per token and head make a token's stored
    K/V independent of what it was batched with, so batching must not change a token."""
    # The roomy engine's steps reach 512+ rows, where float32 projections on a CPU without
    # AVX-512 may switch to MKL (gpu/cpu/linear.py: where pagestream's sgemm is off):
    # another rounding in the last bits, which a quantized cache can amplify into another
    # token.  The oracle must run the kernels the engine under test runs (its steps stay
    # far below 512 rows).
    with mock.patch.dict(os.environ, {"PAGESTREAM_PREFILL_GEMM": "onednn"}):
        engine = make_engine(
            model, num_kv_blocks=1024, max_num_batched_tokens=4096, max_model_len=512,
            enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
    refs = await run_engine(engine, work)
    differ = 0
    for outs, (ref,) in zip(results, refs, strict=True):
        assert len(outs) == n
        differ += sum(o != ref for o in outs)
    if differ and torch.cuda.is_available():
        # On a GPU the GEMMs of a 24-row and a 4096-row step are different cuBLAS kernels:
        # K/V differ in their last float32 bits before quantization, and a coarse cache
        # (fp8's 3-bit mantissa) can turn that into another token.  The premise of this
        # oracle (a token's K/V independent of its batch) holds on CPUs only; the float32
        # cases above still compare with transformers token for token on the GPU.
        pytest.xfail(f"{differ} of {len(results) * n} samples differ: GEMMs not batch-invariant")
    assert differ == 0, f"{differ} samples differ from the roomy engine's"


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8"])
async def test_small_token_budget_chunked_prefill(model, hf, kv):
    work = workload(1)
    engine = make_engine(
        model, num_kv_blocks=512, max_num_batched_tokens=16, max_model_len=512, kv_cache_dtype=kv
    )
    results = await run_engine(engine, work, stagger_steps=2)
    if kv == "auto":
        check(hf, work, results)
    else:
        await check_quantized(model, kv, work, results)


@pytest.mark.slow
async def test_few_kv_blocks_forced_preemption(model, hf):
    work = workload(2)
    # 24 blocks of 16 = 384 slots for 34 requests of up to 110 tokens each.
    engine = make_engine(
        model, num_kv_blocks=24, max_num_batched_tokens=64, max_model_len=384, block_size=16
    )
    results = await run_engine(engine, work, stagger_steps=1)
    check(hf, work, results)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.slow
async def test_shared_prefix_cache_hits(model, hf):
    work = workload(3, shared_prefix=50, max_prompt=20)
    engine = make_engine(model, num_kv_blocks=256, max_num_batched_tokens=128, block_size=8)
    results = await run_engine(engine, work, stagger_steps=3)
    check(hf, work, results)
    # Most requests found the 6 full blocks of the shared 50-token prefix.
    assert engine.scheduler.kv.prefix_hits >= (N_REQ // 2) * 48


@pytest.mark.slow
async def test_parallel_sampling_forks(model, hf):
    work = workload(4, max_prompt=40)[:16] + workload(5, max_prompt=40)[:16]
    engine = make_engine(model, num_kv_blocks=200, max_num_batched_tokens=48, block_size=16)
    results = await run_engine(engine, work, n=3, stagger_steps=1)
    check(hf, work, results, n=3)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
async def test_preemption_with_forks_and_shared_prefix(model, hf, kv):
    """Everything at once: a short cache, a shared prefix, forks and staggered arrivals."""
    work = workload(6, shared_prefix=20, max_prompt=30)
    engine = make_engine(
        model, num_kv_blocks=20, max_num_batched_tokens=24, max_model_len=320, block_size=16,
        kv_cache_dtype=kv,
    )  # fmt: skip
    results = await run_engine(engine, work, n=2, stagger_steps=1)
    if kv == "auto":
        check(hf, work, results, n=2)
    else:
        await check_quantized(model, kv, work, results, n=2)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.prefix_hits > 0
