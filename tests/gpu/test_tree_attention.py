"""Tree attention (Medusa verify chunks): every attention path applies AttentionMetadata's
tree bits on top of its causal mask.  The oracle attends each tree row over the keys it
must see, gathered by hand (the context, the root, its ancestors and itself), so it shares
no mask code with the paths under test: the reference, the torch backend's SDPA path, the
compiled CPU prefill kernel, and the Triton kernel (interpreted on a CPU)."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.torch_backend import paged_attention_reference, write_kv_reference
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.attention import CpuAttentionBackend
from gpu.kernels.testing import make_paged_batch
from scheduler.medusa_tree import build_tree, tree_paths

HQ, HKV, D, BS = 4, 2, 64, 16


def _tree_batch(dtype: torch.dtype, seed: int = 0):
    """Decodes, an ordinary chunk, a 17-row tree chunk (root + 16 nodes) and a chunk of
    70 rows (past the bitmask's 64) behind it; the tree's rows get their tree bits."""
    paths = tree_paths(4)
    topk = [[100 * d + r for r in range(4)] for d in range(4)]
    tree = build_tree(topk, len(paths))
    qlens = [1, 1, 9, tree.size + 1, 70]
    ctxs = [20, 5, 11, 29, 3]
    b = make_paged_batch(
        qlens, ctxs, num_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
        dtype=dtype, device="cpu", seed=seed,
    )  # fmt: skip
    bits = [-1] * b.meta.num_tokens
    start = sum(qlens[:3])
    bits[start : start + tree.size + 1] = tree.bits()
    b.meta.tree_bits = torch.tensor(bits, dtype=torch.int64)
    write_kv_reference(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    return b, tree, start, ctxs[3]


def _oracle(b, tree, start: int, ctx: int) -> torch.Tensor:
    """The tree chunk's rows, each over exactly its visible keys, in float64."""
    meta = b.meta
    seq = 3
    nb = -(-meta.seq_lens_cpu[seq] // BS)
    blocks = meta.block_tables[seq, :nb].long()
    kc = b.k_cache[blocks].reshape(nb * BS, HKV, D).double()
    vc = b.v_cache[blocks].reshape(nb * BS, HKV, D).double()
    out = []
    for row in range(tree.size + 1):
        chain, node = [row], row - 1
        while node >= 0:
            node = tree.parents[node]
            chain.append(node + 1)
        keys = list(range(ctx)) + [ctx + r for r in sorted(set(chain))]
        q = b.q[start + row].double()  # [HQ, D]
        k = kc[keys].repeat_interleave(HQ // HKV, dim=1)  # [S, HQ, D]
        v = vc[keys].repeat_interleave(HQ // HKV, dim=1)
        p = (torch.einsum("hd,shd->hs", q, k) * D**-0.5).softmax(-1)
        out.append(torch.einsum("hs,shd->hd", p, v))
    return torch.stack(out)


def _check(got: torch.Tensor, ref: torch.Tensor, b, tree, start: int, ctx: int, tol: float):
    rows = slice(start, start + tree.size + 1)
    torch.testing.assert_close(got[rows].double(), _oracle(b, tree, start, ctx), atol=tol, rtol=tol)
    # Every other row is untouched by the tree: the plain causal reference.
    other = torch.ones(got.shape[0], dtype=torch.bool)
    other[rows] = False
    torch.testing.assert_close(got[other].float(), ref[other].float(), atol=tol, rtol=tol)


def _plain_reference(b) -> torch.Tensor:
    bits, b.meta.tree_bits = b.meta.tree_bits, None
    try:
        return paged_attention_reference(b.q, b.k_cache, b.v_cache, b.meta, D**-0.5)
    finally:
        b.meta.tree_bits = bits


def test_tree_mask_changes_the_answer():
    """The oracle is not the causal answer (else these tests could not fail)."""
    b, tree, start, ctx = _tree_batch(torch.float32)
    plain = _plain_reference(b)[start : start + tree.size + 1].double()
    assert (plain - _oracle(b, tree, start, ctx)).abs().max() > 1e-2


def test_reference_applies_tree_bits():
    b, tree, start, ctx = _tree_batch(torch.float32)
    got = paged_attention_reference(b.q, b.k_cache, b.v_cache, b.meta, D**-0.5)
    _check(got, _plain_reference(b), b, tree, start, ctx, 1e-5)


@pytest.mark.parametrize("choice", ["sdpa", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_tree(monkeypatch, choice, dtype):
    if choice == "kernel" and not cpu_kernels.available():
        pytest.skip("no compiled CPU kernels on this machine")
    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", choice)
    b, tree, start, ctx = _tree_batch(dtype, seed=1)
    backend = CpuAttentionBackend(HQ, HKV, D, D**-0.5)
    got = backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    _check(got, _plain_reference(b), b, tree, start, ctx, tol)


def test_cpu_prefill_kernel_tree_quantized():
    """The int8 cache's kernel instantiation takes the same bits."""
    if not cpu_kernels.available():
        pytest.skip("no compiled CPU kernels on this machine")
    from gpu.kv_quant import dequantize, write_quantized

    b, tree, start, ctx = _tree_batch(torch.float32, seed=2)
    m = b.meta
    shape = b.k_cache.shape
    kq, vq = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    ks = torch.zeros(shape[:3], dtype=torch.bfloat16)
    vs = torch.zeros(shape[:3], dtype=torch.bfloat16)
    # Context and chunk K/V alike, quantized; the oracle reads them dequantized.
    all_k = b.k_cache.view(-1, HKV, D).nan_to_num(0.0)
    all_v = b.v_cache.view(-1, HKV, D).nan_to_num(0.0)
    slots = torch.arange(all_k.shape[0])
    write_quantized(all_k, kq, ks, slots)
    write_quantized(all_v, vq, vs, slots)
    b.k_cache = dequantize(kq, ks, torch.float32)
    b.v_cache = dequantize(vq, vs, torch.float32)
    nd = m.num_decodes
    got = torch.zeros_like(b.q)
    cpu_kernels.prefill_attention(
        b.q, kq, vq, m.block_tables[nd:], m.query_start_loc[nd:], m.seq_lens[nd:], D**-0.5,
        got, ks, vs, tree_bits=m.tree_bits,
    )  # fmt: skip
    rows = slice(start, start + tree.size + 1)
    torch.testing.assert_close(
        got[rows].double(), _oracle(b, tree, start, ctx), atol=1e-4, rtol=1e-4
    )


def test_triton_kernel_tree():
    from gpu.kernels._common import is_interpreted
    from gpu.kernels.attention import _paged_attention_kernel, paged_attention

    if not torch.cuda.is_available() and not is_interpreted(_paged_attention_kernel):
        pytest.skip("no CUDA and the kernels are compiled (TRITON_INTERPRET unset)")
    b, tree, start, ctx = _tree_batch(torch.float32, seed=3)
    m = b.meta
    for splits in (1, 2):  # the decodes through the split path, the chunks through varlen
        got = paged_attention(
            b.q, b.k_cache, b.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
            max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            num_decodes=m.num_decodes, scale=D**-0.5, num_splits=splits,
            tree_bits=m.tree_bits,
        )  # fmt: skip
        _check(got, _plain_reference(b), b, tree, start, ctx, 1e-4)
