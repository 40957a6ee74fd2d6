"""The serving comparison's table, verdict and charts, from small synthetic results."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from bench import charts
from bench.serve_vllm import rows_for, slim, tree_cpu_seconds, verdict


def _run(tput: float, ttft99: float, tpot99: float, itl: float = 40.0) -> dict:
    return {
        "request_throughput": tput / 100,
        "output_throughput": tput,
        "p50_ttft_ms": ttft99 / 3,
        "p99_ttft_ms": ttft99,
        "p50_tpot_ms": tpot99 * 0.7,
        "p99_tpot_ms": tpot99,
        "p50_itl_ms": itl,
        "p99_itl_ms": itl * 2,
        "mean_concurrency": tput / 50,
        "cpu_ms_per_token": 10.0 if ttft99 < 600 else 12.0,
        "ttfts": [0.1, 0.2],  # per-request arrays must not reach the chart data
        "failed": 0,
    }


RESULTS = {
    "pagestream": {
        ("rate", 1.0): _run(90, 300, 60),
        ("rate", 2.0): _run(180, 500, 80),
        ("rate", 4.0): _run(300, 900, 130),
        ("conc", 1.0): _run(40, 50, 25),
        ("conc", 8.0): _run(250, 400, 70),
    },
    "vLLM": {
        ("rate", 1.0): _run(90, 280, 55),
        ("rate", 2.0): _run(175, 600, 95),
        ("rate", 4.0): _run(290, 1000, 140),
        ("conc", 1.0): _run(45, 40, 22),
        ("conc", 8.0): _run(240, 450, 72),
    },
}


def test_verdict_picks_highest_rate_under_the_slo():
    rate, met, line = verdict(RESULTS["pagestream"], RESULTS["vLLM"], 100.0)
    assert rate == 2.0 and met  # 4 req/s breaks vLLM's p99 TPOT
    assert "MET" in line and "180.0 vs vLLM 175.0" in line
    # A stricter SLO lands on 1 req/s, where pagestream's p99 TTFT is worse.
    rate, met, line = verdict(RESULTS["pagestream"], RESULTS["vLLM"], 60.0)
    assert rate == 1.0 and not met and "NOT MET" in line
    assert verdict(RESULTS["pagestream"], RESULTS["vLLM"], 10.0)[0] is None


def test_rows_have_ratios_between_the_servers():
    rows = rows_for(RESULTS)
    assert [r[0] for r in rows[:3]] == ["1 req/s"] * 3  # rates first, then closed loop
    ratio = next(r for r in rows if r[0] == "2 req/s" and r[1] == "pagestream / vLLM")
    assert ratio[3] == f"{180 / 175:.2f}x"
    assert ratio[4] == f"{(500 / 3) / 200:.2f}x / {500 / 600:.2f}x"
    assert ratio[7] == f"{10 / 12:.2f}x"  # server CPU per token
    assert rows[-1][0] == "8 in flight"


def test_tree_cpu_seconds_counts_children():
    """A process that burns 0.3 s of CPU and starts a child that burns 0.3 s more: the
    tree's CPU time counts both."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = f"{busy}time.sleep(60)\n"
    parent = f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
    proc = subprocess.Popen([sys.executable, "-c", parent + busy + "time.sleep(60)\n"])
    try:
        deadline = time.monotonic() + 60
        while (tree_cpu_seconds(proc.pid) or 0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        # Both 0.3 s spins (and interpreter start-ups) counted; the parent alone cannot
        # reach 0.6 s before it sleeps.
        assert tree_cpu_seconds(proc.pid) >= 0.6
    finally:
        for p in children_of(proc.pid):
            os.kill(p, signal.SIGKILL)
        proc.kill()
        proc.wait()


def children_of(pid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(e))
    return out


def _png_chunks(data: bytes) -> list[bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, kind
        kinds.append(kind)
        pos += 12 + n
    return kinds


def test_charts_are_valid_pngs(tmp_path):
    data = slim("float32", RESULTS)
    assert all("ttfts" not in p for runs in data["servers"].values() for p in runs)
    paths = charts.write_charts(data, tmp_path, "test CPU (avx512f)")
    assert [p.name for p in paths] == ["serve_throughput.png", "serve_latency.png"]
    for p in paths:
        raw = p.read_bytes()
        kinds = _png_chunks(raw)
        assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
        width, height = struct.unpack(">II", raw[16:24])
        assert width >= 600 and height >= 400
    # Without closed-loop points the throughput chart falls back to the Poisson runs.
    rates_only = {k: {kk: v for kk, v in r.items() if kk[0] == "rate"} for k, r in RESULTS.items()}
    p = charts.throughput_chart(slim("bfloat16", rates_only), tmp_path)
    assert _png_chunks(p.read_bytes())[-1] == b"IEND"


def _engine(name: str, seconds: list[float], useful: int = 1000) -> dict:
    med = sorted(seconds)[len(seconds) // 2] if len(seconds) % 2 else sum(seconds) / 2
    return {"name": name, "label": f"{name} label", "seconds": seconds,
            "tok_s": [useful / s for s in seconds], "median_tok_s": useful / med}  # fmt: skip


OFFLINE = {
    "workload": "8 requests, prompts 32-64, outputs 8-16 tokens, greedy, ignore_eos",
    "model": "small",
    "threads": 2,
    "reps": 2,
    "useful_tokens": 1000,
    "cpu": "test CPU (avx512f)",
    "dtypes": [
        {"dtype": "bfloat16", "native": True, "load": [0.5, 1.5], "engines": [
            _engine("transformers", [10.0, 12.0]), _engine("pagestream", [3.0, 4.0]),
            _engine("vLLM compiled", [3.5, 3.2]), _engine("vLLM eager", [4.0, 4.4])]},
        {"dtype": "float32", "native": False, "load": [1.5, 2.0], "engines": [
            _engine("transformers", [20.0, 21.0]), _engine("pagestream", [6.0, 5.0]),
            {"name": "vLLM compiled", "label": "vLLM compiled", "failed": "OSError()"},
            _engine("vLLM eager", [7.0, 7.5])]},
    ],
}  # fmt: skip


def _assert_png(p: Path, min_w: int = 600, min_h: int = 400) -> None:
    raw = p.read_bytes()
    kinds = _png_chunks(raw)
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height = struct.unpack(">II", raw[16:24])
    assert width >= min_w and height >= min_h


def _legends(monkeypatch) -> list[list[str]]:
    """Records every chart's legend labels as the chart is saved."""
    seen: list[list[str]] = []
    save = charts._save

    def spy(fig, path, *a, **k):
        seen.extend([t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes)
        return save(fig, path, *a, **k)

    monkeypatch.setattr(charts, "_save", spy)
    return seen


def test_offline_chart_draws_every_engine_and_dtype(tmp_path, monkeypatch):
    legends = _legends(monkeypatch)
    p = charts.offline_chart(OFFLINE, tmp_path / "sub", "ignored: the data names its CPU")
    assert p == tmp_path / "sub" / "offline_throughput.png"
    _assert_png(p)
    # One legend entry per engine, though vLLM compiled failed for float32.
    assert legends == [["transformers", "pagestream", "vLLM compiled", "vLLM eager"]]
    # Nothing measured (every engine failed, or no dtype finished): no chart.
    failed = {"dtypes": [{"dtype": "float32", "engines": [OFFLINE["dtypes"][1]["engines"][2]]}]}
    assert charts.offline_chart(failed, tmp_path) is None
    assert charts.offline_chart({"dtypes": []}, tmp_path) is None


def test_serving_charts_show_both_servers(tmp_path, monkeypatch):
    legends = _legends(monkeypatch)
    charts.write_charts(slim("bfloat16", RESULTS), tmp_path)
    assert {lab.split(",")[0].split()[0] for lab in legends[0]} == {"pagestream", "vLLM"}
    assert {lab.split()[0] for ax in legends[1:] for lab in ax} == {"pagestream", "vLLM"}
    assert charts.write_charts(slim("bfloat16", {}), tmp_path / "none") == []


def test_bench_run_writes_json_and_charts(tmp_path, monkeypatch):
    """bench.run's last step: the JSON of the sections that ran and their charts; then
    `python -m bench.charts DIR` redraws them from that JSON alone."""
    import json

    from bench import run

    monkeypatch.setattr(run, "RESULTS", tmp_path)
    args = run.build_parser().parse_args(["--charts-dir", str(tmp_path / "png")])
    run.write_charts(args)  # no chartable section ran: nothing written
    assert list(tmp_path.iterdir()) == []
    args.offline_results = OFFLINE
    run.write_charts(args)
    assert json.loads((tmp_path / "offline.json").read_text()) == OFFLINE
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["offline_throughput.png"]
    args.serve_compare = slim("float32", RESULTS)
    run.write_charts(args)
    names = {"offline_throughput.png", "serve_throughput.png", "serve_latency.png"}
    assert {p.name for p in (tmp_path / "png").iterdir()} == names
    assert charts.main([str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert {p.name for p in (tmp_path / "again").iterdir()} == names
    for p in (tmp_path / "again").iterdir():
        _assert_png(p)


def test_offline_table_rows_from_records():
    from bench.offline import table_rows

    recs = OFFLINE["dtypes"][1]["engines"]
    rows = table_rows(recs, 1000, "/vllm/python")
    assert rows[0] == ["transformers label", "20.5 (20.0, 21.0)", "49", "1.00x", "-"]
    assert rows[1][0] == "**pagestream label**" and rows[1][3] == f"{20.5 / 5.5:.2f}x"
    assert rows[2][0].startswith("vLLM compiled FAILED") and rows[2][1:] == ["", "", "", "-"]
    rows = table_rows(OFFLINE["dtypes"][0]["engines"], 1000, None)
    assert all(len(r) == 4 for r in rows) and rows[2][3] == f"{11.0 / 3.35:.2f}x"


def test_every_load_has_its_own_prompts_and_none_is_the_warm_ups():
    """A load replaying another's prompts measures the prefix cache, not the server."""
    import argparse

    from bench.serve_vllm import WARMUP_SEED, _config, load_plan
    from bench.serve_workload import random_requests

    args = argparse.Namespace(
        cmp_rates="0.5,1,2", cmp_concurrency="1,4", cmp_prompts=48, cmp_input=160,
        cmp_output=96, cmp_range=0.33, cmp_warmup=4,
    )  # fmt: skip
    plan = load_plan(args)
    assert [(k, x) for k, x, _ in plan] == [
        ("rate", 0.5), ("rate", 1.0), ("rate", 2.0), ("conc", 1.0), ("conc", 4.0)
    ]  # fmt: skip
    # Repetitions replay the same loads, each on arrivals and prompts of its own.
    again = load_plan(args, rep=1)
    assert [(k, x) for k, x, _ in again] == [(k, x) for k, x, _ in plan]
    plan += again

    def heads(kind: str, x: float, seed: int, n: int | None = None) -> set[tuple[int, ...]]:
        c = _config(args, "http://x", kind, x, seed=seed)
        reqs = random_requests(
            n or c.num_prompts, c.input_len, c.output_len, c.range_ratio, 49152, 0, c.seed
        )
        return {tuple(r.prompt[:16]) for r in reqs}

    sets = [heads(k, x, s) for k, x, s in plan] + [heads("conc", 4, WARMUP_SEED, 4)]
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            assert not a & b


def test_repetitions_pool_every_request_into_one_sample():
    """p99 over all the runs' requests, not a mean of per-run p99s; throughput as all the
    tokens over all the time; each run's p99 kept to show the spread."""
    import numpy as np

    from bench.serve_stats import summarize
    from bench.serve_vllm import pool
    from bench.serve_workload import RequestResult

    rng = np.random.default_rng(0)
    runs, everyone = [], []
    for i in range(3):
        reqs = [
            RequestResult(
                success=True,
                prompt_len=100,
                output_tokens=int(n),
                ttft=float(t),
                itl=[0.05] * (int(n) - 1),
                e2e=float(t) + 0.05 * (int(n) - 1),
            )
            for t, n in zip(rng.uniform(0.1, 2.0, 48), rng.integers(64, 128, 48), strict=True)
        ]
        everyone += reqs
        rec = summarize(reqs, 10.0 + i, [50, 99]) | {
            "percentiles": [50, 99],
            "input_lens": [r.prompt_len for r in reqs],
            "output_lens": [r.output_tokens for r in reqs],
            "ttfts": [r.ttft for r in reqs],
            "itls": [r.itl for r in reqs],
            "e2els": [r.e2e for r in reqs],
            "errors": [""] * len(reqs),
            "cpu_seconds": 5.0,
        }
        runs.append(rec)
    out = pool(runs)
    ttfts_ms = np.array([r.ttft for r in everyone]) * 1e3
    assert out["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 99))
    assert out["p99_ttft_ms"] != pytest.approx(np.mean([r["p99_ttft_ms"] for r in runs]))
    tokens = sum(r.output_tokens for r in everyone)
    assert out["output_throughput"] == pytest.approx(tokens / 33.0)
    assert out["completed"] == 144 and out["runs"] == 3
    assert out["p99_ttft_ms_runs"] == [r["p99_ttft_ms"] for r in runs]
    assert out["cpu_ms_per_token"] == pytest.approx(15.0 * 1e3 / tokens)
    assert pool(runs[:1]) is runs[0]
    # The verdict names every run's own p99 beside the pooled one.
    a = {("rate", 8.0): out}
    b = {("rate", 8.0): out | {"p99_tpot_ms": 90.0}}
    rate, met, line = verdict(a, b, 100.0)
    assert rate == 8.0 and met and "over 3 runs pooled" in line
