"""Data parallelism on one machine's cores: the same served load against one engine on
all of them (`--threads` = the cores) and against `--data-parallel-size` ranks, each an
engine process pinned to its share of the cores (the baseline measured in the same run).

Closed-loop clients at each `--dp-concurrency`, `--dp-prompts` requests of the serving
comparison's workload (`--cmp-input` / `--cmp-output` tokens, spread `--cmp-range`),
random prompts (no shared prefix: the routing's cache affinity has nothing to find, so
this is the load balance alone).  Each server is started, warmed up and measured at every
concurrency in turn, `--dp-reps` times alternated.  Printed: output tok/s, TTFT and TPOT
p50 for each, and the ranks' throughput over the one engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.fair import start_server


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dp-size", type=int, default=2, help="dp: ranks (each cores / size)")
    ap.add_argument("--dp-concurrency", default="4,16", help="dp: closed-loop clients")
    ap.add_argument("--dp-prompts", type=int, default=48, help="dp: requests per level")
    ap.add_argument("--dp-reps", type=int, default=1, help="dp: alternated runs, pooled")


def _serve(args: argparse.Namespace, path: Path, extra: list[str]) -> tuple:
    # Each kind sets its own threads (the one engine all the cores, a rank its share).
    own = argparse.Namespace(**{**vars(args), "threads": None})
    return start_server(own, path, ["--max-model-len", "2048", *extra])


def _load(args: argparse.Namespace, url: str, n: int, concurrency: int, seed: int) -> dict:
    from bench.serve import BenchConfig, run_benchmark

    cfg = BenchConfig(
        base_url=url, num_prompts=n, input_len=args.cmp_input, output_len=args.cmp_output,
        range_ratio=args.cmp_range, max_concurrency=concurrency, seed=seed,
    )  # fmt: skip
    r = asyncio.run(run_benchmark(cfg))
    if r["failed"]:
        raise RuntimeError(f"{url}: {r['failed']} requests failed: {r['errors'][:2]}")
    return r


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    path = model_dir(args)
    cores = len(os.sched_getaffinity(0))
    size = args.dp_size
    levels = [int(c) for c in args.dp_concurrency.split(",") if c.strip()]
    kinds = {
        f"one engine, {cores} threads": ["--threads", str(cores)],
        f"{size} ranks x {max(cores // size, 1)} thread(s)": ["--data-parallel-size", str(size)],
    }
    got: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.dp_reps):
        for kind, extra in kinds.items():
            proc, url = _serve(args, path, extra)
            try:
                _load(args, url, 8, 8, 1)  # warm-up
                for c in levels:
                    got.setdefault((kind, c), []).append(
                        _load(args, url, args.dp_prompts, c, 7 + rep)
                    )
            finally:
                proc.terminate()
                proc.wait(60)
    rows = []
    base = next(iter(kinds))
    for c in levels:
        base_tput = statistics.median(r["output_throughput"] for r in got[(base, c)])
        for kind in kinds:
            rs = got[(kind, c)]
            tput = statistics.median(r["output_throughput"] for r in rs)
            rows.append([
                str(c), kind, f"{tput:.1f}",
                f"{statistics.median(r['median_ttft_ms'] for r in rs):.0f}",
                f"{statistics.median(r['median_tpot_ms'] for r in rs):.1f}",
                f"{tput / base_tput:.2f}x",
            ])  # fmt: skip
    title = (
        f"Data parallelism on {cores} cores: {path.name}, {args.dtype}, {args.dp_prompts} "
        f"requests of {args.cmp_input}/{args.cmp_output} tokens a level, {args.dp_reps} run(s)"
    )
    header = ["clients", "engine", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "vs one engine"]
    return table(title, header, rows)
