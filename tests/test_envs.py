"""Every environment variable goes through scheduler/envs.py.

Product code (service/, scheduler/, gpu/) reads and writes the environment only there, and
every variable it names is documented there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from scheduler import envs

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("service", "scheduler", "gpu")
HOME = ROOT / "scheduler" / "envs.py"


def _environ_uses(src: str, filename: str) -> list[int]:
    """Lines that touch the environment: os.environ, os.getenv / putenv / unsetenv."""
    lines = []
    for node in ast.walk(ast.parse(src, filename)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in ("environ", "getenv", "putenv") for a in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def _product_files() -> list[Path]:
    return [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_only_the_envs_module_touches_the_environment() -> None:
    found: dict[str, list[int]] = {}
    for p in _product_files():
        lines = _environ_uses(p.read_text(), str(p)) if p != HOME else []
        if lines:
            found[str(p.relative_to(ROOT))] = lines
    assert not found, f"environment read outside scheduler/envs.py: {found}"
    assert _environ_uses(HOME.read_text(), str(HOME)), "the finder stopped seeing os.environ"


def test_the_finder_sees_every_spelling() -> None:
    src = "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
    assert _environ_uses(src, "x.py") == [2, 3, 4]


def test_every_variable_named_in_product_code_is_documented_here() -> None:
    named = {
        m
        for p in _product_files()
        if p != HOME
        for m in re.findall(r"\bPAGESTREAM_[A-Z0-9_]+\b", p.read_text())
    }
    assert named, "the pattern stopped matching"
    unknown = sorted(named - set(envs.VARS) - set(envs.SETS))
    assert not unknown, f"variables named in the code but not in scheduler/envs.py: {unknown}"
    for var in envs.VARS.values():
        assert len(var.doc) > 10, f"{var.name} has no documentation"


def test_reads_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGESTREAM_DECODE_GEMM", raising=False)
    assert envs.PAGESTREAM_DECODE_GEMM == "auto"
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "onednn")
    assert envs.PAGESTREAM_DECODE_GEMM == "onednn"
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "fastest")
    with pytest.raises(ValueError, match="PAGESTREAM_DECODE_GEMM must be one of auto"):
        _ = envs.PAGESTREAM_DECODE_GEMM
    monkeypatch.setenv("PAGESTREAM_LAYER_STACK", "0")
    assert envs.PAGESTREAM_LAYER_STACK is False
    monkeypatch.setenv("PAGESTREAM_LAYER_STACK", "")  # empty reads as the default
    assert envs.PAGESTREAM_LAYER_STACK is True
    with pytest.raises(AttributeError):
        _ = envs.PAGESTREAM_NOT_A_VARIABLE


def test_kernel_env_for_a_bench_child() -> None:
    env = envs.kernel_env({"PAGESTREAM_PREFILL_GEMM": "mkl", "PAGESTREAM_CPU_FUSED": "0"})
    assert env["PAGESTREAM_PREFILL_GEMM"] == "mkl" and env["PAGESTREAM_CPU_FUSED"] == "0"
    assert "PATH" in env
    with pytest.raises(KeyError, match="not a kernel choice"):
        envs.kernel_env({"PAGESTREAM_MODEL": "x"})
    with pytest.raises(ValueError, match="must be one of"):
        envs.kernel_env({"PAGESTREAM_PREFILL_GEMM": "blas"})


def test_only_the_listed_variables_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    envs.set_default("LRU_CACHE_CAPACITY", "64")  # the operator's own value wins
    assert envs.os.environ["LRU_CACHE_CAPACITY"] == "7"
    with pytest.raises(KeyError):
        envs.set_value("PATH", "/nowhere")


def test_the_import_layers_allow_every_layer_to_import_it() -> None:
    tree = ast.parse(HOME.read_text())
    ours = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom | ast.Import)
        and any(
            (getattr(n, "module", None) or a.name).split(".")[0] in (*PRODUCT, "bench", "modelkit")
            for a in n.names
        )
    ]
    assert not ours, "scheduler/envs.py must import nothing of ours (every layer imports it)"


def test_bench_sets_kernel_choices_for_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.run import apply_kernel_choices, build_parser

    monkeypatch.delenv("PAGESTREAM_PREFILL_GEMM", raising=False)
    args = build_parser().parse_args(["--kernel", "PAGESTREAM_PREFILL_GEMM=onednn"])
    # Restore whatever apply_kernel_choices writes once the test ends.
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "auto")
    assert apply_kernel_choices(args.kernel) == {"PAGESTREAM_PREFILL_GEMM": "onednn"}
    assert envs.PAGESTREAM_PREFILL_GEMM == "onednn"
    with pytest.raises(KeyError):
        apply_kernel_choices(["PAGESTREAM_API_KEY=secret"])
    with pytest.raises(ValueError):
        apply_kernel_choices(["PAGESTREAM_PREFILL_GEMM=blas"])
