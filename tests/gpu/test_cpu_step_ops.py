"""The compiled per-step ops against the torch ops they replace: decode attention on strided
q / out (views into the fused qkv projection and the step's output), the fused K/V store
(plain and quantized caches, bit for bit), and the logits argmax (torch.argmax's ties,
NaN and infinities, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.torch_backend import paged_attention_reference, write_kv_reference
from gpu.cpu import kernels as cpu_kernels
from gpu.kv_quant import quantize
from tests.gpu.test_cpu_kernels import assert_decode_close, decode_case

if not cpu_kernels.available():
    pytest.skip("no C++ compiler: the CPU kernels are unavailable", allow_module_level=True)

NAN, INF = float("nan"), float("inf")


def _quantized(kc, vc, kind):
    nb, bs, h, d = kc.shape
    if kind == "plain":
        return kc, vc, None, None
    kq, ks = quantize(kc.reshape(-1, h, d), kind)
    vq, vs = quantize(vc.reshape(-1, h, d), kind)
    return kq.view(nb, bs, h, d), vq.view(nb, bs, h, d), ks.view(nb, bs, h), vs.view(nb, bs, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "int8", "fp8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_strided_q_and_out(dtype, kind, threads):
    # q as the fused projection's view (token stride q + 2 kv), out as rows of a wider
    # buffer: the same result as contiguous tensors, and the rest of the buffer untouched.
    hq, hkv, d = 8, 2, 64
    q, kc, vc, meta = decode_case(5, [1, 17, 300, 40, 2000], hq, hkv, d, 16, dtype)
    kc, vc, ks, vs = _quantized(kc, vc, kind)
    b = q.shape[0]
    qkv = torch.randn(b, (hq + 2 * hkv) * d).to(dtype)
    qv = qkv[:, : hq * d].view(b, hq, d)
    qv.copy_(q)
    wide = torch.full((b + 2, hq * d + 64), 7.0, dtype=dtype)
    out = wide[1 : b + 1, 32 : 32 + hq * d].view(b, hq, d)
    args = (kc, vc, meta.block_tables, meta.seq_lens, 0.125, threads)
    got = cpu_kernels.decode_attention(qv, *args, k_scale=ks, v_scale=vs, out=out)
    assert got is out
    dense = cpu_kernels.decode_attention(q.contiguous(), *args, k_scale=ks, v_scale=vs)
    assert torch.equal(out, dense)
    wide[1 : b + 1, 32 : 32 + hq * d] = 7.0
    assert (wide == 7).all()
    ref = paged_attention_reference(q, kc, vc, meta, 0.125, ks, vs)
    assert_decode_close(dense, ref, dtype)


def test_decode_out_with_split_heads_is_copied():
    # An out whose heads are not dense (a transposed view) still gets the right values.
    q, kc, vc, meta = decode_case(6, [9, 33], 4, 2, 64, 16, torch.float32)
    out = torch.zeros(64, 4, 2).permute(2, 1, 0)  # [B=2, H=4, D=64], D-strided
    cpu_kernels.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, out=out)
    ref = paged_attention_reference(q, kc, vc, meta, 0.125)
    assert_decode_close(out.contiguous(), ref, torch.float32)


# ---- K/V store -----------------------------------------------------------------------


def _kv_step(seed, t, hkv, d, dtype, num_slots):
    """Strided k/v (views into a fused qkv row) and distinct scattered slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (4 + 2) * hkv * d, generator=g).to(dtype)
    k = qkv[:, 4 * hkv * d : 5 * hkv * d].view(t, hkv, d)
    v = qkv[:, 5 * hkv * d :].view(t, hkv, d)
    if t > 3:  # rows the quantizer must not trip on: zeros, tiny, huge, a lone outlier
        k[0] = 0
        v[1] = 1e-30
        k[2] = 3e4
        v[3, 0, 5] = 900.0
    slots = torch.randperm(num_slots, generator=g)[:t]
    return k, v, slots


def _caches(kind, dtype, nb, bs, hkv, d):
    store = {"plain": dtype, "int8": torch.int8, "fp8": torch.uint8}[kind]
    kc = torch.full((nb, bs, hkv, d), 5, dtype=store)
    vc = torch.full((nb, bs, hkv, d), 6, dtype=store)
    if kind == "plain":
        return [kc, vc]
    ks = torch.full((nb, bs, hkv), 2.0, dtype=torch.bfloat16)
    return [kc, vc, ks, ks.clone()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["plain", "int8", "fp8"])
@pytest.mark.parametrize(("t", "hkv", "d", "threads"), [(5, 2, 64, 1), (64, 4, 64, 2),
                                                        (3, 1, 33, 2), (2100, 4, 128, 2)])  # fmt: skip
def test_write_kv_matches_reference(dtype, kind, t, hkv, d, threads, monkeypatch):
    # The last case is big enough to run on two threads.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    nb, bs = 300, 16
    k, v, slots = _kv_step(t + d, t, hkv, d, dtype, nb * bs)
    ref = _caches(kind, dtype, nb, bs, hkv, d)
    write_kv_reference(k, v, *ref[:2], slots, *ref[2:])
    got = _caches(kind, dtype, nb, bs, hkv, d)
    assert cpu_kernels.write_kv(k, v, *got[:2], slots, *got[2:])
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_write_kv_skips_negative_slots_and_declines_what_it_cannot_take():
    k, v, slots = _kv_step(1, 6, 2, 64, torch.float32, 64)
    slots[2] = -1
    kc, vc = _caches("plain", torch.float32, 4, 16, 2, 64)
    assert cpu_kernels.write_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    rk, rv = _caches("plain", torch.float32, 4, 16, 2, 64)
    write_kv_reference(k[keep], v[keep], rk, rv, slots[keep])
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    # a dtype conversion on the way (fp32 rows into a bf16 cache): the torch ops' job
    bk, bv = _caches("plain", torch.bfloat16, 4, 16, 2, 64)
    assert not cpu_kernels.write_kv(k, v, bk, bv, slots)
    assert (bk == 5).all()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_write_rounds_every_code_as_torch(kind):
    # A row whose max makes the scale exactly 1, so the values are quantized as they are:
    # every code, the midpoints between neighbours (ties to even / half up) and a hair
    # either side of them, fp8 subnormals and underflow.
    top = 127.0 if kind == "int8" else 448.0
    if kind == "int8":
        codes = torch.arange(-127, 128, dtype=torch.float32)
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[codes.abs() <= top].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, mids.nextafter(codes[1:]), mids.nextafter(codes[:-1])])
    vals = torch.cat([vals, torch.tensor([1e-4, -3e-3, 2.0**-10, 2.0**-9 * 1.5, 1e-30])])
    d = 64
    n = -(-vals.numel() // (d - 1))
    rows = torch.zeros(n * (d - 1))
    rows[: vals.numel()] = vals
    x = torch.cat([torch.full((n, 1), top), rows.view(n, d - 1)], dim=1).view(n, 1, d)
    kc, vc, ks, vs = _caches(kind, torch.float32, 1, n, 1, d)
    assert cpu_kernels.write_kv(x, x, kc, vc, torch.arange(n), ks, vs)
    want_q, want_s = quantize(x, kind)
    assert (want_s.float() == 1).all()
    assert torch.equal(kc.view(n, 1, d), want_q) and torch.equal(ks.view(n, 1), want_s)


# ---- argmax --------------------------------------------------------------------------


def _argmax_rows(cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, cols, generator=g).to(dtype)
    x[1] = (x[1] * 2).round()  # many ties: the first one wins
    x[2] = 0.0
    x[3] = -INF
    x[4, :: max(1, cols // 5)] = INF
    x[5, cols // 2 :] = NAN  # NaN counts as the maximum, the first one wins
    x[6, -1] = NAN
    x[7] = -0.0  # -0 == +0: the first index
    x[7, -1] = 0.0
    x[8] = -x[8].abs()
    x[9, cols // 3] = 1e30 if dtype == torch.float32 else 1e38
    x[10] = NAN
    x[11] = -NAN  # a NaN with the sign bit set is still a NaN
    x[12] = -INF
    x[12, -1] = -3e38
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 16, 64, 65, 129, 1000, 32000, 32003])
def test_argmax_matches_torch(dtype, cols):
    x = _argmax_rows(cols, dtype, cols)
    assert torch.equal(cpu_kernels.argmax(x), torch.argmax(x, -1))
    if cols > 1:  # a row stride past the row's end (a vocab-sliced lm_head output)
        xs = x[:, :-1]
        assert torch.equal(cpu_kernels.argmax(xs), torch.argmax(xs, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_many_rows_parallel(dtype, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    x = torch.randn(70, 32000).to(dtype)
    x[::7, 100] = NAN
    assert torch.equal(cpu_kernels.argmax(x), torch.argmax(x, -1))
    assert cpu_kernels.argmax(x[:0]).shape == (0,)
    with pytest.raises(IndexError):
        cpu_kernels.argmax(torch.empty(2, 0))


# ---- embedding gather -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "threads"), [(1, 1), (64, 2), (3000, 2)])
def test_gather_rows_is_embedding(dtype, n, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    table = torch.randn(1000, 384).to(dtype)
    idx = torch.randint(0, 1000, (n,))
    got = cpu_kernels.gather_rows(table, idx)
    assert got is not None and torch.equal(got, torch.nn.functional.embedding(idx, table))
    wide = torch.randn(1000, 400).to(dtype)[:, 8:392]  # rows apart by more than a row
    assert torch.equal(cpu_kernels.gather_rows(wide, idx), wide[idx])


def test_gather_rows_declines_bad_indices():
    table = torch.randn(10, 8)
    assert cpu_kernels.gather_rows(table, torch.tensor([1, 10])) is None
    assert cpu_kernels.gather_rows(table, torch.tensor([-1])) is None
    assert cpu_kernels.gather_rows(table, torch.tensor([1], dtype=torch.int32)) is None
