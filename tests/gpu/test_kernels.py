"""Each Triton kernel against its torch reference.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so sizes stay small but cover the edges.  With CUDA, or PAGESTREAM_GPU_CHECK=1, the
`large` cases add real sizes (batch 64, contexts up to 8k, head dim 128).
Seeds differ per case; PAGESTREAM_TEST_SEED shifts them all for a fresh draw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gpu.kernels import (
    apply_rotary,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
    rms_norm,
    rms_norm_reference,
    rotary_cos_sin_cache,
    rotary_reference,
    write_kv,
    write_kv_skip_reference,
)
from gpu.kernels._common import is_interpreted
from gpu.kernels.attention import (
    MAX_SPLITS,
    AttentionKernelConfig,
    _paged_attention_kernel,
)
from gpu.kernels.testing import make_paged_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LARGE = DEVICE.type == "cuda" or os.environ.get("PAGESTREAM_GPU_CHECK") == "1"
SEED_SHIFT = int(os.environ.get("PAGESTREAM_TEST_SEED", "0"))

if DEVICE.type == "cpu" and not is_interpreted(_paged_attention_kernel):
    pytest.skip(
        "no CUDA and the kernels are compiled (TRITON_INTERPRET unset)", allow_module_level=True
    )

large = pytest.mark.skipif(not LARGE, reason="real sizes: CUDA or PAGESTREAM_GPU_CHECK=1")

# (atol, rtol) of a kernel output against the reference computed in fp32 and rounded.
ATTN_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2e-2),
}


def seed_of(case_id: str) -> int:
    return zlib.crc32(case_id.encode()) + SEED_SHIFT


# --------------------------------------------------------------------------- KV write


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, torch.float32, 2, 64, 16),
        (torch.bfloat16, torch.bfloat16, 1, 128, 32),
        (torch.float16, torch.float16, 8, 64, 16),
        (torch.bfloat16, torch.bfloat16, 3, 128, 16),  # kv heads not a power of two
        (torch.float32, torch.bfloat16, 2, 64, 32),  # cast on the way in
    ],
)
def test_write_kv(
    dtype: torch.dtype, cache_dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int
) -> None:
    case = f"write-{dtype}-{cache_dtype}-{kv_heads}-{head_dim}-{block_size}"
    gen = torch.Generator().manual_seed(seed_of(case))
    num_blocks, num_tokens = 7, 23
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11, 22]] = -1  # padding tokens: skipped
    slots = slots.to(DEVICE)
    # A strided view, as k and v come out of a fused qkv projection.
    kv = torch.randn(num_tokens, 2 * kv_heads + 1, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads : 2 * kv_heads]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_skip_reference(k, v, k_ref, v_ref, slots)
    # Exact, and untouched slots still NaN.
    assert torch.equal(k_cache.isnan(), k_ref.isnan()), case
    assert torch.equal(k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0)), case
    assert torch.equal(v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0)), case


def test_write_kv_rejects_bad_inputs() -> None:
    k = torch.zeros(4, 2, 64, device=DEVICE)
    cache = torch.zeros(3, 16, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping dtype torch\.int32"):
        write_kv(k, k, cache, cache, slots.int())
    with pytest.raises(ValueError, match=r"k has shape \[4, 2, 32\]"):
        write_kv(k[..., :32], k, cache, cache, slots)
    with pytest.raises(ValueError, match=r"dtype torch\.float64"):
        write_kv(k.double(), k.double(), cache.double(), cache.double(), slots)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        kt = torch.zeros(4, 2, 128, device=DEVICE)[..., ::2]
        write_kv(kt, kt, cache, cache, slots)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttnCase:
    id: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_splits: int | None = None  # None: heuristic; > 1 forces the split path
    num_decodes: int | None = None  # default: the leading query_len == 1 sequences
    tile_n: int | None = None
    block_m: int | None = None


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Context lengths are tokens cached before the step; seq_len = context + query.  Between
# them they hit seq_len 1, exactly a block, a block + 1, a few blocks, and a longer one.
ATTN_CASES = [
    # decode only
    AttnCase("decode-gqa4-f32-d64-bs16", (1,) * 6, (0, 15, 16, 31, 47, 300), 8, 2, 64, 16, F32),
    AttnCase("decode-mqa-bf16-d128-bs32", (1,) * 5, (0, 31, 32, 64, 260), 8, 1, 128, 32, BF16),
    AttnCase("decode-mha-f16-d64-bs16", (1,) * 4, (16, 17, 5, 90), 4, 4, 64, 16, F16),
    AttnCase("decode-gqa3-bf16-d64-bs16", (1,) * 3, (16, 40, 99), 6, 2, 64, 16, BF16),
    # mixed: decodes, then fresh prefills and chunks continuing a cached prefix
    AttnCase(
        "mixed-gqa4-bf16-d64-bs16",
        (1, 1, 1, 20, 7, 1, 33),
        (5, 16, 31, 0, 40, 16, 17),
        8,
        2,
        64,
        16,
        BF16,
        num_decodes=3,  # the 1-token chunk at index 5 is a prefill chunk
    ),
    AttnCase("mixed-mha-f32-d128-bs32", (1, 1, 45, 32), (63, 2, 0, 32), 2, 2, 128, 32, F32),
    AttnCase("prefill-mqa-f16-d128-bs16", (37, 16, 5), (0, 48, 100), 4, 1, 128, 16, F16),
    AttnCase("prefill-gqa8-bf16-d128-bs32", (1, 19, 40), (70, 0, 33), 16, 2, 128, 32, BF16),
    AttnCase("prefill-gqa4-f32-d64-bs16-bm32", (30, 9), (3, 0), 4, 1, 64, 16, F32, block_m=32),
    # many chunks, each over several BLOCK_Q query blocks or just one: exercises the
    # program -> sequence search (fp32 MHA: 32 tokens a program; bf16 GQA-8: 8)
    AttnCase(
        "chunks-mha-f32-d64-bs16",
        (1, 33, 1, 31, 64, 5, 32, 65, 2),
        (9, 0, 3, 40, 16, 70, 1, 0, 100),
        2,
        2,
        64,
        16,
        F32,
        num_decodes=1,
    ),
    AttnCase(
        "chunks-gqa8-bf16-d64-bs32",
        (9, 8, 7, 17, 1, 16, 3),
        (0, 32, 5, 60, 31, 0, 64),
        8,
        1,
        64,
        32,
        BF16,
        num_decodes=0,
    ),
    # key tiles smaller than a block, and spanning many blocks
    AttnCase("decode-tile16-bf16-d64-bs32", (1, 1), (50, 97), 4, 2, 64, 32, BF16, tile_n=16),
    AttnCase("mixed-tile128-f32-d64-bs16", (1, 12), (150, 140), 4, 2, 64, 16, F32, tile_n=128),
    # split context (flash-decoding), forced; short sequences leave splits empty
    AttnCase("split4-gqa4-bf16-d128-bs16", (1,) * 4, (0, 16, 99, 300), 8, 2, 128, 16, BF16, 4),
    AttnCase("split3-mixed-f32-d64-bs32", (1, 1, 14), (64, 200, 20), 4, 2, 64, 32, F32, 3),
    AttnCase("split7-mqa-f16-d64-bs16", (1, 1), (250, 33), 4, 1, 64, 16, F16, 7),
]

LARGE_CASES = [
    AttnCase(
        "large-decode64-bf16-d128",
        (1,) * 64,
        tuple(1 + (i * 2654435761) % 8191 for i in range(64)),
        32,
        8,
        128,
        16,
        BF16,
        num_splits=1,
    ),
    AttnCase(
        "large-decode64-split8-bf16-d128",
        (1,) * 64,
        tuple(1 + (i * 40503) % 8191 for i in range(64)),
        32,
        8,
        128,
        16,
        BF16,
        num_splits=8,
    ),
    AttnCase(
        "large-decode4-heuristic-bf16", (1,) * 4, (8191, 4000, 6000, 8000), 32, 8, 128, 16, BF16
    ),
    AttnCase(
        "large-mixed-bf16-d128",
        (*(1,) * 32, 512, 512, 300),
        (*(1 + (i * 977) % 4095 for i in range(32)), 0, 1024, 2500),
        32,
        8,
        128,
        16,
        BF16,
    ),
    AttnCase(
        "large-decode64-f16-d64-bs32",
        (1,) * 64,
        tuple(1 + (i * 7919) % 4095 for i in range(64)),
        16,
        4,
        64,
        32,
        F16,
    ),
]


def random_case(index: int) -> AttnCase:
    """A random mixed batch: shape, dtype and lengths all drawn from the case's seed."""
    rng = torch.Generator().manual_seed(seed_of(f"random-{index}"))

    def pick(options: list) -> object:  # type: ignore[type-arg]
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    def ints(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=rng).tolist()

    num_kv_heads, group = pick([(1, 4), (2, 2), (2, 3), (4, 1), (1, 8)])  # type: ignore[misc]
    dtype = pick([F32, BF16, F16])
    head_dim = pick([64, 128])
    block_size = pick([16, 32])
    num_decodes = int(torch.randint(0, 6, (1,), generator=rng))
    num_prefills = int(torch.randint(0 if num_decodes else 1, 4, (1,), generator=rng))
    query_lens = [1] * num_decodes + ints(num_prefills, 1, 70)
    context_lens = ints(num_decodes, 0, 300) + [
        pick([0, int(torch.randint(1, 200, (1,), generator=rng))]) for _ in range(num_prefills)
    ]
    splits = pick([None, None, 2, 5]) if num_decodes else None
    return AttnCase(
        f"random{index}",
        tuple(query_lens),
        tuple(context_lens),  # type: ignore[arg-type]
        num_kv_heads * group,
        num_kv_heads,
        head_dim,  # type: ignore[arg-type]
        block_size,  # type: ignore[arg-type]
        dtype,  # type: ignore[arg-type]
        num_splits=splits,  # type: ignore[arg-type]
        num_decodes=num_decodes,
    )


def run_attention_case(case: AttnCase) -> None:
    b = make_paged_batch(
        case.query_lens,
        case.context_lens,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        block_size=case.block_size,
        dtype=case.dtype,
        device=DEVICE,
        seed=seed_of(case.id),
        num_decodes=case.num_decodes,
    )
    m = b.meta
    write_kv(b.k, b.v, b.k_cache, b.v_cache, m.slot_mapping)
    scale = case.head_dim**-0.5
    out = torch.full_like(b.q, float("nan"))  # every row must be written
    paged_attention(
        b.q,
        b.k_cache,
        b.v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        num_decodes=m.num_decodes,
        scale=scale,
        out=out,
        num_splits=case.num_splits,
        config=AttentionKernelConfig(tile_n=case.tile_n, block_m=case.block_m),
    )
    ref = paged_attention_reference(b.q, b.k_cache, b.v_cache, m, scale)
    assert not out.isnan().any(), f"{case.id}: NaN in output (unwritten rows or poisoned reads)"
    atol, rtol = ATTN_TOL[case.dtype]
    torch.testing.assert_close(
        out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda s: f"{case.id}: {s}"
    )


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c.id)
def test_paged_attention(case: AttnCase) -> None:
    run_attention_case(case)


@pytest.mark.parametrize("index", range(8))
def test_paged_attention_random_batches(index: int) -> None:
    case = random_case(index)
    try:
        run_attention_case(case)
    except AssertionError as e:
        raise AssertionError(f"{case}: {e}") from e


@large
@pytest.mark.parametrize("case", LARGE_CASES, ids=lambda c: c.id)
def test_paged_attention_large(case: AttnCase) -> None:
    run_attention_case(case)


def test_padding_sequence_gets_zeros() -> None:
    """A CUDA-graph padding slot (seq_len 0, slot -1) writes nothing and outputs zeros."""
    b = make_paged_batch(
        (1, 1, 1),
        (20, 0, 7),
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=F32,
        device=DEVICE,
        seed=seed_of("padding"),
    )
    m = b.meta
    m.seq_lens[1] = 0
    m.slot_mapping[1] = -1
    k_before = b.k_cache.clone()
    write_kv(b.k, b.v, b.k_cache, b.v_cache, m.slot_mapping)
    changed = (b.k_cache.nan_to_num(9.0) != k_before.nan_to_num(9.0)).any(-1).any(-1)
    assert int(changed.sum()) == 2  # two real tokens, two slots
    out = torch.full_like(b.q, float("nan"))
    for splits in (1, 2):
        out.fill_(float("nan"))
        paged_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            m.query_start_loc,
            m.seq_lens,
            m.block_tables,
            max_query_len=1,
            max_seq_len=21,
            num_decodes=3,
            scale=0.125,
            out=out,
            num_splits=splits,
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = paged_attention_reference(b.q, b.k_cache, b.v_cache, m, 0.125)
        torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], atol=1e-4, rtol=1e-4)


def _tiny_attention_args(
    head_dim: int = 64, dtype: torch.dtype = F32, block_size: int = 16
) -> dict[str, object]:
    q = torch.zeros(2, 4, head_dim, dtype=dtype, device=DEVICE)
    cache = torch.zeros(4, block_size, 2, head_dim, dtype=dtype, device=DEVICE)
    return dict(
        q=q,
        k_cache=cache,
        v_cache=cache,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([3, 5], dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
        max_query_len=1,
        max_seq_len=5,
        num_decodes=2,
        scale=0.125,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(head_dim=96), "head_dim 96 is not supported"),
        (dict(head_dim=256), "head_dim 256 is not supported"),
        (dict(dtype=torch.float64), "q dtype torch.float64 is not supported"),
        (dict(block_size=8), "block_size 8 is not supported"),
        (dict(block_size=64), "block_size 64 is not supported"),
    ],
)
def test_paged_attention_rejects_unsupported(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_attention(**_tiny_attention_args(**change))  # type: ignore[arg-type]


def test_paged_attention_rejects_bad_metadata() -> None:
    args = _tiny_attention_args()
    with pytest.raises(ValueError, match=r"seq_lens dtype torch\.int64"):
        paged_attention(**{**args, "seq_lens": args["seq_lens"].long()})  # type: ignore[union-attr,arg-type]
    with pytest.raises(ValueError, match=r"query_start_loc has shape \[2\]"):
        paged_attention(**{**args, "query_start_loc": args["query_start_loc"][:2]})  # type: ignore[index,arg-type]
    with pytest.raises(ValueError, match="differs from q dtype"):
        paged_attention(**{**args, "k_cache": args["k_cache"].half()})  # type: ignore[union-attr,arg-type]
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        paged_attention(**{**args, "q": torch.zeros(2, 3, 64, device=DEVICE)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        q = torch.zeros(2, 4, 128, device=DEVICE)[..., ::2]
        paged_attention(**{**args, "q": q})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_decodes 3"):
        paged_attention(**{**args, "num_decodes": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_query_len is 1 but there are 3 tokens"):
        paged_attention(**{**args, "q": torch.zeros(3, 4, 64, device=DEVICE)})  # type: ignore[arg-type]


def test_choose_num_splits() -> None:
    sms = 132
    # Few long decodes: split, each split >= 256 keys, capped.
    assert choose_num_splits(1, 1, 8, 32768, sms) == MAX_SPLITS == 64
    assert choose_num_splits(1, 1, 8, 8192, sms) == 32  # 256 keys each
    assert choose_num_splits(4, 4, 8, 16384, sms) == 17  # 4 programs per SM
    assert choose_num_splits(1, 1, 8, 1024, sms) == 4
    # Splits only below 2 programs per SM (b64 ran best in one launch on an H200).
    assert choose_num_splits(33, 33, 8, 8192, sms) == 1
    assert choose_num_splits(32, 32, 8, 8192, sms) == 3
    # Enough programs already, short contexts, prefills present, nothing to decode: no split.
    assert choose_num_splits(64, 64, 8, 8192, sms) == 1
    assert choose_num_splits(1, 1, 8, 512, sms) == 1
    assert choose_num_splits(3, 2, 8, 8192, sms) == 1
    assert choose_num_splits(0, 0, 8, 8192, sms) == 1


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(seed_of(f"rms-{dtype}-{hidden}-{with_residual}"))
    num_tokens = 9
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    r = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    x_before, r_before = x.clone(), r.clone()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)
    if with_residual:
        out, new_res = rms_norm(x, w, 1e-6, residual=r)
        ref, ref_res = rms_norm_reference(x, w, 1e-6, residual=r)
        assert torch.equal(new_res, ref_res)  # same single rounding of x + residual
    else:
        out = rms_norm(x, w, 1e-6)
        ref = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(x, x_before) and torch.equal(r, r_before)  # inputs untouched


def test_rms_norm_rejects_bad_inputs() -> None:
    x = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight has shape \[32\]"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, torch.ones(64, device=DEVICE, dtype=BF16), 1e-6)
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, residual=torch.zeros(2, 64, device=DEVICE))


# --------------------------------------------------------------------------- rotary


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim"),
    [(F32, 4, 2, 64), (BF16, 6, 2, 128), (F16, 4, 4, 64), (BF16, 8, 1, 64)],
)
def test_rotary(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(seed_of(f"rope-{dtype}-{num_heads}-{head_dim}"))
    num_tokens, max_pos = 11, 4096
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rotary_cos_sin_cache(inv_freq.to(DEVICE), max_pos)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    # q and k as views of one fused qkv output, as the model produces them.
    width = num_heads + 2 * num_kv_heads
    qkv = torch.randn(num_tokens, width, head_dim, generator=gen).to(DEVICE, dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    q_ref, k_ref = rotary_reference(q, k, cos, sin, positions)
    apply_rotary(q, k, cos, sin, positions)
    if DEVICE.type == "cpu" or dtype != F32:
        # Same roundings as the reference, in the same places: identical bits.
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    else:  # fp32 on a GPU may fuse multiply-adds
        torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)  # v untouched


def test_rotary_rejects_bad_inputs() -> None:
    q = torch.zeros(3, 4, 64, device=DEVICE)
    cos = torch.zeros(16, 32, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"positions dtype torch\.int32"):
        apply_rotary(q, q, cos, cos, pos.int())
    with pytest.raises(ValueError, match=r"cos_cache has shape \[16, 16\]"):
        apply_rotary(q, q, cos[:, :16], cos[:, :16], pos)
    with pytest.raises(ValueError, match="head_dim 96 must be an even power of two"):
        q96 = torch.zeros(3, 4, 96, device=DEVICE)
        apply_rotary(q96, q96, cos, cos, pos)


# --------------------------------------------------------------------------- GPU compile


def test_kernels_compile_for_hopper() -> None:
    """The interpreter skips GPU limits; compile each kernel for sm_90 with Triton's ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
    except Exception as e:  # pragma: no cover - wheel without the CUDA toolchain
        pytest.skip(f"no ptxas: {e}")
    if not ptxas or not shutil.which(ptxas):
        pytest.skip("no ptxas in this Triton install")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "gpu.kernels.aot_check", "--quick", "--json"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [r for r in reports if not r["ok"]]
    assert not failed, failed
    spilled = [r["name"] for r in reports if r["spill_bytes"]]
    assert not spilled, f"register spills in {spilled}"
