"""The house rules for imports: one-way layers and no loops, lazy or not.

scheduler/ (pure Python) <- gpu/ (torch) <- service/ (aiohttp, the composition root);
modelkit/ (checkpoint writers) sits beside gpu/; bench/ (benchmarks, load generator) is a
client of everything and nothing imports it.  Every import statement
counts, including those inside functions and under `if TYPE_CHECKING:`: a loop hidden by a
lazy import still couples the two modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "gpu", "service", "modelkit", "bench")

# package -> project packages it must never import
FORBIDDEN = {
    "scheduler": {"gpu", "service", "modelkit", "bench", "tests"},
    "gpu": {"service", "modelkit", "bench", "tests"},
    "modelkit": {"service", "bench", "tests"},
    "service": {"bench", "tests"},
    "bench": {"tests"},
}
# No exceptions: `pagestream bench serve` runs `python -m bench serve` as a new program
# rather than importing bench/ (service/cli.py `main`).
ALLOWED: set[tuple[str, str]] = set()
# Third-party packages a layer must not pull in (scheduler/ stays importable without torch).
FORBIDDEN_THIRD_PARTY = {
    "scheduler": {"torch", "triton", "numpy", "aiohttp"},
    "gpu": {"aiohttp", "asyncio", "redis"},
}


def _modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of everything a module imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            # `from pkg import submodule` imports the submodule.
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _cycles(mods: dict[str, Path]) -> list[list[str]]:
    graph = {n: {m for m in _imports(n, p) if m in mods and m != n} for n, p in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages work.
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_modules())
    assert not cycles, "import loops:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_import_only_downward() -> None:
    bad = []
    for name, path in _modules().items():
        pkg = name.split(".")[0]
        for mod in _imports(name, path):
            top = mod.split(".")[0]
            if top in FORBIDDEN[pkg] and (name, top) not in ALLOWED:
                bad.append(f"{name} imports {mod}")
            if top in FORBIDDEN_THIRD_PARTY.get(pkg, ()):
                bad.append(f"{name} imports {mod} (not allowed in {pkg}/)")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_lazy_loop(tmp_path: Path) -> None:
    """The cycle finder itself: a loop through a function-level import and a
    TYPE_CHECKING import is found."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from p.b import g\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    assert _cycles(_modules(tmp_path, ("p",))) == [["p.a", "p.b", "p.a"]]


# The CPU backend (gpu/cpu/) is a room of its own: it builds on the attention interface,
# the torch reference path and the cache folder, and the rest of gpu/ reaches it through
# a known set of doors (the attention factory, the loader's linear packing, the model's
# fused CPU ops, the sampler's argmax, the int8 GEMV, the dtype choice).
CPU_BACKEND_USES = {"gpu.attention.base", "gpu.attention.torch_backend", "gpu.config"}
CPU_BACKEND_DOORS = {
    "gpu.attention",
    "gpu.config",
    "gpu.model",
    "gpu.model_runner",
    "gpu.quant_eval",
    "gpu.quant_linear",
    "gpu.sampler",
}


def _is_cpu(mod: str) -> bool:
    return mod == "gpu.cpu" or mod.startswith("gpu.cpu.")


def test_cpu_backend_is_a_room_of_its_own() -> None:
    mods = _modules(packages=("gpu",))
    inside = {n: p for n, p in mods.items() if _is_cpu(n)}
    assert "gpu.cpu.kernels" in inside and "gpu.cpu.attention" in inside
    used = {m for n, p in inside.items() for m in _imports(n, p) if m in mods and not _is_cpu(m)}
    assert used <= CPU_BACKEND_USES, f"gpu/cpu/ reaches out to {sorted(used - CPU_BACKEND_USES)}"
    doors = {
        n for n, p in mods.items() if not _is_cpu(n) and any(_is_cpu(m) for m in _imports(n, p))
    }
    assert doors == CPU_BACKEND_DOORS, (
        f"modules of gpu/ importing the CPU backend changed: new {sorted(doors - CPU_BACKEND_DOORS)}"
        f", gone {sorted(CPU_BACKEND_DOORS - doors)}"
    )
