"""A CPU that is not the engine's alone: served and offline beside 0, 1 and 2 busy
processes (`while True: pass`), the thread team chosen by the engine (gpu/cpu_threads.py)
against the same engine fixed at `--threads` (the baseline, measured in the same run).

Served: Poisson arrivals at `--crowded-rate` req/s, `--cmp-prompts` requests of
`--cmp-input` prompt and `--cmp-output` output tokens (spread `--cmp-range`), the serving
comparison's workload; the neighbours start after the warm-up and stop with the run.
Offline: `LLM.generate` over `--crowded-offline-n` mixed requests in a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.serve_sweep import _free_port, _wait_health
from bench.serve_vllm import _stop

_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@contextmanager
def neighbours(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    if os.path.exists(_TCMALLOC) and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = _TCMALLOC  # as `make run` serves
    return env


def served(args: argparse.Namespace, path: Path, threads: int | None, busy: int) -> dict:
    from bench.serve import BenchConfig, run_benchmark

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(path),
           "--port", str(port), "--dtype", args.dtype, "--disable-access-log"]  # fmt: skip
    if threads is not None:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        _wait_health(url, proc)

        def load(n: int, rate: float, seed: int) -> dict:
            cfg = BenchConfig(
                base_url=url, num_prompts=n, input_len=args.cmp_input,
                output_len=args.cmp_output, range_ratio=args.cmp_range, request_rate=rate,
                seed=seed,
            )  # fmt: skip
            return asyncio.run(run_benchmark(cfg))

        load(8, float("inf"), 1)  # warm-up, quiet
        with neighbours(busy):
            return load(args.cmp_prompts, args.crowded_rate, 7)
    finally:
        _stop(proc)


def offline(args: argparse.Namespace, path: Path, threads: int | None, busy: int) -> float:
    """Output tokens per second of one LLM.generate call, in a fresh process."""
    spec = {"model": str(path), "dtype": args.dtype, "threads": threads,
            "n": args.crowded_offline_n}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.crowded", json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    # The neighbours start once the engine is built and warm (the worker says so).
    assert proc.stdout.readline().strip() == "warm"
    with neighbours(busy):
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.readline()
    proc.wait(60)
    return float(out)


def _offline_worker(spec: dict) -> None:
    import random

    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    llm = LLM(spec["model"], dtype=spec["dtype"], threads=spec["threads"], max_model_len=1024)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(32, 256))]
               for _ in range(spec["n"])]  # fmt: skip
    outs = [rng.randrange(16, 64) for _ in prompts]
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm)
    print("warm", flush=True)
    sys.stdin.readline()  # "go": the neighbours are running
    t0 = time.perf_counter()
    res = llm.generate(
        prompts,
        [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in outs],
    )
    took = time.perf_counter() - t0
    print(sum(len(r.outputs[0].token_ids) for r in res) / took, flush=True)
    llm.shutdown()


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    from gpu.cpu_threads import usable_cpus

    path: Path = model_dir(args)
    fixed = args.threads or usable_cpus()
    rows = []
    for busy in (0, 1, 2):
        base = served(args, path, fixed, busy)
        auto = served(args, path, None, busy)
        off_base = offline(args, path, fixed, busy)
        off_auto = offline(args, path, None, busy)
        rows.append([
            str(busy),
            f"{base['output_throughput']:.0f} / {auto['output_throughput']:.0f}",
            f"**{auto['output_throughput'] / base['output_throughput']:.2f}x**",
            f"{base['p50_tpot_ms']:.0f} / {auto['p50_tpot_ms']:.0f}",
            f"{base['p99_tpot_ms']:.0f} / {auto['p99_tpot_ms']:.0f}",
            f"{base['p99_ttft_ms']:.0f} / {auto['p99_ttft_ms']:.0f}",
            f"{off_base:.0f} / {off_auto:.0f}",
            f"**{off_auto / off_base:.2f}x**",
        ])  # fmt: skip
    return table(
        f"crowded CPU ({args.dtype}): served at {args.crowded_rate:g} req/s "
        f"({args.cmp_prompts} requests, {args.cmp_input}/{args.cmp_output} tokens) and "
        f"offline ({args.crowded_offline_n} requests), beside N busy processes; each cell "
        f"is fixed {fixed} threads / the engine's own choice",
        ["busy", "served tok/s", "ratio", "TPOT p50 ms", "TPOT p99 ms", "TTFT p99 ms",
         "offline tok/s", "ratio"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    _offline_worker(json.loads(sys.argv[1]))
