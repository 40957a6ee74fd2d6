"""The CPU projections, one strategy per kernel family: oneDNN's packed weight, or
pagestream's sgemm (float32 without AVX-512, bf16 without native bf16; every size), AMX
kernel (bf16 with AMX, decode sizes), AVX512-BF16 kernel (bf16 with AVX512-BF16 and no AMX;
every size) or its float32 twin (float32 with AVX-512; every size); MKL's sgemm on the
plain weight from MKL_FROM_ROWS rows where asked (or where the sgemm is not built on a
float32 CPU without AVX-512).  `choose` picks what the flag chains it replaced picked
(test_choose_picks_what_the_flag_chains_picked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu import linear as cpu_linear
from gpu.cpu.features import CpuFeatures
from gpu.cpu.linear import (
    AMX_MAX_ROWS,
    Choice,
    PackedLinear,
    choose,
    mkl_from_rows,
    use_amx,
    use_dpbf16,
    use_sgemm,
    use_sgemm512,
)

AVX2 = CpuFeatures("test CPU", frozenset({"avx2"}))
AVX512 = CpuFeatures("test CPU", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = CpuFeatures("test CPU", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
AVX512_NO_BF16 = CpuFeatures("test CPU", frozenset({"avx2", "avx512f"}))

needs_packing = pytest.mark.skipif(
    not cpu_linear.packing_available(torch.float32), reason="no packed oneDNN linear here"
)


needs_sgemm = pytest.mark.skipif(
    not cpu_kernels.sgemm_available(), reason="sgemm.cpp needs AVX2 + FMA"
)


needs_amx = pytest.mark.skipif(
    not cpu_kernels.amx_available(), reason="amx_gemm.cpp needs AMX tiles (and the kernel's leave)"
)


needs_dpbf16 = pytest.mark.skipif(
    not cpu_kernels.dpbf16_available(), reason="dpbf16_gemm.cpp needs AVX512-BF16"
)


needs_sgemm512 = pytest.mark.skipif(
    not cpu_kernels.sgemm512_available(), reason="the float32 kernel needs AVX-512F/BW"
)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("PAGESTREAM_PREFILL_GEMM", raising=False)
    monkeypatch.delenv("PAGESTREAM_DECODE_GEMM", raising=False)


def test_mkl_only_for_float32_without_avx512_or_sgemm_unless_asked(monkeypatch):
    mkl = torch.backends.mkl.is_available()
    # Where pagestream's sgemm is built it takes every size on an AVX2 CPU.
    if cpu_kernels.sgemm_available():
        assert mkl_from_rows(torch.float32, AVX2) is None
    monkeypatch.setattr(cpu_kernels, "sgemm_available", lambda: False)
    assert mkl_from_rows(torch.float32, AVX2) == (cpu_linear.MKL_FROM_ROWS if mkl else None)
    monkeypatch.undo()
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "onednn")
    assert mkl_from_rows(torch.float32, AVX2) == (cpu_linear.MKL_FROM_ROWS if mkl else None)
    monkeypatch.delenv("PAGESTREAM_DECODE_GEMM")
    assert mkl_from_rows(torch.float32, AVX512) is None
    assert mkl_from_rows(torch.bfloat16, AVX2) is None  # MKL has no bf16 sgemm
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "mkl")
    assert mkl_from_rows(torch.float32, AVX512) == (cpu_linear.MKL_FROM_ROWS if mkl else None)
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "onednn")
    assert mkl_from_rows(torch.float32, AVX2) is None
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "fast")
    with pytest.raises(ValueError, match="PAGESTREAM_PREFILL_GEMM"):
        mkl_from_rows(torch.float32, AVX2)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_takes_mkl_from_the_threshold_with_the_same_result(monkeypatch, bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    layer = PackedLinear(lin, Choice("onednn", mkl_from=8))
    onednn = []
    real = cpu_linear.packed_linear
    monkeypatch.setattr(
        cpu_linear, "packed_linear", lambda *a: onednn.append(a[0].shape[0]) or real(*a)
    )
    for rows in (1, 7, 8, 40):
        x = torch.randn(rows, 64)
        ref = F.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    assert onednn == [1, 7]  # 8 and 40 rows went to MKL
    assert PackedLinear(lin, Choice("onednn")).strategy.plain is None  # no copy unless asked


@needs_packing
def test_model_keeps_plain_weights_only_where_mkl_is_used(monkeypatch):
    from gpu.model_runner import ModelRunner
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint("llama")
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "onednn")  # no kernel of ours takes them all
    for choice, plain in (("onednn", False), ("mkl", torch.backends.mkl.is_available())):
        monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", choice)
        r = ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=16)
        layers = [m for m in r.model.layers.modules() if isinstance(m, PackedLinear)]
        assert layers and all((m.strategy.plain is not None) == plain for m in layers)
        head = r.model.lm_head_packed.strategy
        assert head.plain is None  # logits rows never reach MKL's sizes


@needs_packing
def test_scratch_output_is_reused_and_exact():
    """Layers sharing a Scratch write their MKL outputs into one buffer (their outputs are
    dead before the next such layer runs); results equal F.linear at every size."""
    torch.manual_seed(1)
    lins = [nn.Linear(32, 48, bias=b) for b in (False, True)]
    layers = [PackedLinear(lin, Choice("onednn", mkl_from=4)) for lin in lins]
    scratch = cpu_linear.Scratch()
    for layer in layers:
        layer.scratch = scratch
    outs = []
    for rows in (6, 20, 5):
        for lin, layer in zip(lins, layers, strict=True):
            x = torch.randn(rows, 32)
            y = layer(x)
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
            outs.append(y.data_ptr())
    assert len(set(outs)) <= 2  # one buffer (regrown once for 20 rows), no fresh outputs


def test_sgemm_where_onednn_has_no_native_kernel_unless_asked(monkeypatch):
    built = cpu_kernels.sgemm_available()
    assert use_sgemm(torch.float32, AVX2) == built
    assert not use_sgemm(torch.float32, AVX512)
    # bf16 wherever the CPU has no bf16 product (oneDNN emulates it), AVX-512 or not.
    assert use_sgemm(torch.bfloat16, AVX2) == built
    assert use_sgemm(torch.bfloat16, AVX512_NO_BF16) == built
    assert not use_sgemm(torch.bfloat16, AVX512)
    assert not use_sgemm(torch.bfloat16, AMX)
    assert not use_sgemm(torch.float16, AVX2)
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "sgemm")
    assert use_sgemm(torch.float32, AVX512) == built
    assert use_sgemm(torch.bfloat16, AMX) == built
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "onednn")
    assert not use_sgemm(torch.float32, AVX2)
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "fast")
    with pytest.raises(ValueError, match="PAGESTREAM_DECODE_GEMM"):
        use_sgemm(torch.float32, AVX2)


@needs_sgemm
@pytest.mark.parametrize("n", [1, 16, 37, 100])
@pytest.mark.parametrize("k", [1, 9, 256, 600])
def test_sgemm_matches_float64_at_every_tile_shape(n, k):
    """Rows 1-3 take the wide tiles, 4+ the 6-row ones with a partial last tile (1-2 left
    over: 4 + 3 or 4 + 4), 121+ more than one block of packed rows; columns not a multiple
    of 16 end in a partial panel; k crosses the 256-deep blocks."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    packed = cpu_kernels.sgemm_pack(w)
    for m in (1, 2, 3, 4, 6, 7, 8, 11, 40, 121, 250):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = cpu_kernels.sgemm(x, packed, n, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(got.double(), ref, atol=1e-4 * k**0.5, rtol=1e-4)


@needs_sgemm
def test_sgemm_rows_do_not_depend_on_the_batch():
    """A row's output is the same bit for bit whatever rows share its call, and reads x and
    writes y at their row strides (views into wider tensors)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 520, generator=g)
    packed = cpu_kernels.sgemm_pack(w)
    wide = torch.randn(300, 600, generator=g)
    x = wide[:, 40:560]  # row stride 600
    full = cpu_kernels.sgemm(x, packed, 200)
    # Edge tiles, tiles of every height, and blocks of packed rows that split differently.
    for lo, hi in ((0, 1), (5, 7), (9, 12), (2, 8), (3, 30), (0, 121), (7, 300), (150, 160)):
        out = torch.full((hi - lo, 210), -1.0)
        got = cpu_kernels.sgemm(x[lo:hi], packed, 200, out=out[:, 5:205])
        assert torch.equal(got, full[lo:hi])
        assert (out[:, :5] == -1).all() and (out[:, 205:] == -1).all()  # nothing outside


@needs_sgemm
@pytest.mark.parametrize("threads", [2, 3])
def test_sgemm_shared_tail_of_panels_gives_the_single_thread_bits(threads):
    """Each thread runs its share of the first three quarters of the panels, then claims
    chunks of the rest as it frees up: every panel of every block of rows is computed once,
    whichever thread takes it, to the bits one thread gets."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1000, 300, generator=g)  # 63 panels, the last partial
    b = torch.randn(1000, generator=g)
    packed = cpu_kernels.sgemm_pack(w)
    inter = 400  # 25 pairs for the gated form
    gated = cpu_kernels.sgemm_gated_pack(w[: 2 * inter], inter)
    x = torch.randn(370, 300, generator=g)  # 4 blocks of packed rows
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [(cpu_kernels.sgemm(x[:m], packed, 1000, b),
                 cpu_kernels.sgemm_silu(x[:m], gated, inter)) for m in (5, 38, 370)]  # fmt: skip
        torch.set_num_threads(threads)
        for m, (y, silu) in zip((5, 38, 370), want):
            for _ in range(3):  # which thread claims which chunk varies from call to call
                assert torch.equal(cpu_kernels.sgemm(x[:m], packed, 1000, b), y)
                assert torch.equal(cpu_kernels.sgemm_silu(x[:m], gated, inter), silu)
    finally:
        torch.set_num_threads(old)


@needs_dpbf16
@pytest.mark.parametrize("threads", [2, 3])
def test_dpbf16_prefill_sized_products_split_by_rows_give_the_same_rows(threads):
    """From 2 blocks of rows a thread (here 361+ rows on 2 threads) each thread takes blocks
    of rows over the whole weight instead of a share of the columns: every row is the bits
    it gets alone, at any thread count, and the gated epilogue too."""
    g = torch.Generator().manual_seed(8)
    w = _bf16(192, 300, g=g)
    x = _bf16(1000, 300, g=g)
    packed, gated = cpu_kernels.dpbf16_pack(w), cpu_kernels.dpbf16_gated_pack(w, 96)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (361, 480, 1000):
            full = cpu_kernels.dpbf16_gemm(x[:m], packed, 192)
            silu = cpu_kernels.dpbf16_silu(x[:m], gated, 96)
            for lo, hi in ((0, 1), (7, 13), (m - 40, m)):
                assert torch.equal(full[lo:hi], cpu_kernels.dpbf16_gemm(x[lo:hi], packed, 192))
                assert torch.equal(silu[lo:hi], cpu_kernels.dpbf16_silu(x[lo:hi], gated, 96))
    finally:
        torch.set_num_threads(old)


@needs_sgemm
@pytest.mark.parametrize("n, k", [(37, 600), (200, 9), (300, 1024)])
def test_sgemm_bf16_is_the_float32_product_rounded_once(n, k):
    """bf16 weights and x, float32 sums, y rounded to bf16 once: against the float32
    product of the same bf16 values, only a sum's last bit (another order) may differ."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    packed = cpu_kernels.sgemm_pack(w)
    assert packed.dtype == torch.bfloat16
    for m in (1, 2, 3, 4, 7, 40, 130):
        wide = torch.randn(m, k + 8, generator=g).bfloat16()
        x = wide[:, 3 : 3 + k]  # a row stride that is not k
        for bias in (None, b):
            got = cpu_kernels.sgemm(x, packed, n, bias)
            assert got.dtype == torch.bfloat16
            ref = F.linear(x.float(), w.float(), bias).bfloat16()
            torch.testing.assert_close(got.float(), ref.float(), atol=1e-2 * k**0.5, rtol=8e-3)
            assert (got != ref).float().mean() < 0.01
    out = torch.full((5, n + 4), 7.0).bfloat16()
    full = cpu_kernels.sgemm(x[:5], packed, n, b)
    cpu_kernels.sgemm(x[:5], packed, n, b, out=out[:, 2 : 2 + n])
    assert torch.equal(out[:, 2 : 2 + n], full) and (out[:, :2] == 7).all()


@needs_sgemm
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_on_sgemm_below_mkl(monkeypatch, bias):
    torch.manual_seed(2)
    lin = nn.Linear(64, 40, bias=bias)
    layer = PackedLinear(lin, Choice("sgemm", mkl_from=8))
    calls = []
    real = cpu_kernels.sgemm
    monkeypatch.setattr(
        cpu_kernels, "sgemm", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
    )
    for shape in ((1, 64), (7, 64), (8, 64), (2, 3, 64)):
        x = torch.randn(*shape)
        torch.testing.assert_close(
            layer(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5
        )
    assert calls == [1, 7, 6]  # 8 rows went to MKL; the 3-d input as 6 rows
    head = PackedLinear.of_weight(lin.weight, Choice("sgemm"))
    x = torch.randn(3, 64)
    torch.testing.assert_close(head(x), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)


@needs_sgemm
def test_bf16_packed_linear_on_sgemm():
    torch.manual_seed(4)
    lin = nn.Linear(64, 40, bias=True).bfloat16()
    layer = PackedLinear(lin, Choice("sgemm"))
    for shape in ((1, 64), (9, 64), (2, 3, 64)):
        x = torch.randn(*shape).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 40)
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=1e-2)


def test_amx_only_for_bf16_on_amx_cpus_unless_turned_off(monkeypatch):
    built = cpu_kernels.amx_available()
    assert use_amx(torch.bfloat16, AMX) == built
    assert not use_amx(torch.bfloat16, AVX512)  # AVX512-BF16 alone: oneDNN
    assert not use_amx(torch.float32, AMX)
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "amx")
    assert use_amx(torch.bfloat16, AMX) == built
    assert not use_sgemm(torch.float32, AVX2)
    for choice in ("onednn", "sgemm"):
        monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", choice)
        assert not use_amx(torch.bfloat16, AMX)


def _bf16(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).bfloat16()


@needs_amx
@pytest.mark.parametrize("n", [16, 37, 100, 1000])
@pytest.mark.parametrize("k", [32, 96, 1024, 2144])
def test_amx_matches_float64_at_every_tile_shape(n, k):
    """1 row tile takes four panels a pass, 2+ two (three row tiles in one pass, k in
    chunks of 4 tiles; four in two passes), 80+ rows in blocks of row pairs read in place
    (the last m % 32 through a padded copy, 300 rows: two blocks); rows not a multiple of
    16 end in a padded tile, columns in a partial panel; an odd panel count ends in a
    one-panel pass; k past 2,048 in the row blocks goes in two passes, C parked between."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = _bf16(n, k, g=g)
    b = torch.randn(n, generator=g)
    packed = cpu_kernels.amx_pack(w)
    for m in (1, 5, 16, 17, 32, 33, 48, 63, 64, 65, 100, 128, 150, 300):
        x = _bf16(m, k, g=g)
        for bias in (None, b):
            got = cpu_kernels.amx_gemm(x, packed, n, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            # float32 accumulation, one bf16 rounding of the result (2^-8 relative)
            torch.testing.assert_close(got.double(), ref, atol=1e-4 * k**0.5, rtol=2**-8)


@needs_amx
def test_amx_product_in_a_process_that_never_asked_for_the_tiles():
    """The kernel asks the OS for the tile registers itself: a process whose first AMX call
    is a product (no amx_available() before it) gets the product, not SIGILL."""
    code = (
        "import torch; from gpu.cpu import kernels as ck; w = torch.randn(48, 64).bfloat16(); "
        "x = torch.randn(5, 64).bfloat16(); y = ck.amx_gemm(x, ck.amx_pack(w), 48); "
        "assert torch.allclose(y.float(), x.float() @ w.float().T, atol=0.1, rtol=0.02)"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]


@needs_amx
@pytest.mark.parametrize("k", [512, 224, 2144])
def test_amx_rows_do_not_depend_on_the_batch(k):
    """A row's output is the same bit for bit whatever rows share its call (three row tiles,
    k in chunks, a last chunk short at k = 224, against the others' passes; the row blocks'
    two passes over k = 2,144), and reads x and writes y at their row strides (views into
    wider tensors)."""
    g = torch.Generator().manual_seed(3)
    w = _bf16(200, k, g=g)
    packed = cpu_kernels.amx_pack(w)
    x = _bf16(300, k + 88, g=g)[:, 40 : 40 + k]  # row stride k + 88
    full = cpu_kernels.amx_gemm(x, packed, 200)
    spans = ((0, 1), (5, 7), (9, 12), (2, 18), (3, 40), (20, 68), (0, 70), (10, 110), (1, 129),
             (7, 300))  # fmt: skip
    for lo, hi in spans:  # the last three on the row-blocked path (80+ rows)
        out = torch.full((hi - lo, 210), -1.0, dtype=torch.bfloat16)
        got = cpu_kernels.amx_gemm(x[lo:hi], packed, 200, out=out[:, 5:205])
        assert torch.equal(got, full[lo:hi])
        assert (out[:, :5] == -1).all() and (out[:, 205:] == -1).all()  # nothing outside


@needs_amx
@pytest.mark.parametrize("prefill", ["auto", "onednn"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_on_amx_at_every_size_or_up_to_max_rows(monkeypatch, bias, prefill):
    """auto: every product on AMX, one copy of the weight; PAGESTREAM_PREFILL_GEMM=onednn:
    up to AMX_MAX_ROWS rows, oneDNN's copy above."""
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", prefill)
    torch.manual_seed(2)
    lin = nn.Linear(64, 48, bias=bias).bfloat16()
    layer = PackedLinear(lin, Choice("amx"))
    amx = layer.strategy
    assert amx.amx is not None and (amx.packed is not None) == (prefill == "onednn")
    assert amx.onednn_rows() == (None if prefill == "auto" else (AMX_MAX_ROWS + 1, None))
    calls = []
    real = cpu_kernels.amx_gemm
    monkeypatch.setattr(
        cpu_kernels, "amx_gemm", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
    )
    for shape in ((1, 64), (AMX_MAX_ROWS, 64), (AMX_MAX_ROWS + 1, 64), (2, 3, 64)):
        x = torch.randn(*shape).bfloat16()
        ref = F.linear(
            x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
        )
        torch.testing.assert_close(layer(x).float(), ref, atol=2e-2, rtol=2**-7)
    # The 3-d input as 6 rows; AMX_MAX_ROWS + 1 on oneDNN under onednn.
    big = [AMX_MAX_ROWS + 1] if prefill == "auto" else []
    assert calls == [1, AMX_MAX_ROWS, *big, 6]
    assert cpu_linear.pack_head(lin.weight, amx_copy=True).strategy.amx is not None
    assert choose(torch.bfloat16, (16, 40)).family == "onednn"  # k not a multiple of 32
    assert choose(torch.float32, (48, 64)).family != "amx"  # float32: never


@needs_amx
def test_bf16_model_runs_its_decode_projections_on_amx_and_matches_onednn(monkeypatch):
    """The tiny checkpoint's bf16 decode logits on AMX are oneDNN's up to bf16 rounding."""
    from gpu.model_runner import ModelRunner
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint("llama")
    logits = {}
    for choice in ("amx", "onednn"):
        monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", choice)
        r = ModelRunner(path, dtype="bfloat16", device="cpu", num_kv_blocks=16)
        layers = [m for m in r.model.layers.modules() if isinstance(m, PackedLinear)]
        assert layers and all((m.strategy.amx is not None) == (choice == "amx") for m in layers)
        h = torch.randn(5, r.config.hidden_size, generator=torch.Generator().manual_seed(0))
        logits[choice] = r.model.compute_logits(h.bfloat16())
    torch.testing.assert_close(logits["amx"], logits["onednn"], atol=3e-2, rtol=2**-7)


def test_amx_copy_only_where_it_fits_the_memory_unless_forced(monkeypatch):
    """auto makes the second (AMX) copy only within AMX_COPY_MEMORY_SHARE of the memory
    available; PAGESTREAM_DECODE_GEMM=amx always."""
    share = cpu_linear.AMX_COPY_MEMORY_SHARE
    assert cpu_linear.amx_copy_fits(100, available=int(100 / share))
    assert not cpu_linear.amx_copy_fits(101, available=int(100 / share))
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "amx")
    assert cpu_linear.amx_copy_fits(10**15, available=1)
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(40, 8)).bfloat16()
    assert cpu_linear.amx_copy_bytes(model, extra=7) == 64 * 16 * 2 + 7  # k=40: no copy
    assert cpu_linear.amx_copy_bytes(model.float()) == 0


@needs_amx
def test_bf16_model_keeps_one_copy_when_the_amx_copy_does_not_fit(monkeypatch, caplog):
    from gpu.model_runner import ModelRunner
    from tests.checkpoints import tiny_checkpoint

    monkeypatch.setattr(cpu_linear, "_mem_available", lambda: 1024)
    # Under auto the AMX layout is the only copy: no memory for a second one needed.
    r = ModelRunner(tiny_checkpoint("llama"), dtype="bfloat16", device="cpu", num_kv_blocks=16)
    layers = [m for m in r.model.layers.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.choice.family == "amx" for m in layers)
    assert all(m.strategy.packed is None and m.strategy.halves is None for m in layers)
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "onednn")
    with caplog.at_level("WARNING"):
        r = ModelRunner(tiny_checkpoint("llama"), dtype="bfloat16", device="cpu", num_kv_blocks=16)
    layers = [m for m in r.model.layers.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.choice.family == "onednn" for m in layers)
    assert r.model.lm_head_packed.strategy.amx is None
    assert "stay on oneDNN" in caplog.text


def test_dpbf16_for_bf16_on_avx512_bf16_cpus_without_amx_unless_turned_off(monkeypatch):
    built = cpu_kernels.dpbf16_available()
    assert use_dpbf16(torch.bfloat16, AVX512) == built
    assert not use_dpbf16(torch.bfloat16, AMX)  # AMX: the tiles' kernels
    assert not use_dpbf16(torch.bfloat16, AVX512_NO_BF16)  # no vdpbf16ps: the sgemm
    assert not use_dpbf16(torch.bfloat16, AVX2)
    assert not use_dpbf16(torch.float32, AVX512)
    assert not use_sgemm(torch.bfloat16, AVX512)
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "dpbf16")
    assert use_dpbf16(torch.bfloat16, AMX) == built
    assert not use_amx(torch.bfloat16, AMX) and not use_sgemm(torch.bfloat16, AVX2)
    for choice in ("onednn", "sgemm", "amx"):
        monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", choice)
        assert not use_dpbf16(torch.bfloat16, AVX512)


@needs_dpbf16
@pytest.mark.parametrize("n", [1, 16, 37, 100, 1000])
@pytest.mark.parametrize("k", [1, 9, 256, 600, 2144])
def test_dpbf16_matches_float64_at_every_tile_shape(n, k):
    """Row tiles of 6 (the last two 4 + 3 or 4 + 4 where 1-2 rows are left), groups of 1-4
    panels at the end of n, columns in a partial panel, an odd k's padded pair, k past one
    block (128 values up to 16 rows on a 32 KB L1, else 256 or 2,048), rows past one packed
    block (120)."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = _bf16(n, k, g=g)
    b = torch.randn(n, generator=g)
    packed = cpu_kernels.dpbf16_pack(w)
    for m in (1, 2, 3, 4, 7, 8, 13, 38, 121, 250):
        x = _bf16(m, k, g=g)
        for bias in (None, b):
            got = cpu_kernels.dpbf16_gemm(x, packed, n, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(got.double(), ref, atol=1e-4 * k**0.5, rtol=2**-8)


@needs_dpbf16
def test_dpbf16_rows_do_not_depend_on_the_batch():
    """A row's output is the same bit for bit whatever rows share its call, and x and y are
    read and written at their row strides (views into wider tensors, odd offsets)."""
    g = torch.Generator().manual_seed(5)
    w = _bf16(200, 512, g=g)
    packed = cpu_kernels.dpbf16_pack(w)
    x = _bf16(130, 601, g=g)[:, 41:553]  # row stride 601: rows not 4-byte aligned
    full = cpu_kernels.dpbf16_gemm(x, packed, 200)
    for lo, hi in ((0, 1), (5, 7), (9, 12), (2, 18), (3, 40), (0, 121), (0, 130)):
        out = torch.full((hi - lo, 210), -1.0, dtype=torch.bfloat16)
        got = cpu_kernels.dpbf16_gemm(x[lo:hi], packed, 200, out=out[:, 5:205])
        assert torch.equal(got, full[lo:hi])
        assert (out[:, :5] == -1).all() and (out[:, 205:] == -1).all()  # nothing outside


@needs_dpbf16
def test_packed_linear_on_dpbf16_every_size(monkeypatch):
    torch.manual_seed(6)
    lin = nn.Linear(64, 40, bias=True).bfloat16()
    layer = PackedLinear(lin, Choice("dpbf16"))
    assert layer.strategy.kernel == "dpbf16"
    calls = []
    real = cpu_kernels.dpbf16_gemm
    monkeypatch.setattr(
        cpu_kernels,
        "dpbf16_gemm",
        lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw),
    )
    for shape in ((1, 64), (9, 64), (700, 64), (2, 3, 64)):
        x = torch.randn(*shape).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 40)
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2**-7)
    assert calls == [1, 9, 700, 6]  # prefill-sized products too; the 3-d input as 6 rows
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "dpbf16")
    assert cpu_linear.pack_head(lin.weight).choice.family == "dpbf16"
    assert choose(torch.float32, (40, 64)).family != "dpbf16"  # float32: never


def _model_on_kernel_matches_onednn(
    monkeypatch, kernel: str, dtype: str, atol: float, rtol: float
) -> None:
    """The tiny checkpoint's logits with every projection and the lm_head on `kernel` (a
    PackedLinear flag and a PAGESTREAM_DECODE_GEMM choice) are oneDNN's up to `dtype`'s
    rounding, for a prefill-sized batch of hidden states."""
    from gpu.model_runner import ModelRunner
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint("llama")
    logits = {}
    for choice in (kernel, "onednn"):
        monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", choice)
        r = ModelRunner(path, dtype=dtype, device="cpu", num_kv_blocks=16)
        layers = [m for m in r.model.layers.modules() if isinstance(m, PackedLinear)]
        layers.append(r.model.lm_head_packed)
        assert layers and all((m.choice.family == kernel) == (choice == kernel) for m in layers)
        h = torch.randn(300, r.config.hidden_size, generator=torch.Generator().manual_seed(0))
        logits[choice] = r.model.compute_logits(h.to(r.model.embed_tokens.weight.dtype))
    torch.testing.assert_close(logits[kernel], logits["onednn"], atol=atol, rtol=rtol)


@needs_dpbf16
def test_bf16_model_on_dpbf16_matches_onednn(monkeypatch):
    _model_on_kernel_matches_onednn(monkeypatch, "dpbf16", "bfloat16", 3e-2, 2**-7)


@needs_dpbf16
@pytest.mark.parametrize("inter", [32, 96, 2816])
@pytest.mark.parametrize("k", [9, 256, 600, 2144])
def test_dpbf16_silu_is_the_gemm_then_silu_mul_bit_for_bit(inter, k):
    """The gated epilogue gives the bits of gate_up through the plain kernel followed by the
    compiled silu_mul: at every row-tile shape, k past a block, odd k, and x and out as
    row-strided views (out's neighbours untouched)."""
    _check_gated_epilogue("dpbf16", inter, k, (1, 2, 3, 7, 13, 38, 121, 250))


def _check_gated_epilogue(kernel: str, inter: int, k: int, rows: tuple[int, ...]) -> None:
    """{kernel}_silu on its gated pack against {kernel}'s plain product + silu_mul, bit for
    bit, x and out row-strided views; and close to silu(gate) * up in float32."""
    pack, gated_pack, gemm, silu = {
        "dpbf16": (cpu_kernels.dpbf16_pack, cpu_kernels.dpbf16_gated_pack,
                   cpu_kernels.dpbf16_gemm, cpu_kernels.dpbf16_silu),
        "amx": (cpu_kernels.amx_pack, cpu_kernels.amx_gated_pack, cpu_kernels.amx_gemm,
                cpu_kernels.amx_silu),
        "sgemm512": (cpu_kernels.sgemm512_pack, cpu_kernels.sgemm512_gated_pack,
                     cpu_kernels.sgemm512, cpu_kernels.sgemm512_silu),
        "sgemm": (cpu_kernels.sgemm_pack, cpu_kernels.sgemm_gated_pack, cpu_kernels.sgemm,
                  cpu_kernels.sgemm_silu),
    }[kernel]  # fmt: skip
    dtype = torch.float32 if kernel in ("sgemm512", "sgemm") else torch.bfloat16
    g = torch.Generator().manual_seed(inter + k)
    w = _bf16(2 * inter, k, g=g).to(dtype)
    plain, gated = pack(w), gated_pack(w, inter)
    wide = (4 * torch.randn(max(rows), k + 7, generator=g)).to(dtype)
    for m in rows:
        x = wide[:m, 3 : 3 + k]
        want = cpu_kernels.silu_mul(gemm(x, plain, 2 * inter))
        out = torch.full((m, inter + 10), -1.0, dtype=dtype)
        got = silu(x, gated, inter, out=out[:, 4 : 4 + inter])
        assert torch.equal(got, want)
        assert (out[:, :4] == -1).all() and (out[:, 4 + inter :] == -1).all()
    gate, up = F.linear(wide[:5, 3 : 3 + k].float(), w.float()).split(inter, dim=-1)
    got = silu(wide[:5, 3 : 3 + k], gated, inter).float()
    torch.testing.assert_close(got, F.silu(gate) * up, atol=0.1, rtol=2**-6)


@needs_dpbf16
def test_packed_gate_up_on_dpbf16_takes_the_gated_layout_where_it_can():
    torch.manual_seed(7)
    lin = nn.Linear(64, 2 * 96, bias=False).bfloat16()
    layer = PackedLinear(lin, Choice("dpbf16", gated_inter=96))
    ungated = PackedLinear(lin, Choice("dpbf16"))
    assert layer.gated_inter == 96 and ungated.gated_inter is None
    x = torch.randn(9, 64).bfloat16()
    # forward() still gives [gate; up] in the checkpoint's order; silu_mul() the fused op.
    assert torch.equal(layer(x), ungated(x))
    assert torch.equal(layer.silu_mul(x), cpu_kernels.silu_mul(ungated(x)))
    assert layer.silu_mul(x.view(3, 3, 64)).shape == (3, 3, 96)

    # Where the epilogue cannot run, the plain layout: a bias, an inter that does not tile
    # by 32, float32, or no vdpbf16ps kernel chosen.
    def gated(dtype=torch.bfloat16, shape=(192, 64), inter=96, bias=False, cpu=AVX512):
        return choose(dtype, shape, bias=bias, gated_inter=inter, cpu=cpu).gated_inter

    assert gated() == 96
    assert gated(bias=True) is None
    assert gated(shape=(80, 64), inter=40) is None
    assert choose(torch.float32, (192, 64), gated_inter=96, cpu=AVX512).family == "sgemm512"
    assert gated(cpu=AVX512_NO_BF16) is None  # the bf16 sgemm's: no gated layout


@needs_dpbf16
def test_bf16_model_on_dpbf16_runs_silu_in_the_gate_up_epilogue(monkeypatch):
    """Every MLP of a bf16 model on the kernel takes the gated layout, and greedy output is
    the same token for token as with the plain layout + silu_mul (gating off with the
    fused kernels), over prefill chunks and decodes."""
    _check_gated_model(monkeypatch, "dpbf16", "GATED_GROUP", list(range(40, 130)), budget=32)


def _check_gated_model(monkeypatch, kernel: str, group: str, prompt: list[int], budget: int):
    """Greedy tokens of the tiny bf16 model on `kernel` with every MLP gated and with none
    (cpu_kernels.<group> set past any inter), over prefill chunks of up to `budget` tokens."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", kernel)
    model = str(tiny_checkpoint("llama"))
    prompts = [[5, 6, 7], prompt, [9] * 18]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for gate in (True, False):
        if not gate:
            monkeypatch.setattr(cpu_kernels, group, 10**9)  # no inter tiles by it
        llm = LLM(model, dtype="bfloat16", num_kv_blocks=64, threads=1,
                  max_num_batched_tokens=budget)  # fmt: skip
        try:
            mlps = [layer.mlp for layer in llm.engine.runner.model.layers]
            assert all((m.gate_up_proj.gated_inter is not None) == gate for m in mlps)
            outs[gate] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]


@needs_amx
def test_bf16_prompt_on_amx_gets_the_same_bits_in_one_step_as_in_chunks(monkeypatch):
    """Under auto every product is on AMX, whose rows do not depend on their batch: a
    300-token prompt prefilled in one step (the kernel's prompt-sized path) and in chunks
    of 48 gives the same greedy tokens with the same logprobs, bit for bit."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "auto")
    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", "kernel")
    rng = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 2000, (300,), generator=rng).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = {}
    for budget in (512, 48):
        llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", num_kv_blocks=64, threads=2,
                  max_num_batched_tokens=budget)  # fmt: skip
        try:
            layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
            assert layers and all(m.choice.family == "amx" for m in layers)
            out = llm.generate([prompt], params)[0].outputs[0]
            got[budget] = (out.token_ids, [lp.logprob for lp in out.logprobs])
        finally:
            llm.shutdown()
    assert got[512] == got[48]


@needs_amx
@pytest.mark.parametrize("inter", [16, 48, 2816])
@pytest.mark.parametrize("k", [32, 224, 1024, 2144])
def test_amx_silu_is_the_gemm_then_silu_mul_bit_for_bit(inter, k):
    """The AMX kernel's gated epilogue gives the bits of gate_up through amx_gemm followed
    by the compiled silu_mul: at 1-6 row tiles (3: the one-pass chunked k), panel counts
    that leave a short group of 2 (inter 48: 6 panels), and x and out as row-strided views
    (out's neighbours untouched)."""
    _check_gated_epilogue("amx", inter, k, (1, 5, 16, 17, 38, 48, 64, 96, 130, 192))


@needs_amx
@pytest.mark.parametrize("prefill", ["auto", "onednn"])
def test_packed_gate_up_on_amx_takes_the_gated_layout_where_it_can(monkeypatch, prefill):
    """Rows on AMX run the gated AMX epilogue (the bits of the product + silu_mul): every
    size under auto; under PAGESTREAM_PREFILL_GEMM=onednn, prefill-sized ones gated_linear,
    oneDNN's products of the gate and up halves with SiLU and the multiply fused (close:
    SiLU of the float32 sums); forward() gives [gate; up]."""
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", prefill)
    torch.manual_seed(8)
    lin = nn.Linear(64, 2 * 96, bias=False).bfloat16()
    layer = PackedLinear(lin, Choice("amx", gated_inter=96))
    ungated = PackedLinear(lin, Choice("amx"))
    assert layer.gated_inter == 96 and ungated.gated_inter is None
    gated = layer.strategy
    assert gated.packed is None  # no [gate; up] oneDNN copy
    assert (gated.halves is not None) == (prefill == "onednn")
    calls = []
    real = cpu_kernels.amx_silu
    monkeypatch.setattr(
        cpu_kernels, "amx_silu", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
    )
    for rows in (1, 9, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64).bfloat16()
        gate, up = F.linear(x.float(), lin.weight.float()).split(96, dim=-1)
        if rows <= AMX_MAX_ROWS or prefill == "auto":
            assert torch.equal(layer(x), ungated(x))
            assert torch.equal(layer.silu_mul(x), cpu_kernels.silu_mul(ungated(x)))
        else:
            torch.testing.assert_close(layer(x).float(), ungated(x).float(), atol=0, rtol=2**-7)
            got = layer.silu_mul(x)
            assert got.shape == (rows, 96)
            torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=3e-2, rtol=2**-6)
    assert calls == [1, 9, AMX_MAX_ROWS, *([AMX_MAX_ROWS + 1, 300] if prefill == "auto" else [])]
    assert layer.silu_mul(torch.randn(3, 3, 64).bfloat16()).shape == (3, 3, 96)

    # A bias, an inter that does not tile by 16, or no AMX copy: the plain layout.
    def gated(shape=(192, 64), inter=96, bias=False, amx_copy=True):
        choice = choose(torch.bfloat16, shape, bias=bias, gated_inter=inter, amx_copy=amx_copy,
                        cpu=AMX)  # fmt: skip
        return choice.family, choice.gated_inter

    assert gated() == ("amx", 96)
    assert gated(bias=True) == ("amx", None)
    assert gated(shape=(80, 64), inter=40) == ("amx", None)
    assert gated(amx_copy=False) == ("onednn", None)


@needs_packing
def test_gated_linear_is_silu_gate_times_up_at_bucketed_rows():
    """oneDNN's two fused products give SiLU(x gate^T) * (x up^T) at any row count (run at
    the bucketed size, the padding dropped) for a plain x and for a strided view."""
    if not cpu_linear.packing_available(torch.bfloat16):
        pytest.skip("no packed oneDNN bf16 linear here")
    g = torch.Generator().manual_seed(10)
    w = (torch.randn(2 * 80, 64, generator=g) / 8).bfloat16()
    gate_w, up_w = cpu_linear.pack_weight(w[:80]), cpu_linear.pack_weight(w[80:])
    for m in (1, 17, 97, 300):
        wide = torch.randn(m, 70, generator=g).bfloat16()
        for x in (wide[:, 3:67].contiguous(), wide[:, 3:67]):
            got = cpu_linear.gated_linear(x, gate_w, up_w)
            gate, up = F.linear(x.float(), w.float()).split(80, dim=-1)
            assert got.shape == (m, 80) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=3e-2, rtol=2**-6)


@needs_amx
def test_bf16_model_on_amx_runs_silu_in_the_gate_up_epilogue(monkeypatch):
    """Every MLP of a bf16 model on the AMX kernel takes the gated layout, and greedy output
    is the same token for token as with the plain layout + silu_mul over steps of up to
    AMX_MAX_ROWS tokens (prefill chunks and decodes on AMX; larger chunks take gated_linear,
    whose rounding differs: test_gated_linear_is_silu_gate_times_up_at_bucketed_rows)."""
    _check_gated_model(monkeypatch, "amx", "AMX_GATED_GROUP", list(range(40, 250)), budget=64)


def test_gemm_rows_buckets_every_size_into_few():
    """Every row count maps to a bucket at least as large and less than 1/16 larger (exact
    up to 64 rows, at most 3 rows more to 128, 7 to 512); up to 4,096 rows there are under 180 buckets, so oneDNN
    builds that many kernels per weight however the chunk sizes vary."""
    sizes = {cpu_kernels.gemm_rows(m) for m in range(1, 4097)}
    assert len(sizes) < 180
    for m in range(1, 20000):
        b = cpu_kernels.gemm_rows(m)
        assert b >= m and cpu_kernels.gemm_rows(b) == b
        assert b == m if m <= 64 else (b - m) * 16 < m
        assert b - m <= (0 if m <= 64 else 3 if m <= 128 else 7 if m <= 512 else b)
    assert cpu_kernels.gemm_rows(1153) == cpu_kernels.gemm_rows(1172) == 1216


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_runs_at_bucketed_rows(dtype):
    """packed_linear of m rows gives the rows oneDNN computes at the bucketed size, from x's
    own storage where it has the room (empty_rows: compiled kernels' outputs) and from a
    zero-padded copy otherwise (a plain tensor, a row-strided view)."""
    if not cpu_linear.packing_available(dtype):
        pytest.skip(f"no packed oneDNN linear for {dtype} here")
    torch.manual_seed(9)
    w = torch.randn(40, 64).to(dtype)
    b = torch.randn(40).to(dtype)
    pw = cpu_linear.pack_weight(w)
    for m in (3, 67, 100, 300, 1172):
        full = cpu_kernels.gemm_rows(m)
        slack = cpu_kernels.empty_rows(m, 64, dtype)
        slack.copy_(torch.randn(m, 64).to(dtype))
        assert slack.untyped_storage().nbytes() == full * 64 * slack.element_size()
        assert (slack.as_strided((full, 64), (64, 1))[m:] == 0).all()
        plain = slack.clone()
        strided = torch.zeros(m, 80, dtype=dtype)[:, 8:72]
        strided.copy_(slack)
        padded = torch.zeros(full, 64, dtype=dtype)
        padded[:m] = slack
        want = torch.ops.mkldnn._linear_pointwise(padded, pw, b, "none", [None], "")[:m]
        for x in (slack, plain, strided):
            got = cpu_linear.packed_linear(x, pw, b)
            assert got.shape == (m, 40) and got.is_contiguous()
            assert torch.equal(got, want)
        ref = F.linear(slack.double(), w.double(), b.double())
        torch.testing.assert_close(want.double(), ref, atol=0.1, rtol=2**-6)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no compiled kernels")
def test_projection_inputs_leave_room_for_the_bucketed_rows():
    """The compiled kernels whose outputs feed projections (the norms: qkv and gate_up, SiLU
    * up: down) leave zeroed rows up to gemm_rows in their storage, so packed_linear extends
    them in place (the attention backend's output, o_proj's input, is made the same way)."""
    m = 301
    full = cpu_kernels.gemm_rows(m)
    assert full > m
    for dtype in (torch.float32, torch.bfloat16):
        res = torch.randn(m, 64).to(dtype)
        outs = [
            cpu_kernels.add_rms_norm(None, res, torch.ones(64, dtype=dtype), 1e-5),
            cpu_kernels.silu_mul(torch.randn(m, 128).to(dtype)),
        ]
        for out in outs:
            assert out.shape == (m, 64) and out.is_contiguous()
            assert out.untyped_storage().nbytes() == full * 64 * out.element_size()
            assert (out.as_strided((full, 64), (64, 1))[m:] == 0).all()


@needs_packing
def test_engine_start_runs_every_bucketed_onednn_product_once(monkeypatch):
    """An engine on CPU runs each oneDNN product shape once at start (so oneDNN's kernels
    are built before the first request): every bucket up to the token budget for each
    projection shape, up to max_num_seqs rows for the lm_head, none on the AMX kernel's
    rows; and PAGESTREAM_CPU_WARMUP=0 skips it."""
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    seen: list[tuple[int, int]] = []
    real = cpu_linear.packed_linear
    monkeypatch.setattr(
        cpu_linear, "packed_linear", lambda x, w, b: seen.append(tuple(x.shape)) or real(x, w, b)
    )
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "onednn")
    monkeypatch.setenv("PAGESTREAM_CPU_WARMUP", "1")
    model = str(tiny_checkpoint("llama"))
    llm = LLM(model, dtype="float32", num_kv_blocks=64, threads=1, max_num_batched_tokens=300,
              max_num_seqs=40)  # fmt: skip
    try:
        cfg = llm.engine.runner.config
    finally:
        llm.shutdown()
    buckets = sorted({cpu_kernels.gemm_rows(m) for m in range(1, 301)})
    heads = sorted({cpu_kernels.gemm_rows(m) for m in range(1, 41)})
    h = cfg.hidden_size
    by_k: dict[int, list[int]] = {}
    for rows, k in seen:
        by_k.setdefault(k, []).append(rows)
    # qkv, gate_up (k = hidden) and o_proj (k = heads x dim, here hidden too) and the
    # lm_head; down_proj (k = intermediate).
    assert sorted(by_k[cfg.intermediate_size]) == buckets
    assert len(seen) == 4 * len(buckets) + len(heads)
    assert all(rows in buckets for rows in by_k[h])
    seen.clear()
    monkeypatch.setenv("PAGESTREAM_CPU_WARMUP", "0")
    LLM(model, dtype="float32", num_kv_blocks=64, threads=1).shutdown()
    assert seen == []


def test_sgemm512_for_float32_on_avx512_cpus_unless_turned_off(monkeypatch):
    built = cpu_kernels.sgemm512_available()
    for cpu in (AVX512, AVX512_NO_BF16, AMX):  # AMX has no float32 product
        assert use_sgemm512(torch.float32, cpu) == built
        assert not use_sgemm(torch.float32, cpu)
    assert not use_sgemm512(torch.float32, AVX2)  # AVX2: sgemm.cpp
    assert not use_sgemm512(torch.bfloat16, AVX512)
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", "sgemm512")
    assert use_sgemm512(torch.float32, AVX2) == built
    for choice in ("onednn", "sgemm", "amx", "dpbf16"):
        monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", choice)
        assert not use_sgemm512(torch.float32, AVX512)


@needs_sgemm512
@pytest.mark.parametrize("n", [1, 16, 37, 100, 1000])
@pytest.mark.parametrize("k", [1, 9, 128, 300, 1100])
def test_sgemm512_matches_float64_at_every_tile_shape(n, k):
    """The bf16 kernel's tiles and groups with a float32 word per value of k: k past one
    block (128 values, or 1,024 on a 32 KB L1), rows past one packed block (120)."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    packed = cpu_kernels.sgemm512_pack(w)
    for m in (1, 2, 3, 4, 7, 8, 13, 38, 121, 250):
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = cpu_kernels.sgemm512(x, packed, n, bias)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(got.double(), ref, atol=1e-5 * k**0.5, rtol=1e-5)


@needs_sgemm512
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sgemm512_rows_do_not_depend_on_the_batch(threads):
    """A row's output is the same bits whatever rows share its call, decode-sized (columns
    split over threads) or prefill-sized (rows split), and x and y are read and written at
    their row strides."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=g)
    packed = cpu_kernels.sgemm512_pack(w)
    x = torch.randn(1000, 345, generator=g)[:, 41:341]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = cpu_kernels.sgemm512(x, packed, 200)
        for lo, hi in ((0, 1), (5, 7), (9, 12), (2, 18), (3, 40), (0, 121), (0, 361), (7, 1000)):
            out = torch.full((hi - lo, 210), -1.0)
            got = cpu_kernels.sgemm512(x[lo:hi], packed, 200, out=out[:, 5:205])
            assert torch.equal(got, full[lo:hi])
            assert (out[:, :5] == -1).all() and (out[:, 205:] == -1).all()
    finally:
        torch.set_num_threads(old)


@needs_sgemm512
def test_float32_model_on_sgemm512_matches_onednn(monkeypatch):
    """Under auto on an AVX-512 CPU every float32 projection and the lm_head take it."""
    _model_on_kernel_matches_onednn(monkeypatch, "sgemm512", "float32", 1e-4, 1e-4)


@needs_sgemm512
@pytest.mark.parametrize("inter", [32, 96, 2816])
@pytest.mark.parametrize("k", [9, 128, 300])
def test_sgemm512_silu_is_the_gemm_then_silu_mul_bit_for_bit(inter, k):
    _check_gated_epilogue("sgemm512", inter, k, (1, 2, 3, 7, 13, 38, 121, 250))


@needs_sgemm512
def test_packed_float32_gate_up_on_sgemm512_takes_the_gated_layout():
    torch.manual_seed(7)
    lin = nn.Linear(64, 2 * 96, bias=False)
    layer = PackedLinear(lin, Choice("sgemm512", gated_inter=96))
    ungated = PackedLinear(lin, Choice("sgemm512"))
    assert layer.strategy.gated == cpu_kernels.gated_kernel("sgemm512")
    assert layer.gated_inter == 96 and ungated.gated_inter is None
    assert ungated.strategy.gated is None
    for rows in (9, 700):  # decode-sized (columns split) and prefill-sized (rows split)
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), ungated(x))  # [gate; up] in the checkpoint's order
        assert torch.equal(layer.silu_mul(x), cpu_kernels.silu_mul(ungated(x)))


@needs_sgemm
@pytest.mark.parametrize("inter", [16, 96, 2816])
@pytest.mark.parametrize("k", [9, 256, 300])
def test_sgemm_silu_is_the_gemm_then_silu_mul_bit_for_bit(inter, k):
    """1-3 rows (the whole product, then the epilogue), 4+ in 6-row tiles, 121+ in more than
    one block of rows; k across the 256-deep blocks."""
    _check_gated_epilogue("sgemm", inter, k, (1, 2, 3, 4, 7, 13, 38, 121, 250))


@needs_sgemm
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sgemm_silu_rows_do_not_depend_on_the_batch_or_threads(threads):
    """Pairs of panels split over the threads: a row's result is the same bits whatever
    rows and how many threads share its call."""
    g = torch.Generator().manual_seed(5)
    inter, k = 176, 200  # 11 pairs: an odd count, uneven over 2 or 3 threads
    w = torch.randn(2 * inter, k, generator=g)
    packed = cpu_kernels.sgemm_gated_pack(w, inter)
    x = torch.randn(40, k, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = torch.cat([cpu_kernels.sgemm_silu(x[i : i + 1], packed, inter) for i in range(40)])
        torch.set_num_threads(threads)
        for rows in (4, 9, 40):
            assert torch.equal(cpu_kernels.sgemm_silu(x[:rows], packed, inter), want[:rows])
    finally:
        torch.set_num_threads(old)


@needs_sgemm
def test_packed_float32_gate_up_on_sgemm_takes_the_gated_layout():
    torch.manual_seed(7)
    lin = nn.Linear(64, 2 * 96, bias=False)
    layer = PackedLinear(lin, Choice("sgemm", gated_inter=96))
    ungated = PackedLinear(lin, Choice("sgemm"))
    assert layer.strategy.gated == cpu_kernels.gated_kernel("sgemm")
    assert layer.gated_inter == 96 and ungated.gated_inter is None
    assert ungated.strategy.gated is None
    for rows in (2, 9, 700):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), ungated(x))  # [gate; up] in the checkpoint's order
        assert torch.equal(layer.silu_mul(x), cpu_kernels.silu_mul(ungated(x)))


@needs_sgemm
def test_sgemm_gates_only_float32_without_mkl(monkeypatch):
    """The plain layout where the epilogue cannot run: a bias, an inter that does not tile
    by 16, bf16 weights, or MKL taking the prefill rows (which read the plain weight)."""

    def gated(dtype=torch.float32, shape=(192, 64), inter=96, bias=False):
        choice = choose(dtype, shape, bias=bias, gated_inter=inter, cpu=AVX2)
        assert choice.family == "sgemm"
        return choice.gated_inter

    assert gated() == 96
    assert gated(bias=True) is None
    assert gated(shape=(80, 64), inter=40) is None
    assert gated(dtype=torch.bfloat16) is None
    monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", "mkl")
    assert gated() == (None if torch.backends.mkl.is_available() else 96)


def test_bf16_exact_is_every_value_a_bf16_one():
    g = torch.Generator().manual_seed(3)
    w = _bf16(40, 24, g=g).float()
    assert cpu_kernels.bf16_exact(w) and cpu_kernels.bf16_exact(w[:, 1:5])
    w[7, 3] = torch.nextafter(w[7, 3], torch.tensor(1.0))  # one value off the bf16 grid
    assert not cpu_kernels.bf16_exact(w)
    assert not cpu_kernels.bf16_exact(_bf16(4, 4, g=g))  # bf16 itself: not this case


@needs_sgemm
@pytest.mark.parametrize("n", [1, 16, 37, 100])
@pytest.mark.parametrize("k", [9, 256, 600])
def test_sgemm_w16_is_sgemm_bit_for_bit(n, k):
    """The weight held in bf16 and widened as it loads gives the float32 weight's bits:
    wide tiles (1-3 rows), 6-row tiles with partial ones, more than one block of rows, a
    partial last panel (its zero columns too), k across the 256-deep blocks, a bias."""
    g = torch.Generator().manual_seed(n * 100 + k)
    w = _bf16(n, k, g=g).float()
    b = torch.randn(n, generator=g)
    f32, w16 = cpu_kernels.sgemm_pack(w), cpu_kernels.sgemm_w16_pack(w)
    assert w16.dtype == torch.bfloat16 and w16.numel() == f32.numel()
    wide = torch.randn(250, k + 5, generator=g)
    for m in (1, 2, 3, 4, 7, 8, 13, 40, 121, 250):
        x = wide[:m, 2 : 2 + k]
        for bias in (None, b):
            assert torch.equal(
                cpu_kernels.sgemm_w16(x, w16, n, bias), cpu_kernels.sgemm(x, f32, n, bias)
            )


@needs_sgemm
@pytest.mark.parametrize("inter", [16, 96])
@pytest.mark.parametrize("k", [9, 300])
def test_sgemm_w16_silu_is_sgemm_silu_bit_for_bit(inter, k):
    g = torch.Generator().manual_seed(inter + k)
    w = _bf16(2 * inter, k, g=g).float()
    f32 = cpu_kernels.sgemm_gated_pack(w, inter)
    w16 = cpu_kernels.sgemm_w16_gated_pack(w, inter)
    for m in (1, 3, 4, 13, 121):
        x = torch.randn(m, k, generator=g)
        want = cpu_kernels.sgemm_silu(x, f32, inter)
        assert torch.equal(cpu_kernels.sgemm_w16_silu(x, w16, inter), want)


@needs_sgemm
def test_packed_linear_holds_bf16_valued_float32_weights_in_bf16(monkeypatch):
    """A float32 weight of bf16 values goes on sgemm_w16 (half the bytes, the same bits);
    one value off the grid, MKL's plain copy for the prefill rows, or
    PAGESTREAM_BF16_WEIGHTS=0 keep float32."""
    g = torch.Generator().manual_seed(11)
    lin = nn.Linear(64, 2 * 96, bias=False)
    lin.weight.data = _bf16(2 * 96, 64, g=g).float()

    def layer(choice: Choice | None = None):
        return PackedLinear(lin, choice or Choice("sgemm"))

    held, gated = layer(), layer(Choice("sgemm", gated_inter=96))
    assert held.strategy.kernel == gated.strategy.kernel == "sgemm_w16"
    assert held.strategy.packed.dtype == torch.bfloat16
    assert gated.strategy.gated == cpu_kernels.gated_kernel("sgemm_w16")
    monkeypatch.setenv("PAGESTREAM_BF16_WEIGHTS", "0")
    plain, plain_gated = layer(), layer(Choice("sgemm", gated_inter=96))
    assert plain.strategy.kernel == "sgemm" and plain.strategy.packed.dtype == torch.float32
    for rows in (1, 9, 300):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(held(x), plain(x))
        assert torch.equal(gated.silu_mul(x), plain_gated.silu_mul(x))
    monkeypatch.delenv("PAGESTREAM_BF16_WEIGHTS")
    assert layer(Choice("sgemm", cpu_linear.MKL_FROM_ROWS)).strategy.kernel is None
    lin.weight.data[5, 5] += 1e-6
    assert layer().strategy.kernel == "sgemm"


# What the flag chains the strategies replaced chose (PackedLinear's six flags sorted out in
# its __init__ from pack_model_linears' use_* calls; issue 49), recorded by running that
# code for every combination below before the change.  First a plain projection's family
# per dtype, CPU and PAGESTREAM_PREFILL_GEMM (rows), for each PAGESTREAM_DECODE_GEMM
# (columns, in DECODES' order), every kernel of ours built; "/mkl": MKL's sgemm from
# MKL_FROM_ROWS rows.
DECODES = ("auto", "onednn", "sgemm", "amx", "dpbf16", "sgemm512")
OLD_FAMILIES = """
float32  base       auto   sgemm      onednn/mkl sgemm      onednn/mkl onednn/mkl sgemm512
float32  base       mkl    sgemm/mkl  onednn/mkl sgemm/mkl  onednn/mkl onednn/mkl sgemm512
float32  base       onednn sgemm      onednn     sgemm      onednn     onednn     sgemm512
float32  avx2       auto   sgemm      onednn/mkl sgemm      onednn/mkl onednn/mkl sgemm512
float32  avx2       mkl    sgemm/mkl  onednn/mkl sgemm/mkl  onednn/mkl onednn/mkl sgemm512
float32  avx2       onednn sgemm      onednn     sgemm      onednn     onednn     sgemm512
float32  avx512     auto   sgemm512   onednn     sgemm      onednn     onednn     sgemm512
float32  avx512     mkl    sgemm512   onednn/mkl sgemm/mkl  onednn/mkl onednn/mkl sgemm512
float32  avx512     onednn sgemm512   onednn     sgemm      onednn     onednn     sgemm512
float32  avx512bf16 auto   sgemm512   onednn     sgemm      onednn     onednn     sgemm512
float32  avx512bf16 mkl    sgemm512   onednn/mkl sgemm/mkl  onednn/mkl onednn/mkl sgemm512
float32  avx512bf16 onednn sgemm512   onednn     sgemm      onednn     onednn     sgemm512
float32  amx        auto   sgemm512   onednn     sgemm      onednn     onednn     sgemm512
float32  amx        mkl    sgemm512   onednn/mkl sgemm/mkl  onednn/mkl onednn/mkl sgemm512
float32  amx        onednn sgemm512   onednn     sgemm      onednn     onednn     sgemm512
bfloat16 base       auto   sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 base       mkl    sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 base       onednn sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx2       auto   sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx2       mkl    sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx2       onednn sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx512     auto   sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx512     mkl    sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx512     onednn sgemm      onednn     sgemm      onednn     dpbf16     sgemm
bfloat16 avx512bf16 auto   dpbf16     onednn     sgemm      onednn     dpbf16     dpbf16
bfloat16 avx512bf16 mkl    dpbf16     onednn     sgemm      onednn     dpbf16     dpbf16
bfloat16 avx512bf16 onednn dpbf16     onednn     sgemm      onednn     dpbf16     dpbf16
bfloat16 amx        auto   amx        onednn     sgemm      amx        dpbf16     amx
bfloat16 amx        mkl    amx        onednn     sgemm      amx        dpbf16     amx
bfloat16 amx        onednn amx        onednn     sgemm      amx        dpbf16     amx
"""
# With none of our kernels built, every projection was oneDNN's whatever DECODE_GEMM said:
# float32 ones with MKL from MKL_FROM_ROWS rows under PREFILL_GEMM=mkl, and under auto on
# CPUs without AVX-512.  Without MKL, no "/mkl" anywhere (the rest as above).
# Then what each kind of projection in SHAPES (in, out, bias, gated_inter; "head": the
# lm_head) got, in SHAPES' order, per dtype and plain projection's family (the first
# column after the dtype is the plain one's, the key); "+g": packed for silu_mul.
SHAPES = {
    "plain": (64, 48, False, None),
    "bias": (64, 48, True, None),
    "k40": (40, 48, False, None),
    "gated": (64, 192, False, 96),
    "gated48": (64, 96, False, 48),
    "gated40": (64, 80, False, 40),
    "gatedbias": (64, 192, True, 96),
    "head": (64, 48, False, "head"),
}
OLD_SHAPES = """
float32  sgemm      sgemm      sgemm      sgemm+g    sgemm+g    sgemm      sgemm      sgemm
float32  onednn/mkl onednn/mkl onednn/mkl onednn/mkl onednn/mkl onednn/mkl onednn/mkl onednn
float32  sgemm512   sgemm512   sgemm512   sgemm512+g sgemm512   sgemm512   sgemm512   sgemm512
float32  sgemm/mkl  sgemm/mkl  sgemm/mkl  sgemm/mkl  sgemm/mkl  sgemm/mkl  sgemm/mkl  sgemm
float32  onednn     onednn     onednn     onednn     onednn     onednn     onednn     onednn
bfloat16 sgemm      sgemm      sgemm      sgemm      sgemm      sgemm      sgemm      sgemm
bfloat16 onednn     onednn     onednn     onednn     onednn     onednn     onednn     onednn
bfloat16 dpbf16     dpbf16     dpbf16     dpbf16+g   dpbf16     dpbf16     dpbf16     dpbf16
bfloat16 amx        amx        onednn     amx+g      amx+g      amx        amx        amx
"""
# The kernel the layer stack ran for each (dtype, family) (PackedLinear.decode_kernel()).
OLD_KERNELS = {
    ("float32", "sgemm"): "sgemm",
    ("float32", "sgemm/mkl"): None,
    ("float32", "sgemm512"): "sgemm512",
    ("float32", "onednn"): None,
    ("float32", "onednn/mkl"): None,
    ("bfloat16", "sgemm"): None,
    ("bfloat16", "onednn"): None,
    ("bfloat16", "dpbf16"): "dpbf16",
    ("bfloat16", "amx"): "amx",
}
FAKE_CPUS = {
    "base": CpuFeatures("test CPU", frozenset()),
    "avx2": AVX2,
    "avx512": AVX512_NO_BF16,
    "avx512bf16": AVX512,
    "amx": AMX,
}
_BUILT = ("sgemm_available", "amx_available", "dpbf16_available", "sgemm512_available")


def _code(choice: Choice) -> str:
    assert choice.mkl_from in (None, cpu_linear.MKL_FROM_ROWS)
    mkl = "" if choice.mkl_from is None else "/mkl"
    return choice.family + mkl + ("+g" if choice.gated_inter else "")


def _old_family(dtype: str, cpu: str, prefill: str, family: str, built: bool, mkl: bool) -> str:
    if not built:
        no_avx512 = "avx512f" not in FAKE_CPUS[cpu].flags
        on_mkl = dtype == "float32" and (prefill == "mkl" or (prefill == "auto" and no_avx512))
        family = "onednn/mkl" if on_mkl else "onednn"
    return family if mkl else family.replace("/mkl", "")


@pytest.mark.parametrize("built, mkl", [(True, True), (False, True), (True, False)])
def test_choose_picks_what_the_flag_chains_picked(monkeypatch, built, mkl):
    """For every dtype, fake CPU, kernel choice and kind of projection, `choose` gives the
    family, MKL threshold and gated layout the flag chains gave (OLD_FAMILIES, OLD_SHAPES),
    whatever this machine is."""
    for name in _BUILT:
        monkeypatch.setattr(cpu_kernels, name, lambda: built)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    shapes = {tuple(row[:2]): row[1:] for row in map(str.split, OLD_SHAPES.strip().splitlines())}
    checked = 0
    for dtype, cpu, prefill, *families in map(str.split, OLD_FAMILIES.strip().splitlines()):
        monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", prefill)
        for decode, family in zip(DECODES, families, strict=True):
            monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", decode)
            family = _old_family(dtype, cpu, prefill, family, built, mkl)
            wants = shapes[dtype, family]
            for (k, n, bias, inter), want in zip(SHAPES.values(), wants, strict=True):
                got = choose(getattr(torch, dtype), (n, k), bias=bias, cpu=FAKE_CPUS[cpu],
                             gated_inter=None if inter == "head" else inter,
                             mkl=inter != "head")  # fmt: skip
                assert _code(got) == want, (dtype, cpu, prefill, decode, (k, n, bias, inter))
                checked += 1
    assert checked == 2 * 5 * 3 * 6 * len(SHAPES)


def test_choose_leaves_amx_where_its_copy_does_not_fit(monkeypatch):
    """decode_on_amx's refusal (no room for the AMX copy) left bf16 on oneDNN under auto."""
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: True)
    assert choose(torch.bfloat16, (48, 64), cpu=AMX).family == "amx"
    assert choose(torch.bfloat16, (48, 64), cpu=AMX, amx_copy=False).family == "onednn"


def test_each_family_names_the_kernel_the_layer_stack_ran():
    """A strategy's `kernel` is what PackedLinear.decode_kernel() gave (OLD_KERNELS), for
    every family this machine builds."""
    avail = {
        "sgemm": cpu_kernels.sgemm_available(),
        "sgemm512": cpu_kernels.sgemm512_available(),
        "dpbf16": cpu_kernels.dpbf16_available(),
        "amx": cpu_kernels.amx_available(),
        "onednn": cpu_linear.packing_available(torch.float32),
    }
    tried = 0
    for (dtype, code), kernel in OLD_KERNELS.items():
        family, _, mkl = code.partition("/")
        dt = getattr(torch, dtype)
        if not avail[family] or (family == "onednn" and not cpu_linear.packing_available(dt)):
            continue
        choice = Choice(family, cpu_linear.MKL_FROM_ROWS if mkl else None)
        layer = PackedLinear(nn.Linear(64, 48).to(dt), choice)
        assert layer.strategy.kernel == kernel, (dtype, code)
        tried += 1
    assert tried or not cpu_kernels.available()
