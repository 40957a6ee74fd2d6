"""Parts 1 and 4: pytest natively on the device; pass/fail/skip counts as table rows.

Part 1 runs the kernel and backend tests at real sizes.  Part 4 runs the engine and the
server on the device: the engine's greedy parity with transformers (the engine picks CUDA
when it is there; the oracle runs on the CPU) and the service tests over real HTTP and
WebSocket clients.  The interpreter cannot stand in for either: only a device run shows
device mismatches in the Python around the kernels and GEMM choices that change tokens.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_check.common import ROOT, Report, Row

KERNEL_TESTS = ("tests/gpu/test_kernels.py", "tests/gpu/test_triton_backend.py")

# Part 4 on a GPU: what a chat service runs, end to end, on the device.
ENGINE_TESTS = (
    "tests/gpu/test_cuda_graphs.py",
    "tests/gpu/test_triton_model.py",
    "tests/gpu/test_kv_quant.py",
    "tests/e2e/test_engine_parity.py",
    "tests/e2e/test_spec_parity.py",
    "tests/service/test_openai_api.py",
    "tests/service/test_structured_api.py",
    "tests/service/test_websocket.py",
    "tests/service/test_spec_serving.py",
    "tests/service/test_tool_calls.py",
    "tests/service/test_quant_server.py",
    # serve's CUDA default: the engine in a child process (its parity with inline and the
    # thread, and its death).
    "tests/service/test_engine_process.py::test_process_engine_serves_what_inline_and_thread_serve",
    "tests/service/test_engine_process.py::test_engine_process_death_fails_streams_and_health",
)
# The dry run only checks the harness: one quick file, no model.
ENGINE_TESTS_DRY = ("tests/service/test_stop_matcher.py",)

# Imported by the engine tests but not by pagestream itself: a device image may lack them
# (carry them as wheels; docs/PERFORMANCE.md, "GPU check").
ENGINE_TEST_MODULES = ("openai", "websockets", "jsonschema", "pytest_asyncio", "transformers")


@dataclass
class PytestResult:
    seconds: float
    returncode: int | None  # None: timed out
    per_file: dict[str, list[int]] = field(default_factory=dict)  # file -> [pass, fail, skip]
    failed: list[tuple[str, str]] = field(default_factory=list)  # (file, test)
    tail: list[str] = field(default_factory=list)

    @property
    def total(self) -> list[int]:
        return [sum(c[i] for c in self.per_file.values()) for i in range(3)]


def run_pytest(files: tuple[str, ...], env: dict[str, str], timeout_s: int) -> PytestResult:
    """pytest on `files` in a subprocess; counts per file from its JUnit report."""
    with tempfile.TemporaryDirectory() as d:
        xml_path = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"]
        cmd.append(f"--junitxml={xml_path}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return PytestResult(time.perf_counter() - t0, None)
        res = PytestResult(time.perf_counter() - t0, proc.returncode)
        res.tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        if xml_path.exists():
            _count(ET.parse(xml_path).getroot(), res)
    return res


def _count(root: ET.Element, res: PytestResult) -> None:
    for case in root.iter("testcase"):
        # classname "tests.e2e.test_spec_parity" -> "tests/e2e/test_spec_parity.py"
        path = case.get("classname", "?").replace(".", "/") + ".py"
        counts = res.per_file.setdefault(path, [0, 0, 0])
        if case.find("failure") is not None or case.find("error") is not None:
            counts[1] += 1
            res.failed.append((path, case.get("name", "?")))
        elif case.find("skipped") is not None:
            counts[2] += 1
        else:
            counts[0] += 1


def _counts_text(c: list[int]) -> str:
    return f"{c[0]} passed, {c[1]} failed, {c[2]} skipped"


def _device_env(device: Any) -> dict[str, str]:
    env = dict(os.environ)
    if device.type == "cuda":
        env["PAGESTREAM_GPU_CHECK"] = "1"
        env.pop("TRITON_INTERPRET", None)
    return env


def _reported(report: Report, part: str, case: str, res: PytestResult, timeout_s: int) -> bool:
    """Prints the run's tail; False (and a failed check, with a row saying why) where
    pytest timed out or left no report."""
    if res.returncode is None:
        note = f"timed out >{timeout_s}s"
    else:
        print("\n".join("    " + line for line in res.tail))
        if res.per_file:
            return True
        note = f"pytest rc={res.returncode}, no report"
    report.tests_ok = False
    report.add(Row(part, case, notes=note))
    return False


def part_tests(report: Report, device: Any, timeout_s: int) -> None:
    res = run_pytest(KERNEL_TESTS, _device_env(device), timeout_s)
    case = "kernel + backend tests" + (", real sizes" if device.type == "cuda" else "")
    if not _reported(report, "tests", case, res, timeout_s):
        return
    total = res.total
    report.tests_ok = total[1] == 0 and res.returncode == 0
    notes = ("failed: " + ", ".join(name for _, name in res.failed[:8])) if res.failed else ""
    report.add(
        Row("tests", case, time=f"{res.seconds:.0f} s", achieved=_counts_text(total), notes=notes)
    )


def part_engine(report: Report, device: Any, timeout_s: int) -> None:
    """Part 4: one row per test file; a failure fails the check like a kernel test's."""
    case = "engine + server tests"
    missing = [m for m in ENGINE_TEST_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        report.add(Row("engine", case, notes="not run: missing " + ", ".join(missing)))
        return
    files = ENGINE_TESTS if device.type == "cuda" else ENGINE_TESTS_DRY
    res = run_pytest(files, _device_env(device), timeout_s)
    if not _reported(report, "engine", case, res, timeout_s):
        return
    for path, counts in res.per_file.items():
        bad = [name for f, name in res.failed if f == path]
        notes = ("failed: " + ", ".join(bad[:6])) if bad else ""
        report.add(Row("engine", path, achieved=_counts_text(counts), notes=notes))
    report.tests_ok = report.tests_ok and res.returncode == 0
    report.add(
        Row("engine", "all files", time=f"{res.seconds:.0f} s", achieved=_counts_text(res.total))
    )
