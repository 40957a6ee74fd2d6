"""The compiled CPU attention kernels (decode, prefill) against the definition (torch
reference), and the backend that uses them."""

from __future__ import annotations

import os
import random

import pytest
import torch

from gpu import cpu_kernels
from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_backend import TorchAttentionBackend, paged_attention_reference

if not cpu_kernels.available():
    if os.environ.get("CI") == "true":
        pytest.fail("the CPU kernel must build in CI (a C++ compiler is installed)")
    pytest.skip("no C++ compiler: the CPU kernel is unavailable", allow_module_level=True)


def decode_case(seed: int, lens: list[int], hq: int, hkv: int, d: int, bs: int, dtype):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    b = len(lens)
    nb = [-(-n // bs) for n in lens]
    num_blocks = sum(nb) + 7
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # scattered, non-contiguous block tables
    tables = torch.zeros(b, max(nb), dtype=torch.int32)
    i = 0
    for r, n in enumerate(nb):
        tables[r, :n] = torch.tensor(perm[i : i + n])
        i += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=b, num_seqs=b, num_decodes=b,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=seq_lens,
        context_lens=seq_lens - 1, block_tables=tables,
        slot_mapping=torch.zeros(b, dtype=torch.int64), max_query_len=1,
        max_seq_len=max(lens), query_lens_cpu=[1] * b, seq_lens_cpu=lens, block_size=bs,
    )  # fmt: skip
    return q, kc, vc, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(4, 2, 64), (8, 1, 64), (4, 4, 128), (9, 3, 64), (6, 2, 40), (2, 2, 16)],
)
@pytest.mark.parametrize("bs", [16, 8])
def test_decode_kernel_matches_reference(dtype, hq, hkv, d, bs):
    lens = [1, bs, bs + 1, 2 * bs - 1, 3 * bs + 5, 97]
    seed = hq * 1000 + hkv * 100 + d + bs + (dtype == torch.bfloat16)
    q, kc, vc, meta = decode_case(seed, lens, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    got = cpu_kernels.decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale)
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_backend_uses_kernel_and_can_be_switched_off(monkeypatch):
    q, kc, vc, meta = decode_case(3, [5, 40, 17], 4, 2, 64, 16, torch.float32)
    be = TorchAttentionBackend(4, 2, 64, 0.125)
    assert be._use_cpu_kernel(q)
    fast = be._decode(q, kc, vc, meta)
    monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    slow = TorchAttentionBackend(4, 2, 64, 0.125)
    assert not slow._use_cpu_kernel(q)
    torch.testing.assert_close(fast, slow._decode(q, kc, vc, meta), atol=1e-5, rtol=1e-5)


def test_zero_length_rows_give_zeros():
    q, kc, vc, meta = decode_case(5, [4, 9], 4, 2, 64, 16, torch.bfloat16)
    lens = torch.tensor([0, 9], dtype=torch.int32)
    out = cpu_kernels.decode_attention(q, kc, vc, meta.block_tables, lens, 0.125)
    assert (out[0] == 0).all() and torch.isfinite(out).all()


# ---- prefill ---------------------------------------------------------------------------


def prefill_case(seed, qlens, ctxs, hq, hkv, d, bs, dtype, num_decodes=0):
    """Requests with chunks of qlens tokens after ctxs cached ones (the chunk's K/V are in
    the cache already, as the backend writes them first), scattered block tables."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [c + n for c, n in zip(ctxs, qlens, strict=True)]
    b = len(lens)
    nb = [-(-n // bs) for n in lens]
    num_blocks = sum(nb) + 5
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = torch.zeros(b, max(nb), dtype=torch.int32)
    i = 0
    for r, n in enumerate(nb):
        tables[r, :n] = torch.tensor(perm[i : i + n])
        i += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    t = sum(qlens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    slots = [
        int(tables[r, p // bs]) * bs + p % bs for r in range(b) for p in range(ctxs[r], lens[r])
    ]
    meta = AttentionMetadata(
        num_tokens=t, num_seqs=b, num_decodes=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        context_lens=torch.tensor(ctxs, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(qlens),
        max_seq_len=max(lens), query_lens_cpu=list(qlens), seq_lens_cpu=lens, block_size=bs,
    )  # fmt: skip
    return q, kc, vc, meta


def run_prefill(q, kc, vc, meta, scale, out=None):
    return cpu_kernels.prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, out
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(9, 3, 64), (8, 1, 64), (4, 4, 128), (10, 2, 128), (6, 2, 40), (4, 2, 33)],
)
@pytest.mark.parametrize("bs", [16, 8])
def test_prefill_kernel_matches_reference(dtype, hq, hkv, d, bs):
    # Chunk lengths 1, bs, bs + 1 and odd ones, with and without a cached context; the
    # longer ones span several key tiles and several work items per kv head.
    qlens = [1, bs, bs + 1, 37, 3, 150, 70]
    ctxs = [0, 5, 0, 2 * bs + 3, 64, 130, 0]
    seed = hq * 1000 + hkv * 100 + d + bs + (dtype == torch.bfloat16)
    q, kc, vc, meta = prefill_case(seed, qlens, ctxs, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    got = run_prefill(q, kc, vc, meta, scale)
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_strided_q_and_untouched_rows(dtype):
    # q as a view into a wider buffer (as from a fused qkv projection), and only the
    # requests' rows of out written: the backend passes the step's whole output.
    q, kc, vc, meta = prefill_case(7, [20, 33], [0, 40], 8, 2, 64, 16, dtype)
    ref = paged_attention_reference(q, kc, vc, meta, 0.125)
    t = q.shape[0]
    wide = torch.randn(t + 3, 8 * 64 + 96).to(dtype)
    q_wide = wide[:, 32 : 32 + 8 * 64].view(t + 3, 8, 64)  # token stride 8 * 64 + 96
    q_wide[3:] = q
    meta.query_start_loc += 3  # rows 0..2 belong to something else
    out = torch.full((t + 3, 8, 64), 7.0, dtype=dtype)
    run_prefill(q_wide, kc, vc, meta, 0.125, out)
    assert (out[:3] == 7).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[3:].float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_mixed_step_kernel_vs_torch_path(dtype, monkeypatch):
    # A step of 3 decodes and 3 prefill chunks through TorchAttentionBackend.forward (K/V
    # written by the backend): kernels vs the SDPA path vs the definition.
    hq, hkv, d, bs = 6, 2, 64, 16
    qlens, ctxs = [1, 1, 1, 30, 17, 64], [9, 40, 16, 0, 50, 33]
    q, kc, vc, meta = prefill_case(11, qlens, ctxs, hq, hkv, d, bs, dtype, num_decodes=3)
    g = torch.Generator().manual_seed(12)
    k = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    v = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    scale = d**-0.5
    fast = TorchAttentionBackend(hq, hkv, d, scale)
    assert fast._use_cpu_kernel(q)
    kc1, vc1 = kc.clone(), vc.clone()
    got = fast.forward(q, k, v, kc1, vc1, meta)
    ref = paged_attention_reference(q, kc1, vc1, meta, scale)
    monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    slow = TorchAttentionBackend(hq, hkv, d, scale)
    assert not slow._use_cpu_kernel(q)
    kc2, vc2 = kc.clone(), vc.clone()
    torch_path = slow.forward(q, k, v, kc2, vc2, meta)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), torch_path.float(), atol=tol, rtol=tol)
