"""`make bench` section `host`: the server's own cost per token, with the model taken out.

The real server (bench/host_server.py) with a stand-in model that answers each step at
once or after `--host-step-ms` (what a device would take), loaded by N streams at once over
SSE and WebSocket (bench/host_client.py, a separate process), N in `--host-streams`.  Per
row: tokens delivered per second; TPOT p50 / p99 over streams; the largest gap a stream
saw; the server's CPU per token (its whole process tree, from /proc); steps and the step
period, and with a device time the share of the period the host adds in series
(1 - device time / period: 0 when host work hides behind the device).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.serve_sweep import _free_port, _wait_health
from bench.serve_vllm import _stop

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / "bench" / "results" / "host_server.log"


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every live descendant (worker pools are processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # exited meanwhile
    return total


def engine_steps(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pagestream_engine_step_seconds_count"):
                return float(line.split()[-1])
    return 0.0


def one_round(url: str, pid: int, proto: str, streams: int, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "bench.host_client", url, "--streams", str(streams),
           "--tokens", str(tokens), "--proto", proto]  # fmt: skip
    steps, cpu = engine_steps(url), tree_cpu_seconds(pid)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"host client failed: {out.stderr[-1000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["server_cpu"] = tree_cpu_seconds(pid) - cpu
    res["steps"] = engine_steps(url) - steps
    return res


def row(proto: str, streams: int, step_ms: float, r: dict) -> list[str]:
    tpot = sorted(r["tpot"])
    p99 = tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))]
    period = r["wall"] / r["steps"] * 1e3 if r["steps"] else float("nan")
    serial = f"{max(0.0, 1 - step_ms / period):.0%}" if step_ms else "-"
    return [proto, str(streams), f"{step_ms:g}", f"{r['tokens'] / r['wall']:,.0f}",
            f"{statistics.median(tpot) * 1e3:.1f} / {p99 * 1e3:.1f}",
            f"{max(r['max_gap']) * 1e3:.0f}", f"{r['server_cpu'] / r['tokens'] * 1e6:.1f}",
            f"{r['steps']:.0f} ({period:.1f} ms)", serial]  # fmt: skip


def serve(
    step_ms: float,
    max_seqs: int,
    engine: str = "auto",
    overlap: str = "auto",
    switch: str = "default",
) -> tuple[subprocess.Popen, str]:
    LOG.parent.mkdir(exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "bench.host_server", "--step-ms", str(step_ms),
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_seqs),
           "--max-num-batched-tokens", str(max(8192, 16 * max_seqs)),
           "--max-websockets", str(max_seqs + 16), "--disable-access-log",
           "--async-scheduling", overlap]  # fmt: skip
    # engine: an --engine-thread value, or `process` (--engine-process).
    cmd += ["--engine-process"] if engine == "process" else ["--engine-thread", engine]
    if switch != "default":
        cmd += ["--switch-interval-ms", switch]
    # The log goes to a file: a pipe nobody reads would stall the server once it filled.
    log = open(LOG, "ab")  # noqa: SIM115 - the child holds it; closed with our copy below
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log)
    log.close()
    try:
        _wait_health(url, proc, timeout=120)
    except BaseException:
        _stop(proc)
        raise
    return proc, url


def run(args: argparse.Namespace, print_table: Callable[..., str]) -> str:
    streams = [int(x) for x in args.host_streams.split(",")]
    steps = [float(x) for x in args.host_step_ms.split(",")]
    # serve --engine-thread per round: off (the engine on the HTTP loop), on (its own
    # thread), auto (the device's default: off for this CPU stand-in); or `process`
    # (serve --engine-process: the engine in a child process).
    engines = getattr(args, "host_engine_thread", "auto").split(",")
    # serve --async-scheduling per round (auto: off for this CPU stand-in).
    overlaps = getattr(args, "host_async_scheduling", "auto").split(",")
    # serve --switch-interval-ms per round (default: the interpreter's 5 ms).
    switches = getattr(args, "host_switch_interval", "default").split(",")
    rows = []
    for engine, overlap, switch in itertools.product(engines, overlaps, switches):
        for step_ms in steps:
            proc, url = serve(step_ms, max(streams), engine, overlap, switch)
            try:
                one_round(url, proc.pid, "sse", min(streams), 8)  # warm-up
                for proto in ("sse", "ws"):
                    for n in streams:
                        r = one_round(url, proc.pid, proto, n, args.host_tokens)
                        rows.append([*row(proto, n, step_ms, r), engine, overlap, switch])
                        print("  host " + " | ".join(rows[-1]), flush=True)
            finally:
                _stop(proc)
    return print_table(
        f"host path: the real server with a stand-in model, {args.host_tokens} tokens a "
        "stream, all streams at once, clients in another process on the same CPUs",
        ["proto", "streams", "device ms a step", "delivered tok/s", "TPOT p50 / p99 ms",
         "largest gap ms", "server CPU µs / token", "steps (period)", "host share in series",
         "engine thread", "async scheduling", "switch interval ms"],
        rows,
    )  # fmt: skip
