"""GPU check: kernel tests at real sizes, kernel bandwidth/FLOP rates, end-to-end decode.

For a machine with a CUDA GPU (`make gpu-check`, i.e. `python -m bench.gpu_check`); the
whole run takes a few minutes on an H100/H200-class card.  Three independent parts, each
guarded so one failing part still leaves the others' rows in the table:

1. tests    pytest on tests/gpu/test_kernels.py + test_triton_backend.py, natively, with
            PAGESTREAM_GPU_CHECK=1 (real sizes); pass/fail/skip counts.
2. kernels  device copy bandwidth; each attention kernel's achieved bandwidth (bytes of
            K/V/Q/O it must move / time) as a fraction of it; split vs non-split decode;
            prefill TFLOP/s against torch SDPA; a small tile-config sweep; fused RMSNorm and
            rotary against their torch versions.
3. e2e      decode tokens/s of a random ~1B Llama-shaped model through gpu.model_runner at
            batch 1 and 64, eager and (when the runner offers them) with CUDA graphs,
            against the roofline of reading the weights (+ KV) once per step.

Writes one markdown table to $OUT/gpu_check.md when $OUT is set, else
bench/results/gpu_check.md, and prints it.  `--device cpu` is a dry run of the harness at
toy sizes through Triton's interpreter (numbers meaningless; for checking the script).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- report


@dataclass
class Row:
    part: str
    case: str
    time: str = ""  # per call / per step
    achieved: str = ""  # GB/s, TFLOP/s or tokens/s
    ceiling: str = ""  # what it is measured against (copy bandwidth, SDPA, torch, roofline)
    ratio: str = ""  # achieved / ceiling (or speed-up over torch)
    notes: str = ""


@dataclass
class Report:
    header: dict[str, str] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    tests_ok: bool = True  # part 1 ran and every test passed

    def add(self, row: Row) -> None:
        self.rows.append(row)
        cells = [row.part, row.case, row.time, row.achieved, row.ceiling, row.ratio, row.notes]
        print("  " + " | ".join(c for c in cells if c), flush=True)

    def markdown(self) -> str:
        lines = ["# GPU check", ""]
        lines += [f"- {k}: {v}" for k, v in self.header.items()]
        lines += [
            "",
            "| part | case | time | achieved | ceiling / baseline | ratio | notes |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            cells = [r.part, r.case, r.time, r.achieved, r.ceiling, r.ratio, r.notes]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def fmt_time(ms: float) -> str:
    return f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.2f} ms"


def fmt_pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def guarded(report: Report, part: str, case: str) -> contextlib.AbstractContextManager[None]:
    """Run a block; on failure add a row with the error instead of stopping the check."""

    @contextlib.contextmanager
    def cm() -> Any:
        try:
            yield
        except Exception as e:
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            report.add(Row(part, case, notes=f"FAILED: {msg}"))
        finally:
            gc.collect()
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    return cm()


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    batch: int = 64
    ctx: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    prefill_len: int = 4096
    chunk_len: int = 2048
    chunk_ctx: int = 6144
    long_ctx: int = 16384
    longest_ctx: int = 32768
    norm_hidden: int = 4096
    norm_tokens: tuple[int, ...] = (64, 8192)
    copy_mib: int = 2048
    sweep: bool = True
    e2e_batches: tuple[int, ...] = (1, 64)
    e2e_prompt: int = 128
    e2e_warmup: int = 5
    e2e_steps: int = 30
    # Llama-3.2-1B's shape: 1.24B parameters, tied 128k vocabulary.
    model: tuple[tuple[str, Any], ...] = (
        ("hidden_size", 2048),
        ("num_hidden_layers", 16),
        ("num_attention_heads", 32),
        ("num_key_value_heads", 8),
        ("head_dim", 64),
        ("intermediate_size", 8192),
        ("vocab_size", 128256),
        ("tie_word_embeddings", True),
        ("max_position_embeddings", 4096),
        ("rope_theta", 500000.0),
    )


DRY_SIZES = Sizes(
    batch=3,
    ctx=40,
    heads=4,
    kv_heads=2,
    head_dim=64,
    prefill_len=48,
    chunk_len=20,
    chunk_ctx=30,
    long_ctx=300,
    longest_ctx=600,
    norm_hidden=256,
    norm_tokens=(4, 16),
    copy_mib=16,
    sweep=False,
    e2e_batches=(1, 3),
    e2e_prompt=8,
    e2e_warmup=1,
    e2e_steps=2,
    model=(
        ("hidden_size", 128),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 64),
        ("intermediate_size", 256),
        ("vocab_size", 512),
        ("tie_word_embeddings", True),
        ("max_position_embeddings", 256),
        ("rope_theta", 10000.0),
    ),
)


# --------------------------------------------------------------------------- timing


def bench_ms(fn: Callable[[], Any], device: Any, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    import torch

    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


# --------------------------------------------------------------------------- part 1


def part_tests(report: Report, device: Any, timeout_s: int) -> None:
    env = dict(os.environ)
    if device.type == "cuda":
        env["PAGESTREAM_GPU_CHECK"] = "1"
        env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as d:
        xml_path = Path(d) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests/gpu/test_kernels.py",
            "tests/gpu/test_triton_backend.py",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml_path}",
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            report.tests_ok = False
            report.add(Row("tests", "kernel tests (real sizes)", notes=f"timed out >{timeout_s}s"))
            return
        secs = time.perf_counter() - t0
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        print("\n".join("    " + line for line in tail))
        if not xml_path.exists():
            report.tests_ok = False
            report.add(
                Row("tests", "kernel tests", notes=f"pytest rc={proc.returncode}, no report")
            )
            return
        suite = ET.parse(xml_path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert suite is not None
        total = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        bad = [
            c.get("name", "?")
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
        report.tests_ok = failed == 0 and proc.returncode == 0
        report.add(
            Row(
                "tests",
                "kernel + backend tests" + (", real sizes" if device.type == "cuda" else ""),
                time=f"{secs:.0f} s",
                achieved=f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped",
                notes=("failed: " + ", ".join(bad[:8])) if bad else "",
            )
        )


# --------------------------------------------------------------------------- part 2


class KernelBench:
    """Part 2.  One method per measurement; each runs under `guarded`, so a failure costs
    one row, and its tensors are freed when the method returns."""

    def __init__(self, report: Report, device: Any, s: Sizes) -> None:
        import torch

        from gpu.kernels.attention import _sm_count

        self.report = report
        self.device = device
        self.s = s
        self.dtype = torch.bfloat16
        self.elem = 2
        self.copy_bw: float | None = None  # bytes/s
        self.sms = _sm_count(device)
        self.shape = f"Hq{s.heads}/Hkv{s.kv_heads} d{s.head_dim} bs{s.block_size}"

    def run(self) -> float | None:
        s, g = self.s, self.report
        with guarded(g, "kernels", "device copy bandwidth"):
            self.copy_bandwidth()
        with guarded(g, "attention", f"decode b{s.batch} ctx{s.ctx}"):
            self.decode_main()
        for nseq, ctx in ((4, s.long_ctx), (1, s.longest_ctx)):
            with guarded(g, "attention", f"decode b{nseq} ctx{ctx}"):
                self.decode_split(nseq, ctx)
        with guarded(g, "attention", "prefill"):
            self.prefill(
                f"prefill 1x{s.prefill_len} causal, {self.shape}", [s.prefill_len], [0], True
            )
        with guarded(g, "attention", "chunked prefill"):
            self.prefill(
                f"chunked prefill {s.chunk_len} on {s.chunk_ctx} cached",
                [s.chunk_len],
                [s.chunk_ctx],
                False,
            )
        with guarded(g, "attention", "mixed step"):
            nd = s.batch // 2
            self.prefill(
                f"mixed step: {nd} decodes ctx{s.ctx // 2} + 1x512 chunk on 1024",
                [1] * nd + [512],
                [s.ctx // 2] * nd + [1024],
                False,
            )
        if s.sweep:
            with guarded(g, "attention", "prefill tile sweep"):
                self.prefill_sweep()
        with guarded(g, "kernels", "kv write"):
            self.kv_write()
        for tokens in s.norm_tokens:
            with guarded(g, "fused", f"rms_norm T={tokens}"):
                self.rms_norm(tokens)
            with guarded(g, "fused", f"rotary T={tokens}"):
                self.rotary(tokens)
        return self.copy_bw

    # ------------------------------------------------------------------ helpers
    def ceiling(self) -> tuple[str, float]:
        bw = self.copy_bw
        return (f"{bw / 1e9:.0f} GB/s copy", bw) if bw else ("", 0.0)

    def batch(self, qlens: list[int], ctxs: list[int], seed: int) -> Any:
        from gpu.kernels.testing import make_paged_batch

        s = self.s
        return make_paged_batch(
            qlens,
            ctxs,
            num_heads=s.heads,
            num_kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            block_size=s.block_size,
            dtype=self.dtype,
            device=self.device,
            seed=seed,
            poison=0.0,
        )

    def attention_fn(self, b: Any, num_splits: int | None, cfg: Any = None) -> Callable[[], Any]:
        import torch

        from gpu.kernels import paged_attention

        m = b.meta
        out = torch.empty_like(b.q)
        scale = self.s.head_dim**-0.5

        def fn() -> Any:
            return paged_attention(
                b.q,
                b.k_cache,
                b.v_cache,
                m.query_start_loc,
                m.seq_lens,
                m.block_tables,
                max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len,
                num_decodes=m.num_decodes,
                scale=scale,
                out=out,
                num_splits=num_splits,
                config=cfg,
            )

        return fn

    def decode_bytes(self, b: Any) -> int:
        s = self.s
        kv = 2 * sum(b.meta.seq_lens_cpu) * s.kv_heads * s.head_dim * self.elem  # K and V once
        return kv + 2 * b.q.numel() * self.elem  # q in, o out

    def bw_row(self, part: str, label: str, ms: float, moved: float, notes: str = "") -> None:
        bw = moved / (ms * 1e-3)
        ceil, cbw = self.ceiling()
        ratio = fmt_pct(bw / cbw) if cbw else ""
        self.report.add(Row(part, label, fmt_time(ms), f"{bw / 1e9:.0f} GB/s", ceil, ratio, notes))

    def attn_flops(self, qlens: list[int], ctxs: list[int]) -> float:
        visible = sum(c * q + q * (q + 1) // 2 for q, c in zip(qlens, ctxs))
        return 4.0 * self.s.heads * self.s.head_dim * visible  # QK^T and PV: 2 FLOPs a MAC

    # ------------------------------------------------------------------ cases
    def copy_bandwidth(self) -> None:
        import torch

        n = self.s.copy_mib * (1 << 20) // 4
        src = torch.empty(n, dtype=torch.float32, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = bench_ms(lambda: dst.copy_(src), self.device)
        self.copy_bw = 2 * src.numel() * 4 / (ms * 1e-3)  # read + write
        self.report.add(
            Row(
                "kernels",
                f"device copy, {self.s.copy_mib} MiB",
                fmt_time(ms),
                f"{self.copy_bw / 1e9:.0f} GB/s",
                notes="read + write bytes; the ceiling of the GB/s rows",
            )
        )

    def decode_main(self) -> None:
        """Decode at batch 64, context 4k: the main target (70%+ of copy bandwidth)."""
        from gpu.attention.torch_backend import TorchAttentionBackend
        from gpu.kernels import AttentionKernelConfig, choose_num_splits

        s = self.s
        b = self.batch([1] * s.batch, [s.ctx - 1] * s.batch, 1)
        moved = self.decode_bytes(b)
        nsplit = choose_num_splits(s.batch, s.batch, s.kv_heads, s.ctx, self.sms)
        label = f"decode b{s.batch} ctx{s.ctx} {self.shape}"
        ms = bench_ms(self.attention_fn(b, 1), self.device)
        self.bw_row("attention", f"{label}, one launch", ms, moved, "target 70%+")
        ms = bench_ms(self.attention_fn(b, 4), self.device)
        self.bw_row(
            "attention", f"{label}, split 4 (forced)", ms, moved, f"heuristic picks {nsplit}"
        )
        with guarded(self.report, "attention", "torch backend decode"):
            be = TorchAttentionBackend(s.heads, s.kv_heads, s.head_dim, s.head_dim**-0.5)
            ms = bench_ms(lambda: be._decode(b.q, b.k_cache, b.v_cache, b.meta), self.device, 2, 5)
            self.bw_row("attention", f"{label}, torch backend", ms, moved, "for comparison")
        if not s.sweep:
            return
        results = []
        for tile_n, warps, stages in [
            (64, 4, 2),
            (32, 4, 2),
            (128, 4, 2),
            (64, 4, 3),
            (128, 8, 3),
            (64, 2, 2),
        ]:
            cfg = AttentionKernelConfig(tile_n=tile_n, num_warps=warps, num_stages=stages)
            t = bench_ms(self.attention_fn(b, 1, cfg), self.device)
            results.append((t, f"tile_n={tile_n} warps={warps} stages={stages}"))
        results.sort()
        self.bw_row(
            "attention",
            "decode tile sweep (one launch), best",
            results[0][0],
            moved,
            results[0][1] + "; all: " + ", ".join(f"{c} {fmt_time(t)}" for t, c in results),
        )

    def decode_split(self, nseq: int, ctx: int) -> None:
        """Few sequences, long contexts: where splitting the context should pay."""
        from gpu.kernels import choose_num_splits

        b = self.batch([1] * nseq, [ctx - 1] * nseq, 2 + nseq)
        moved = self.decode_bytes(b)
        nsplit = choose_num_splits(nseq, nseq, self.s.kv_heads, ctx, self.sms)
        t1 = bench_ms(self.attention_fn(b, 1), self.device)
        t2 = bench_ms(self.attention_fn(b, None), self.device)
        self.bw_row("attention", f"decode b{nseq} ctx{ctx}, one launch", t1, moved)
        self.bw_row(
            "attention",
            f"decode b{nseq} ctx{ctx}, heuristic ({nsplit} splits)",
            t2,
            moved,
            f"{t1 / t2:.2f}x vs one launch",
        )

    def prefill(self, label: str, qlens: list[int], ctxs: list[int], sdpa: bool) -> None:
        """TFLOP/s; for a fresh prompt also torch SDPA (FlashAttention) on the same shape."""
        import torch.nn.functional as F

        s = self.s
        b = self.batch(qlens, ctxs, 7)
        flops = self.attn_flops(qlens, ctxs)
        ms = bench_ms(self.attention_fn(b, 1), self.device)
        base, ratio = "", ""
        if sdpa and self.device.type == "cuda":
            group = s.heads // s.kv_heads
            q4 = b.q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            k4 = b.k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
            v4 = b.v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
            ms_ref = bench_ms(
                lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True), self.device
            )
            base = f"SDPA {flops / (ms_ref * 1e-3) / 1e12:.0f} TFLOP/s ({fmt_time(ms_ref)})"
            ratio = fmt_pct(ms_ref / ms)
        tflops = flops / (ms * 1e-3) / 1e12
        self.report.add(Row("attention", label, fmt_time(ms), f"{tflops:.1f} TFLOP/s", base, ratio))

    def prefill_sweep(self) -> None:
        from gpu.kernels import AttentionKernelConfig

        s = self.s
        b = self.batch([s.prefill_len], [0], 8)
        flops = self.attn_flops([s.prefill_len], [0])
        results = []
        for block_m, tile_n, warps, stages in [
            (64, 64, 4, 2),
            (128, 64, 8, 2),
            (64, 32, 4, 3),
            (128, 32, 8, 3),
            (64, 128, 4, 2),
        ]:
            cfg = AttentionKernelConfig(
                block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages
            )
            t = bench_ms(self.attention_fn(b, 1, cfg), self.device)
            results.append((t, f"block_m={block_m} tile_n={tile_n} warps={warps} stages={stages}"))
        results.sort()
        best = results[0][0]
        self.report.add(
            Row(
                "attention",
                "prefill tile sweep, best",
                fmt_time(best),
                f"{flops / (best * 1e-3) / 1e12:.1f} TFLOP/s",
                notes=results[0][1]
                + "; all: "
                + ", ".join(f"{c} {fmt_time(t)}" for t, c in results),
            )
        )

    def kv_write(self) -> None:
        from gpu.kernels import write_kv

        s = self.s
        b = self.batch([s.prefill_len], [0], 9)
        slots = b.meta.slot_mapping
        ms = bench_ms(lambda: write_kv(b.k, b.v, b.k_cache, b.v_cache, slots), self.device)
        moved = 2 * 2 * b.k.numel() * self.elem  # K and V, each read + written
        self.bw_row("kernels", f"kv write, {s.prefill_len} tokens", ms, moved)

    def rms_norm(self, tokens: int) -> None:
        import torch

        from gpu.kernels import rms_norm, rms_norm_reference

        h, dev = self.s.norm_hidden, self.device
        gen = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(tokens, h, device=dev, generator=gen).to(self.dtype)
        r = torch.randn(tokens, h, device=dev, generator=gen).to(self.dtype)
        w = torch.randn(h, device=dev, generator=gen).to(self.dtype)
        ms_k = bench_ms(lambda: rms_norm(x, w, 1e-5, residual=r), dev)
        ms_t = bench_ms(lambda: rms_norm_reference(x, w, 1e-5, residual=r), dev)
        moved = 4 * x.numel() * self.elem  # x, residual in; out, new residual out
        self.report.add(
            Row(
                "fused",
                f"rms_norm + residual, T={tokens} H={h}",
                fmt_time(ms_k),
                f"{moved / (ms_k * 1e-3) / 1e9:.0f} GB/s",
                f"torch {fmt_time(ms_t)}",
                f"{ms_t / ms_k:.2f}x",
                "speed-up over torch; worth using above 1",
            )
        )

    def rotary(self, tokens: int) -> None:
        import torch

        from gpu.kernels import apply_rotary, rotary_cos_sin_cache, rotary_reference

        s, dev = self.s, self.device
        d = s.head_dim
        gen = torch.Generator(device=dev).manual_seed(tokens + 1)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
        cos, sin = rotary_cos_sin_cache(inv, 8192)
        pos = torch.randint(0, 8192, (tokens,), device=dev, generator=gen)
        q = torch.randn(tokens, s.heads, d, device=dev, generator=gen).to(self.dtype)
        k = torch.randn(tokens, s.kv_heads, d, device=dev, generator=gen).to(self.dtype)
        ms_k = bench_ms(lambda: apply_rotary(q, k, cos, sin, pos), dev)
        ms_t = bench_ms(lambda: rotary_reference(q, k, cos, sin, pos), dev)
        moved = 2 * (q.numel() + k.numel()) * self.elem
        self.report.add(
            Row(
                "fused",
                f"rotary q+k in place, T={tokens} Hq{s.heads}/Hkv{s.kv_heads} d{d}",
                fmt_time(ms_k),
                f"{moved / (ms_k * 1e-3) / 1e9:.0f} GB/s",
                f"torch {fmt_time(ms_t)}",
                f"{ms_t / ms_k:.2f}x",
                "speed-up over torch; worth using above 1",
            )
        )


# --------------------------------------------------------------------------- part 3


def write_checkpoint(out_dir: Path, s: Sizes, device: Any) -> tuple[Path, int]:
    """A random-weight Llama checkpoint (config.json + model.safetensors); returns
    (dir, weight bytes).  No tokenizer: the runner does not need one."""
    import torch
    from safetensors.torch import save_file

    overrides = dict(s.model)
    try:
        from modelkit.make_model import build_config, state_dict_shapes

        cfg = build_config(
            "mid",
            "llama",
            vocab_size=overrides["vocab_size"],
            dtype="bfloat16",
            init_std=0.02,
            overrides=overrides,
        )
        shapes = state_dict_shapes(cfg)
    except ImportError:  # written by hand when the generator is missing
        cfg, shapes = _llama_config_and_shapes(overrides)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, device=device, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, device=device, generator=gen)
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"), {"format": "pt"})
    return out_dir, nbytes


def _llama_config_and_shapes(o: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    h, inter, heads = o["hidden_size"], o["intermediate_size"], o["num_attention_heads"]
    kvh, d, v = o["num_key_value_heads"], o["head_dim"], o["vocab_size"]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        **o,
    }
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (v, h)}
    for i in range(o["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * d, h),
            f"{p}.self_attn.k_proj.weight": (kvh * d, h),
            f"{p}.self_attn.v_proj.weight": (kvh * d, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * d),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    if not o.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return cfg, shapes


def decode_tokens_per_s(
    runner: Any, s: Sizes, batch: int, vocab: int, tag: str
) -> dict[str, float]:
    """Prefill `batch` prompts, then time decode steps; returns tokens/s and context."""
    import random

    from scheduler.contract import NewRequestData, ScheduledRequest, SchedulerOutput
    from scheduler.sampling_params import SamplingParams

    bs = runner.block_size
    total = s.e2e_prompt + s.e2e_warmup + s.e2e_steps + 1
    blocks_each = -(-total // bs)
    free = list(range(runner.num_kv_blocks))
    random.Random(batch).shuffle(free)  # scattered blocks, as after some serving
    rng = random.Random(1)
    ids = [f"{tag}-b{batch}-{i}" for i in range(batch)]
    tables = {rid: [free.pop() for _ in range(blocks_each)] for rid in ids}
    prompts = {rid: [rng.randrange(vocab) for _ in range(s.e2e_prompt)] for rid in ids}
    greedy = SamplingParams(temperature=0.0, max_tokens=None)

    def table(rid: str, upto: int) -> list[int]:  # blocks covering positions [0, upto)
        return tables[rid][: -(-upto // bs)]

    step = 0
    last: dict[str, int] = {}
    # Prefill in chunks of up to 16 prompts, like a token budget would.
    for i in range(0, batch, 16):
        group = ids[i : i + 16]
        out = runner.execute_model(
            SchedulerOutput(
                step=step,
                new_requests=[
                    NewRequestData(
                        req_id=r, prompt_len=s.e2e_prompt, token_ids=prompts[r], sampling=greedy
                    )
                    for r in group
                ],
                scheduled=[
                    ScheduledRequest(
                        req_id=r,
                        input_ids=prompts[r],
                        start_pos=0,
                        new_block_ids=table(r, s.e2e_prompt),
                        sample=True,
                    )
                    for r in group
                ],
                finished_req_ids=[],
            )
        )
        last.update(zip(out.req_ids, out.sampled_token_ids))
        step += 1
    pos = s.e2e_prompt
    elapsed = 0.0
    for k in range(s.e2e_warmup + s.e2e_steps):
        so = SchedulerOutput(
            step=step,
            new_requests=[],
            scheduled=[
                ScheduledRequest(
                    req_id=r,
                    input_ids=[last[r]],
                    start_pos=pos,
                    new_block_ids=table(r, pos + 1),
                    sample=True,
                )
                for r in ids
            ],
            finished_req_ids=[],
        )
        t0 = time.perf_counter()
        out = runner.execute_model(so)  # returns host ints: the step is complete
        if k >= s.e2e_warmup:
            elapsed += time.perf_counter() - t0
        last.update(zip(out.req_ids, out.sampled_token_ids))
        pos += 1
        step += 1
    runner.execute_model(
        SchedulerOutput(step=step, new_requests=[], scheduled=[], finished_req_ids=ids)
    )
    steps = s.e2e_steps
    return {
        "tok_s": batch * steps / elapsed,
        "ms_step": 1e3 * elapsed / steps,
        "avg_ctx": s.e2e_prompt + s.e2e_warmup + steps / 2,
    }


def part_e2e(report: Report, device: Any, s: Sizes, copy_bw: float | None) -> None:
    try:
        from gpu.model_runner import ModelRunner
    except Exception as e:
        report.add(
            Row("e2e", "decode tokens/s", notes=f"skipped: model runner not importable ({e})")
        )
        return
    import torch

    params = inspect.signature(ModelRunner).parameters
    tmp = Path(tempfile.mkdtemp(prefix="pagestream-gpucheck-"))
    try:
        t0 = time.perf_counter()
        ckpt, weight_bytes = write_checkpoint(tmp / "model", s, device)
        cfgd = dict(s.model)
        n_params = weight_bytes / 2
        print(f"  checkpoint: {n_params / 1e9:.2f}B params, {time.perf_counter() - t0:.0f}s")
        kv_per_token = 2 * cfgd["num_hidden_layers"] * cfgd["num_key_value_heads"]
        kv_per_token *= cfgd["head_dim"] * 2  # bytes, bf16
        block_size = 16
        per_req = -(-(s.e2e_prompt + s.e2e_warmup + s.e2e_steps + 2) // block_size)
        num_blocks = per_req * max(s.e2e_batches) + 16
        for graphs in (False, True):
            mode = "CUDA graphs" if graphs else "eager"
            if graphs and "cuda_graphs" not in params:
                report.add(
                    Row(
                        "e2e",
                        f"decode, {mode}",
                        notes="skipped: the runner has no cuda_graphs option",
                    )
                )
                continue
            if graphs and device.type != "cuda":
                continue
            kwargs: dict[str, Any] = dict(
                dtype="bfloat16",
                device=str(device),
                block_size=block_size,
                num_kv_blocks=num_blocks,
                attention_backend="triton",
            )
            if "max_num_batched_tokens" in params:
                kwargs["max_num_batched_tokens"] = 16 * s.e2e_prompt
            if "cuda_graphs" in params:
                kwargs["cuda_graphs"] = graphs
            with guarded(report, "e2e", f"runner ({mode})"):
                runner = ModelRunner(ckpt, **kwargs)
                try:
                    for b in s.e2e_batches:
                        with guarded(report, "e2e", f"decode b{b} {mode}"):
                            r = decode_tokens_per_s(runner, s, b, cfgd["vocab_size"], mode[:5])
                            bytes_step = weight_bytes + b * r["avg_ctx"] * kv_per_token
                            roof = b / (bytes_step / copy_bw) if copy_bw else 0.0
                            report.add(
                                Row(
                                    "e2e",
                                    f"decode b{b}, {mode}, {n_params / 1e9:.2f}B Llama bf16",
                                    f"{r['ms_step']:.2f} ms/step",
                                    f"{r['tok_s']:.0f} tok/s",
                                    f"roofline {roof:.0f} tok/s" if roof else "",
                                    fmt_pct(r["tok_s"] / roof) if roof else "",
                                    f"weights {weight_bytes / 1e9:.2f} GB + KV at ctx "
                                    f"~{r['avg_ctx']:.0f}, read once per step",
                                )
                            )
                finally:
                    del runner
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="pagestream GPU check (see module docstring)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run")
    ap.add_argument("--skip", action="append", default=[], choices=["tests", "kernels", "e2e"])
    ap.add_argument("--tests-timeout", type=int, default=170, help="seconds for part 1")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = ap.parse_args(argv)

    dry = args.device == "cpu"
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch
    import triton

    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for a dry run of the harness")
        return 2
    device = torch.device(args.device)
    sizes = DRY_SIZES if dry else Sizes()
    report = Report()
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
    else:
        card = platform.processor() or platform.machine() or "cpu"
    report.header = {
        "card": card + (" (dry run: interpreter, toy sizes, numbers meaningless)" if dry else ""),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
    }
    t_start = time.perf_counter()
    print(f"gpu_check on {card}")
    if "tests" not in args.skip:
        print("[1/3] kernel tests")
        report.tests_ok = False  # until part_tests says otherwise
        with guarded(report, "tests", "kernel tests"):
            part_tests(report, device, args.tests_timeout)
    copy_bw = None
    if "kernels" not in args.skip:
        print("[2/3] kernel measurements")
        with guarded(report, "kernels", "kernel measurements"):
            copy_bw = KernelBench(report, device, sizes).run()
    if "e2e" not in args.skip:
        print("[3/3] end-to-end decode")
        with guarded(report, "e2e", "end-to-end decode"):
            part_e2e(report, device, sizes, copy_bw)
    report.header["runtime"] = f"{time.perf_counter() - t_start:.0f} s"

    md = report.markdown()
    out = args.out
    if out is None:
        out = Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT") else None
    if out is None:
        out = ROOT / "bench" / "results" / ("gpu_check_dry.md" if dry else "gpu_check.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print()
    print(md)
    print(f"written to {out}")
    return 0 if report.tests_ok else 1


if __name__ == "__main__":
    sys.exit(main())
