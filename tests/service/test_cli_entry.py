"""The command line's front door: no training at start-up, and `bench` as its own program."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service import cli, engine_setup

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_default_model_is_an_error_naming_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PAGESTREAM_MODEL", raising=False)
    gone = tmp_path / "pair" / "target"
    monkeypatch.setattr(engine_setup, "default_model_dir", lambda: gone)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"pagestream train-pair {gone.parent}" in err
    assert "--model" in err
    assert not gone.parent.exists(), "nothing may be trained or written at start-up"


def test_the_shipped_default_model_is_there() -> None:
    path = engine_setup.ensure_default_model()
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_pagestream_bench_serve_runs_the_bench_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "serve", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage: pagestream bench serve" in out.stdout and "--request-rate" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "pagestream bench serve" in bad.stderr
