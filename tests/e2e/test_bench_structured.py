"""The `structured` bench section runs end to end on a tiny model (figures not checked)."""

from __future__ import annotations

from bench.run import main
from tests.checkpoints import tiny_checkpoint


def test_structured_section_runs(tmp_path, monkeypatch, capsys):
    import bench.run

    monkeypatch.setattr(bench.run, "RESULTS", tmp_path)
    model = str(tiny_checkpoint("llama"))
    argv = ["--sections", "structured", "--model", model, "--dtype", "float32", "--threads", "1",
            "--structured-batch", "1", "--structured-tokens", "8", "--structured-reps", "1"]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "latest.md").read_text()
    assert "FAILED" not in text, text
    assert "Constrained-row overhead per token" in text and "llguidance" in text
