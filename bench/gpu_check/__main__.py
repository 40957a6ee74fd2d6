"""`python -m bench.gpu_check`: run the four parts and write the markdown table."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_check.common import DRY_SIZES, ROOT, Report, Sizes, guarded
from bench.gpu_check.e2e import part_e2e
from bench.gpu_check.kernels import KernelBench
from bench.gpu_check.pytest_part import part_engine, part_tests


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="pagestream GPU check (see module docstring)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run")
    ap.add_argument(
        "--skip", action="append", default=[], choices=["tests", "kernels", "e2e", "engine"]
    )
    ap.add_argument("--tests-timeout", type=int, default=170, help="seconds for part 1")
    ap.add_argument("--engine-timeout", type=int, default=300, help="seconds for part 4")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write")
    return ap.parse_args(argv)


def _card(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _header(card: str, dry: bool) -> dict[str, str]:
    import torch
    import triton

    return {
        "card": card + (" (dry run: interpreter, toy sizes, numbers meaningless)" if dry else ""),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
    }


def _run_parts(report: Report, args: argparse.Namespace, device: Any, sizes: Sizes) -> None:
    if "tests" not in args.skip:
        print("[1/4] kernel tests")
        report.tests_ok = False  # until part_tests says otherwise
        with guarded(report, "tests", "kernel tests"):
            part_tests(report, device, args.tests_timeout)
    copy_bw = None
    if "kernels" not in args.skip:
        print("[2/4] kernel measurements")
        with guarded(report, "kernels", "kernel measurements"):
            copy_bw = KernelBench(report, device, sizes).run()
    if "e2e" not in args.skip:
        print("[3/4] end-to-end decode")
        with guarded(report, "e2e", "end-to-end decode"):
            part_e2e(report, device, sizes, copy_bw)
    if "engine" not in args.skip:
        print("[4/4] engine and server tests")
        with guarded(report, "engine", "engine + server tests"):
            part_engine(report, device, args.engine_timeout)


def _out_path(args: argparse.Namespace, dry: bool) -> Path:
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.md"
    return ROOT / "bench" / "results" / ("gpu_check_dry.md" if dry else "gpu_check.md")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dry = args.device == "cpu"
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for a dry run of the harness")
        return 2
    device = torch.device(args.device)
    report = Report()
    card = _card(device)
    report.header = _header(card, dry)
    t_start = time.perf_counter()
    print(f"gpu_check on {card}")
    _run_parts(report, args, device, DRY_SIZES if dry else Sizes())
    report.header["runtime"] = f"{time.perf_counter() - t_start:.0f} s"

    md = report.markdown()
    out = _out_path(args, dry)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print()
    print(md)
    print(f"written to {out}")
    return 0 if report.tests_ok else 1


if __name__ == "__main__":
    sys.exit(main())
