"""Shared pieces of the GPU check: the report table, the sizes, the timer."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

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


def bench_ms(
    fn: Callable[[], Any], device: Any, warmup: int = 5, iters: int = 20, burst: int = 8
) -> float:
    """Median milliseconds per call (CUDA events on a GPU, wall clock elsewhere).

    On a GPU each sample times `burst` calls queued back to back: with one call between
    two events, a short kernel is timed with the host's launch latency in it (the same
    case read far apart from one row to the next)."""
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
            for _ in range(burst):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / burst)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]
