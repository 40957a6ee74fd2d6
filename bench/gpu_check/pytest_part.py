"""Part 1: the kernel and backend tests, natively at real sizes; pass/fail/skip counts."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.gpu_check.common import ROOT, Report, Row


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
