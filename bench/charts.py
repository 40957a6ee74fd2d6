"""PNG charts of a `make bench` run, written beside its markdown: serving throughput vs
requests in flight, and TTFT / ITL percentiles vs offered request rate, one line per server.

Input is the JSON-ready summary `bench.serve_vllm.slim` builds (also written to
`serve_compare.json`), so a chart can be redrawn from a saved run without re-measuring.
matplotlib is imported lazily and drawn with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# One colour per server, the same in every chart.
COLOURS = {"pagestream": "#1f77b4", "vLLM": "#d62728"}
_FALLBACK = ("#2ca02c", "#9467bd", "#8c564b", "#7f7f7f")


def _colour(name: str, i: int) -> str:
    return COLOURS.get(name, _FALLBACK[i % len(_FALLBACK)])


def _points(runs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if r["kind"] == kind), key=lambda r: r["x"])


def throughput_chart(data: dict[str, Any], out: Path, cpu: str = "") -> Path:
    """Output tokens/s against requests in flight: the closed-loop points (N in flight),
    and the Poisson runs at their measured mean concurrency (Little's law)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for i, (name, runs) in enumerate(data["servers"].items()):
        closed = _points(runs, "conc")
        if closed:
            ax.plot([p["x"] for p in closed], [p["output_throughput"] for p in closed], "o-",
                    color=_colour(name, i), label=f"{name}, N in flight")  # fmt: skip
        open_ = sorted(_points(runs, "rate"), key=lambda r: r.get("mean_concurrency", 0))
        if open_:
            ax.plot([p.get("mean_concurrency", 0.0) for p in open_],
                    [p["output_throughput"] for p in open_], "^:", color=_colour(name, i),
                    label=f"{name}, Poisson (mean in flight)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Serving throughput vs concurrency ({data.get('dtype', '')})", fontsize=10)
    _footer(fig, cpu)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "serve_throughput.png")


def latency_chart(data: dict[str, Any], out: Path, cpu: str = "") -> Path:
    """TTFT and ITL, p50 (solid) and p99 (dashed), against the offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    for ax, metric, title in zip(axes, ("ttft", "itl"), ("TTFT", "inter-token latency")):
        for i, (name, runs) in enumerate(data["servers"].items()):
            pts = _points(runs, "rate")
            xs = [p["x"] for p in pts]
            for pct, style in (("p50", "o-"), ("p99", "s--")):
                ys = [p[f"{pct}_{metric}_ms"] for p in pts]
                ax.plot(xs, ys, style, color=_colour(name, i), label=f"{name} {pct}")
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title} vs request rate ({data.get('dtype', '')})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _footer(fig, cpu)
    return _save(fig, out / "serve_latency.png")


def write_charts(data: dict[str, Any], out: Path, cpu: str = "") -> list[Path]:
    """Every chart the data supports; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    return [throughput_chart(data, out, cpu), latency_chart(data, out, cpu)]


def _footer(fig: Any, cpu: str) -> None:
    if cpu:
        fig.text(0.01, 0.01, cpu, fontsize=7, color="#555555")


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def cpu_label() -> str:
    """The CPU's model name and the vector features that decide its speed, for a footer."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and not name:
                name = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(feats) or 'no AVX2'})"
