"""The CPU projections: oneDNN's packed weight at decode sizes, MKL's sgemm on the plain
weight from MKL_FROM_ROWS rows where that is the faster kernel (float32 without AVX-512)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu import cpu_linear
from gpu.cpu_features import CpuFeatures
from gpu.cpu_linear import PackedLinear, mkl_from_rows

AVX2 = CpuFeatures("test CPU", frozenset({"avx2"}))
AVX512 = CpuFeatures("test CPU", frozenset({"avx2", "avx512f", "avx512_bf16"}))

needs_packing = pytest.mark.skipif(
    not cpu_linear.packing_available(torch.float32), reason="no packed oneDNN linear here"
)


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.delenv("PAGESTREAM_PREFILL_GEMM", raising=False)


def test_mkl_only_for_float32_without_avx512_unless_asked(monkeypatch):
    mkl = torch.backends.mkl.is_available()
    assert mkl_from_rows(torch.float32, AVX2) == (cpu_linear.MKL_FROM_ROWS if mkl else None)
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
    layer = PackedLinear(lin, mkl_from=8)
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
    assert PackedLinear(lin).plain is None  # no second copy unless asked


@needs_packing
def test_model_keeps_plain_weights_only_where_mkl_is_used(monkeypatch):
    from gpu.model_runner import ModelRunner
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint("llama")
    for choice, plain in (("onednn", False), ("mkl", torch.backends.mkl.is_available())):
        monkeypatch.setenv("PAGESTREAM_PREFILL_GEMM", choice)
        r = ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=16)
        layers = [m for m in r.model.modules() if isinstance(m, PackedLinear)]
        assert layers and all((m.plain is not None) == plain for m in layers)


@needs_packing
def test_scratch_output_is_reused_and_exact():
    """Layers sharing a Scratch write their MKL outputs into one buffer (their outputs are
    dead before the next such layer runs); results equal F.linear at every size."""
    torch.manual_seed(1)
    lins = [nn.Linear(32, 48, bias=b) for b in (False, True)]
    layers = [PackedLinear(lin, mkl_from=4) for lin in lins]
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
