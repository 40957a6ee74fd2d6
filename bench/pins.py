"""Conversation KV pins, served: the second turn of a pinned conversation against an
unpinned one after a storm that evicts everything evictable (issue 51).

One server with a KV pool of `--pins-blocks` blocks and the default `--pinned-kv-fraction`.
Each round: `--pins-conversations` conversations of each kind take a first turn (prompts of
`--pins-input` tokens, `--pins-output` generated), the pinned ones with a
`conversation_id`; then a storm of unique prompts (`--pins-storm-input` tokens, one token
out) totalling `--pins-storm-factor` times the pool; then every conversation's second
turn (its first turn's prompt and answer plus 32 new tokens), streamed.  Printed per kind:
the second turn's TTFT p50 / p99 and the prompt tokens it found cached
(usage.prompt_tokens_details.cached_tokens), and the pinned blocks against the cap
(/metrics), which must hold.  Prompts are token ids, so no tokenizer runs in the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.fair import pct_ms, start_server

KEY = "bench-pins"
BLOCK = 16


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pins-blocks", type=int, default=1024, help="pins: KV blocks of the pool")
    ap.add_argument("--pins-conversations", type=int, default=6, help="pins: per kind a round")
    ap.add_argument("--pins-input", type=int, default=384, help="pins: first turn's prompt")
    ap.add_argument("--pins-output", type=int, default=32, help="pins: tokens a turn makes")
    ap.add_argument("--pins-storm-input", type=int, default=512, help="pins: storm prompt")
    ap.add_argument("--pins-storm-factor", type=float, default=2.0,
                    help="pins: storm tokens over the pool's")  # fmt: skip
    ap.add_argument("--pins-rounds", type=int, default=2, help="pins: rounds")


async def _turn(session, url: str, prompt: list[int], max_tokens: int, conv: str | None) -> dict:
    """One streamed greedy completion: its TTFT, output ids and cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if conv is not None:
        body["conversation_id"] = conv
    t0 = time.perf_counter()
    first, ids, cached = None, [], None
    async with session.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if first is None and c.get("token_ids"):
                    first = time.perf_counter() - t0
                ids += c.get("token_ids") or []
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None and cached is not None
    return {"ttft": first, "ids": ids, "cached": cached}


def _pinned_blocks(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pagestream_kv_pinned_blocks{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _rounds(url: str, args: argparse.Namespace, seed: int) -> tuple[dict, float]:
    """Second turns per kind ({kind: [turn]}) and the most pinned blocks seen."""
    import aiohttp

    rng = random.Random(seed)
    out: dict[str, list[dict]] = {"pinned": [], "unpinned": []}
    most_pinned = 0.0

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, 2000) for _ in range(n)]

    storm_n = max(1, round(args.pins_storm_factor * args.pins_blocks * BLOCK
                           / args.pins_storm_input))  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _turn(session, url, prompt(16), 2, None)  # warm-up
        for r in range(args.pins_rounds):
            convs = []
            for i in range(args.pins_conversations):
                for kind in ("pinned", "unpinned"):
                    p1 = prompt(args.pins_input)
                    cid = f"r{r}-{i}" if kind == "pinned" else None
                    t1 = await _turn(session, url, p1, args.pins_output, cid)
                    convs.append((kind, cid, p1 + t1["ids"]))
            most_pinned = max(most_pinned, await asyncio.to_thread(_pinned_blocks, url))
            storm = [
                _turn(session, url, prompt(args.pins_storm_input), 1, None) for _ in range(storm_n)
            ]
            for i in range(0, len(storm), 16):  # 16 at a time: a storm, not a queue of hours
                await asyncio.gather(*storm[i : i + 16])
            most_pinned = max(most_pinned, await asyncio.to_thread(_pinned_blocks, url))
            for kind, cid, history in convs:
                t2 = await _turn(session, url, history + prompt(32), args.pins_output, cid)
                t2["history"] = len(history)
                out[kind].append(t2)
    return out, most_pinned


def _serve(args: argparse.Namespace, path: Path) -> tuple:
    with open(Path(args.pins_keys), "w") as f:
        f.write(KEY + "\n")
    return start_server(
        args, path,
        ["--api-key-file", args.pins_keys, "--num-kv-blocks", str(args.pins_blocks),
         "--block-size", str(BLOCK), "--enable-prompt-tokens-details"],
    )  # fmt: skip


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    import tempfile

    from bench.serve_vllm import _stop

    path: Path = model_dir(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.pins_keys = str(Path(tmp) / "keys")
        proc, url = _serve(args, path)
        try:
            turns, most_pinned = asyncio.run(_rounds(url, args, seed=11))
        finally:
            _stop(proc)
    cap = int(0.25 * args.pins_blocks)  # the server's default --pinned-kv-fraction
    rows, summary = [], {}
    for kind, ts in turns.items():
        ttft = [t["ttft"] for t in ts]
        hit = [t["cached"] / t["history"] for t in ts]
        summary[kind] = {"ttft": ttft, "cached": [t["cached"] for t in ts]}
        rows.append([
            kind, str(len(ts)), f"{pct_ms(ttft, 50):.0f} / {pct_ms(ttft, 99):.0f}",
            f"{statistics.mean(t['cached'] for t in ts):.0f}",
            f"{100 * statistics.mean(hit):.0f}%",
        ])  # fmt: skip
    args.pins_results = summary
    return table(
        f"conversation pins ({args.dtype}): turn 2 after a storm of "
        f"{args.pins_storm_factor:g}x the pool ({args.pins_blocks} blocks); first turns "
        f"{args.pins_input}/{args.pins_output} tokens; most pinned blocks seen "
        f"{most_pinned:.0f} of a cap of {cap}"
        + ("" if most_pinned <= cap else " (**CAP EXCEEDED**)"),
        ["conversation", "turns", "turn-2 TTFT p50 / p99 ms", "cached prompt tokens",
         "of turn 1 cached"],
        rows,
    )  # fmt: skip
