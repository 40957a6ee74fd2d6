"""Quantized linear layers: weight-only INT8 (quantized at load) and AWQ INT4 (AutoAWQ GEMM
checkpoints), each run through torch's packed low-bit matmuls where they exist.

INT8: symmetric, one scale per output channel, w ~= q * scale[n], the lm_head included.
On CPU decode rows go through a compiled int8 GEMV (gpu/cpu/kernels/int8_gemv.cpp: torch's
`aten._weight_int8pack_mm` was no faster than oneDNN's bf16 GEMV there, and far slower
with float32 activations); on GPU through `_weight_int8pack_mm`;
where neither exists the layer dequantizes its weight inside the call.

AWQ (https://github.com/casper-hansen/AutoAWQ, "gemm" version): per projection
  qweight [in, out / 8] int32   8 4-bit values per int32 along the output dim, nibble i
                                holding output column 8 c + AWQ_ORDER[i]
  qzeros  [in / g, out / 8] int32  the zero points, packed the same way
  scales  [in / g, out] fp16
and w[out, in] = (q - zero) * scale per group of g input channels.  At load the nibbles
are unpacked and repacked for torch's int4 kernels (`_weight_int4pack_mm_for_cpu` on CPU,
`_weight_int4pack_mm` on CUDA), which compute (q - 8) * s + z: so z = (8 - zero) * s.
When a kernel is missing or disagrees with the dequantized reference on a probe, the
layer keeps a dequantized weight instead (and says so in the log).

FP8 (W8A8, what Hopper runs): weight float8_e4m3fn [N, K] with a float32 scale per output
channel (amax / 448, quantized at load, or a checkpoint's own), activations quantized per
token in the forward (row amax / 448, dynamic), the product `torch._scaled_mm` with row
and column scales.  Where `_scaled_mm` refuses the layer's shape, device or output dtype
(CUDA: K and N multiples of 16, row-wise scales only with a bf16 output), the layer keeps
the FP8 values widened to the model dtype and multiplies them with the same quantized
activations, so both paths compute the same W8A8 product.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.linear import swap_linears

log = logging.getLogger(__name__)

INT8_MAX = 127.0
_GEMV_MAX_ROWS = cpu_kernels.INT8_GEMV_MAX_ROWS
# Nibble i of a packed AWQ int32 holds column AWQ_ORDER[i] of its group of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INT4_INNER_K_TILES = 2  # torch's int4 packing parameter (2, 4 or 8)


# ---------------------------------------------------------------------- INT8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 [N, K] and float32 scales [N], symmetric per output channel."""
    wf = w.float()
    scale = wf.abs().amax(1).clamp_min(1e-12) / INT8_MAX
    q = torch.round(wf / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _int8_probe(device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(3, 64, generator=g).to(device, dtype)
    q, s = quantize_int8(w)
    try:
        got = torch.ops.aten._weight_int8pack_mm(x, q.to(device), s.to(device, dtype))
    except Exception as e:  # not built for this device / dtype
        log.info("int8 weight matmul unavailable on %s/%s: %s", device, dtype, e)
        return False
    ref = F.linear(x.float(), (q.float() * s[:, None]).to(device))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got.float(), ref, atol=tol, rtol=tol))


_probes: dict[tuple[str, str, torch.dtype], bool] = {}


def _probed(kind: str, device: torch.device, dtype: torch.dtype, fn) -> bool:
    key = (kind, device.type, dtype)
    if key not in _probes:
        _probes[key] = fn(device, dtype)
    return _probes[key]


class Int8Linear(nn.Module):
    """Weight-only INT8 linear layer; activations stay in the model dtype.

    CPU: up to cpu_kernels.INT8_GEMV_MAX_ROWS rows (decode) go through the compiled int8
    GEMV, which streams the int8 weight at memory speed; more rows (prefill, compute-bound)
    through a dequantized weight and oneDNN's GEMM.  Elsewhere torch's packed op.
    `float_out` (the lm_head) returns float32 logits without a round trip through the
    model dtype."""

    def __init__(
        self,
        linear: nn.Linear | None,
        dtype: torch.dtype,
        *,
        weight: torch.Tensor | None = None,
        float_out: bool = False,
    ) -> None:
        super().__init__()
        w = (linear.weight if linear is not None else weight).detach()
        self.out_features, self.in_features = w.shape
        q, s = quantize_int8(w)
        dev = w.device
        gemv = dev.type == "cpu" and cpu_kernels.int8_gemv_supports(self.in_features)
        # [N, K] int8; for the CPU GEMV its packed layout instead (cpu_kernels.int8_pack), the
        # same bytes, which the prefill path unpacks as it widens them.
        self.register_buffer("qweight", cpu_kernels.int8_pack(q) if gemv else q.to(dev))
        self.register_buffer("scale", s.to(dev, dtype))  # [N]
        self.bias = None if linear is None or linear.bias is None else linear.bias.detach()
        self.float_out = float_out
        # The decode GEMV writes x's dtype (float32 logits for the lm_head) itself.
        out = torch.float32 if float_out else None
        n, k = self.out_features, self.in_features
        self.gemv = cpu_kernels.Int8Gemv(self.qweight, n, k, s, self.bias, out) if gemv else None
        # (torch 2.13's 16-bit CPU kernel crashes when in_features is not a multiple of 16.)
        k_ok = dtype == torch.float32 or self.in_features % 16 == 0
        self.packed_op = k_ok and _probed("int8", dev, dtype, _int8_probe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= _GEMV_MAX_ROWS:
            return self.gemv(x)  # the decode step's case, kept to one call
        x2 = x.reshape(-1, self.in_features)
        if self.gemv is not None and x2.shape[0] <= _GEMV_MAX_ROWS:
            return self.gemv(x2).view(*x.shape[:-1], self.out_features)
        if self.packed_op and self.gemv is None:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        else:
            y = F.linear(x2, self._dequant_rows(x.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        if self.float_out:
            y = y.float()
        return y.view(*x.shape[:-1], self.out_features)

    def _dequant_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The int8 values as [N, K] of `dtype` (the scale is applied after the matmul)."""
        if self.gemv is None:
            return self.qweight.to(dtype)
        return cpu_kernels.int8_unpack(self.qweight, self.out_features, self.in_features, dtype)


def quantize_model_int8(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every nn.Linear for an Int8Linear, and give the lm_head an int8 copy (decode
    reads the whole vocab x hidden matrix every token: with a small model's large
    vocabulary it is a third or more of the weight bytes).  A tied embedding keeps its
    16-bit table for lookups, which read one row per token.  Returns how many layers."""
    n = swap_linears(model, lambda linear: Int8Linear(linear, dtype))
    embed = getattr(model, "embed_tokens", None)
    if embed is None or not hasattr(model, "lm_head_int8"):
        return n
    head = model.lm_head_weight if model.lm_head_weight is not None else embed.weight
    model.lm_head_int8 = Int8Linear(None, dtype, weight=head, float_out=True)
    model.lm_head_weight = None  # untied: only the int8 copy is used from now on
    return n + 1


# ---------------------------------------------------------------------- AWQ INT4


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8 C] uint8 values 0..15, in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed[:, :, None] >> shifts) & 0xF  # [R, C, 8], nibble i = column AWQ_ORDER[i]
    cols = torch.empty_like(nib)
    cols[:, :, list(AWQ_ORDER)] = nib
    return cols.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_awq: [R, 8 C] values 0..15 -> [R, C] int32 (AutoAWQ's layout)."""
    r, n = values.shape
    v = values.to(torch.int64).reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble order
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    word = (v << shifts).sum(-1)  # < 2^32
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """Unpacked q [K, N], zeros [K/g, N], scales [K/g, N] -> float32 weight [N, K]."""
    z = zeros.float().repeat_interleave(group, 0)
    s = scales.float().repeat_interleave(group, 0)
    return ((q.float() - z) * s).t().contiguous()


def _int4_pack(q_nk: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, K] values 0..15 -> torch's packed int4 layout for `device`."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q_nk.to(torch.int32), _INT4_INNER_K_TILES
        )
    pairs = (q_nk[:, ::2].to(torch.uint8) << 4) | q_nk[:, 1::2].to(torch.uint8)  # [N, K/2]
    return torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), _INT4_INNER_K_TILES)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)


class AWQLinear(nn.Module):
    """A linear layer from INT4 tensors (AWQ's or GPTQ's, already unpacked), run by torch's
    int4 kernel; `perm` (GPTQ act-order) gathers the input into the rows' order first."""

    def __init__(
        self,
        q: torch.Tensor,  # [K, N] uint8 values 0..15
        zeros: torch.Tensor,  # [K/g, N] 0..15
        scales: torch.Tensor,  # [K/g, N]
        bias: torch.Tensor | None,
        group: int,
        dtype: torch.dtype,
        device: torch.device,
        perm: torch.Tensor | None = None,  # act-order: the input order q's rows are in
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape
        self.group = group
        self.perm = None if perm is None else perm.to(device)
        self.bias = None if bias is None else bias.to(device, dtype)
        s = scales.float()
        sz = torch.stack([s, (8.0 - zeros.float()) * s], dim=-1)  # [K/g, N, 2]
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        try:
            packed = _int4_pack(q.t().contiguous(), device)
            sz = sz.to(device, dtype).contiguous()
            if self._agrees(packed, sz, q, zeros, scales, dtype, device):
                self.packed, self.sz = packed, sz
        except Exception as e:  # kernel missing for this device / dtype / shape
            log.info("AWQ int4 kernel unavailable (%s); using a dequantized weight", e)
        if self.packed is None:
            w = awq_dequantize(q, zeros, scales, group)
            self.weight = w.to(device, dtype)

    def _agrees(self, packed, sz, q, zeros, scales, dtype, device) -> bool:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, self.in_features, generator=g).to(device, dtype)
        got = _int4_mm(x, packed, self.group, sz).float()
        ref = F.linear(x.float(), awq_dequantize(q, zeros, scales, self.group).to(device))
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        ok = bool(torch.allclose(got, ref, atol=tol * ref.abs().max().item(), rtol=tol))
        if not ok:
            log.warning("AWQ int4 kernel disagrees with the dequantized weight; not used")
        return ok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.packed is not None:
            y = _int4_mm(x2, self.packed, self.group, self.sz)
        else:
            y = F.linear(x2, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


# ---------------------------------------------------------------------- FP8 (W8A8)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_fp8_logged: set[str] = set()


def _log_once(msg: str, *args: object) -> None:
    key = msg % args
    if key not in _fp8_logged:
        _fp8_logged.add(key)
        log.info(msg, *args)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> float8_e4m3fn [N, K] and float32 scales [N], per output channel.
    Clamped before the cast: e4m3fn has no infinity, and out-of-range values become NaN."""
    wf = w.float()
    scale = wf.abs().amax(1).clamp_min(1e-12) / FP8_MAX
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> float8_e4m3fn [M, K] and float32 scales [M, 1], one per token
    (dynamic: from this call's values)."""
    xf = x.float()
    scale = xf.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """W8A8 FP8 linear layer: `qweight` float8_e4m3fn [N, K], `scale` float32 [N] per
    output channel; the input is quantized per token on every call, the result comes back
    in the model dtype with the bias added after the product."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if qweight.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Linear needs a {FP8_DTYPE} weight, got {qweight.dtype}")
        self.out_features, self.in_features = qweight.shape
        dev = qweight.device
        self.register_buffer("scale_b", scale.float().reshape(1, -1).to(dev).contiguous())
        self.bias = None if bias is None else bias.detach().to(dev, dtype)
        # _scaled_mm's output dtype: the model's where the device takes it, else bf16 (CUDA's
        # row-wise scaling writes bf16 only) widened after; None: the fallback below.
        self.mm_out: torch.dtype | None = None
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight", None)
        why = ""
        for out in dict.fromkeys((dtype, torch.bfloat16)):
            try:
                ok = self._agrees(out, dtype)
            except (RuntimeError, NotImplementedError) as e:
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                continue
            if ok:
                self.mm_out = out
                break
            why = f"its {out} result disagrees with the dequantized product"
        if self.mm_out is None:
            _log_once(
                "FP8: torch._scaled_mm refuses [%d, %d] on %s (%s); that shape runs the FP8 "
                "values widened to %s",
                self.out_features, self.in_features, dev.type, why, dtype,
            )  # fmt: skip
            # Exact: every e4m3 value is a bf16 / fp16 / fp32 value.
            self.weight, self.qweight = qweight.to(dtype), None

    def _agrees(self, out: torch.dtype, dtype: torch.dtype) -> bool:
        """One small product through _scaled_mm against float32 on the dequantized
        operands (the layer's own shape: a refusal raises here, at load, not mid-step)."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, self.in_features, generator=g).to(self.qweight.device, dtype)
        got = self._scaled_mm(x, out).float()
        xq, sa = quantize_fp8_rows(x)
        ref = (xq.float() * sa) @ (self.qweight.float() * self.scale_b.reshape(-1, 1)).T
        tol = 1e-4 if out == torch.float32 else 2.0**-7
        return bool(torch.allclose(got, ref, atol=tol * ref.abs().max().item(), rtol=tol))

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> Fp8Linear:
        q, s = quantize_fp8(linear.weight.detach())
        return cls(q, s, linear.bias, dtype)

    def _scaled_mm(self, x2: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        xq, sa = quantize_fp8_rows(x2)
        assert self.qweight is not None
        return torch._scaled_mm(
            xq, self.qweight.t(), scale_a=sa, scale_b=self.scale_b, out_dtype=out
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.mm_out is not None:
            y = self._scaled_mm(x2, self.mm_out).to(x.dtype)
        else:
            assert self.weight is not None
            xq, sa = quantize_fp8_rows(x2)
            y = (F.linear(xq.to(self.weight.dtype), self.weight) * (sa * self.scale_b)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies by, float32 [N, K] (tests, references)."""
        w = self.qweight if self.qweight is not None else self.weight
        assert w is not None
        return w.float() * self.scale_b.reshape(-1, 1)


def quantize_model_fp8(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every projection (nn.Linear) for an Fp8Linear quantized from its weight.  The
    lm_head and the embedding stay in the model dtype: the logits are what sampling reads
    and per-token FP8 rounding of the final hidden state would move every one of them,
    while at the 8B shape the head is ~7% of the weight bytes.  Returns how many layers."""
    return swap_linears(model, lambda linear: Fp8Linear.from_linear(linear, dtype))
