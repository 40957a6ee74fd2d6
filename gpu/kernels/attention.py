"""Paged attention over a varlen batch of decodes and prefill chunks.

Two paths:

* One launch for the whole batch (`_paged_attention_kernel`).  A program owns BLOCK_Q
  query tokens of one sequence and all query heads of one kv head: its rows are
  (token, head-in-group) pairs, so the K/V tile it loads serves the whole GQA group.
  Rows are padded to at least 16 so `tl.dot` maps onto tensor cores (decode of an
  8-head group is an [16, D] x [D, TILE_N] product with half the rows masked).  The
  context is walked in TILE_N-key steps with an online softmax (FlashAttention); each
  key's physical block is looked up in the block table, so a tile may span several
  cache blocks.  Programs are laid out over the flattened query tokens: sequence i owns
  program ids [start(i), start(i+1)) with start(i) = (q_start(i) - q_start(0) + i *
  (BLOCK_Q - 1)) // BLOCK_Q.  That leaves each sequence at least the ceil(len / BLOCK_Q)
  programs it needs (a spare one exits at once), and the grid size follows from host
  ints alone: (num_tokens + num_seqs * (BLOCK_Q - 1)) // BLOCK_Q.  A program finds its
  sequence by binary search over query_start_loc; decode-only batches skip the search.
* Split context (flash-decoding) for decode-only batches with few (sequence, kv head)
  pairs and long contexts: each sequence's context is cut into NUM_SPLITS ranges, one
  program each, writing a partial (max, sum, unnormalised acc); a second kernel merges
  them.  The split length is derived from each sequence's own length on the device, so a
  captured CUDA graph stays correct whatever the context lengths at replay.

Numerics: everything is accumulated in fp32; 16-bit Q, K, V and the probabilities are fed
to `tl.dot` in their 16-bit dtype on a GPU (tensor cores).  Under the interpreter, which
computes 16-bit dots wrongly, the same values are rounded to 16 bits and multiplied in fp32,
so CPU tests see the GPU's rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from gpu.attention.torch_backend import paged_attention_reference
from gpu.kernels._common import (
    SUPPORTED_DTYPES,
    cast_to,
    check_block_size,
    check_device,
    check_dtype,
    check_head_dim,
    check_kv_scales,
    check_last_dim_contiguous,
    check_shape,
    dot_dtype,
    fp8e4m3_decode,
    is_interpreted,
    next_pow2,
    round_to,
    tl_dtype,
)

__all__ = [
    "AttentionKernelConfig",
    "choose_num_splits",
    "paged_attention",
    "paged_attention_reference",
]

LOG2E = 1.4426950408889634  # log2(e): the kernels use exp2, so scores are scaled by it
# A finite "minus infinity" for the running max: rows that have seen no key yet keep
# exp2(m_old - m_new) == 1 instead of NaN from (-inf) - (-inf).
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)

# Split heuristic knobs (see choose_num_splits).
SPLIT_MIN_CONTEXT = 1024  # shorter contexts are not worth a second kernel
SPLIT_MIN_KEYS = 256  # each split walks at least this many keys
SPLIT_PROGRAMS_PER_SM = 2  # split only below this many programs per SM
# Once splitting, aim for more: long single sequences leave most SMs idle at two programs
# each, and the forced-split sweep of `make gpu-check` on an H200 was faster at four, up to
# 64 splits (docs/PERFORMANCE.md, "NVIDIA H200").
SPLIT_TARGET_PROGRAMS_PER_SM = 4
MAX_SPLITS = 64


@dataclass(frozen=True)
class AttentionKernelConfig:
    """Tile sizes and launch options; None picks the default for the batch."""

    block_m: int | None = None  # rows (query tokens x heads of a group) per program
    tile_n: int | None = None  # keys per inner-loop step (any power of two >= 16)
    num_warps: int | None = None
    num_stages: int | None = None


@triton.jit
def _load_q(
    q_ptr,
    row_off,  # each row's token offset (token * stride_qt): a scalar or [BLOCK_M, 1]
    head,  # [BLOCK_M] query head of each row
    row_ok,  # [BLOCK_M] rows that exist (the rest are padding, loaded as zeros)
    stride_qh,
    HEAD_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """The program's query rows, [BLOCK_M, HEAD_DIM] in the dot operand dtype."""
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(
        q_ptr + row_off + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(DOT_DTYPE)


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_M, HEAD_DIM] in DOT_DTYPE
    q_pos,  # [BLOCK_M] int32, position of each row's query token
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,  # this sequence's block-table row
    kv_head,
    kv_start,  # first key (a multiple of TILE_N)
    kv_end,  # one past the last key
    scale_log2,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    k_scale_ptr,  # quantized cache: [num_blocks, block_size, num_kv_heads] bf16 (else None)
    v_scale_ptr,
    stride_sb,
    stride_ss,
    QUANT: tl.constexpr,  # 0: K/V in IN_DTYPE; 1: int8; 2: fp8 e4m3 bytes
    tree_bits,  # [BLOCK_M] int64: each row's visible chunk keys (HAS_TREE), else unused
    ctx_len,  # tokens before the chunk (HAS_TREE)
    HAS_TREE: tl.constexpr,
):
    """Online softmax over keys [kv_start, kv_end) of one kv head, in TILE_N-key steps.
    Returns (acc [BLOCK_M, HEAD_DIM]: the unnormalised output, m_i [BLOCK_M]: the running
    max of the scores (log2 domain), l_i [BLOCK_M]: the sum of exp2(score - m_i)), all fp32."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(kv_start, kv_end, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_ok = offs_n < kv_end
        # Physical block of each key; int64 so block * stride cannot overflow on big caches.
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + blk[:, None] * stride_kb
            + row[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :],
            mask=n_ok[:, None],
            other=0,
        )  # [TILE_N, HEAD_DIM]
        v = tl.load(
            v_cache_ptr
            + blk[:, None] * stride_vb
            + row[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=n_ok[:, None],
            other=0,
        )  # [TILE_N, HEAD_DIM]
        if QUANT == 0:
            k = k.to(DOT_DTYPE)
            v = v.to(DOT_DTYPE)
        else:
            # Dequantized as loaded: each (key, kv head) row times its scale, in fp32.
            s_off = blk * stride_sb + row * stride_ss + kv_head
            ks = tl.load(k_scale_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
            vs = tl.load(v_scale_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
            k = _dequant(k, ks, QUANT, IN_DTYPE, DOT_DTYPE, SOFT_BF16)
            v = _dequant(v, vs, QUANT, IN_DTYPE, DOT_DTYPE, SOFT_BF16)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, TILE_N]
        # Key must exist and not lie after the query (causal within the chunk).
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_TREE:
            # Tree attention (gpu/medusa.py): chunk key j only where the row's bit j is set.
            rel = offs_n - ctx_len
            in_bits = (rel >= 0) & (rel < 64)
            bit = (tree_bits[:, None] >> tl.where(in_bits, rel, 0).to(tl.int64)[None, :]) & 1
            visible = visible & (((rel < 0) | (rel >= 64))[None, :] | (bit != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_DTYPE == tl.float32:  # noqa: SIM300
            # fp32 dot: exact fp32 inputs, or the interpreter emulating a 16-bit one.
            p_dot = round_to(p, IN_DTYPE, SOFT_BF16)
        else:
            p_dot = p.to(DOT_DTYPE)  # tensor cores, as FlashAttention does
        pv = tl.dot(p_dot, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dequant(
    x,
    scale,
    QUANT: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    """int8 / fp8 rows [N, D] times scale [N] -> the dot operand dtype.  Under the
    interpreter (fp32 dots) the value is rounded to the activations' 16-bit dtype first,
    as a GPU's cast to its tensor-core operand would."""
    if QUANT == 1:
        f = x.to(tl.float32)
    else:
        f = fp8e4m3_decode(x)
    f = f * scale[:, None]
    if DOT_DTYPE == tl.float32:  # noqa: SIM300
        return round_to(f, IN_DTYPE, SOFT_BF16)
    else:
        return f.to(DOT_DTYPE)


@triton.jit
def _find_seq(pid, query_start_loc_ptr, q_base, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, query block within it) of program `pid`: the largest seq with
    start(seq) <= pid, by binary search (see the module docstring for start)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - q_base + mid * (BLOCK_Q - 1)) // BLOCK_Q
        right = first <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    first = (tl.load(query_start_loc_ptr + lo) - q_base + lo * (BLOCK_Q - 1)) // BLOCK_Q
    return lo, pid - first


# Arguments that change step to step are not specialised on (== 1, % 16), so a serving run
# does not compile extra variants as the batch changes shape.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: max(16, BLOCK_Q * GROUP_PAD)
    TILE_N: tl.constexpr,
    SINGLE_TOKEN: tl.constexpr,  # every sequence has exactly one query token
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # interpreted: bf16 rounding in software (see round_to)
    k_scale_ptr,  # quantized cache: scales [num_blocks, block_size, num_kv_heads] (else None)
    v_scale_ptr,
    stride_sb,
    stride_ss,
    QUANT: tl.constexpr,
    tree_ptr,  # [num_tokens] int64 tree bits (AttentionMetadata.tree_bits), or None
    HAS_TREE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_base = tl.load(query_start_loc_ptr)  # query_start_loc may be a slice of a longer one

    if SINGLE_TOKEN:
        seq = pid
        q_block = 0
    else:
        seq, q_block = _find_seq(pid, query_start_loc_ptr, q_base, num_seqs, BLOCK_Q)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens before this chunk
    tok0 = q_block * BLOCK_Q  # first query token of this program, within the chunk

    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // GROUP_PAD  # [BLOCK_M] query token of each row
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group  # [BLOCK_M] query head of each row
    row_ok = (offs_m < BLOCK_Q * GROUP_PAD) & (head_in_group < GROUP) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = (q_start + tok).to(tl.int64)
    q = _load_q(q_ptr, q_rows[:, None] * stride_qt, head, row_ok, stride_qh, HEAD_DIM, DOT_DTYPE)
    q_pos = ctx_len + tok  # query j sits at position ctx_len + j
    if HAS_TREE:
        tree_bits = tl.load(tree_ptr + q_rows, mask=row_ok, other=-1)
    else:
        tree_bits = q_rows

    # Keys up to the last query of this program; none for a program past the chunk's end
    # (the layout over-allocates up to one program per sequence).
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(tok0 + BLOCK_Q, q_len))
    kv_end = tl.where(tok0 < q_len, kv_end, 0)

    acc, _m_i, l_i = _attend_tiles(
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head,
        0,
        kv_end,
        scale_log2,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_M,
        TILE_N,
        IN_DTYPE,
        DOT_DTYPE,
        SOFT_BF16,
        k_scale_ptr,
        v_scale_ptr,
        stride_sb,
        stride_ss,
        QUANT,
        tree_bits,
        ctx_len,
        HAS_TREE,
    )
    # A sequence with no keys (seq_len 0: a padding slot in a CUDA-graph batch) gets zeros.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        cast_to(o, IN_DTYPE, SOFT_BF16),
        mask=row_ok[:, None],
    )


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_split_kernel(
    m_part_ptr,  # [num_decodes, num_heads, num_splits] fp32
    l_part_ptr,  # [num_decodes, num_heads, num_splits] fp32
    acc_part_ptr,  # [num_decodes, num_heads, num_splits, head_dim] fp32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # max(16, GROUP rounded up to a power of two)
    TILE_N: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    # This sequence's split length, a whole number of tiles.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    kv_start = split * split_len
    kv_end = tl.minimum(seq_len, kv_start + split_len)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_q(q_ptr, q_row * stride_qt, head, row_ok, stride_qh, HEAD_DIM, DOT_DTYPE)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    acc, m_i, l_i = _attend_tiles(
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head,
        kv_start,
        kv_end,
        scale_log2,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_M,
        TILE_N,
        IN_DTYPE,
        DOT_DTYPE,
        SOFT_BF16,
        k_scale_ptr,
        v_scale_ptr,
        stride_sb,
        stride_ss,
        QUANT,
        q_pos,
        0,
        False,
    )
    # An empty split leaves (NEG_BIG, 0, 0), which the merge weighs as nothing.
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_M]
    tl.store(m_part_ptr + part, m_i, mask=row_ok)
    tl.store(l_part_ptr + part, l_i, mask=row_ok)
    tl.store(acc_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _split_merge_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(m_part_ptr + part, mask=s_ok, other=NEG_BIG)
    l = tl.load(l_part_ptr + part, mask=s_ok, other=0.0)  # noqa: E741
    acc = tl.load(acc_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None])
    acc = tl.where(s_ok[:, None], acc, 0.0)  # [SPLITS_PAD, HEAD_DIM]
    w = tl.math.exp2(m - tl.max(m, 0))  # rescale every split to the global max
    total = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM]
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_ot + head * stride_oh + offs_d, cast_to(o, OUT_DTYPE, SOFT_BF16)
    )


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small number keeps the heuristic meaningful


def choose_num_splits(
    num_seqs: int,
    num_decodes: int,
    num_kv_heads: int,
    max_seq_len: int,
    sm_count: int,
) -> int:
    """How many ranges to cut each decode context into (1 = the one-launch path).

    Only decode-only batches split.  The one-launch path runs num_decodes * num_kv_heads
    programs, each walking a whole context; when that is too few to keep every SM busy
    (fewer than SPLIT_PROGRAMS_PER_SM per SM) and contexts are long, splitting multiplies
    the programs, up to SPLIT_TARGET_PROGRAMS_PER_SM per SM, at the cost of a small merge
    kernel.  Each split keeps >= SPLIT_MIN_KEYS keys so the partial results stay cheap
    relative to the work.
    """
    if num_decodes == 0 or num_decodes != num_seqs or max_seq_len < SPLIT_MIN_CONTEXT:
        return 1
    programs = num_decodes * num_kv_heads
    if programs >= SPLIT_PROGRAMS_PER_SM * sm_count:
        return 1
    target = SPLIT_TARGET_PROGRAMS_PER_SM * sm_count
    splits = min(triton.cdiv(target, programs), max_seq_len // SPLIT_MIN_KEYS, MAX_SPLITS)
    return splits if splits >= 2 else 1


def _check_q_and_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """The queries against the caches (and their scales): ranks, sizes, dtypes."""
    name = "paged_attention"
    if q.dim() != 3:
        raise ValueError(
            f"{name}: q has shape {list(q.shape)}, expected [num_tokens, num_heads, head_dim]"
        )
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache has shape {list(k_cache.shape)}, expected "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_head_dim(name, head_dim)
    check_block_size(name, block_size)
    check_dtype(name, "q", q, SUPPORTED_DTYPES)
    if cache_head_dim != head_dim:
        raise ValueError(f"{name}: q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    if k_scale is not None or v_scale is not None:
        check_kv_scales(name, k_cache, v_cache, k_scale, v_scale, strided=True)
    else:
        for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise ValueError(f"{name}: {what} dtype {t.dtype} differs from q dtype {q.dtype}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{name}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor | None,
    num_decodes: int,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    name = "paged_attention"
    tensors = [q, k_cache, v_cache, query_start_loc, seq_lens, block_tables]
    check_device(_paged_attention_kernel, name, *tensors, *([out] if out is not None else []))
    _check_q_and_cache(q, k_cache, v_cache, k_scale, v_scale)
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_shape(name, "seq_lens", seq_lens, (num_seqs,))
    check_shape(name, "query_start_loc", query_start_loc, (num_seqs + 1,))
    check_shape(name, "block_tables", block_tables, (num_seqs, None))
    for what, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        check_dtype(name, what, t, (torch.int32,))
        check_last_dim_contiguous(name, what, t)
    for what, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, what, t)
    if out is not None:
        check_shape(name, "out", out, tuple(q.shape))
        if out.dtype != q.dtype:
            raise ValueError(f"{name}: out dtype {out.dtype} differs from q dtype {q.dtype}")
        check_last_dim_contiguous(name, "out", out)
    if not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"{name}: num_decodes {num_decodes} not in [0, {num_seqs}]")
    if num_seqs and max_query_len < 1:
        raise ValueError(f"{name}: max_query_len must be >= 1, got {max_query_len}")
    if max_query_len == 1 and num_tokens != num_seqs:
        raise ValueError(
            f"{name}: max_query_len is 1 but there are {num_tokens} tokens for {num_seqs} seqs"
        )


def default_config(
    single_token: bool, group_pad: int, max_query_len: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """(block_q, block_m, tile_n, num_warps, num_stages) for the one-launch path.

    fp32 has no tensor-core path here (ieee dots run on the FMA units, which need far more
    registers), so its tiles are halved to stay clear of register spills.
    """
    max_rows = 32 if dtype == torch.float32 else 64
    if single_token:
        block_q = 1
    else:
        # Up to max_rows (token, head) rows per program, fewer when the chunks are short.
        block_q = min(next_pow2(max_query_len), max(1, max_rows // group_pad))
    block_m = max(16, block_q * group_pad)
    tile_n = 16 if dtype == torch.float32 else 64
    num_warps = 4 if block_m <= 64 else 8
    return block_q, block_m, tile_n, num_warps, 2


def split_config(group_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(block_m, tile_n, num_warps, num_stages) for the split-context kernel."""
    return max(16, group_pad), 16 if dtype == torch.float32 else 64, 4, 2


def _check_config(cfg: AttentionKernelConfig) -> None:
    for what, val in (("block_m", cfg.block_m), ("tile_n", cfg.tile_n)):
        if val is not None and (val < 16 or val & (val - 1)):
            raise ValueError(f"paged_attention: {what} must be a power of two >= 16, got {val}")


def _shared_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> dict[str, Any]:
    """The arguments both attention kernels take, by name: the queries, the caches (and
    their scales when quantized), their strides, sizes and dtypes."""
    interpreted = is_interpreted(_paged_attention_kernel)
    return dict(
        q_ptr=q,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        scale_log2=float(scale) * LOG2E,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        HEAD_DIM=q.shape[2],
        BLOCK_SIZE=k_cache.shape[1],
        IN_DTYPE=tl_dtype(q.dtype),
        DOT_DTYPE=dot_dtype(q.dtype, interpreted),
        SOFT_BF16=interpreted,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        stride_sb=k_scale.stride(0) if k_scale is not None else 0,
        stride_ss=k_scale.stride(1) if k_scale is not None else 0,
        QUANT=0 if k_scale is None else (1 if k_cache.dtype == torch.int8 else 2),
    )


def _seq_args(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> dict[str, Any]:
    """The per-sequence arguments (the varlen launch may get a tail of them)."""
    return dict(
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        stride_bt=block_tables.stride(0),
    )


def _launch_split(
    out: torch.Tensor,
    args: dict[str, Any],
    seqs: dict[str, Any],
    num_decodes: int,
    num_splits: int,
    cfg: AttentionKernelConfig,
) -> None:
    """Flash-decoding for the first num_decodes sequences: partials per context range,
    then the merge into `out`."""
    q = args["q_ptr"]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = args["k_cache_ptr"].shape[2]
    block_m, tile_n, num_warps, num_stages = split_config(
        next_pow2(num_heads // num_kv_heads), q.dtype
    )
    parts_shape = (num_decodes, num_heads, num_splits)
    m_part = torch.empty(parts_shape, dtype=torch.float32, device=q.device)
    l_part = torch.empty(parts_shape, dtype=torch.float32, device=q.device)
    acc_part = torch.empty((*parts_shape, head_dim), dtype=torch.float32, device=q.device)
    _paged_attention_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        m_part_ptr=m_part,
        l_part_ptr=l_part,
        acc_part_ptr=acc_part,
        num_heads=num_heads,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        TILE_N=cfg.tile_n or tile_n,
        **args,
        **seqs,
        num_warps=cfg.num_warps or num_warps,
        num_stages=cfg.num_stages or num_stages,
    )
    _split_merge_kernel[(num_decodes, num_heads)](
        out,
        m_part,
        l_part,
        acc_part,
        seqs["query_start_loc_ptr"],
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=next_pow2(num_splits),
        OUT_DTYPE=args["IN_DTYPE"],
        SOFT_BF16=args["SOFT_BF16"],
        num_warps=1 if head_dim <= 64 else 2,
    )


def _launch_varlen(
    out: torch.Tensor,
    args: dict[str, Any],
    seqs: dict[str, Any],
    num_tokens: int,
    max_query_len: int,
    cfg: AttentionKernelConfig,
    tree_bits: torch.Tensor | None = None,
) -> None:
    """The one-launch path over every sequence in `seqs` (num_tokens query tokens)."""
    q = args["q_ptr"]
    num_heads, num_kv_heads = q.shape[1], args["k_cache_ptr"].shape[2]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    num_seqs = seqs["seq_lens_ptr"].shape[0]
    single_token = max_query_len == 1
    block_q, block_m, tile_n, num_warps, num_stages = default_config(
        single_token, group_pad, max_query_len, q.dtype
    )
    if cfg.block_m is not None and not single_token:
        block_m = max(cfg.block_m, group_pad, 16)
        block_q = max(1, block_m // group_pad)
    if single_token:
        grid_q = num_tokens
    else:
        grid_q = (num_tokens + num_seqs * (block_q - 1)) // block_q
    _paged_attention_kernel[(grid_q, num_kv_heads)](
        out_ptr=out,
        num_seqs=num_seqs,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=cfg.tile_n or tile_n,
        SINGLE_TOKEN=single_token,
        tree_ptr=tree_bits,
        HAS_TREE=tree_bits is not None,
        **args,
        **seqs,
        num_warps=cfg.num_warps or num_warps,
        num_stages=cfg.num_stages or num_stages,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    *,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    config: AttentionKernelConfig | None = None,
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, kv_heads]
    v_scale: torch.Tensor | None = None,
    check: bool = True,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64 (AttentionMetadata.tree_bits)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attend each query over its sequence's paged context (cached tokens + this chunk).

    Sequences are ordered decodes first (num_decodes of them, one query token each).
    num_splits: None = heuristic (choose_num_splits), 1 = never split, > 1 = split the
    decode sequences' contexts into that many ranges (forcing the split path).
    check=False skips the argument checks (see TritonAttentionBackend.forward).
    """
    if check:
        _check_inputs(
            q,
            k_cache,
            v_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            out,
            num_decodes,
            max_query_len,
            k_scale,
            v_scale,
        )
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    cfg = config or AttentionKernelConfig()
    _check_config(cfg)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_decodes, k_cache.shape[2], max_seq_len, _sm_count(q.device)
        )
    elif num_splits < 1:
        raise ValueError(f"paged_attention: num_splits must be >= 1, got {num_splits}")
    args = _shared_args(q, k_cache, v_cache, scale, k_scale, v_scale)
    if num_splits > 1 and num_decodes > 0:
        seqs = _seq_args(query_start_loc, seq_lens, block_tables)
        _launch_split(out, args, seqs, num_decodes, num_splits, cfg)
        if num_decodes == num_seqs:
            return out
        # The prefill chunks go through the one-launch path below.
        query_start_loc = query_start_loc[num_decodes:]
        seq_lens = seq_lens[num_decodes:]
        block_tables = block_tables[num_decodes:]
        num_tokens -= num_decodes
    seqs = _seq_args(query_start_loc, seq_lens, block_tables)
    _launch_varlen(out, args, seqs, num_tokens, max_query_len, cfg, tree_bits)
    return out
