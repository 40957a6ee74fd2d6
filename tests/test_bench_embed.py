"""bench/embed.py's section end to end on the tiny checkpoint: pagestream's and
transformers' workers embed the same prompts in processes of their own, and the table
reads their runs and how far transformers' vectors are from pagestream's (vLLM's row
needs --vllm-python, which CI does not have)."""

from __future__ import annotations

from bench.embed import run
from bench.run import _print_table, build_parser
from tests.checkpoints import tiny_checkpoint


def test_embed_section_times_both_engines_and_compares_their_vectors():
    model = tiny_checkpoint("llama")
    args = build_parser().parse_args(
        ["--sections", "embed", "--model", str(model), "--threads", "1",
         "--embed-prompts", "6", "--embed-max-len", "48", "--embed-reps", "2"]
    )  # fmt: skip
    text = run(args, _print_table, lambda a: model)
    assert "6 prompts of 32-48 tokens" in text
    ours = next(line for line in text.splitlines() if "**pagestream**" in line)
    assert ours.split("|")[2].count(",") == 1  # two timed runs
    hf = next(line for line in text.splitlines() if "| transformers |" in line)
    # float32 on the same weights: the same vectors (left padding changes no real token).
    assert float(hf.split("|")[5]) < 1e-4
