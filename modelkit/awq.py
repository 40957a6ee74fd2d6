"""Write an AutoAWQ-format ("gemm" version) INT4 checkpoint from a 16/32-bit one.

For tests and benchmarks: round-to-nearest asymmetric 4-bit quantization per group of
input channels (no activation-aware search: the scales are plain min/max ones; the file
format is what matters here), packed exactly as AutoAWQ's WQLinear_GEMM stores it:

  intweight [in, out]  (the weight transposed), values 0..15
  qweight   [in, out / 8] int32: for each group of 8 output columns, value of column
            order_map[i] in bits 4 i .. 4 i + 3, with order_map = [0, 2, 4, 6, 1, 3, 5, 7]
  qzeros    [in / g, out / 8] int32, the zero points packed the same way
  scales    [in / g, out] float16
  config.json quantization_config: quant_method "awq", bits 4, group_size g,
            zero_point true, version "gemm"

`python -m modelkit.awq SRC DST --group-size 64`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> intweight [in, out], zeros [in / g, out] (ints 0..15) and scales
    [in / g, out] float16, with w ~= (intweight - zero) * scale per group."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group, group)
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()  # [out, in / g], as stored
    s = scale.float()
    zero = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + zero[..., None], 0, 15)
    return (
        q.reshape(out_f, in_f).t().to(torch.int32).contiguous(),
        zero.t().to(torch.int32).contiguous(),
        scale.t().contiguous(),
    )


def pack(intweight: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints 0..15 -> [rows, cols / 8] int32, AutoAWQ's interleaved order."""
    rows, cols = intweight.shape
    # nibble i of packed column c = intweight[:, 8 c + ORDER_MAP[i]]
    v = intweight.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(ORDER_MAP)]
    packed = (v << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def dequantized(intweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] the quantized tensors stand for (float32)."""
    group = intweight.shape[0] // zeros.shape[0]
    z = zeros.float().repeat_interleave(group, 0)
    s = scales.float().repeat_interleave(group, 0)
    return ((intweight.float() - z) * s).t().contiguous()


def write_awq_checkpoint(
    src: str | Path,
    dst: str | Path,
    group_size: int = 64,
    *,
    dequantized_copy: str | Path | None = None,
) -> Path:
    """Quantize src's projections into an AWQ checkpoint at dst.  dequantized_copy: also
    write a plain checkpoint holding the dequantized weights (the exact reference)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(PROJECTIONS):
            q, z, s = quantize_groups(t, group_size)
            out[base + ".qweight"] = pack(q)
            out[base + ".qzeros"] = pack(z)
            out[base + ".scales"] = s
            plain[name] = dequantized(q, z, s).to(t.dtype)
        else:
            out[name] = t.contiguous()
            plain[name] = t
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm"}  # fmt: skip
    return save_quantized(src, dst, out, plain, qc, dequantized_copy)


def save_quantized(
    src: Path,
    dst: Path,
    out: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor],
    quantization_config: dict,
    dequantized_copy: str | Path | None,
) -> Path:
    """Write the quantized tensors `out` to dst with src's other files and its config plus
    `quantization_config`; the dequantized `plain` tensors to dequantized_copy if given."""
    save_file(out, str(dst / "model.safetensors"), {"format": "pt"})
    (dst / "model.safetensors").chmod(0o644)  # safetensors writes 0600
    cfg = json.loads((src / "config.json").read_text())
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    if dequantized_copy is not None:
        ref = Path(dequantized_copy)
        ref.mkdir(parents=True, exist_ok=True)
        save_file(plain, str(ref / "model.safetensors"), {"format": "pt"})
        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, ref / f.name)
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))  # last: marks it complete
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m modelkit.awq", description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args(argv)
    write_awq_checkpoint(a.src, a.dst, a.group_size)
    print(a.dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
