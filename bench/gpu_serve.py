"""`make gpu-bench`: `pagestream serve` under load on the device, beside its roofline.

Per shape (Llama-3.2-1B's and Llama-3.1-8B's, bf16, the local 32k vocabulary): a
random-weight checkpoint written in seconds (modelkit's `write_fast_weights`, drawn on the
GPU; cached under the cache root's models/), the server started on 127.0.0.1, then
`pagestream bench serve` (closed loop, `--max-concurrency` c, token-id prompts of
`--input-len`, exactly `--output-len` tokens out) at each concurrency. A row: output tok/s,
TTFT / TPOT / ITL p50 and p99, errors; the decode roofline at that batch,
c / ((weights read a step + c x context x KV bytes a token) / copy bandwidth), with the
context the average a decode step sees (input + output / 2) and the copy bandwidth
measured on the device (bench/gpu_check's); TPOT against the roofline's step time; and
the host share of the server's steps: 1 - the GPU's busy fraction (NVML's utilization,
sampled every 50 ms through the run; the driver averages it over its own period, a sixth
of a second to a second, so a run of a few seconds reads coarsely), beside the engine's
step period (the run's wall time over the steps counted by the server's /metrics, as
`make bench`'s host section counts them). Host work that overlaps the GPU (async
scheduling) is not in the share: it is the time the GPU waits. Output tok/s includes the prompts' prefill, which the decode roofline does
not: at high concurrency it is an upper bound the served rate cannot reach.

`--device cpu --dry` runs the same path with the tiny preset, concurrency 1 and 2 and
short prompts (tests/test_bench_gpu_serve.py): the roofline from the CPU's copy
bandwidth (meaningless, but the same arithmetic) and no host share.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.host import engine_steps
from bench.serve_sweep import _free_port, _wait_health
from bench.serve_vllm import _stop

REPO = Path(__file__).resolve().parent.parent

SHAPES = {"1b": "llama1b", "8b": "llama8b"}


@dataclass
class Shape:
    preset: str
    path: Path
    weight_bytes: int  # read once per decode step: every weight but an untied embedding
    kv_per_token: int  # K and V, every layer, in the KV cache's dtype (the model's)
    params: int
    write_s: float


@dataclass
class Result:
    concurrency: int
    prompts: int
    bench: dict[str, Any]
    steps: float
    gpu_busy: float | None  # fraction of the run with a kernel on the GPU (NVML)
    extra: dict[str, Any] = field(default_factory=dict)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu with --dry")
    ap.add_argument("--dry", action="store_true", help="tiny preset, toy sizes (CPU test)")
    ap.add_argument("--shapes", default="1b,8b", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--concurrency", default=None, help="default 1,16,64,256 (dry: 1,2)")
    ap.add_argument("--input-len", type=int, default=None, help="default 1024 (dry: 24)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (dry: 6)")
    ap.add_argument("--prompts-per-slot", type=float, default=2.0,
                    help="prompts sent at concurrency c: c x this, at least 4")  # fmt: skip
    ap.add_argument("--max-prompts", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `pagestream serve` argument (repeatable, e.g. =--enforce-eager)")  # fmt: skip
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write")
    a = ap.parse_args(argv)
    if a.dry:
        a.concurrency = a.concurrency or "1,2"
        a.input_len = a.input_len or 24
        a.output_len = a.output_len or 6
        a.max_model_len = min(a.max_model_len, 256)
        a.max_num_batched_tokens = min(a.max_num_batched_tokens, 512)
    a.concurrency = [int(x) for x in (a.concurrency or "1,16,64,256").split(",") if x.strip()]
    a.input_len = a.input_len or 1024
    a.output_len = a.output_len or 128
    return a


# --------------------------------------------------------------------------- checkpoint


def _shape_numbers(cfg: dict[str, Any]) -> tuple[int, int, int]:
    from modelkit.make_model import DTYPES, param_count, state_dict_shapes

    elem = DTYPES[cfg["torch_dtype"]].itemsize
    read = 0
    for name, shape in state_dict_shapes(cfg).items():
        if name == "model.embed_tokens.weight" and not cfg.get("tie_word_embeddings"):
            continue  # a step gathers a few rows of it, not the table
        n = 1
        for d in shape:
            n *= d
        read += n * elem
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
    return read, kv, param_count(cfg)


def checkpoint(preset: str, device: str, dtype: str | None = None) -> Shape:
    """The shape's checkpoint, written once (fast weights) and reused from the cache."""
    from modelkit.make_model import build_config, cache_root, make_model

    cfg = build_config(preset, "llama", dtype=dtype)
    path = cache_root() / "models" / f"gpu-serve-{preset}-{cfg['torch_dtype']}"
    t0 = time.perf_counter()
    if not (path / "config.json").is_file():
        make_model(path, preset, "llama", dtype=dtype, fast_weights=device)
    write_s = time.perf_counter() - t0
    read, kv, params = _shape_numbers(json.loads((path / "config.json").read_text()))
    return Shape(preset, path, read, kv, params, write_s)


# --------------------------------------------------------------------------- device


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a device copy (read + write), measured as bench/gpu_check measures it
    (its 16 MiB dry size on a CPU, where the figure only exercises the roofline's path)."""
    import torch

    from bench.gpu_check.common import DRY_SIZES, Report, Sizes
    from bench.gpu_check.kernels import KernelBench

    dev = torch.device(device)
    kb = KernelBench(Report(), dev, DRY_SIZES if dev.type == "cpu" else Sizes())
    kb.copy_bandwidth()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return kb.copy_bw


class BusySampler:
    """The GPU's busy fraction over a run: NVML's utilization (the share of its last
    sample period with a kernel running), averaged over samples taken every 50 ms."""

    def __init__(self, device: str) -> None:
        self.handle: Any = None
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device == "cpu":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.split(":")[1]) if ":" in device else 0
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as e:  # no NVML: the host-share column stays empty
            print(f"gpu_serve: no NVML ({type(e).__name__}: {e}); no host share", flush=True)

    def __enter__(self) -> BusySampler:
        if self.handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(0.05):
            self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None


# --------------------------------------------------------------------------- server


def start_server(shape: Shape, args: argparse.Namespace, log: Path) -> tuple[Any, str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(shape.path),
           "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--dtype", "float32" if args.device == "cpu" else "bfloat16", "--max-num-seqs", str(max(args.concurrency)),
           "--max-model-len", str(args.max_model_len),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-websockets", str(max(args.concurrency) + 16),
           "--disable-access-log", *args.server_arg]  # fmt: skip
    if args.device == "cpu":
        cmd += ["--threads", "1"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:  # the child holds its own copy
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_health(url, proc, timeout=args.start_timeout)
    except BaseException as e:
        _stop(proc)
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"server did not start ({e}); log tail:\n{tail}") from e
    return proc, url


def one_load(url: str, c: int, args: argparse.Namespace, device: str) -> Result:
    from bench.serve import BenchConfig, run_benchmark

    prompts = min(args.max_prompts, max(4, int(c * args.prompts_per_slot)))
    cfg = BenchConfig(
        base_url=url,
        num_prompts=prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=c,
        warmup=min(c, 4),
        seed=c,
        percentiles=(50.0, 99.0),
    )
    steps0 = engine_steps(url)
    with BusySampler(device) as sampler:
        res = asyncio.run(run_benchmark(cfg))
    return Result(c, prompts, res, engine_steps(url) - steps0, sampler.busy())


# --------------------------------------------------------------------------- table


def roofline(shape: Shape, c: int, ctx: float, bw: float | None) -> float | None:
    """Decode tokens/s at batch c if a step only read its weights and KV at `bw`."""
    if not bw:
        return None
    return c / ((shape.weight_bytes + c * ctx * shape.kv_per_token) / bw)


HEAD = ["shape", "conc.", "prompts", "output tok/s", "roofline tok/s", "of roofline",
        "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "roofline step ms", "ITL p50 / p99 ms",
        "step period ms", "host share (GPU idle)", "errors"]  # fmt: skip


def row(shape: Shape, r: Result, args: argparse.Namespace, bw: float | None) -> list[str]:
    b = r.bench
    ctx = args.input_len + args.output_len / 2
    roof = roofline(shape, r.concurrency, ctx, bw)
    period = b["duration"] / r.steps * 1e3 if r.steps else None
    host = f"{1 - r.gpu_busy:.0%}" if r.gpu_busy is not None else "-"
    return [
        f"{shape.preset} ({_count(shape.params)})",
        str(r.concurrency),
        str(r.prompts),
        f"{b['output_throughput']:,.0f}",
        f"{roof:,.0f}" if roof else "-",
        f"{b['output_throughput'] / roof:.0%}" if roof else "-",
        f"{b['median_ttft_ms']:.1f} / {b['p99_ttft_ms']:.1f}",
        f"{b['median_tpot_ms']:.2f} / {b['p99_tpot_ms']:.2f}",
        f"{r.concurrency / roof * 1e3:.2f}" if roof else "-",
        f"{b['median_itl_ms']:.2f} / {b['p99_itl_ms']:.2f}",
        f"{period:.2f}" if period else "-",
        host,
        str(b["failed"]),
    ]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def markdown(header: dict[str, str], rows: list[list[str]], notes: list[str]) -> str:
    lines = ["# Served benchmark on the device", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| " + " | ".join(HEAD) + " |", "|" + " --- |" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _out_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_serve.md"
    return REPO / "bench" / "results" / ("gpu_serve_dry.md" if args.dry else "gpu_serve.md")


def _card(device: str) -> str:
    if device == "cpu":
        return (platform.processor() or platform.machine()) + " (dry run: numbers meaningless)"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cpu" and not args.dry:
        print("gpu_serve: --device cpu runs only as --dry")
        return 2
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print("gpu_serve: no CUDA device; use --device cpu --dry for a dry run")
            return 2
    t_start = time.perf_counter()
    presets = ["tiny"] if args.dry else [SHAPES[s.strip()] for s in args.shapes.split(",")]
    bw = copy_bandwidth(args.device)
    out = _out_path(args)
    header = {
        "card": _card(args.device),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load": f"closed loop, {args.input_len}-token prompts (token ids), "
        f"{args.output_len} tokens out (ignore_eos), greedy, SSE",
        "copy bandwidth": f"{bw / 1e9:.0f} GB/s (read + write)" if bw else "-",
        "roofline context": f"{args.input_len + args.output_len / 2:.0f} tokens a sequence",
        # Which engine mode (--engine-process, --engine-thread) and the like: a second run
        # with other flags is only comparable where the header says what differs.
        "server flags": " ".join(args.server_arg) or "defaults",
    }
    rows: list[list[str]] = []
    notes: list[str] = []
    failed = False
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> str:
        # After every row: a run stopped at the device's time limit keeps what it measured.
        header["runtime"] = f"{time.perf_counter() - t_start:.0f} s"
        md = markdown(header, rows, notes)
        out.write_text(md)
        return md

    def failure(preset: str, c: str, e: Exception) -> None:
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        rows.append([preset, c, *["-"] * (len(HEAD) - 3), f"FAILED: {msg}"])
        print(f"  {preset} c={c}: {msg}", flush=True)
        write()

    for preset in presets:
        try:  # a shape that cannot be written or served costs its row, not the other shape
            shape = checkpoint(preset, args.device, "float32" if args.dry else None)
            notes.append(
                f"- {preset}: weights read a step {shape.weight_bytes / 1e9:.2f} GB, KV "
                f"{shape.kv_per_token / 1024:.0f} KiB a token; checkpoint ready in "
                f"{shape.write_s:.1f} s ({shape.path})"
            )
            print(notes[-1], flush=True)
            t0 = time.perf_counter()
            proc, url = start_server(shape, args, out.parent / f"gpu_serve_{preset}.log")
            notes.append(f"- {preset}: server healthy in {time.perf_counter() - t0:.0f} s")
        except Exception as e:
            failed = True
            failure(preset, "all", e)
            continue
        try:
            for c in args.concurrency:
                try:
                    r = one_load(url, c, args, args.device)
                except Exception as e:  # one load's failure costs its row, not the table
                    failed = True
                    failure(preset, str(c), e)
                    continue
                rows.append(row(shape, r, args, bw))
                failed |= bool(r.bench["failed"])
                errs = sorted({e for e in r.bench["errors"] if e})[:3]
                if errs:
                    notes.append(f"- {preset} c={c} errors: " + "; ".join(errs))
                print("  " + " | ".join(rows[-1]), flush=True)
                write()
        finally:
            _stop(proc)
    md = write()
    print()
    print(md)
    print(f"written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
