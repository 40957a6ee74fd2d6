"""Fair shares per API key, served: an interactive key's TTFT while another key floods the
server, first come first served against deficit round robin (issue 51).

One server per policy (`--scheduling-policy fcfs`, then `fair`), two API keys of equal
weight.  The interactive key sends `--fair-interactive` short streamed requests one after
another, alone first, then again right after the flooding key has queued `--fair-flood`
long ones at once (prompts of `--fair-flood-input` tokens).  Printed: the interactive
key's TTFT p50 / p99 alone and under the flood, and the ratio of the p99s (fair shares
aim at <= 2x; FCFS grows with the flood).  Prompts are token ids, so no tokenizer runs
in the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

FLOOD_KEY, CHAT_KEY = "bench-flood", "bench-chat"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--fair-flood", type=int, default=300, help="fair: the flood's requests")
    ap.add_argument("--fair-flood-input", type=int, default=512, help="fair: flood prompt")
    ap.add_argument("--fair-flood-output", type=int, default=64, help="fair: flood output")
    ap.add_argument("--fair-interactive", type=int, default=20, help="fair: interactive reqs")
    ap.add_argument("--fair-interactive-input", type=int, default=48, help="fair: its prompt")
    ap.add_argument("--fair-interactive-output", type=int, default=8, help="fair: its output")
    ap.add_argument("--fair-policies", default="fcfs,fair", help="fair: the policies, in turn")


async def _ttft(
    session, url: str, key: str, prompt: list[int], max_tokens: int, count: list[int] | None = None
) -> float:
    """Seconds to the first streamed token; the rest of the stream is read to its end,
    each streamed token, and the prompt once the first arrives, counted into `count[0]`
    when given."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    async with session.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                if first is None:
                    first = time.perf_counter() - t0
                    if count is not None:
                        count[0] += len(prompt)  # its prompt is computed now
                if count is not None:
                    count[0] += 1
    assert first is not None
    return first


async def _interactive(
    session, url: str, args: argparse.Namespace, rng: random.Random, n: int
) -> list[float]:
    out = []
    for _ in range(n):
        prompt = [rng.randrange(16, 2000) for _ in range(args.fair_interactive_input)]
        out.append(await _ttft(session, url, CHAT_KEY, prompt, args.fair_interactive_output))
    return out


async def _flooded(url: str, args: argparse.Namespace, seed: int) -> tuple[list, list, float]:
    """(TTFTs alone, TTFTs while the flood waits) of the interactive key, and the flood's
    tokens a second (prompts computed and tokens streamed) while the interactive key runs
    beside it."""
    import aiohttp

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        await _interactive(session, url, args, rng, 2)  # warm-up
        alone = await _interactive(session, url, args, rng, args.fair_interactive)
        count = [0]
        flood = [
            asyncio.create_task(_ttft(
                session, url, FLOOD_KEY,
                [rng.randrange(16, 2000) for _ in range(args.fair_flood_input)],
                args.fair_flood_output, count,
            ))
            for _ in range(args.fair_flood)
        ]  # fmt: skip
        await asyncio.sleep(0.5)  # the flood is queued before the interactive key asks
        try:
            begun, before = time.perf_counter(), count[0]
            crowded = await _interactive(session, url, args, rng, args.fair_interactive)
            rate = (count[0] - before) / (time.perf_counter() - begun)
        finally:
            for t in flood:
                t.cancel()  # closing the streams aborts what is left of the flood
            await asyncio.gather(*flood, return_exceptions=True)
    return alone, crowded, rate


def start_server(args: argparse.Namespace, path: Path, extra: list[str]) -> tuple:
    """A `pagestream serve` of `path` on a free port with `extra` flags: (process, url),
    once healthy."""
    from bench.serve_sweep import _free_port, _wait_health

    port = _free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(path),
           "--port", str(port), "--dtype", args.dtype, "--disable-access-log", *extra]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_health(url, proc)
    return proc, url


def _serve(args: argparse.Namespace, path: Path, policy: str, keys: Path) -> tuple:
    return start_server(
        args, path,
        ["--api-key-file", str(keys), "--scheduling-policy", policy,
         "--max-waiting-requests", "0", "--max-waiting-requests-per-key", "0"],
    )  # fmt: skip


def pct_ms(xs: list[float], p: float) -> float:
    """The p-th percentile of seconds `xs`, in ms (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1000


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    from bench.serve_vllm import _stop

    path: Path = model_dir(args)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"{FLOOD_KEY} weight=1\n{CHAT_KEY} weight=1\n")
        for policy in args.fair_policies.split(","):
            proc, url = _serve(args, path, policy, keys)
            try:
                alone, crowded, rate = asyncio.run(_flooded(url, args, seed=7))
            finally:
                _stop(proc)
            results[policy] = {"alone": alone, "flood": crowded, "flood_tok_s": rate}
            ratio = pct_ms(crowded, 99) / pct_ms(alone, 99)
            rows.append([
                policy,
                f"{pct_ms(alone, 50):.0f} / {pct_ms(alone, 99):.0f}",
                f"{pct_ms(crowded, 50):.0f} / {pct_ms(crowded, 99):.0f}",
                f"**{ratio:.2f}x**",
                f"{statistics.mean(crowded) * 1000:.0f}",
                f"{rate:.0f}",
            ])  # fmt: skip
    args.fair_results = json.loads(json.dumps(results))
    return table(
        f"fair shares ({args.dtype}): one key floods {args.fair_flood} requests of "
        f"{args.fair_flood_input}/{args.fair_flood_output} tokens, another sends "
        f"{args.fair_interactive} of {args.fair_interactive_input}/"
        f"{args.fair_interactive_output} one at a time; the interactive key's TTFT",
        ["policy", "alone p50 / p99 ms", "under flood p50 / p99 ms", "p99 ratio",
         "under flood mean ms", "flood tok/s meanwhile (in + out)"],
        rows,
    )  # fmt: skip
