"""Serving latency at a few request rates: a real `pagestream serve` process on loopback
driven by `pagestream bench serve` (SSE and WebSocket), as in docs/PERFORMANCE.md."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError("server did not become healthy")


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    from bench.serve import BenchConfig, run_benchmark

    path: Path = model_dir(args)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--model", str(path), "--port", str(port),
        "--dtype", args.dtype, "--threads", str(args.threads),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ}
    )
    rows = []
    try:
        _wait_health(url, proc)
        for transport, rate in [
            ("sse", 0.5), ("sse", 1.0), ("sse", 2.0), ("ws", 2.0), ("sse", math.inf),
        ]:  # fmt: skip
            cfg = BenchConfig(
                base_url=url,
                transport=transport,  # type: ignore[arg-type]
                num_prompts=args.serve_prompts,
                input_len=args.serve_input,
                output_len=args.serve_output,
                request_rate=rate,
                max_concurrency=16 if math.isinf(rate) else None,
                warmup=2,
                seed=1,
            )
            r = asyncio.run(run_benchmark(cfg))
            rows.append(
                [
                    transport,
                    "inf (16 at once)" if math.isinf(rate) else f"{rate:g}",
                    f"{r['request_throughput']:.2f}",
                    f"{r['output_throughput']:.0f}",
                    f"{r['mean_ttft_ms']:.0f} / {r['p50_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}",
                    f"{r['mean_tpot_ms']:.0f} / {r['p50_tpot_ms']:.0f} / {r['p90_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f}",
                    f"{r['mean_itl_ms']:.0f} / {r['p50_itl_ms']:.0f} / {r['p90_itl_ms']:.0f} / {r['p99_itl_ms']:.0f}",
                    f"{r['mean_e2el_ms'] / 1e3:.1f} / {r['p50_e2el_ms'] / 1e3:.1f} / {r['p90_e2el_ms'] / 1e3:.1f} / {r['p99_e2el_ms'] / 1e3:.1f}",
                ]
            )  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return table(
        f"pagestream serve ({args.dtype}, {args.threads} threads, default flags): "
        f"{args.serve_prompts} requests of {args.serve_input} prompt + {args.serve_output} "
        "output tokens per row, Poisson arrivals; latency columns are mean / p50 / p90 / p99",
        ["transport", "req/s offered", "req/s done", "output tok/s", "TTFT ms", "TPOT ms",
         "ITL ms", "E2E s"],
        rows,
    )  # fmt: skip
