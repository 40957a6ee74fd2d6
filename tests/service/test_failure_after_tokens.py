"""A request that fails after it sampled tokens: a consumer that reads late (its stream
merged the tokens and the failure into one update) still gets those tokens before the
failure, as a consumer that keeps up does."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine, RequestFailed
from tests.checkpoints import tiny_checkpoint

SAMPLE = 2040  # a prompt holding it fails at its third sampled token


@pytest.mark.parametrize("late", [False, True], ids=["keeps-up", "reads-late"])
async def test_tokens_sampled_before_a_failure_reach_the_consumer(late):
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(
            model=str(tiny_checkpoint("llama")),
            dtype="float32",
            fault_injection=f"sample-token={SAMPLE}@2",
        )
    )
    await engine.start()
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        sub = engine.submit([5, SAMPLE, 9, 11], params, "r")
        if late:
            for _ in range(400):
                if sub.stream.finished:
                    break
                await asyncio.sleep(0.01)
            assert sub.stream.finished
        seen: list[int] = []
        with pytest.raises(RequestFailed, match="sampling"):
            async for out in engine.generate("", submitted=sub):
                seen += out.outputs[0].delta_token_ids
        assert len(seen) == 2
    finally:
        await engine.shutdown()
