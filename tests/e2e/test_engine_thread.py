"""The engine core on its own thread (EngineConfig's device.engine_thread, EngineCore own_thread)
serves exactly what the inline engine serves: greedy tokens identical to HF transformers
under preemption, forks (n > 1), prefix hits and chunked prefill; and identical to the
inline engine's output with n-gram speculation, stop strings and grammars; an abort from
the consumer's loop frees the request's KV on the engine's."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from service.async_engine import AsyncEngine
from tests.checkpoints import tiny_checkpoint
from tests.e2e.test_engine_parity import check, run_engine, workload

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def make_engine(model: str, engine_thread: bool, **kw) -> AsyncEngine:
    return AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=model, dtype="float32", engine_thread=engine_thread, **kw)
    )


@pytest.mark.slow
async def test_thread_engine_matches_transformers_under_preemption_forks_and_prefix(model, hf):
    work = workload(6, shared_prefix=20, max_prompt=30)[:16]
    engine = make_engine(
        model, True, num_kv_blocks=20, max_num_batched_tokens=24, max_model_len=320,
        block_size=16,
    )  # fmt: skip
    assert engine.core.own_thread
    results = await run_engine(engine, work, n=2, stagger_steps=1)
    check(hf, work, results, n=2)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.prefix_hits > 0


def _requests() -> list[tuple[list[int], SamplingParams]]:
    # Repetitive prompts so that n-gram speculation finds drafts to verify.
    loop = [5, 17, 42, 99, 7, 5, 17, 42, 99, 7, 5, 17, 42]
    greedy = dict(temperature=0, ignore_eos=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return [
        (loop * 2, SamplingParams(max_tokens=30, **greedy)),
        ([*loop[:7], 300, 301], SamplingParams(max_tokens=24, n=2, **greedy)),
        ([*loop, 1000], SamplingParams(max_tokens=30, stop=["e"], **greedy)),
        (
            [11, 12, 13],
            SamplingParams(
                max_tokens=24,
                structured_outputs=StructuredOutputsParams(regex="[a-z]{3,12}"),
                **greedy,
            ),
        ),
        (
            [21, 22, 23, 24],
            SamplingParams(
                max_tokens=40,
                structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
                temperature=0,
            ),
        ),
    ]


async def _serve(
    engine: AsyncEngine, extra: list[tuple[list[int], SamplingParams]] = ()
) -> list[list[tuple[list[int], str, str | None]]]:
    await engine.start()
    try:

        async def one(i: int, prompt: list[int], params: SamplingParams):
            last = None
            async for out in engine.generate(prompt, params, request_id=f"q{i}"):
                last = out
            assert last is not None and last.finished
            return [(o.token_ids, o.text, o.finish_reason) for o in last.outputs]

        reqs = [*_requests(), *extra]
        return await asyncio.wait_for(
            asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(reqs))), 300
        )
    finally:
        await engine.shutdown()


@pytest.mark.slow
async def test_thread_engine_equals_inline_with_speculation_stops_and_grammars():
    # Weights that copy from their context (tests/e2e/test_spec_parity.py's), so drafts
    # get accepted as well as rejected.
    model = str(tiny_checkpoint("llama", init_std=0.05, tie_word_embeddings=True))
    # Speculating in every step (tests/e2e/test_spec_parity.py's settings).
    spec = {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 256, "min_acceptance_rate": 0.0,
    }  # fmt: skip
    kw = dict(num_kv_blocks=128, max_num_batched_tokens=64, speculative_config=spec)
    inline = await _serve(make_engine(model, False, **kw))
    threaded = make_engine(model, True, **kw)
    got = await _serve(threaded)
    assert got == inline
    stats = threaded.scheduler.stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0, f"no draft accepted: {stats}"
    stopped = got[2][0]
    assert stopped[2] == "stop" and "e" not in stopped[1]


async def test_abort_from_the_consumer_frees_kv_on_the_engine_thread(model):
    engine = make_engine(model, True, num_kv_blocks=64)
    await engine.start()
    try:
        loop_thread = threading.get_ident()
        assert engine.core._loop_thread != loop_thread  # really another thread
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gen = engine.generate([3, 4, 5, 6], params, request_id="long")
        seen = 0
        async for out in gen:
            seen += len(out.outputs[0].delta_token_ids)
            if seen >= 3:
                break
        await gen.aclose()
        sched = engine.scheduler

        async def freed() -> bool:
            return await engine.core.call_in_loop(
                lambda: not sched.requests and sched.kv.pool.num_free == sched.kv.pool.num_blocks
            )

        for _ in range(200):
            if await freed():
                break
            await asyncio.sleep(0.02)
        assert await freed(), "the aborted request still holds KV"
        assert not engine.core.streams
        # The same engine serves the next request.
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o async for o in engine.generate([3, 4, 5, 6], short, request_id="next")]
        assert len(outs[-1].outputs[0].token_ids) == 4
    finally:
        await engine.shutdown()
