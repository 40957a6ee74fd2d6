"""Checkpoint loading fails early with a message naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.config import ModelConfig, ModelLoadError, read_eos_token_ids, resolve_dtype
from gpu.model_runner import ModelRunner
from tests.checkpoints import tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    return dst


def load(path: Path) -> ModelRunner:
    return ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=16)


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load(ckpt)


def test_missing_config_field_and_bad_json(ckpt):
    edit_config(ckpt, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load(ckpt)


def test_missing_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj"):
        load(ckpt)


def test_mismatched_shape_is_named(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][
            :64
        ]

    edit_tensors(ckpt, shrink)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \(64, 256\)"):
        load(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.extra_head.weight", torch.zeros(2)))
    with pytest.raises(ModelLoadError, match=r"does not use: model\.extra_head\.weight"):
        load(ckpt)


def test_sharded_checkpoint_loads_like_the_single_file(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}  # fmt: skip
    sharded = tmp_path / "sharded"
    shutil.copytree(ckpt, sharded)
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / fname))
        weight_map |= dict.fromkeys(keys, fname)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load(ckpt), load(sharded)
    ids = torch.tensor([5, 6, 7, 8])
    ea, eb = a.model.embed_tokens(ids), b.model.embed_tokens(ids)
    assert torch.equal(ea, eb)
    assert torch.equal(
        a.model.compute_logits(torch.ones(1, 256)), b.model.compute_logits(torch.ones(1, 256))
    )
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shards listed in the index are missing"):
        load(sharded)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="only safetensors"):
        load(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load(tmp_path)


def test_dtypes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # auto on CPU follows the CPU's features: tests/gpu/test_cpu_features.py
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ModelLoadError, match="float64"):
        resolve_dtype("float64", cpu)


def test_eos_ids_merge_generation_config(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    ids = read_eos_token_ids(ckpt, cfg)
    assert set(gen) <= set(ids) and len(ids) == len(set(ids))


def test_server_reports_a_load_failure(ckpt):
    from scheduler.config import EngineConfig
    from service.app import ServerConfig
    from tests.service.live_server import LiveServer

    edit_config(ckpt, architectures=["BertModel"])
    server = LiveServer(
        ServerConfig(engine=EngineConfig.from_kwargs(model=str(ckpt), num_kv_blocks=16))
    )
    with pytest.raises(RuntimeError, match="BertModel"):
        server.start(timeout=60)
    server.stop()


def test_the_loaded_model_does_not_keep_the_file_mapped(ckpt):
    # safetensors' tensors view its mapping of the file; a weight kept as is (the
    # embedding) held every page of the file mapped beside the copies the model made.
    dtype = next(iter(load_file(str(ckpt / "model.safetensors")).values())).dtype
    runner = ModelRunner(ckpt, dtype=str(dtype).removeprefix("torch."), device="cpu",
                         num_kv_blocks=16)  # fmt: skip
    maps = Path("/proc/self/maps").read_text()
    assert str(ckpt / "model.safetensors") not in maps
    assert runner is not None


def test_cpu_kv_cache_size_follows_the_environment(monkeypatch):
    """Without --kv-cache-memory / --num-kv-blocks a CPU cache takes
    PAGESTREAM_CPU_KVCACHE_SPACE GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); a bad value is an
    error naming the variable's rule, not a silent default."""
    ck = tiny_checkpoint("llama")
    monkeypatch.setenv("PAGESTREAM_CPU_KVCACHE_SPACE", "0.0625")
    r = ModelRunner(ck, dtype="float32", device="cpu")
    assert r.num_kv_blocks == (1 << 26) // r.kv_bytes_per_block
    assert r.kv_caches[0][0].shape[0] == r.num_kv_blocks
    monkeypatch.delenv("PAGESTREAM_CPU_KVCACHE_SPACE")
    from scheduler import envs

    assert envs.PAGESTREAM_CPU_KVCACHE_SPACE == 2 << 30
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv("PAGESTREAM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="a size in GiB must be a number above 0"):
            ModelRunner(ck, dtype="float32", device="cpu")


def test_loading_a_model_does_not_import_torch_dynamo():
    """~0.9 s of every server, engine process and rank start-up: nn.Embedding's own random
    init and arithmetic on the meta device (the loader's first pass) both import it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gpu.model_runner import ModelRunner\n"
        f"r = ModelRunner({str(tiny_checkpoint('llama'))!r}, dtype='float32', device='cpu',"
        " num_kv_blocks=16)\n"
        "assert r.model.rotary.cos.is_meta is False\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
