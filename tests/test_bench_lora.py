"""bench/lora.py's section end to end on the tiny checkpoint: adapters written in PEFT's
format, four cases timed side by side, each as a ratio to the base alone."""

from __future__ import annotations

from bench.lora import run
from bench.run import _print_table, build_parser
from tests.checkpoints import tiny_checkpoint


def test_lora_section_times_the_four_cases(tmp_path):
    model = tmp_path / "m"
    model.symlink_to(tiny_checkpoint("llama"), target_is_directory=True)
    args = build_parser().parse_args(
        ["--sections", "lora", "--model", str(model), "--threads", "1", "--dtype", "float32",
         "--lora-n", "4", "--lora-adapters", "2", "--lora-rank", "4", "--lora-reps", "1"]
    )  # fmt: skip
    text = run(args, _print_table, lambda a: model)
    assert "rank 4 on every projection" in text
    for case in ("base, no adapter loaded", "base, 2 adapters loaded",
                 "every request on one adapter", "requests over 2 adapters"):  # fmt: skip
        row = next(line for line in text.splitlines() if case in line)
        assert row.count("|") == 5 and "x |" in row
    assert "| 1.00x |" in next(line for line in text.splitlines() if "no adapter" in line)
    assert len(list(tmp_path.glob("m-lora-r4-*"))) == 2  # beside the model, not in it
