"""bench/data_parallel.py's section end to end on the tiny checkpoint: one engine and two
data-parallel ranks each serve the same closed-loop load through real servers, and the
table has a row per engine and client count (figures, not asserted speeds)."""

from __future__ import annotations

from bench.data_parallel import run
from bench.run import _print_table, build_parser
from tests.checkpoints import tiny_checkpoint


def test_dp_section_serves_both_engines():
    model = tiny_checkpoint("llama")
    args = build_parser().parse_args(
        ["--sections", "dp", "--model", str(model), "--dtype", "float32", "--dp-prompts", "6",
         "--dp-concurrency", "1,3", "--cmp-input", "24", "--cmp-output", "6"]
    )  # fmt: skip
    text = run(args, _print_table, lambda a: model)
    rows = [
        line.split("|")
        for line in text.splitlines()
        if line.startswith("| ") and "|---" not in line
    ]
    rows = [[c.strip() for c in r[1:-1]] for r in rows[1:]]
    assert [(r[0], "ranks" in r[1]) for r in rows] == [
        ("1", False),
        ("1", True),
        ("3", False),
        ("3", True),
    ]
    for r in rows:
        assert float(r[2]) > 0 and float(r[4]) > 0, r
    assert rows[0][5] == "1.00x"
