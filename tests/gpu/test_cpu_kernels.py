"""The compiled CPU attention kernels (decode, prefill) against the definition (torch
reference), and the backend that uses them."""

from __future__ import annotations

import os
import random

import pytest
import torch

from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_backend import paged_attention_reference
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.attention import CpuAttentionBackend

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
        block_tables=tables,
        slot_mapping=torch.zeros(b, dtype=torch.int64), max_query_len=1,
        max_seq_len=max(lens), query_lens_cpu=[1] * b, seq_lens_cpu=lens, block_size=bs,
    )  # fmt: skip
    return q, kc, vc, meta


def run_decode(q, kc, vc, meta, scale, num_threads=None, seq_lens=None):
    lens = meta.seq_lens if seq_lens is None else seq_lens
    return cpu_kernels.decode_attention(
        q, kc, vc, meta.block_tables, lens, scale, num_threads=num_threads
    )


def assert_decode_close(got, ref, dtype, fp32_tol=1e-5):
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    tol = fp32_tol if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [
        (4, 2, 64), (8, 1, 64), (4, 4, 128), (9, 3, 64), (6, 2, 40), (2, 2, 16),
        (8, 8, 64), (16, 1, 128), (8, 2, 256), (3, 1, 33), (12, 4, 80),
    ],
)  # fmt: skip
@pytest.mark.parametrize("bs", [16, 8, 32])
def test_decode_kernel_matches_reference(dtype, hq, hkv, d, bs):
    # GQA, MQA (16 heads per kv head: several P.V head blocks) and MHA; head dims that are
    # whole vectors, not (40, 80), odd (33) or past the register-held query (256); blocks
    # smaller than a 16-key tile (8), equal to it and larger (32); contexts with partial
    # tiles and several tiles.
    lens = [1, bs, bs + 1, 2 * bs - 1, 3 * bs + 5, 97, 300]
    seed = hq * 1000 + hkv * 100 + d + bs + (dtype == torch.bfloat16)
    q, kc, vc, meta = decode_case(seed, lens, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    got = run_decode(q, kc, vc, meta, scale)
    assert_decode_close(got, paged_attention_reference(q, kc, vc, meta, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("lens", "hq", "hkv"),
    [([2000], 8, 1), ([1500, 700], 9, 3), ([4100, 33], 4, 4), ([900], 32, 1), ([100, 60], 8, 4)],
)
def test_decode_kernel_few_sequences(dtype, threads, lens, hq, hkv):
    # Few sequences for the threads: work items are ranges of a long context (merged from
    # their maxima and sums), and where that is not enough (short contexts, or more
    # threads), items take fewer kv heads.
    d, bs = 64, 16
    q, kc, vc, meta = decode_case(len(lens) + hq, lens, hq, hkv, d, bs, dtype)
    got = run_decode(q, kc, vc, meta, d**-0.5, num_threads=threads)
    assert_decode_close(got, paged_attention_reference(q, kc, vc, meta, d**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["rising", "falling", "spike"])
def test_decode_kernel_extreme_scores(dtype, shape):
    # Scores spanning hundreds (natural log units): rising ones move the running max at
    # every tile by far more than the kernel lets it lag, falling ones never, and a lone
    # spike once, mid-context.  Every query head of a group sees the same profile.
    hq, hkv, d, bs = 4, 2, 64, 16
    lens = [700, 130, 2000]
    q, kc, vc, meta = decode_case(17, lens, hq, hkv, d, bs, dtype)
    u = torch.nn.functional.normalize(
        torch.randn(d, generator=torch.Generator().manual_seed(3)), dim=0
    )
    q[:] = (8 * u).to(dtype)  # |q| * scale = 1: a score is k . u
    for r, n in enumerate(lens):
        pos = torch.arange(n, dtype=torch.float32)
        if shape == "rising":
            a = pos * (500 / n)
        elif shape == "falling":
            a = (n - pos) * (500 / n)
        else:
            a = torch.where(pos == n // 2, 60.0, 0.0)
        for p in range(n):
            blk, slot = int(meta.block_tables[r, p // bs]), p % bs
            kc[blk, slot] = (kc[blk, slot].float() * 0.1 + a[p] * u).to(dtype)
    got = run_decode(q, kc, vc, meta, d**-0.5)
    ref = paged_attention_reference(q, kc, vc, meta, d**-0.5)
    # fp32 scores of ~500 carry rounding errors of ~500 * 2^-24 each, which the softmax turns
    # into relative errors of that size, in the reference as much as in the kernel.
    assert_decode_close(got, ref, dtype, fp32_tol=5e-4)


def test_backend_uses_kernel_and_can_be_switched_off(monkeypatch):
    q, kc, vc, meta = decode_case(3, [5, 40, 17], 4, 2, 64, 16, torch.float32)
    be = CpuAttentionBackend(4, 2, 64, 0.125)
    assert be._use_cpu_kernel(q)
    fast = be._decode(q, kc, vc, meta)
    monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    slow = CpuAttentionBackend(4, 2, 64, 0.125)
    assert not slow._use_cpu_kernel(q)
    torch.testing.assert_close(fast, slow._decode(q, kc, vc, meta), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_length_rows_give_zeros(dtype):
    lens = [4, 9, 1200, 30]
    q, kc, vc, meta = decode_case(5, lens, 4, 2, 64, 16, dtype)
    ref = paged_attention_reference(q, kc, vc, meta, 0.125)
    zeroed = torch.tensor([0, 9, 1200, 0], dtype=torch.int32)
    out = run_decode(q, kc, vc, meta, 0.125, num_threads=2, seq_lens=zeroed)
    assert (out[0] == 0).all() and (out[3] == 0).all() and torch.isfinite(out).all()
    assert_decode_close(out[1:3], ref[1:3], dtype)
    none = torch.zeros(4, dtype=torch.int32)
    assert (run_decode(q, kc, vc, meta, 0.125, seq_lens=none) == 0).all()


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
        block_tables=tables,
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
    # A step of 3 decodes and 3 prefill chunks through CpuAttentionBackend.forward (K/V
    # written by the backend): kernels vs the SDPA path vs the definition.
    hq, hkv, d, bs = 6, 2, 64, 16
    qlens, ctxs = [1, 1, 1, 30, 17, 64], [9, 40, 16, 0, 50, 33]
    q, kc, vc, meta = prefill_case(11, qlens, ctxs, hq, hkv, d, bs, dtype, num_decodes=3)
    g = torch.Generator().manual_seed(12)
    k = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    v = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    scale = d**-0.5
    fast = CpuAttentionBackend(hq, hkv, d, scale)
    assert fast._use_cpu_kernel(q)
    kc1, vc1 = kc.clone(), vc.clone()
    got = fast.forward(q, k, v, kc1, vc1, meta)
    ref = paged_attention_reference(q, kc1, vc1, meta, scale)
    monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    slow = CpuAttentionBackend(hq, hkv, d, scale)
    assert not slow._use_cpu_kernel(q)
    kc2, vc2 = kc.clone(), vc.clone()
    torch_path = slow.forward(q, k, v, kc2, vc2, meta)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), torch_path.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("choice", ["auto", "kernel", "sdpa"])
def test_backend_prefill_chunks_split_between_kernel_and_sdpa(dtype, choice, monkeypatch):
    # Chunks of SDPA_MIN_ROWS tokens or more take SDPA one by one (under auto: bf16 on AMX;
    # sdpa: all of them), the runs of shorter ones between them one kernel call each; every
    # row of every chunk is written, and all three routes agree with the definition.
    from gpu.cpu import features as cpu_features

    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", choice)
    monkeypatch.setattr(CpuAttentionBackend, "SDPA_MIN_ROWS", 24)
    hq, hkv, d, bs = 8, 2, 64, 16
    qlens, ctxs = [1, 1, 30, 17, 5, 64, 9, 40], [9, 40, 0, 50, 3, 33, 0, 20]
    q, kc, vc, meta = prefill_case(21, qlens, ctxs, hq, hkv, d, bs, dtype, num_decodes=2)
    g = torch.Generator().manual_seed(22)
    k = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    v = torch.randn(q.shape[0], hkv, d, generator=g).to(dtype)
    scale = d**-0.5
    calls = {"kernel": [], "sdpa": 0}
    real_prefill = cpu_kernels.prefill_attention

    def kernel(q_, kc_, vc_, tables, qsl, lens, *rest):
        calls["kernel"].append(len(lens))
        return real_prefill(q_, kc_, vc_, tables, qsl, lens, *rest)

    monkeypatch.setattr(cpu_kernels, "prefill_attention", kernel)
    backend = CpuAttentionBackend(hq, hkv, d, scale)
    real_sdpa = backend._prefill

    def sdpa(*a, **kw):
        calls["sdpa"] += 1
        return real_sdpa(*a, **kw)

    backend._prefill = sdpa
    got = backend.forward(q, k, v, kc, vc, meta)
    ref = paged_attention_reference(q, kc, vc, meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    amx = "amx_bf16" in cpu_features.detect().flags
    if choice == "sdpa":
        assert calls == {"kernel": [], "sdpa": 6}
    elif choice == "kernel" or not (amx and dtype == torch.bfloat16):
        assert calls == {"kernel": [6], "sdpa": 0}
    else:  # 30 | 17, 5 | 64 | 9 | 40 with 24 the bar
        assert calls == {"kernel": [2, 1], "sdpa": 3}


def test_prefill_attention_choice_is_checked(monkeypatch):
    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="PAGESTREAM_PREFILL_ATTENTION"):
        CpuAttentionBackend(8, 2, 64, 0.125)


# ---- ISA variants ----------------------------------------------------------------------

# -march levels this host can run, and the variant each compiles: AVX2 (x86-64-v3) and
# AVX-512 without the bf16 dot products (x86-64-v4), beside the native build.
_VARIANTS = [("x86-64-v3", "avx2", "avx2"), ("x86-64-v4", "avx512", "avx512f")]


@pytest.mark.slow
@pytest.mark.parametrize(("march", "isa", "needs"), _VARIANTS)
def test_isa_variant_builds_apart_and_matches_reference(march, isa, needs, monkeypatch, tmp_path):
    from gpu.cpu import features as cpu_features

    if needs not in cpu_features.detect().flags:
        pytest.skip(f"this CPU cannot run {isa} code")
    native = cpu_kernels.isa()
    monkeypatch.setenv("PAGESTREAM_CPU_MARCH", march)
    monkeypatch.setenv("PAGESTREAM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    assert cpu_kernels.isa() == isa
    assert [p.name.split("-")[1] for p in tmp_path.rglob("*.so")] == ["march"]
    if native == isa:
        pytest.skip("the native build is this variant already")
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, meta = decode_case(7, [1, 17, 300], 8, 2, 64, 16, dtype)
        got = run_decode(q, kc, vc, meta, 0.125)
        assert_decode_close(got, paged_attention_reference(q, kc, vc, meta, 0.125), dtype)
        q, kc, vc, meta = prefill_case(8, [1, 37, 150], [0, 35, 64], 8, 2, 64, 16, dtype)
        got = run_prefill(q, kc, vc, meta, 0.125)
        ref = paged_attention_reference(q, kc, vc, meta, 0.125)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("AnonHugePages:"))


def _anon_huge_kb_at(ptr: int) -> int:
    """AnonHugePages of the mapping that holds address ptr (a test's own allocation may
    reuse memory an earlier test freed, so the process total need not grow)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for ln in f:
            head = ln.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and ln.startswith("AnonHugePages:"):
                return int(ln.split()[1])
    return 0


def _thp_off() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" in f.read()
    except OSError:
        return True


def test_wide_l1_is_an_amd_core_with_48k_of_l1d():
    """The prefetch hints follow the core they were measured on (cpu_cache.h): L1 on AMD
    cores with an L1d of 48 KB or more (Zen 5), L2 or none elsewhere (Zen 4's 32 KB)."""
    from gpu.cpu.features import l1d_bytes

    l1d = l1d_bytes()
    if not cpu_kernels.available() or l1d is None:
        pytest.skip("needs the compiled kernels and the cache sizes in sysfs")
    with open("/proc/cpuinfo") as f:
        amd = any(ln.startswith("vendor_id") and "AuthenticAMD" in ln for ln in f)
    assert cpu_kernels.wide_l1() == (amd and l1d >= 48 * 1024), (amd, l1d)


def test_huge_empty_is_aligned_sized_and_optional(monkeypatch):
    """The packed weights start on a 2 MB boundary with the asked size; below 2 MB, or with
    PAGESTREAM_HUGE_PAGES=0, it is a plain torch.empty."""
    big = cpu_kernels.huge_empty(3_000_000, torch.float32)  # 12 MB
    assert big.numel() == 3_000_000 and big.is_contiguous() and big.dtype == torch.float32
    assert big.data_ptr() % (2 << 20) == 0
    big.fill_(1.5)  # the whole of it is writable
    assert float(big[-1]) == 1.5
    small = cpu_kernels.huge_empty(1000, torch.bfloat16)
    assert small.numel() == 1000 and small.dtype == torch.bfloat16
    monkeypatch.setenv("PAGESTREAM_HUGE_PAGES", "0")
    plain = cpu_kernels.huge_empty(3_000_000, torch.float32)
    assert plain.numel() == 3_000_000 and plain.storage_offset() == 0


@pytest.mark.skipif(_thp_off(), reason="needs THP")
def test_huge_zeros_are_zero_shaped_and_on_huge_pages(monkeypatch):
    """The CPU KV cache's allocation: zeros of the asked shape, from a 2 MB boundary on
    transparent huge pages (blocks are read wherever the pool put them); plain pages with
    PAGESTREAM_HUGE_PAGES=0."""
    t = cpu_kernels.huge_zeros((256, 16, 4, 64), torch.bfloat16)  # 2 MB
    t2 = cpu_kernels.huge_zeros((1024, 16, 4, 64), torch.bfloat16)  # 8 MB
    assert t.shape == (256, 16, 4, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any() and not t2.any()
    assert t.data_ptr() % (2 << 20) == 0 and t2.data_ptr() % (2 << 20) == 0
    assert _anon_huge_kb_at(t2.data_ptr()) >= 8 * 1024
    monkeypatch.setenv("PAGESTREAM_HUGE_PAGES", "0")
    plain = cpu_kernels.huge_zeros((1024, 16, 4, 64), torch.bfloat16)
    assert plain.storage_offset() == 0 and not plain.any()


def test_runner_kv_cache_takes_huge_zeros(monkeypatch):
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    shapes = []
    real = cpu_kernels.huge_zeros

    def record(shape, dtype):
        shapes.append(shape)
        return real(shape, dtype)

    monkeypatch.setattr(cpu_kernels, "huge_zeros", record)
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64, threads=1)
    try:
        runner = llm.engine.runner
        kv = runner.kv_caches
        assert len(shapes) == 2 * len(kv) and shapes[0] == tuple(kv[0][0].shape)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.skipif(
    not cpu_kernels.sgemm_available() or _thp_off(), reason="needs sgemm.cpp and THP"
)
def test_packed_weights_sit_on_huge_pages(monkeypatch):
    """A packed weight of 8 MB+ is backed by transparent huge pages (MADV_HUGEPAGE before
    the pack, MADV_COLLAPSE after it): the weights a decode step streams do not walk the
    page table every 4 KB.  The pack and the product through it are the same bits."""
    w = torch.randn(4096, 1024)  # 16 MB packed
    before = _anon_huge_kb()
    packed = cpu_kernels.sgemm_pack(w)
    assert _anon_huge_kb() - before >= 8 * 1024
    monkeypatch.setenv("PAGESTREAM_HUGE_PAGES", "0")
    plain = cpu_kernels.sgemm_pack(w)
    assert torch.equal(packed, plain)
    x = torch.randn(5, 1024)
    assert torch.equal(
        cpu_kernels.sgemm(x, packed, 4096, None), cpu_kernels.sgemm(x, plain, 4096, None)
    )
