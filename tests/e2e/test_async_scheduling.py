"""Async scheduling (EngineConfig's device.async_scheduling, scheduler/ahead.py) on the real
model: greedy tokens identical to HF transformers (float32) under preemption, forks
(n > 1), prefix hits and chunked prefill; identical to the synchronous engine's output
with stop strings, grammars, n = 2 and n-gram speculation (which stays synchronous); an
abort while steps are in flight frees the request's KV, and the engine serves on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine
from tests.checkpoints import tiny_checkpoint
from tests.e2e.test_engine_parity import check, run_engine, workload
from tests.e2e.test_engine_thread import _serve

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def make_engine(model: str, on: bool, engine_thread: bool = False, **kw) -> AsyncEngine:
    config = EngineConfig.from_kwargs(
        model=model, dtype="float32", async_scheduling=on, engine_thread=engine_thread, **kw
    )
    return AsyncEngine.from_config(config)


@pytest.mark.slow
@pytest.mark.parametrize("engine_thread", [False, True])
async def test_matches_transformers_under_preemption_forks_and_prefix(model, hf, engine_thread):
    work = workload(6, shared_prefix=20, max_prompt=30)[:16]
    engine = make_engine(
        model, True, engine_thread, num_kv_blocks=20, max_num_batched_tokens=24,
        max_model_len=320, block_size=16,
    )  # fmt: skip
    assert engine.core.async_scheduling
    results = await run_engine(engine, work, n=2, stagger_steps=1)
    check(hf, work, results, n=2)
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    assert sched.num_ahead_steps > 0


@pytest.mark.slow
async def test_equals_synchronous_with_stops_grammars_and_forks(model):
    # A plain request that outlives the grammar rows (up to 40 tokens), so that steps
    # without them (which alone go ahead) come whatever steps the requests arrive at.
    tail = [
        ([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=72, temperature=0, ignore_eos=True))
    ]
    sync = await _serve(make_engine(model, False, num_kv_blocks=128), tail)
    engine = make_engine(model, True, num_kv_blocks=128)
    got = await _serve(engine, tail)
    assert got == sync
    assert engine.scheduler.num_ahead_steps > 0
    assert got[2][0][2] == "stop" and "e" not in got[2][0][1]  # the stop string


@pytest.mark.slow
async def test_speculation_stays_synchronous():
    model = str(tiny_checkpoint("llama", init_std=0.05, tie_word_embeddings=True))
    spec = {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 256, "min_acceptance_rate": 0.0,
    }  # fmt: skip
    kw = dict(num_kv_blocks=128, max_num_batched_tokens=64, speculative_config=spec)
    sync = await _serve(make_engine(model, False, **kw))
    engine = make_engine(model, True, **kw)
    assert await _serve(engine) == sync
    assert engine.scheduler.num_ahead_steps == 0
    stats = engine.scheduler.stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0


async def test_abort_in_flight_frees_kv(model):
    engine = make_engine(model, True, num_kv_blocks=64)
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        others = [
            engine.generate([3, 4, 5 + i], SamplingParams(temperature=0, max_tokens=12))
            for i in range(3)
        ]
        gen = engine.generate([3, 4, 5, 6], params, request_id="long")
        seen = 0
        async for out in gen:
            seen += len(out.outputs[0].delta_token_ids)
            if seen >= 6:
                break
        await gen.aclose()
        for g in others:
            async for _ in g:
                pass
        sched = engine.scheduler
        for _ in range(200):
            if not sched.requests and sched.kv.pool.num_free == sched.kv.pool.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert not sched.requests and sched.kv.pool.num_free == sched.kv.pool.num_blocks
        assert sched.num_ahead_steps > 0
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o async for o in engine.generate([3, 4, 5, 6], short, request_id="next")]
        assert len(outs[-1].outputs[0].token_ids) == 4
    finally:
        await engine.shutdown()
