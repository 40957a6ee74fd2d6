"""Write a GPTQ-format INT4 checkpoint from a 16/32-bit one.

For tests: round-to-nearest 4-bit quantization per group of input channels (no GPTQ
error-compensating solve: the file format is what matters here), asymmetric or symmetric,
packed as AutoGPTQ / GPTQModel store it (`checkpoint_format` "gptq", the default, or
"gptq_v2"):

  intweight [in, out]  (the weight transposed), values 0..15
  qweight   [in / 8, out] int32: input row 8 r + i of column c in bits 4 i .. 4 i + 3
  qzeros    [in / g, out / 8] int32: zero point of column 8 c + i in bits 4 i ..; the
            "gptq" format stores each zero point minus one (AutoGPTQ's convention), so a
            zero point of 0 cannot be stored there: asymmetric groups are clamped to 1..15
  scales    [in / g, out] float16
  g_idx     [in] int32: input i's group, i // g; with act-order (`desc_act`) the groups
            are formed over a permutation of the inputs (GPTQ's decreasing Hessian
            order; here a random one, shared by the projections that read the same input,
            as the Hessian is), and qweight keeps the inputs' own order
  config.json quantization_config: quant_method "gptq", bits 4, group_size g,
            desc_act, sym, checkpoint_format

`python -m modelkit.gptq SRC DST --group-size 64 [--sym] [--act-order] [--format gptq_v2]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from modelkit.awq import PROJECTIONS, quantize_groups, save_quantized

# The input each projection reads (q, k and v the same one; gate and up the same one).
_INPUT_OF = {"q_proj": ".qkv", "k_proj": ".qkv", "v_proj": ".qkv", "o_proj": ".o",
             "gate_proj": ".gate_up", "up_proj": ".gate_up", "down_proj": ".down"}  # fmt: skip


def quantize_symmetric(
    w: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As quantize_groups, symmetric: every zero point 8, scale = max |w| / 7.5."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group, group)
    scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-5).half()
    s = scale.float()
    q = torch.clamp(torch.round(wg / s[..., None]) + 8, 0, 15)
    zero = torch.full_like(s, 8)
    return (
        q.reshape(out_f, in_f).t().to(torch.int32).contiguous(),
        zero.t().to(torch.int32).contiguous(),
        scale.t().contiguous(),
    )


def _words(v: torch.Tensor) -> torch.Tensor:
    """[..., 8] ints 0..15 -> [...] int32, element i in bits 4 i .. 4 i + 3."""
    word = (v.to(torch.int64) << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """[in, out] -> [in / 8, out]: 8 input rows a word."""
    k, n = intweight.shape
    return _words(intweight.reshape(k // 8, 8, n).permute(0, 2, 1))


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> [rows, cols / 8]: 8 columns a word, in order."""
    r, c = values.shape
    return _words(values.reshape(r, c // 8, 8))


def write_gptq_checkpoint(
    src: str | Path,
    dst: str | Path,
    group_size: int = 64,
    *,
    sym: bool = False,
    checkpoint_format: str = "gptq",
    zero_bias: bool = False,
    act_order: bool = False,
    dequantized_copy: str | Path | None = None,
) -> Path:
    """Quantize src's projections into a GPTQ checkpoint at dst.  zero_bias: also store a
    zero bias for each projection, as AutoGPTQ does for models without one.  act_order:
    groups over a permutation of the inputs (desc_act).  dequantized_copy: also write a
    plain checkpoint of the dequantized weights."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}  # by the input the projection reads
    for name, t in sd.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(PROJECTIONS):
            k_in = t.shape[1]
            groups = torch.arange(k_in, dtype=torch.int64) // group_size
            perm = torch.arange(k_in)
            if act_order:
                reads = base.rsplit(".", 1)[0] + _INPUT_OF[base.rsplit(".", 1)[1]]
                gen = torch.Generator().manual_seed(len(perms))
                perm = perms.setdefault(reads, torch.randperm(k_in, generator=gen))
            q, z, s = (quantize_symmetric if sym else quantize_groups)(t[:, perm], group_size)
            if checkpoint_format == "gptq" and not sym:
                # (a zero point is stored minus one here; 0 has no code: the group's
                # values shift a step, and the dequantized copy says so)
                z = z.clamp(min=1)
            g_idx = torch.empty_like(groups)
            g_idx[perm] = groups  # input perm[i] is in group i // g
            rows = torch.empty_like(q)
            rows[perm] = q  # back in the inputs' own order
            out[base + ".qweight"] = pack_rows(rows)
            out[base + ".qzeros"] = pack_cols(z - 1 if checkpoint_format == "gptq" else z)
            out[base + ".scales"] = s
            out[base + ".g_idx"] = g_idx.to(torch.int32)
            if zero_bias:
                out[base + ".bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
            w = (rows.float() - z[g_idx].float()) * s[g_idx].float()  # [in, out]
            plain[name] = w.t().contiguous().to(t.dtype)
        else:
            out[name] = t.contiguous()
            plain[name] = t
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
          "sym": sym, "checkpoint_format": checkpoint_format}  # fmt: skip
    return save_quantized(src, dst, out, plain, qc, dequantized_copy)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m modelkit.gptq", description=__doc__.splitlines()[0]
    )
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--format", default="gptq", choices=["gptq", "gptq_v2"])
    a = ap.parse_args(argv)
    write_gptq_checkpoint(
        a.src, a.dst, a.group_size, sym=a.sym, checkpoint_format=a.format,
        act_order=a.act_order,
    )  # fmt: skip
    print(a.dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
