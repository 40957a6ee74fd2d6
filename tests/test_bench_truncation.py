"""bench/truncation.py's section end to end on the tiny checkpoint: both kinds of long
conversation run through a live server, and the table reads their token counts (counts,
not times: the auto kind computes fewer prompt tokens a turn once the window is full)."""

from __future__ import annotations

from bench.run import _print_table, build_parser
from bench.truncation import run
from tests.checkpoints import tiny_checkpoint


def test_truncation_section_compares_the_two_kinds():
    model = tiny_checkpoint("llama")
    args = build_parser().parse_args(
        ["--sections", "truncation", "--model", str(model), "--threads", "1", "--dtype",
         "float32", "--trunc-window", "256", "--trunc-turns", "10", "--trunc-input", "12",
         "--trunc-output", "8", "--trunc-conversations", "1"]
    )  # fmt: skip
    text = run(args, _print_table, lambda a: model)
    rows = {line.split("|")[1].strip(): line.split("|") for line in text.splitlines()
            if line.startswith("| client") or line.startswith("| truncation")}  # fmt: skip
    client, auto = rows["client drops the fewest"], rows['truncation: "auto"']
    assert int(client[2]) >= 3 and int(auto[2]) >= 3  # turns past the full window
    assert int(auto[4]) < int(client[4])  # prompt tokens computed a turn
    assert int(auto[8]) < int(client[8])  # fewer turns mostly computed
