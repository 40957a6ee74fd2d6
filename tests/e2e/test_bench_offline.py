"""The `offline` bench section on a tiny model: every engine gets a row per dtype, the
warm-up prompts are disjoint from the timed ones (figures not checked)."""

from __future__ import annotations

import argparse
import json

from bench.offline import rep_work, workloads
from bench.run import main
from tests.checkpoints import tiny_checkpoint


def test_warm_up_prompts_share_no_first_block_with_timed_ones():
    args = argparse.Namespace(
        n=64, prompt_min=32, prompt_max=512, out_min=16, out_max=256, offline_reps=3
    )
    work, warm = workloads(args, 49152)
    assert len(work) == 64 and len(warm) >= 4
    heads = [{tuple(w.prompt[:16]) for w in rep_work(work, r, 49152)} for r in range(3)]
    assert not {tuple(w.prompt[:16]) for w in warm} & set().union(*heads)
    # Each timed run its own prompts (no run is another's prefix-cache hit), same shape.
    assert not heads[0] & heads[1] and not heads[1] & heads[2] and not heads[0] & heads[2]
    shape = [[(len(w.prompt), w.max_tokens) for w in rep_work(work, r, 49152)] for r in range(3)]
    assert shape[0] == shape[1] == shape[2]


def test_offline_section_rows_in_both_dtypes(tmp_path, monkeypatch):
    import bench.run

    monkeypatch.setattr(bench.run, "RESULTS", tmp_path)
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    model = str(tiny_checkpoint("llama"))
    argv = ["--sections", "offline", "--model", model, "--threads", "1", "--n", "3",
            "--prompt-min", "4", "--prompt-max", "12", "--out-min", "2", "--out-max", "5",
            "--offline-reps", "2"]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "latest.md").read_text()
    assert "FAILED" not in text, text
    for dtype in ("bfloat16", "float32"):
        assert f"Offline throughput, {dtype}" in text
    assert text.count("pagestream LLM.generate") == 2 and text.count("transformers generate()") == 2
    assert "the CPU’s native dtype" in text and "median of 2 alternated runs" in text
    assert "vllm" not in text.lower()  # no vLLM rows without a vLLM venv
    # The same figures, structured, and their chart beside latest.md.
    data = json.loads((tmp_path / "offline.json").read_text())
    assert sorted(g["dtype"] for g in data["dtypes"]) == ["bfloat16", "float32"]
    for g in data["dtypes"]:
        assert [e["name"] for e in g["engines"]] == ["transformers", "pagestream"]
        assert all(len(e["seconds"]) == len(e["tok_s"]) == 2 for e in g["engines"])
        assert g["floor_tok_s"] > 0 and "TFLOP" in g["floor_note"]
    assert text.count("ceiling: the workload's") == 2  # one floor row per dtype
    assert "GFLOP/s on" in text and "GB/s (" in text
    assert (tmp_path / "offline_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
