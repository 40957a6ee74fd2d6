"""Write an FP8 (float8 e4m3) checkpoint from a 16/32-bit one, in the layout FP8 checkpoints
on the Hugging Face hub use, for tests and device runs:

  <proj>.weight        float8_e4m3fn [out, in]
  <proj>.weight_scale  float32, [out, 1] per output channel or [] per tensor (amax / 448)
  config.json quantization_config:
    "compressed-tensors": format "float-quantized", one config group whose weights are
        8-bit float, symmetric, strategy "channel" / "tensor", and whose input activations
        are dynamic per token; "ignore": ["lm_head"]
    "fbgemm_fp8": per channel only (its scales are always [out, 1])

Only the attention and MLP projections are quantized; embeddings, norms and the lm_head
keep their dtype.  `python -m modelkit.fp8 SRC DST [--per-tensor] [--fbgemm]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modelkit.awq import PROJECTIONS

FP8_MAX = 448.0


def quantize(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> float8_e4m3fn [N, K] and float32 scales [N, 1] (or [] per tensor)."""
    wf = w.float()
    amax = wf.abs().amax() if per_tensor else wf.abs().amax(1, keepdim=True)
    scale = amax.clamp_min(1e-12) / FP8_MAX
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantization_config(method: str, per_tensor: bool) -> dict:
    if method == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                            "strategy": "tensor" if per_tensor else "channel",
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "token", "dynamic": True},
            }
        },
    }  # fmt: skip


def write_fp8_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    per_tensor: bool = False,
    method: str = "compressed-tensors",
) -> Path:
    """Quantize src's projections into an FP8 checkpoint at dst (config.json written last)."""
    if method == "fbgemm_fp8" and per_tensor:
        raise ValueError("fbgemm_fp8 checkpoints hold per-channel scales only")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(PROJECTIONS):
            out[name], out[base + ".weight_scale"] = quantize(t, per_tensor)
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), {"format": "pt"})
    (dst / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(method, per_tensor)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--per-tensor", action="store_true", help="one scale per projection")
    ap.add_argument("--fbgemm", action="store_true", help="fbgemm_fp8 config (per channel)")
    a = ap.parse_args(argv)
    method = "fbgemm_fp8" if a.fbgemm else "compressed-tensors"
    print(write_fp8_checkpoint(a.src, a.dst, per_tensor=a.per_tensor, method=method))


if __name__ == "__main__":
    main()
