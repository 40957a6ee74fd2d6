"""modelkit.make_model: generated checkpoints load in transformers exactly and behave."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu.config import ModelConfig
from modelkit import make_model as mm
from tests.checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers")

ARCHS = list(mm.ARCHS)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_hf(path: Path) -> tuple[torch.nn.Module, dict, list[str]]:
    """The model, its loading info, and every warning transformers logged meanwhile."""
    log = logging.getLogger("transformers")
    handler = _Records()
    log.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
    finally:
        log.removeHandler(handler)
    return model.eval(), info, handler.messages


# attention_bias: Llama and Qwen3 then bias o_proj as well as q/k/v.
@pytest.mark.parametrize(
    "arch, over",
    [(a, {}) for a in ARCHS] + [(a, {"attention_bias": True}) for a in ("llama", "qwen3")],
)
def test_transformers_loads_every_tensor(arch: str, over: dict) -> None:
    path = tiny_checkpoint(arch, **over)
    model, info, warnings = _load_hf(path)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert warnings == []
    cfg = json.loads((path / "config.json").read_text())
    assert type(model).__name__ == cfg["architectures"][0]
    # Every tensor on disk is a parameter of the HF model, with its shape and values.
    disk = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    assert set(disk) == set(params) == set(mm.state_dict_shapes(cfg))
    for name, t in disk.items():
        assert torch.equal(params[name].detach(), t.float()), name
    assert sum(p.numel() for p in params.values()) == mm.param_count(cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_specifics(arch: str) -> None:
    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_dir(path)  # our own loader reads it as intended
    names = set(load_file(path / "model.safetensors"))
    assert cfg.attention_bias == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    assert ("model.layers.0.self_attn.k_norm.weight" in names) == (arch == "qwen3")
    assert (cfg.head_dim * cfg.num_heads != cfg.hidden_size) == (arch == "qwen3")
    assert cfg.sliding_window is None
    assert cfg.eos_token_ids == (0, 2)
    assert not cfg.tie_word_embeddings and "lm_head.weight" in names
    if arch == "llama3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 8.0
        orig = cfg.rope_scaling["original_max_position_embeddings"]
        assert cfg.max_position_embeddings > orig
    else:
        assert cfg.rope_scaling is None
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]  # end of text and end of turn
    # Norm weights are near 1 but not 1; biases are not zero.
    w = load_file(path / "model.safetensors")
    norm = w["model.layers.0.input_layernorm.weight"]
    assert 0.05 < norm.std() < 0.15 and (norm.mean() - 1).abs() < 0.05
    if arch == "qwen2":
        assert w["model.layers.0.self_attn.k_proj.bias"].abs().mean() > 0.05


@pytest.mark.parametrize("preset", list(mm.PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_preset_shapes_match_transformers(preset: str, arch: str) -> None:
    # Built on the meta device: shapes and names only, no memory, no file.
    cfg = mm.build_config(preset, arch)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert hf == mm.state_dict_shapes(cfg)


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 1e6, 5e6), ("small", 130e6, 140e6), ("mid", 150e6, 160e6)],
)
def test_preset_param_counts(preset: str, low: float, high: float) -> None:
    n = mm.param_count(mm.build_config(preset, "llama"))
    assert low <= n <= high, n
    assert mm.build_config("small", "llama")["tie_word_embeddings"]
    assert not mm.build_config("mid", "llama")["tie_word_embeddings"]


def _digests(path: Path) -> dict[str, str]:
    files = sorted(f for f in path.iterdir() if not f.name.startswith("."))
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_deterministic(tmp_path: Path) -> None:
    a = mm.make_model(tmp_path / "a", arch="qwen2", seed=7)
    b = mm.make_model(tmp_path / "b", arch="qwen2", seed=7)
    c = mm.make_model(tmp_path / "c", arch="qwen2", seed=8)
    assert _digests(a) == _digests(b)
    da, dc = _digests(a), _digests(c)
    assert da["model.safetensors"] != dc["model.safetensors"]
    assert {k: v for k, v in da.items() if k != "model.safetensors"} == {
        k: v for k, v in dc.items() if k != "model.safetensors"
    }


def test_tokenizer_training_is_deterministic() -> None:
    # Trained afresh (not from the cache) twice on the same text.
    texts = mm.load_corpus(300_000)
    one = mm._train_tokenizer(texts, 600, "gpt2").to_str()
    two = mm._train_tokenizer(texts, 600, "gpt2").to_str()
    assert one == two
    assert json.loads(one)["model"]["vocab"]["<|im_end|>"] == mm.IM_END_ID


def test_bfloat16_and_overrides(tmp_path: Path) -> None:
    path = mm.make_model(
        tmp_path / "m",
        arch="mistral",
        dtype="bfloat16",
        vocab_size=1024,
        config_overrides={"num_hidden_layers": 2, "tie_word_embeddings": True},
    )
    w = load_file(path / "model.safetensors")
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in w and "model.layers.2.mlp.up_proj.weight" not in w
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["vocab_size"] == 1024
    tok = json.loads((path / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 1024
    _, info, warnings = _load_hf(path)
    assert {k: v for k, v in info.items() if v} == {} and warnings == []


def test_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    assert mm.main([str(out), "--preset", "tiny", "--arch", "qwen3", "--seed", "3"]) == 0
    assert ModelConfig.from_dir(out).architecture == "Qwen3ForCausalLM"
    assert _digests(out) == _digests(tiny_checkpoint("qwen3", seed=3))
    with pytest.raises(SystemExit):
        mm.main([str(out), "--arch", "gpt2"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_logits_are_well_separated(arch: str) -> None:
    model, _, _ = _load_hf(tiny_checkpoint(arch))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 2048, (4, 128), generator=gen)
    with torch.no_grad():
        top2 = model(ids).logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    # A near-tie is where two float32 implementations may pick different tokens.
    assert gap.median() > 0.2
    assert (gap < 1e-2).float().mean() < 0.05
    # Greedy decoding wanders rather than repeating one token.
    with torch.no_grad():
        out = model.generate(
            ids[:, :8], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    for row in out[:, 8:].tolist():
        assert len(set(row)) >= 16
        assert max(len(list(g)) for _, g in itertools.groupby(row)) <= 4
