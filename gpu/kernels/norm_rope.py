"""Fused RMSNorm (+ residual add) and in-place rotary embedding (neox / rotate-half).

Opt-in: torch runs these as a handful of elementwise kernels each; fusing them saves
launches and memory passes, which only matters on a GPU, so the model uses them only when
the GPU check shows they pay.  Both kernels round intermediate values to the activation
dtype exactly where the torch references (Hugging Face's Llama code) do, so a bf16 model
gives the same bits either way up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels._common import (
    SUPPORTED_DTYPES,
    cast_to,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
    is_interpreted,
    next_pow2,
    round_to,
    tl_dtype,
)

# --------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    res_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    w_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    res_out_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL): x + residual
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two
    DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # interpreted: bf16 rounding in software (see round_to)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype, as `residual + hidden` is in torch,
        # and that rounded value is both the new residual and what gets normalised.
        x = round_to(x + r, DTYPE, SOFT_BF16)
        tl.store(res_out_ptr + row * stride_ro + cols, cast_to(x, DTYPE, SOFT_BF16), mask=ok)
    var = tl.sum(x * x, 0) / hidden
    y = round_to(x * tl.rsqrt(var + eps), DTYPE, SOFT_BF16)  # rounded before the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, cast_to(y * w, DTYPE, SOFT_BF16), mask=ok)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight; with `residual`, returns (RMSNorm(x + residual) * weight,
    x + residual) like vLLM's fused_add_rms_norm (new tensors; the inputs are untouched)."""
    name = "rms_norm"
    tensors = [x, weight] + ([residual] if residual is not None else [])
    check_device(_rms_norm_kernel, name, *tensors)
    if x.dim() != 2:
        raise ValueError(f"{name}: x has shape {list(x.shape)}, expected [num_tokens, hidden]")
    num_tokens, hidden = x.shape
    check_shape(name, "weight", weight, (hidden,))
    check_dtype(name, "x", x, SUPPORTED_DTYPES)
    if weight.dtype != x.dtype:
        raise ValueError(f"{name}: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    check_last_dim_contiguous(name, "x", x)
    check_last_dim_contiguous(name, "weight", weight)
    if residual is not None:
        check_shape(name, "residual", residual, (num_tokens, hidden))
        if residual.dtype != x.dtype:
            raise ValueError(
                f"{name}: residual dtype {residual.dtype} differs from x dtype {x.dtype}"
            )
        check_last_dim_contiguous(name, "residual", residual)
    if hidden > 65536:
        raise ValueError(f"{name}: hidden size {hidden} is larger than one program handles")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else out
    if num_tokens:
        block = next_pow2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out,
            hidden,
            float(eps),
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            DTYPE=tl_dtype(x.dtype),
            SOFT_BF16=is_interpreted(_rms_norm_kernel),
            num_warps=min(16, max(1, block // 512)),
        )
    return (out, res_out) if residual is not None else out


def rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face LlamaRMSNorm, with the decoder layer's residual add in front."""
    if residual is not None:
        x = x + residual
        new_residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return (out, new_residual) if residual is not None else out


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's first head
    stride_h,
    num_heads,
    cos,  # [1, HALF] fp32, already rounded to DTYPE
    sin,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF)
    ok = (h[:, None] < num_heads) & (d[None, :] < HALF)
    p1 = base_ptr + h[:, None] * stride_h + d[None, :]  # first half of each head
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF]
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded as torch does in DTYPE.
    a1 = round_to(x1 * cos, DTYPE, SOFT_BF16)
    b1 = round_to(x2 * sin, DTYPE, SOFT_BF16)
    a2 = round_to(x2 * cos, DTYPE, SOFT_BF16)
    b2 = round_to(x1 * sin, DTYPE, SOFT_BF16)
    tl.store(p1, cast_to(a1 - b1, DTYPE, SOFT_BF16), mask=ok)
    tl.store(p1 + HALF, cast_to(a2 + b2, DTYPE, SOFT_BF16), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_ptr,  # [max_pos, head_dim // 2]
    sin_ptr,
    pos_ptr,  # [num_tokens] int64
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    # The cache is cast to the activation dtype first, as transformers does.
    cos = round_to(tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32), DTYPE, SOFT_BF16)
    sin = round_to(tl.load(sin_ptr + pos * stride_sin + d).to(tl.float32), DTYPE, SOFT_BF16)
    cos = cos[None, :]  # [1, HALF]
    sin = sin[None, :]
    _rotate_heads(
        q_ptr + t * stride_qt, stride_qh, num_heads, cos, sin, HALF, Q_HEADS_PAD, DTYPE, SOFT_BF16
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        stride_kh,
        num_kv_heads,
        cos,
        sin,
        HALF,
        K_HEADS_PAD,
        DTYPE,
        SOFT_BF16,
    )


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_cache: torch.Tensor,  # [max_pos, head_dim // 2]
    sin_cache: torch.Tensor,  # [max_pos, head_dim // 2]
    positions: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Rotate-half (neox / Llama) rotary embedding of q and k, in place.

    q and k may be strided views (e.g. slices of a fused qkv projection) as long as each
    head's values are contiguous.  Positions are not range-checked on the device.
    """
    name = "apply_rotary"
    check_device(_rotary_kernel, name, q, k, cos_cache, sin_cache, positions)
    if q.dim() != 3:
        raise ValueError(
            f"{name}: q has shape {list(q.shape)}, expected [num_tokens, num_heads, head_dim]"
        )
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"{name}: head_dim {head_dim} must be an even power of two")
    half = head_dim // 2
    check_shape(name, "k", k, (num_tokens, None, head_dim))
    check_shape(name, "cos_cache", cos_cache, (None, half))
    check_shape(name, "sin_cache", sin_cache, tuple(cos_cache.shape))
    check_shape(name, "positions", positions, (num_tokens,))
    check_dtype(name, "positions", positions, (torch.int64,))
    check_dtype(name, "q", q, SUPPORTED_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"{name}: k dtype {k.dtype} differs from q dtype {q.dtype}")
    for what, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_dtype(name, what, t, SUPPORTED_DTYPES)
    for what, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, what, t)
    if positions.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"{name}: positions must be contiguous")
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos_cache,
        sin_cache,
        positions,
        num_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        HALF=half,
        Q_HEADS_PAD=next_pow2(num_heads),
        K_HEADS_PAD=next_pow2(num_kv_heads),
        DTYPE=tl_dtype(q.dtype),
        SOFT_BF16=is_interpreted(_rotary_kernel),
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        # Without this the compiler turns round(x1*cos) - round(x2*sin) into one fused
        # multiply-add in bf16/fp16 (seen in the sm_90 PTX, and on an H200 as 1-ulp
        # differences from torch): torch rounds each product, and so must we.
        enable_fp_fusion=False,
    )


def rotary_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_pos, head_dim // 2]
    sin_cache: torch.Tensor,
    positions: torch.Tensor,  # [num_tokens] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's apply_rotary_pos_emb (out of place)."""
    cos = cos_cache[positions].to(q.dtype)  # [T, half]
    sin = sin_cache[positions].to(q.dtype)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # [T, 1, head_dim]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim // 2] fp32
    max_pos: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [max_pos, head_dim // 2] fp32
    """cos/sin of position * inv_freq, in fp32 as transformers computes them."""
    pos = torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(pos, inv_freq.float())
    return freqs.cos(), freqs.sin()
