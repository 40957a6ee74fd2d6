"""The house's size limits, as a report: functions over 60 lines, and files over 600 lines
outside the kernels (docs/ARCHITECTURE.md and COMMON.md ask for both).  Not a test:
it prints what a reader would find long, for whoever tidies next.

    python docs/sizes.py [--functions N] [--files N]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "scheduler", "gpu", "bench", "modelkit", "tests")
KERNELS = "gpu/kernels/"  # Triton kernels may be long: no per-file limit there


def long_functions(path: Path, limit: int) -> list[tuple[int, str, int]]:
    """(line, qualified name, length in lines) of each def longer than `limit`."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = (child.end_lineno or child.lineno) - child.lineno + 1
                    if n > limit:
                        found.append((child.lineno, name, n))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--functions", type=int, default=60)
    ap.add_argument("--files", type=int, default=600)
    args = ap.parse_args()
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    print(f"files over {args.files} lines (outside {KERNELS}):")
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        n = len(p.read_text().splitlines())
        if n > args.files and not rel.startswith(KERNELS):
            print(f"  {n:5d}  {rel}")
    print(f"functions over {args.functions} lines:")
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        for line, name, n in long_functions(p, args.functions):
            print(f"  {n:5d}  {rel}:{line}  {name}")


if __name__ == "__main__":
    main()
