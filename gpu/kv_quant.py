"""Quantized KV cache: int8 and fp8 (e4m3) values with a bf16 scale per token and KV head.

A layer's cache is (k, v) in the model dtype, or (k, v, k_scale, v_scale) when quantized:
values [num_blocks, block_size, num_kv_heads, head_dim] (int8, or the raw bytes of
float8_e4m3fn as uint8) and scales [num_blocks, block_size, num_kv_heads] bfloat16.

Why per token and KV head: a token's K/V is written once, when it is computed, and never
again, so a scale that covers only that token is final at write time; a per-block or
per-tensor scale would need every earlier token requantized whenever a new one exceeds it
(or a calibrated static range that outliers clip against).  Within a token, KV heads differ
by orders of magnitude (K has per-head outlier channels), so one scale per head keeps the
small heads' resolution.  Scales live beside the values at the same (block, slot), so
paging, copy-on-write, prefix sharing and payload export move them with their block.

Why bfloat16 scales: a float32 scale costs 4 bytes per (token, head) beside head_dim bytes
of values (1.88x the tokens of a 16-bit cache at head_dim 64); 2 bytes give 1.94x (2 x 64 /
(64 + 2)).  The scale is rounded to bf16 *before* the values are quantized against it, so
values x scale still represent each element to half a quantization step; the rounding only
moves the step by < 0.4%.  (bf16 rather than fp16: fp32's range, so tiny rows cannot
underflow to a zero scale, and the CPU kernels already read bf16.)  The rest of the
residual to 2x is the scales themselves: 2 bytes per 64 values.

Dequantization happens where the values are loaded (attention kernels, the torch path's
gather), never as a pass over the cache.
"""

from __future__ import annotations

import torch

from gpu.config import ModelLoadError

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Floor on a row's absolute max: an all-zero row gets a tiny positive scale, never 0/0.
_AMAX_FLOOR = 1e-12
SCALE_DTYPE = torch.bfloat16


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(
            f"kv_cache_dtype {name!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return name


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element type of the cache's value tensors."""
    return {"auto": model_dtype, "int8": torch.int8, "fp8": torch.uint8}[kind]


def bytes_per_token(kind: str, model_dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> int:
    """K and V bytes of one token in one layer (values plus scales)."""
    elem = torch.empty((), dtype=storage_dtype(kind, model_dtype)).element_size()
    scales = 0 if kind == "auto" else SCALE_DTYPE.itemsize
    return 2 * num_kv_heads * (head_dim * elem + scales)


def quant_kind(values: torch.Tensor) -> str:
    """int8 or fp8, from a quantized cache's value tensor."""
    return "int8" if values.dtype == torch.int8 else "fp8"


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] -> values [T, H, D] (int8 / fp8 bytes) and scales [T, H] bfloat16, with
    x ~= values * scales[..., None].  The scale is rounded to bf16 first and the values
    quantized against the rounded one; int8 rounds half up (floor(y + 0.5)), as the Triton
    write kernel does."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(_AMAX_FLOOR)  # [T, H]
    top = INT8_MAX if kind == "int8" else FP8_MAX
    scale = (amax / top).to(SCALE_DTYPE)
    y = xf * (1.0 / scale.float())[..., None]
    if kind == "int8":
        q = torch.floor(y + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] with scales [...] -> dtype."""
    if values.dtype == torch.int8:
        f = values.float()
    else:
        f = values.view(torch.float8_e4m3fn).float()
    return (f * scales[..., None]).to(dtype)


def write_quantized(
    x: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [num_blocks, block_size, H, D] int8 / uint8
    scales: torch.Tensor,  # [num_blocks, block_size, H] bfloat16
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Quantize the step's new rows and store them (values and scales) at their slots."""
    q, s = quantize(x, quant_kind(cache))
    h, d = cache.shape[2], cache.shape[3]
    cache.view(-1, h, d).index_copy_(0, slot_mapping, q)
    scales.view(-1, h).index_copy_(0, slot_mapping, s)
