"""Quantized KV cache (int8 / fp8 e4m3 with per-(token, kv head) scales): the quantizer's
error bounds, and the compiled CPU kernels and the torch path reading such a cache against
the definition over the dequantized values."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from gpu.attention.torch_backend import paged_attention_reference
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.attention import CpuAttentionBackend
from gpu.kernels._common import fp8e4m3_decode, fp8e4m3_encode
from gpu.kv_quant import bytes_per_token, dequantize, quantize
from tests.gpu.test_cpu_kernels import decode_case, prefill_case

KINDS = ["int8", "fp8"]
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")


def quantize_cache(cache: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    nb, bs, h, d = cache.shape
    q, s = quantize(cache.reshape(-1, h, d), kind)
    return q.view(nb, bs, h, d), s.view(nb, bs, h)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_error_bounds(kind):
    g = torch.Generator().manual_seed(0)
    # Heads of very different magnitudes, an all-zero row, and outlier channels.
    x = torch.randn(64, 4, 128, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 30.0])[:, None]
    x[3, 1] = 0
    x[5, 2, 7] = 400.0
    q, s = quantize(x, kind)
    assert s.shape == (64, 4) and s.dtype == torch.bfloat16
    back = dequantize(q, s, torch.float32)
    s = s.float()
    assert torch.isfinite(back).all() and (back[3, 1] == 0).all()
    err = (back - x).abs()
    if kind == "int8":
        assert q.dtype == torch.int8 and q.abs().max() <= 127
        assert (err <= s[..., None] * 0.5 + 1e-6 * x.abs()).all()  # half a step
    else:
        assert q.dtype == torch.uint8
        # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal steps of scale * 2^-9.
        assert (err <= x.abs() * 2**-4 + s[..., None] * 2**-10 + 1e-7).all()
    # Each row's absolute max maps onto the format's largest value: full resolution per head
    # (up to the scale's bf16 rounding, < 2^-9 relative).
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=2**-8)


def test_bytes_per_token():
    # 8 kv heads x 128 dims: bf16 4096 bytes (K + V); int8 2048 + bf16 scales 32.
    assert bytes_per_token("auto", torch.bfloat16, 8, 128) == 4096
    assert bytes_per_token("auto", torch.float32, 8, 128) == 8192
    assert bytes_per_token("int8", torch.bfloat16, 8, 128) == 2048 + 32
    assert bytes_per_token("fp8", torch.float32, 8, 128) == 2048 + 32


def tol_for(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (8, 1, 128), (6, 2, 40), (3, 1, 33)])
@pytest.mark.parametrize("bs", [16, 8])
def test_decode_kernel_quantized(kind, dtype, hq, hkv, d, bs):
    lens = [1, bs + 1, 3 * bs + 5, 97, 300]
    q, kc, vc, meta = decode_case(hq * 7 + d + bs, lens, hq, hkv, d, bs, dtype)
    kq, ks = quantize_cache(kc, kind)
    vq, vs = quantize_cache(vc, kind)
    got = cpu_kernels.decode_attention(
        q, kq, vq, meta.block_tables, meta.seq_lens, d**-0.5, k_scale=ks, v_scale=vs
    )
    ref = paged_attention_reference(q, kq, vq, meta, d**-0.5, ks, vs)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=tol_for(dtype), rtol=tol_for(dtype))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_kernel_quantized_split_contexts(kind, threads):
    # Few long sequences: the kernel splits contexts into ranges and merges them.
    lens, hq, hkv, d = [2000, 33], 8, 2, 64
    q, kc, vc, meta = decode_case(41, lens, hq, hkv, d, 16, torch.float32)
    kq, ks = quantize_cache(kc, kind)
    vq, vs = quantize_cache(vc, kind)
    got = cpu_kernels.decode_attention(
        q, kq, vq, meta.block_tables, meta.seq_lens, 0.125, threads, k_scale=ks, v_scale=vs
    )
    ref = paged_attention_reference(q, kq, vq, meta, 0.125, ks, vs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (4, 2, 33)])
def test_prefill_kernel_quantized(kind, dtype, hq, hkv, d):
    qlens, ctxs = [1, 16, 17, 37, 150], [0, 5, 0, 35, 130]
    q, kc, vc, meta = prefill_case(hq + d, qlens, ctxs, hq, hkv, d, 16, dtype)
    kq, ks = quantize_cache(kc, kind)
    vq, vs = quantize_cache(vc, kind)
    got = cpu_kernels.prefill_attention(
        q, kq, vq, meta.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    ref = paged_attention_reference(q, kq, vq, meta, d**-0.5, ks, vs)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=tol_for(dtype), rtol=tol_for(dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_quantized_step_kernel_vs_torch_path(kind, dtype, monkeypatch):
    # 3 decodes and 3 prefill chunks through CpuAttentionBackend.forward: the backend
    # quantizes the new K/V as it writes them; kernels, the torch path and the definition
    # agree, and the unquantized result is close.
    hq, hkv, d, bs = 6, 2, 64, 16
    qlens, ctxs = [1, 1, 1, 30, 17, 64], [9, 40, 16, 0, 50, 33]
    q, kc, vc, meta = prefill_case(11, qlens, ctxs, hq, hkv, d, bs, dtype, num_decodes=3)
    g = torch.Generator().manual_seed(12)
    k = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    v = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    kq, ks = quantize_cache(kc, kind)
    vq, vs = quantize_cache(vc, kind)
    scale = d**-0.5
    outs, caches = [], []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
        elif not cpu_kernels.available():
            continue
        be = CpuAttentionBackend(hq, hkv, d, scale)
        assert be._use_cpu_kernel(q) == use_kernel
        c = (kq.clone(), vq.clone(), ks.clone(), vs.clone())
        outs.append(be.forward(q, k, v, c[0], c[1], meta, c[2], c[3]))
        caches.append(c)
    ref = paged_attention_reference(q, *caches[-1][:2], meta, scale, *caches[-1][2:])
    for c in caches[:-1]:
        assert all(torch.equal(a, b) for a, b in zip(c, caches[-1], strict=True))
    for out in outs:
        torch.testing.assert_close(
            out.float(), ref.float(), atol=tol_for(dtype), rtol=tol_for(dtype)
        )
    # vs the unquantized cache: attention outputs are averages of V rows, so their error is
    # about V's quantization error (int8: ~0.4% of the row max; fp8: ~3% of each value).
    kc2, vc2 = kc.clone(), vc.clone()
    plain = CpuAttentionBackend(hq, hkv, d, scale).forward(q, k, v, kc2, vc2, meta)
    err = (outs[-1].float() - plain.float()).abs().max().item()
    assert err < (0.05 if kind == "int8" else 0.25), err


# ---- Triton (CPU: the interpreter, as tests/conftest.py sets TRITON_INTERPRET=1) -------

TRITON_CASES = [
    # (id, query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, splits)
    ("mixed-f32", (1, 1, 24, 9), (40, 7, 0, 50), 4, 2, 64, 16, torch.float32, None),
    ("decode-bf16", (1, 1, 1), (15, 33, 70), 8, 2, 128, 32, torch.bfloat16, None),
    ("decode-split-f32", (1, 1), (130, 90), 4, 1, 64, 16, torch.float32, 3),
]


def _triton_or_skip():
    from gpu.kernels._common import is_interpreted
    from gpu.kernels.attention import _paged_attention_kernel

    if not torch.cuda.is_available() and not is_interpreted(_paged_attention_kernel):
        pytest.skip("no CUDA and the Triton kernels are compiled")
    from gpu.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c[0])
def test_triton_quantized_matches_torch_path(kind, case):
    # The Triton write kernel quantizes as the torch path does (values within one step,
    # same scales) and the attention kernel dequantizes as it loads.
    from gpu.kernels.testing import make_paged_batch

    cls = _triton_or_skip()
    cid, qlens, ctxs, hq, hkv, d, bs, dtype, splits = case
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = make_paged_batch(
        qlens, ctxs, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
        device=dev, seed=len(cid), poison=3.0,
    )  # fmt: skip
    kq, ks = quantize_cache(b.k_cache, kind)
    vq, vs = quantize_cache(b.v_cache, kind)
    scale = d**-0.5
    torch_c = [t.clone() for t in (kq, vq, ks, vs)]
    ref = CpuAttentionBackend(hq, hkv, d, scale).forward(
        b.q, b.k, b.v, torch_c[0], torch_c[1], b.meta, torch_c[2], torch_c[3]
    )
    tri_c = [t.clone() for t in (kq, vq, ks, vs)]
    out = cls(hq, hkv, d, scale, num_splits=splits).forward(
        b.q, b.k, b.v, tri_c[0], tri_c[1], b.meta, tri_c[2], tri_c[3]
    )
    torch.testing.assert_close(tri_c[2], torch_c[2], atol=0, rtol=1e-6)  # identical scales
    torch.testing.assert_close(tri_c[3], torch_c[3], atol=0, rtol=1e-6)
    for qv, tv, s in ((tri_c[0], torch_c[0], tri_c[2]), (tri_c[1], torch_c[1], tri_c[3])):
        diff = (dequantize(qv, s, torch.float32) - dequantize(tv, s, torch.float32)).abs()
        # int8 bf16 inputs may land on a rounding tie either side: at most one step.
        assert (diff <= s[..., None] * (1.0 if kind == "int8" else 0.0) + 1e-7).all(), cid
    # Outputs over (nearly) the same cache; bf16 rounding of the dequantized operands.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref2 = CpuAttentionBackend(hq, hkv, d, scale).forward(
        b.q, b.k, b.v, *[t.clone() for t in tri_c[:2]], b.meta, *[t.clone() for t in tri_c[2:]]
    )
    torch.testing.assert_close(out.float(), ref2.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref.float(), atol=max(tol, 2e-2), rtol=tol)


@triton.jit
def _fp8_roundtrip(x_ptr, b_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    b = fp8e4m3_encode(tl.load(x_ptr + o))
    tl.store(b_ptr + o, b)
    tl.store(y_ptr + o, fp8e4m3_decode(b))


def test_triton_fp8_codec_matches_torch():
    _triton_or_skip()
    n = 4096
    g = torch.Generator().manual_seed(5)
    x = torch.cat(
        [torch.linspace(-448, 448, n // 2), torch.randn(n // 4, generator=g) * 0.02,
         torch.randn(n // 4, generator=g) * 30]
    ).clamp(-448, 448)  # fmt: skip
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = x.to(dev)
    b = torch.zeros(n, dtype=torch.uint8, device=dev)
    y = torch.zeros(n, device=dev)
    _fp8_roundtrip[(1,)](x, b, y, N=n)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(b, want.view(torch.uint8))  # round to nearest even, subnormals too
    assert torch.equal(y, want.float())
