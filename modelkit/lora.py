"""LoRA adapters in PEFT's format for a checkpoint, with random weights (no download: the
benchmarks and the default model write their own), as `PeftModel.save_pretrained` writes
them: `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu.config import ModelConfig

_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
EVERY = tuple(_OWNER)


def write_lora_adapter(
    model_dir: str | Path, out: str | Path, rank: int = 16, alpha: float = 32.0,
    targets: tuple[str, ...] = EVERY, seed: int = 0, std: float = 0.05,
) -> Path:  # fmt: skip
    cfg = ModelConfig.from_dir(model_dir)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for t in targets:
            n_out, n_in = shapes[t]
            key = f"base_model.model.model.layers.{i}.{_OWNER[t]}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(targets),
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "inference_mode": True,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
