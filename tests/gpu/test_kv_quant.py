"""Quantized KV cache (int8 / fp8 e4m3 with per-(token, kv head) scales): the quantizer's
error bounds, and the compiled CPU kernels and the torch path reading such a cache against
the definition over the dequantized values."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_kernels
from gpu.attention.torch_backend import TorchAttentionBackend, paged_attention_reference
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
    assert s.shape == (64, 4) and s.dtype == torch.float32
    back = dequantize(q, s, torch.float32)
    assert torch.isfinite(back).all() and (back[3, 1] == 0).all()
    err = (back - x).abs()
    if kind == "int8":
        assert q.dtype == torch.int8 and q.abs().max() <= 127
        assert (err <= s[..., None] * 0.5 + 1e-6 * x.abs()).all()  # half a step
    else:
        assert q.dtype == torch.uint8
        # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal steps of scale * 2^-9.
        assert (err <= x.abs() * 2**-4 + s[..., None] * 2**-10 + 1e-7).all()
    # Each row's absolute max maps onto the format's largest value: full resolution per head.
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)


def test_bytes_per_token():
    # 8 kv heads x 128 dims: bf16 4096 bytes (K + V); int8 2048 + scales 64.
    assert bytes_per_token("auto", torch.bfloat16, 8, 128) == 4096
    assert bytes_per_token("auto", torch.float32, 8, 128) == 8192
    assert bytes_per_token("int8", torch.bfloat16, 8, 128) == 2048 + 64
    assert bytes_per_token("fp8", torch.float32, 8, 128) == 2048 + 64


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
    # 3 decodes and 3 prefill chunks through TorchAttentionBackend.forward: the backend
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
        be = TorchAttentionBackend(hq, hkv, d, scale)
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
    plain = TorchAttentionBackend(hq, hkv, d, scale).forward(q, k, v, kc2, vc2, meta)
    err = (outs[-1].float() - plain.float()).abs().max().item()
    assert err < (0.05 if kind == "int8" else 0.25), err
