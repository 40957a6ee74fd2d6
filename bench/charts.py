"""PNG charts of a `make bench` run, written beside its markdown: serving throughput vs
requests in flight, and TTFT / ITL percentiles vs offered request rate, one line per server
(section serve_vllm); offline useful tokens/s per engine and dtype (section offline).

Inputs are the JSON-ready summaries `bench.serve_vllm.slim` and `bench.offline.run` build
(also written to `serve_compare.json` and `offline.json`), so the charts can be redrawn
from a saved run without re-measuring: `python -m bench.charts [results dir]`.
matplotlib is imported lazily and drawn with the Agg backend (no display needed).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

# One colour per server or engine, the same in every chart.
COLOURS = {
    "pagestream": "#1f77b4",
    "vLLM": "#d62728",
    "vLLM compiled": "#d62728",
    "vLLM eager": "#ff9896",
    "transformers": "#7f7f7f",
}
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
    """The serving charts, when a server has results; returns the files written."""
    if not data.get("servers"):
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [throughput_chart(data, out, cpu), latency_chart(data, out, cpu)]


def offline_chart(data: dict[str, Any], out: Path, cpu: str = "") -> Path | None:
    """Grouped bars: useful tokens/s (median of the alternated runs) per engine, one group
    per dtype, each run as a dot on its bar so the spread shows. None without results."""
    groups = [g for g in data.get("dtypes", []) if any("tok_s" in e for e in g["engines"])]
    if not groups:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(e["name"] for g in groups for e in g["engines"] if "tok_s" in e))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 + 0.85 * len(names) * len(groups)), 4.6))
    _offline_bars(ax, groups, names)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g["dtype"] + (" (native)" if g.get("native") else "") for g in groups])
    ax.set_ylabel("useful output tokens/s")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
    head = f"Offline throughput: {data.get('model', '')}, {data.get('threads', '?')} threads"
    width = int(fig.get_figwidth() * 13)  # characters of a 9-point title per figure inch
    ax.set_title(textwrap.fill(f"{head}; {data.get('workload', '')}", width), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    loads = "; ".join(f"{g['dtype']} load average {g['load'][0]:.1f} -> {g['load'][1]:.1f}"
                      for g in groups if g.get("load"))  # fmt: skip
    failed = [
        f"{e['name']} ({g['dtype']})" for g in data["dtypes"] for e in g["engines"] if "failed" in e
    ]
    note = f"bars: median of {data.get('reps', '?')} alternated runs, dots: each run; {loads}"
    note += f"; failed: {', '.join(failed)}" if failed else ""
    _footer(fig, f"{data.get('cpu') or cpu}\n{note}")
    out.mkdir(parents=True, exist_ok=True)
    return _save(fig, out / "offline_throughput.png", bottom=0.07)


def _offline_bars(ax: Any, groups: list[dict[str, Any]], names: list[str]) -> None:
    """One bar per engine inside each dtype's group, its median written on it."""
    width = 0.8 / len(names)
    labelled: set[str] = set()
    for gi, g in enumerate(groups):
        for j, name in enumerate(names):
            e = next((e for e in g["engines"] if e["name"] == name and "tok_s" in e), None)
            if e is None:  # this engine failed for this dtype: a gap, named in the footer
                continue
            x = gi + (j - (len(names) - 1) / 2) * width
            label = None if name in labelled else name
            labelled.add(name)
            ax.bar(x, e["median_tok_s"], width * 0.9, color=_colour(name, j), label=label)
            ax.plot([x] * len(e["tok_s"]), e["tok_s"], "o", color="black", ms=3.5, zorder=3)
            # Halfway up the bar: the dots cluster near its top, and a figure above the
            # highest dot would read as that run's.
            ax.text(x, e["median_tok_s"] / 2, f"{e['median_tok_s']:.0f}", ha="center",
                    va="center", fontsize=8, color="white", fontweight="bold")  # fmt: skip
        if g.get("floor_tok_s"):
            # The most any engine computing exact logits could reach: the workload's FLOPs
            # at the GEMM rate measured in the same run (bench/roofline.py).
            ax.hlines(g["floor_tok_s"], gi - 0.45, gi + 0.45, colors="black", linestyles="--",
                      linewidth=1, label=None if gi else "ceiling (FLOPs or bytes)")  # fmt: skip


def _footer(fig: Any, cpu: str) -> None:
    if cpu:
        fig.text(0.01, 0.01, cpu, fontsize=7, color="#555555", va="bottom", linespacing=1.3)


def _save(fig: Any, path: Path, bottom: float = 0.03) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, bottom, 1, 1))
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


def draw_all(serve: dict[str, Any] | None, offline: dict[str, Any] | None, out: Path,
             cpu: str = "") -> list[Path]:  # fmt: skip
    """Every chart the sections that ran support; returns the files written."""
    paths = write_charts(serve, out, cpu) if serve else []
    p = offline_chart(offline, out, cpu) if offline else None
    return paths + ([p] if p else [])


def main(argv: list[str] | None = None) -> int:
    """Redraws the charts from a results dir's serve_compare.json / offline.json."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench.charts", description=main.__doc__)
    ap.add_argument("results", nargs="?", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--out", default=None, help="PNGs here (default: the results dir)")
    args = ap.parse_args(argv)
    src = Path(args.results)
    saved = [src / "serve_compare.json", src / "offline.json"]
    serve, offline = (json.loads(f.read_text()) if f.is_file() else None for f in saved)
    for p in draw_all(serve, offline, Path(args.out or src), cpu_label()):
        print(f"(chart written to {p})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
