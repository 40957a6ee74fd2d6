"""Two engines sharing one real Redis: prefixes computed once serve every replica.

A second engine serves a long system prompt it never computed by loading its KV from
Redis (fewer tokens through the model), with greedy output identical to a cold run; a
Redis that dies mid-run or holds garbage only costs recomputation.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine
from tests.checkpoints import tiny_checkpoint
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

SYSTEM = [random.Random(0).randrange(3, 2000) for _ in range(300)]  # 18 full blocks of 16


def questions(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(3, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def engine(model: str, redis_url: str | None, **kw) -> AsyncEngine:
    args = EngineConfig.from_kwargs(
        model=model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=128,
        redis_url=redis_url, **kw,
    )  # fmt: skip
    return AsyncEngine.from_config(args)


async def generate(
    e: AsyncEngine,
    prompts: list[list[int]],
    max_tokens: int = 12,
    tag: str = "q",
    started: set[int] | None = None,
):
    """Greedy outputs of `prompts`; `started` collects the index of each request that has
    a token out (its prefill step, and the tier loads that step made, applied)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, p: list[int]) -> list[int]:
        last = None
        async for out in e.generate("", params, f"{tag}{i}", prompt_token_ids=p):
            last = out
            if started is not None:
                started.add(i)
        return last.outputs[0].token_ids

    return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 300)


async def cold_outputs(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    e = engine(model, None, **kw)
    await e.start()
    try:
        return await generate(e, prompts)
    finally:
        await e.shutdown()


def assert_clean(e: AsyncEngine) -> None:
    s = e.scheduler
    assert not s.has_unfinished() and s.kv.pool.num_free == s.kv.pool.num_blocks


async def wait_published(e: AsyncEngine, n: int) -> None:
    for _ in range(500):
        if e.tier.stats.blocks_published >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {e.tier.stats.blocks_published} blocks published")


@pytest.mark.parametrize("kv", ["auto", "int8"])
async def test_second_engine_loads_system_prompt_from_redis(model, redis_server, kv):
    # int8 KV: payloads carry the values and their scales.
    prompts = [SYSTEM + q for q in questions(6)]
    cold = await cold_outputs(model, prompts, kv_cache_dtype=kv)
    cold_engine_tokens = sum(len(p) for p in prompts) + 11 * len(prompts)

    a = engine(model, redis_server.url, kv_cache_dtype=kv)
    await a.start()
    try:
        info = await a.register_prefix(SYSTEM)
        assert info["blocks"] == 18
        await wait_published(a, 18)
    finally:
        await a.shutdown()

    b = engine(model, redis_server.url, kv_cache_dtype=kv)
    await b.start()
    try:
        got = await generate(b, prompts)
        assert got == cold
        s = b.scheduler
        # The first request loaded 18 blocks from Redis; the rest hit them locally.
        assert s.prefix_hits_remote == 18 * 16
        assert b.tier.stats.blocks_loaded == 18
        assert b.core.tokens_computed < cold_engine_tokens - 6 * 280
        assert_clean(b)
    finally:
        await b.shutdown()
    # Everything lives under one namespace.
    keys = redis_server.client().keys("pagestream:*")
    namespaces = {k.split(b":")[1] for k in keys}
    assert len(namespaces) == 1 and any(b":kv:" in k for k in keys)


async def test_hot_prefix_published_after_hits(model, redis_server):
    prompts = [SYSTEM + q for q in questions(3, seed=5)]
    a = engine(model, redis_server.url, redis_hit_threshold=1)
    await a.start()
    try:
        await generate(a, prompts[:1])
        assert a.tier.stats.blocks_published == 0  # computed once: not hot yet
        await generate(a, prompts[1:2])  # a local hit makes it hot
        await wait_published(a, 18)
    finally:
        await a.shutdown()
    b = engine(model, redis_server.url)
    await b.start()
    try:
        assert await generate(b, prompts[2:]) == await cold_outputs(model, prompts[2:])
        assert b.scheduler.prefix_hits_remote == 18 * 16
    finally:
        await b.shutdown()


async def test_redis_killed_mid_run_changes_nothing(model, redis_server):
    first = [SYSTEM[: 40 + 13 * i] + q for i, q in enumerate(questions(6, seed=7))]
    later = [SYSTEM + q for q in questions(6, seed=8)]
    cold = await cold_outputs(model, first + later)
    a = engine(model, redis_server.url)
    await a.start()
    try:
        await a.register_prefix(SYSTEM)
        await wait_published(a, 18)
    finally:
        await a.shutdown()
    b = engine(model, redis_server.url, redis_lookup_deadline=0.5)
    await b.start()
    try:
        started: set[int] = set()
        running = asyncio.ensure_future(generate(b, first, max_tokens=40, started=started))
        # Killed once every first request has loaded what it will load (loads are counted
        # with the step that made them, which can finish after another request's first
        # step), and while they all still decode.
        while len(started) < len(first):
            await asyncio.sleep(0.005)
        loaded_before = b.tier.stats.blocks_loaded
        assert loaded_before > 0
        redis_server.stop()
        # New arrivals need blocks only Redis had: their look-ups fail, they recompute.
        got_later = await generate(b, later, max_tokens=12, tag="later")
        got_first = await running
        assert [g[:12] for g in got_first] + got_later == cold
        assert b.tier.stats.errors >= 1 and b.tier.stats.blocks_loaded == loaded_before
        assert_clean(b)
    finally:
        await b.shutdown()


async def test_garbage_under_namespace_is_recomputed(model, redis_server):
    prompts = [SYSTEM + q for q in questions(2, seed=9)]
    cold = await cold_outputs(model, prompts)
    a = engine(model, redis_server.url)
    await a.start()
    try:
        await a.register_prefix(SYSTEM)
        await wait_published(a, 18)
    finally:
        await a.shutdown()
    r = redis_server.client()
    kv_keys = sorted(r.keys("pagestream:*:kv:*"))
    assert len(kv_keys) == 18
    for i, k in enumerate(kv_keys):
        # Wrong bytes of the right length, a truncated value, and plain junk.
        blob = r.get(k)
        r.set(k, bytes(len(blob)) if i % 3 == 0 else blob[:-7] if i % 3 == 1 else b"junk")
    b = engine(model, redis_server.url)
    await b.start()
    try:
        assert await generate(b, prompts) == cold
        assert b.tier.stats.bad_payloads >= 1
        assert b.scheduler.prefix_hits_remote == 0
        assert_clean(b)
    finally:
        await b.shutdown()


async def test_redis_down_from_the_start(model):
    server = RedisServer()
    url = server.url
    server.stop()
    prompts = [SYSTEM + q for q in questions(3)]
    e = engine(model, url, redis_lookup_deadline=0.3)
    await e.start()
    try:
        assert await generate(e, prompts) == await cold_outputs(model, prompts)
        assert e.tier.stats.errors >= 1
    finally:
        await e.shutdown()


async def test_kv_cache_dtypes_never_share_a_namespace(model, redis_server):
    # An int8 replica must not load a float32 replica's blocks (other bytes, other layout).
    prompts = [SYSTEM + q for q in questions(2, seed=11)]
    a = engine(model, redis_server.url)
    await a.start()
    try:
        await a.register_prefix(SYSTEM)
        await wait_published(a, 18)
    finally:
        await a.shutdown()
    b = engine(model, redis_server.url, kv_cache_dtype="int8")
    await b.start()
    try:
        assert await generate(b, prompts) == await cold_outputs(
            model, prompts, kv_cache_dtype="int8"
        )
        assert b.scheduler.prefix_hits_remote == 0 and b.tier.stats.bad_payloads == 0
        assert b.tier.cfg.namespace != a.tier.cfg.namespace
    finally:
        await b.shutdown()
