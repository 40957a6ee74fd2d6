"""The compiled CPU decode-attention kernel against the definition (torch reference)."""

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
