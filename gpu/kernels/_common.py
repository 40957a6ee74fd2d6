"""Helpers shared by the kernel wrappers: argument checks and launch-mode detection.

Triton decides at decoration time whether a kernel is compiled for a GPU or run by its
numpy interpreter (TRITON_INTERPRET=1).  The wrappers ask the kernel object itself which
one it is, so a CPU tensor handed to a compiled kernel fails with a clear message instead
of "0 active drivers".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128)
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (16, 32)

_TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated while TRITON_INTERPRET=1 (numpy interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TL_DTYPES[dtype]


def dot_dtype(dtype: torch.dtype, interpreted: bool) -> tl.dtype:
    """The dtype tl.dot operands are cast to.

    On a GPU, 16-bit operands go to the tensor cores as they are (fp32 accumulation).  The
    interpreter computes 16-bit dots wrongly, so there the kernels round the operands to the
    16-bit dtype (same rounding as on a GPU) and then multiply them in fp32.
    """
    if interpreted or dtype == torch.float32:
        return tl.float32
    return _TL_DTYPES[dtype]


@triton.jit
def round_to(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `x` rounded to DTYPE's precision (nearest, ties to even), still as fp32.

    SOFT_BF16: round to bf16 with integer ops.  The interpreter's fp32 -> bf16 cast
    truncates, where a GPU rounds to nearest; the kernels pass SOFT_BF16 when interpreted
    so CPU tests see the GPU's bits.  (fp32 -> fp16 casts are correct there.)
    """
    if SOFT_BF16 and DTYPE == tl.bfloat16:  # noqa: SIM300
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 `x` converted to DTYPE with round-to-nearest-even, also under the interpreter."""
    if SOFT_BF16 and DTYPE == tl.bfloat16:  # noqa: SIM300
        return round_to(x, DTYPE, SOFT_BF16).to(DTYPE)  # exact: already representable
    else:
        return x.to(DTYPE)


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(1, n)))


def check_device(kernel: object, name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and one this kernel can run on."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and is_interpreted(kernel):
        return
    if dev.type == "cpu":
        raise ValueError(
            f"{name}: tensors are on the CPU but the Triton kernels were compiled for a GPU; "
            "set TRITON_INTERPRET=1 before importing gpu.kernels to run them on the CPU "
            "(slow; for tests), or use the torch attention backend"
        )
    raise ValueError(f"{name}: unsupported device {dev} (cuda, or cpu under TRITON_INTERPRET=1)")


def check_dtype(name: str, what: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name}: {what} dtype {t.dtype} is not supported (expected {names})")


def check_shape(name: str, what: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` entries of None match any size."""
    ok = t.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: {what} has shape {list(t.shape)}, expected {want}")


def check_kv_scales(
    name: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    strided: bool = False,
) -> int:
    """0 for a plain cache, 1 for int8, 2 for fp8 (uint8 bytes), after checking the
    per-token, per-KV-head scales [blocks, block_size, kv_heads] beside a quantized cache.
    `strided`: the kernel takes the scales' strides (the same for k and v, unit along heads);
    otherwise they must be contiguous."""
    if k_scale is None and v_scale is None:
        return 0
    if k_scale is None or v_scale is None:
        raise ValueError(f"{name}: a quantized cache needs both k_scale and v_scale")
    if k_cache.dtype not in (torch.int8, torch.uint8) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{name}: quantized caches hold int8 or uint8 (fp8 bytes), got {k_cache.dtype} "
            f"and {v_cache.dtype}"
        )
    for what, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_shape(name, what, s, tuple(k_cache.shape[:3]))
        check_dtype(name, what, s, (torch.bfloat16,))
        if strided and (s.stride() != k_scale.stride() or s.stride(2) != 1):
            raise ValueError(f"{name}: {what} must be contiguous like k_scale")
        if not strided and not s.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous")
        if s.device != k_cache.device:
            raise ValueError(f"{name}: {what} is on {s.device}, the cache on {k_cache.device}")
    return 1 if k_cache.dtype == torch.int8 else 2


def check_last_dim_contiguous(name: str, what: str, t: torch.Tensor) -> None:
    # Rows are read as vectors; a strided last dim would silently turn into a gather.
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: {what} must be contiguous in its last dim (stride {t.stride(-1)}); "
            "call .contiguous() first"
        )


def check_head_dim(name: str, head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{name}: head_dim {head_dim} is not supported by the Triton kernels "
            f"(supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
        )


def check_block_size(name: str, block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"{name}: block_size {block_size} is not supported by the Triton kernels "
            f"(supported: {', '.join(map(str, SUPPORTED_BLOCK_SIZES))})"
        )


# float8 e4m3 ("fn": bias 7, no infinities, 448 the largest finite value) in integer ops.
# The interpreter's fp32 -> float8e4nv cast gets the exponent wrong where rounding carries
# into it (124.5 becomes 64, not 128), so the quantized-KV kernels encode and decode the
# bytes themselves, one way on every target.


@triton.jit
def fp8e4m3_encode(x):
    """fp32 `x` with |x| <= 448 -> e4m3 bytes (uint8), rounded to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # Normal: round the fp32 mantissa to 3 bits (ties to even), rebias the exponent 127 -> 7.
    r = (a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) & 0xFFF00000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormal (|x| < 2^-6): multiples of 2^-9; 2^23 + y - 2^23 rounds y to even.
    m = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    byte = tl.where(a < 0.015625, m, normal) | sign
    return byte.to(tl.uint8)


@triton.jit
def fp8e4m3_decode(b):
    """e4m3 bytes (any integer type) -> fp32."""
    u = b.to(tl.uint32) & 0xFF
    em = u & 0x7F
    normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    mag = tl.where(em < 8, em.to(tl.float32) * 0.001953125, normal)
    return tl.where((u & 0x80) != 0, -mag, mag)
