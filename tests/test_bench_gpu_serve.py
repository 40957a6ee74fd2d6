"""bench/gpu_serve.py (`make gpu-bench`): the dry run end to end on the CPU, and the
pieces a device run depends on (fast checkpoint writing, the roofline's byte counts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import gpu_serve
from gpu.config import ModelConfig
from gpu.loader import read_checkpoint
from modelkit.make_model import build_config, param_count, state_dict_shapes, write_fast_weights


def _table(md: str) -> list[dict[str, str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_dry_run_serves_every_concurrency_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "gpu_serve.md"
    assert gpu_serve.main(["--device", "cpu", "--dry", "--out", str(out)]) == 0
    rows = _table(out.read_text())
    assert [r["conc."] for r in rows] == ["1", "2"]
    for r in rows:
        assert r["errors"] == "0"
        assert r["shape"].startswith("tiny")
        assert float(r["output tok/s"].replace(",", "")) > 0
        # The roofline's arithmetic runs on the CPU's copy bandwidth too.
        assert float(r["roofline tok/s"].replace(",", "")) > 0
        assert r["of roofline"].endswith("%")
        assert float(r["step period ms"]) > 0
        assert r["host share (GPU idle)"] == "-"  # no NVML on a CPU
        p50, p99 = (float(x) for x in r["TPOT p50 / p99 ms"].split("/"))
        assert 0 < p50 <= p99
    # Two sequences a step read the weights once: the roofline nearly doubles.
    roofs = [float(r["roofline tok/s"].replace(",", "")) for r in rows]
    assert 1.5 * roofs[0] < roofs[1] <= 2 * roofs[0]


def test_fast_weights_shard_and_cover_every_tensor(tmp_path: Path) -> None:
    cfg = build_config("tiny", "llama", dtype="bfloat16")
    files = write_fast_weights(cfg, tmp_path, seed=3, shard_bytes=1 << 20)
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shapes = state_dict_shapes(cfg)
    assert set(index["weight_map"]) == set(shapes)
    seen: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                seen[k] = sf.get_tensor(k)
    assert index["metadata"]["total_size"] == 2 * param_count(cfg)
    for name, t in seen.items():
        assert tuple(t.shape) == shapes[name] and t.dtype == torch.bfloat16
    norm = seen["model.layers.0.input_layernorm.weight"].float()
    assert abs(norm.mean().item() - 1) < 0.05 and norm.std().item() > 0.05
    q0 = seen["model.layers.0.self_attn.q_proj.weight"].float()
    q1 = seen["model.layers.1.self_attn.q_proj.weight"].float()
    assert q0.std().item() == pytest.approx(cfg["initializer_range"], rel=0.1)
    assert not torch.equal(q0, q1)  # tiles start at different offsets
    # The server's loader reads the sharded layout, checked against the config.
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    read = read_checkpoint(tmp_path, ModelConfig.from_dict(cfg))
    assert torch.equal(read["model.layers.1.self_attn.q_proj.weight"].float(), q1)


def test_byte_counts_of_the_8b_shape() -> None:
    cfg = build_config("llama8b", "llama")
    read, kv, params = gpu_serve._shape_numbers(cfg)
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    assert params == param_count(cfg)
    assert read == 2 * (params - embed)  # untied: the embedding table is not read a step
    assert kv == 2 * 32 * 8 * 128 * 2
    # Llama-3.1-8B's 7.5B parameters less the 3.9 GB its 128k vocabulary would add.
    assert 7.0e9 < params < 7.6e9
    roof = gpu_serve.roofline(gpu_serve.Shape("llama8b", Path("."), read, kv, params, 0.0),
                              64, 1088, 4.0e12)  # fmt: skip
    assert roof == pytest.approx(64 / ((read + 64 * 1088 * kv) / 4.0e12))


def test_a_server_that_does_not_start_is_a_failed_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu_serve.md"
    argv = ["--device", "cpu", "--dry", "--out", str(out), "--server-arg=--no-such-flag"]
    assert gpu_serve.main(argv) == 1
    rows = _table(out.read_text())
    assert len(rows) == 1 and rows[0]["conc."] == "all"
    assert "FAILED: RuntimeError: server did not start" in rows[0]["errors"]
