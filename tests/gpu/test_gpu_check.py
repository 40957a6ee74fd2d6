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
    rc = main(["--device", "cpu", "--skip", "tests", "--skip", "kernels", "--out", str(out)])
    assert rc == 0
    md = out.read_text()
    rows = [line for line in md.splitlines() if line.startswith("| e2e |")]
    assert [r.split(" | ")[1] for r in rows] == [
        "decode b1, eager, 0.00B Llama bf16",
        "decode b3, eager, 0.00B Llama bf16",
    ]
    assert all("tok/s" in r for r in rows) and "FAILED" not in md
    assert "dry run" in md
