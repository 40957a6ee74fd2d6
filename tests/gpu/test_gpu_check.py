"""The GPU check's harness (bench/gpu_check), exercised on the CPU: the dry run's
end-to-end part must produce its rows through the real model runner, and a missing CUDA
device must be a clean exit, not a traceback."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check.__main__ import main
from bench.gpu_check.common import Report, Row


def test_markdown_escapes_pipes_in_cells():
    r = Report(header={"card": "x"})
    r.add(Row("e2e", "a|b", notes="n"))
    table_row = r.markdown().splitlines()[-1]
    assert table_row == "| e2e | a/b |  |  |  |  | n |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_no_cuda_device_exits_2(tmp_path, capsys):
    assert main(["--device", "cuda", "--out", str(tmp_path / "x.md")]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "x.md").exists()


@pytest.mark.slow
def test_dry_run_e2e_rows(tmp_path):
    out = tmp_path / "gpu_check.md"
    skip = ["--skip", "tests", "--skip", "kernels", "--skip", "engine"]
    rc = main(["--device", "cpu", *skip, "--out", str(out)])
    assert rc == 0
    md = out.read_text()
    rows = [line for line in md.splitlines() if line.startswith("| e2e |")]
    assert [r.split(" | ")[1] for r in rows] == [
        "decode b1, eager, 0.00B Llama bf16",
        "decode b3, eager, 0.00B Llama bf16",
        "mixed step, 3 decodes + a 8-token prompt, eager",
        "prefill step, 3 x 8 tokens, eager",
        "decode b1, eager, torch norm/rope, 0.00B Llama bf16",
        "decode b3, eager, torch norm/rope, 0.00B Llama bf16",
        "mixed step, 3 decodes + a 8-token prompt, eager, torch norm/rope",
        "prefill step, 3 x 8 tokens, eager, torch norm/rope",
        "engine decode b3, async scheduling, eager, 0.00B Llama",
        "engine decode b3, synchronous, eager, 0.00B Llama",
    ]
    engine = [r for r in rows if "engine decode" in r]
    assert all("tok/s" in r for r in rows if "mixed" not in r and r not in engine)
    assert all(" ms/step |" in r for r in engine) and "FAILED" not in md
    assert "dry run" in md


@pytest.mark.slow
def test_dry_run_engine_rows(tmp_path):
    """Part 4's harness: pytest in a subprocess, one row per file from its JUnit report."""
    out = tmp_path / "gpu_check.md"
    skip = ["--skip", "tests", "--skip", "kernels", "--skip", "e2e"]
    assert main(["--device", "cpu", *skip, "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| engine |")]
    assert len(rows) == 2, rows
    assert rows[0].startswith("| engine | tests/service/test_stop_matcher.py |")
    assert " 0 failed" in rows[0] and " 0 passed" not in rows[0]
    assert rows[1].startswith("| engine | all files |")
