"""`pagestream bench serve`'s metrics: the summary of a run and its table (vLLM's names and
layout)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.serve_workload import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


# ----------------------------------------------------------------------------- metrics
def _pct_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def summarize(
    results: Sequence[RequestResult], duration: float, percentiles: Sequence[float]
) -> dict[str, Any]:
    """Aggregate metrics of a run, vLLM's names: throughputs, and for ttft/tpot/itl/e2el
    the mean, median, std and the given percentiles in ms (0 when there is no sample)."""
    ok = [r for r in results if r.success]
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    for name, xs in samples.items():
        ms = np.asarray(xs, dtype=np.float64) * 1000.0
        have = ms.size > 0
        out[f"mean_{name}_ms"] = float(ms.mean()) if have else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if have else 0.0
        out[f"std_{name}_ms"] = float(ms.std()) if have else 0.0
        for p in percentiles:
            out[f"{_pct_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if have else 0.0
    return out


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table (vLLM's layout)."""
    width = 50

    def rule(title: str, c: str) -> str:
        return f"{title:{c}^{width}}"

    def row(label: str, value: Any) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {v}"

    lines = [
        rule(" Serving Benchmark Result ", "="),
        row("Backend:", result["backend"]),
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Maximum request concurrency:", result["max_concurrency"]),
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        lines.append(rule(title, "-"))
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in result["percentiles"]:
            if p != 50:  # the median already says it
                key = _pct_key(p)
                lines.append(row(f"{key.upper()} {short} (ms):", result[f"{key}_{name}_ms"]))
    lines.append("=" * width)
    errors = result.get("errors") or []
    distinct = sorted({e for e in errors if e})
    if distinct:
        lines.append(f"Errors ({len(distinct)} distinct, first 5):")
        lines += [f"  {e[:200]}" for e in distinct[:5]]
    return "\n".join(lines)
