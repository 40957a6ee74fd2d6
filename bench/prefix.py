"""TTFT of a long shared system prompt: cold, local prefix-cache hit, and a Redis-tier hit
on a second engine that never computed it."""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def _ttft(engine, prompt: list[int], rid: str) -> float:
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    t = time.perf_counter()
    first = None
    async for out in engine.generate("", params, rid, prompt_token_ids=prompt):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter() - t
    assert first is not None
    return first


async def _wait_published(engine, n: int) -> None:
    for _ in range(3000):
        if engine.tier.stats.blocks_published >= n:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("system prompt was not published to Redis")


def _make_engine(path: Path, args: argparse.Namespace, redis_url: str) -> Any:
    from scheduler.config import EngineConfig
    from service.async_engine import AsyncEngine

    return AsyncEngine.from_config(
        EngineConfig.from_kwargs(
            model=str(path), dtype=args.dtype, redis_url=redis_url,
            max_num_batched_tokens=args.budget or 2048,
        )
    )  # fmt: skip


async def _measure(
    make: Callable[[], Any], vocab: int, sys_len: int, reps: int, rng: random.Random
) -> dict[str, list[float]]:
    """TTFTs of `reps` fresh system prompts: cold on engine A, a local hit on A, then a
    Redis-tier hit on B (which never saw the prompt)."""
    times: dict[str, list[float]] = {"cold": [], "local": [], "redis": []}
    a, b = make(), make()  # inside the loop, as the server builds them
    await a.start()
    await b.start()
    try:
        warm = [rng.randrange(16, vocab) for _ in range(64)]
        await _ttft(a, warm, "warm-a")
        await _ttft(b, warm, "warm-b")
        for k in range(reps):
            system = [rng.randrange(16, vocab) for _ in range(sys_len)]

            def q() -> list[int]:
                return [rng.randrange(16, vocab) for _ in range(16)]

            times["cold"].append(await _ttft(a, system + q(), f"cold{k}"))
            # The local hit also makes the blocks hot, so A publishes them.
            times["local"].append(await _ttft(a, system + q(), f"local{k}"))
            await _wait_published(a, (k + 1) * (sys_len // a.scheduler.block_size))
            times["redis"].append(await _ttft(b, system + q(), f"redis{k}"))
            assert b.scheduler.prefix_hits_remote >= (k + 1) * (sys_len - 16)
    finally:
        await a.shutdown()
        await b.shutdown()
    return times


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    if shutil.which("redis-server") is None:
        return "### prefix: skipped (no redis-server binary)\n"
    from bench.redis_server import RedisServer
    from gpu.config import ModelConfig

    path: Path = model_dir(args)
    vocab = ModelConfig.from_dir(path).vocab_size
    sys_len, reps = args.prefix_len, args.prefix_reps
    redis = RedisServer()
    try:
        make = functools.partial(_make_engine, path, args, redis.url)
        times = asyncio.run(_measure(make, vocab, sys_len, reps, random.Random(0)))
    finally:
        redis.stop()
    cold = statistics.median(times["cold"])
    rows = []
    for name, label in (
        ("cold", "cold (prefill everything)"),
        ("local", "local prefix-cache hit (same engine)"),
        ("redis", "Redis-tier hit (second engine, never saw the prompt)"),
    ):
        med = statistics.median(times[name])
        rows.append([label, f"{med * 1e3:.1f}", f"{cold / med:.2f}x"])
    return table(
        f"TTFT of a {sys_len}-token shared system prompt + 16-token question "
        f"(median of {reps}, {args.dtype}, preset {args.preset})",
        ["case", "TTFT ms", "speed-up vs cold"],
        rows,
    )
