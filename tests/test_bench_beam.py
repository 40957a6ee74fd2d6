"""bench/beam.py's section end to end on the tiny checkpoint: pagestream's worker runs
`LLM.beam_search` in its own process and the table reads its runs (vLLM's rows need
--vllm-python, which CI does not have)."""

from __future__ import annotations

import argparse

from bench.beam import run, workload
from bench.run import _print_table, build_parser
from tests.checkpoints import tiny_checkpoint


def test_beam_section_times_pagestreams_search():
    args = build_parser().parse_args(
        ["--sections", "beam", "--model", str(tiny_checkpoint("llama")), "--threads", "1",
         "--beam-prompts", "2", "--beam-tokens", "4", "--beam-reps", "2", "--beam-width", "3"]
    )  # fmt: skip
    text = run(args, _print_table, lambda a: tiny_checkpoint("llama"))
    assert "width 3, 4 tokens" in text and "| **pagestream** |" in text
    row = next(line for line in text.splitlines() if "**pagestream**" in line)
    runs = row.split("|")[2]
    assert runs.count(",") == 1  # two timed runs


def test_workload_is_fixed_by_its_seed():
    args = argparse.Namespace(beam_prompts=3, beam_tokens=5)
    a, b = workload(args, 500, 0), workload(args, 500, 0)
    assert a == b and len(a) == 3 and all(w.max_tokens == 5 for w in a)
    assert all(32 <= len(w.prompt) <= 160 and min(w.prompt) >= 16 for w in a)
    assert workload(args, 500, 1) != a
