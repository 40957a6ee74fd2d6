"""KV-cache write: scatter the step's new K/V rows into their paged-cache slots; for a
quantized cache (gpu/kv_quant.py) each (token, kv head) row is quantized on the way, its
scale stored beside it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.attention.torch_backend import write_kv_reference
from gpu.kernels._common import (
    SUPPORTED_DTYPES,
    cast_to,
    check_device,
    check_dtype,
    check_kv_scales,
    check_last_dim_contiguous,
    check_shape,
    fp8e4m3_encode,
    is_interpreted,
    next_pow2,
    round_to,
    tl_dtype,
)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # interpreted: round to bf16 in software (see round_to)
    k_scale_ptr=None,  # quantized: [num_blocks, block_size, num_kv_heads] bf16, contiguous
    v_scale_ptr=None,
    QUANT: tl.constexpr = 0,  # 0: store as CACHE_DTYPE; 1: int8; 2: fp8 e4m3 bytes
):
    # One program per token moves all of its kv heads: [HEADS_PAD, DIM_PAD] per tensor.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # A negative slot marks a padding token (CUDA-graph batches): nothing is written.
    # (Compared after broadcasting: the interpreter mis-types scalar-bool & block-bool.)
    slots = tl.zeros([HEADS_PAD, DIM_PAD], dtype=tl.int64) + slot
    mask = (slots >= 0) & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    if QUANT == 0:
        # Via fp32: exact when the dtypes match, rounded to nearest when the cache is narrower.
        k = cast_to(k.to(tl.float32), CACHE_DTYPE, SOFT_BF16)
        v = cast_to(v.to(tl.float32), CACHE_DTYPE, SOFT_BF16)
    else:
        # Scales sit at the same (block, slot) as the values: [.., block_size, heads].
        s_off = (block * BLOCK_SIZE + offset) * NUM_KV_HEADS + h
        s_mask = ((tl.zeros([HEADS_PAD], dtype=tl.int64) + slot) >= 0) & (h < NUM_KV_HEADS)
        k = _quantize_rows(k.to(tl.float32), k_scale_ptr + s_off, s_mask, QUANT, SOFT_BF16)
        v = _quantize_rows(v.to(tl.float32), v_scale_ptr + s_off, s_mask, QUANT, SOFT_BF16)
    tl.store(kc + h[:, None] * stride_kch + d[None, :], k, mask=mask)
    tl.store(vc + h[:, None] * stride_vch + d[None, :], v, mask=mask)


@triton.jit
def _quantize_rows(x, scale_ptrs, s_mask, QUANT: tl.constexpr, SOFT_BF16: tl.constexpr):
    """[HEADS, DIM] fp32 rows -> int8 / fp8 bytes, storing each row's bf16 scale (as
    gpu.kv_quant.quantize: absmax per row, the scale rounded to bf16 before the values are
    quantized against it, int8 rounds half up)."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-12)  # [HEADS]
    top = 127.0 if QUANT == 1 else 448.0
    s = round_to(amax / top, tl.bfloat16, SOFT_BF16)
    tl.store(scale_ptrs, cast_to(s, tl.bfloat16, SOFT_BF16), mask=s_mask)
    y = x * (1.0 / s)[:, None]
    if QUANT == 1:
        q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        q = fp8e4m3_encode(tl.minimum(tl.maximum(y, -448.0), 448.0))
    return q


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip this token
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, heads]
    v_scale: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> None:
    """Store each new token's K/V at its flat slot (block * block_size + offset);
    quantized caches (int8 / uint8 fp8 values + bf16 scales) quantize on the way.
    check=False skips the argument checks (see TritonAttentionBackend.forward)."""
    if check:
        quant = check_kv_scales("write_kv", k_cache, v_cache, k_scale, v_scale)
        num_tokens, block_size, kv_heads, head_dim = _check_write_kv(
            k, v, k_cache, v_cache, slot_mapping, quant
        )
    else:
        quant = 0 if k_scale is None else (1 if k_cache.dtype == torch.int8 else 2)
        num_tokens = k.shape[0]
        _, block_size, kv_heads, head_dim = k_cache.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(kv_heads),
        DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        CACHE_DTYPE=tl_dtype(k.dtype if quant else k_cache.dtype),
        SOFT_BF16=is_interpreted(_write_kv_kernel),
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        QUANT=quant,
        num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )


def _check_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: int,
) -> tuple[int, int, int, int]:
    """write_kv's input checks; returns (num_tokens, block_size, kv_heads, head_dim)."""
    name = "write_kv"
    check_device(_write_kv_kernel, name, k, v, k_cache, v_cache, slot_mapping)
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache has shape {list(k_cache.shape)}, expected "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    _, block_size, kv_heads, head_dim = k_cache.shape
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    num_tokens = k.shape[0] if k.dim() else 0
    check_shape(name, "k", k, (num_tokens, kv_heads, head_dim))
    check_shape(name, "v", v, (num_tokens, kv_heads, head_dim))
    check_shape(name, "slot_mapping", slot_mapping, (num_tokens,))
    check_dtype(name, "slot_mapping", slot_mapping, (torch.int64,))
    caches = () if quant else (("k_cache", k_cache), ("v_cache", v_cache))
    for what, t in (("k", k), ("v", v), *caches):
        check_dtype(name, what, t, SUPPORTED_DTYPES)
        check_last_dim_contiguous(name, what, t)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"{name}: slot_mapping must be contiguous")
    return num_tokens, block_size, kv_heads, head_dim


def write_kv_skip_reference(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """write_kv_reference, honouring negative (padding) slots as the kernel does."""
    keep = slot_mapping >= 0
    write_kv_reference(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep], k_scale, v_scale)
