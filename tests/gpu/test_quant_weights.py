"""Weight quantization.  INT8: per-output-channel layers against their dequantized
reference, and the model's projections swapped at load.  AWQ INT4 checkpoints (AutoAWQ "gemm" format) written here from a random tiny model with
the format's documented packing: the loader unpacks them, repacks for torch's int4 kernel,
and every layer (and the whole model) matches a plain checkpoint of the dequantized
weights to float tolerance.  Unsupported quantization configs fail clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from gpu.config import ModelLoadError
from gpu.model_runner import ModelRunner
from gpu.quant_eval import teacher_forced_logits
from gpu.quant_linear import (
    AWQLinear,
    Int8Linear,
    awq_dequantize,
    pack_awq,
    quantize_int8,
    unpack_awq,
)
from modelkit.awq import ORDER_MAP, dequantized, pack, quantize_groups, write_awq_checkpoint
from scheduler.config import ConfigError
from tests.checkpoints import tiny_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "k"), [(False, 256), (True, 200), (True, 96)])
def test_int8_layer_matches_dequantized_reference(dtype, bias, k):
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(k, 72, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, k, generator=g) * torch.rand(72, 1, generator=g))
    lin = lin.to(dtype)
    layer = Int8Linear(lin, dtype)
    # torch's 16-bit kernel needs in_features % 16 == 0 (else the layer dequantizes).
    assert layer.packed_op == (dtype == torch.float32 or k % 16 == 0)
    q, s = quantize_int8(lin.weight.detach())
    assert q.dtype == torch.int8 and q.abs().max() == 127  # every row uses its full range
    w_ref = q.float() * s[:, None]
    # Per output channel: each weight within half a step of its row's scale.
    assert ((w_ref - lin.weight.float()).abs() <= s[:, None] * 0.5 + 1e-6).all()
    # 12 rows: the decode GEMV (when k allows); 40 rows: the prefill path.
    for rows in (3, 10):
        x = torch.randn(rows, 4, k, generator=g).to(dtype)  # leading dims are kept
        got = layer(x).float()
        ref = F.linear(x.float(), w_ref, None if lin.bias is None else lin.bias.float())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert got.shape == (rows, 4, 72)
        torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
        # [tokens, features] as the model passes them (the GEMV's direct path): the same.
        assert torch.equal(layer(x.reshape(-1, k)), layer(x).reshape(-1, 72))


def test_int8_gemv_kernel_matches_reference():
    from gpu.cpu import kernels as cpu_kernels

    if not cpu_kernels.int8_gemv_supports(64):
        pytest.skip("no compiled CPU kernels")
    g = torch.Generator().manual_seed(5)
    q, s = quantize_int8(torch.randn(203, 64, generator=g))  # rows not a multiple of 8
    w = q.float() * s[:, None]
    for m in (1, 2, 3, 4, 5, 16):  # every activation-row tile and a remainder
        x = torch.randn(m, 64, generator=g)
        ref = x.double() @ w.double().T
        # The VNNI path rounds each activation row to 16-bit fixed point (step max|x| /
        # 32767): at most half a step per element, times the weights it multiplies.
        step = x.abs().amax(1, keepdim=True).double() / 32767
        bound = step / 2 * w.abs().sum(1).double() + 1e-5 * ref.abs() + 1e-6
        err = (cpu_kernels.int8_gemv(x, q, s).double() - ref).abs()
        assert (err <= bound).all(), float((err / bound).max())


def test_int8_pack_round_trips():
    from gpu.cpu import kernels as cpu_kernels

    if not cpu_kernels.int8_gemv_supports(64):
        pytest.skip("no compiled CPU kernels")
    g = torch.Generator().manual_seed(7)
    for n in (3, 8, 21, 64):  # no whole tile, tiles only, tiles and a remainder
        q = torch.randint(-127, 128, (n, 96), generator=g, dtype=torch.int8)
        packed = cpu_kernels.int8_pack(q)
        assert packed.numel() == q.numel()
        assert torch.equal(packed.view(n, 96), q) == (n < 8)  # only a remainder: row-major
        for dtype in (torch.int8, torch.bfloat16):
            assert torch.equal(cpu_kernels.int8_unpack(packed, n, 96, dtype), q.to(dtype))


def test_int8_gemv_reads_and_writes_the_model_dtype():
    """bf16 / strided activations read as they are, the bias added and the result rounded
    once, in the kernel: the float32 result plus bias, then rounded (the add may be fused
    into the scaling's multiply: one float32 rounding apart, so one bf16 step at most)."""
    from gpu.cpu import kernels as cpu_kernels

    if not cpu_kernels.int8_gemv_supports(64):
        pytest.skip("no compiled CPU kernels")
    g = torch.Generator().manual_seed(6)
    q, s = quantize_int8(torch.randn(203, 128, generator=g))
    for m in range(1, cpu_kernels.INT8_GEMV_MAX_ROWS + 1, 2):  # odd rows: every tile tail
        wide = torch.randn(m, 160, generator=g).to(torch.bfloat16)
        x = wide[:, 16:144]  # a row stride other than k
        f32 = cpu_kernels.int8_gemv(x.float(), q, s)
        assert f32.dtype == torch.float32
        assert torch.equal(cpu_kernels.int8_gemv(x, q, s, out_dtype=torch.float32), f32)
        assert torch.equal(cpu_kernels.int8_gemv(x, q, s), f32.to(torch.bfloat16))
        for bias_dtype in (torch.float32, torch.bfloat16):
            b = torch.randn(203, generator=g).to(bias_dtype)
            with_bias = f32 + b.float()
            got = cpu_kernels.int8_gemv(x, q, s, b)
            assert got.dtype == torch.bfloat16
            ref = with_bias.to(torch.bfloat16).float()
            torch.testing.assert_close(got.float(), ref, atol=1e-6, rtol=2**-8)
            got = cpu_kernels.int8_gemv(x.float(), q, s, b, torch.float32)
            torch.testing.assert_close(got, with_bias, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_int8_runner_quantizes_projections_and_lm_head(tied):
    path = tiny_checkpoint("qwen2", tie_word_embeddings=tied)
    r = ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=8, quantization="int8")
    assert r.quantization == "int8"
    kinds = {type(m).__name__ for layer in r.model.layers for m in layer.modules()}
    assert "Int8Linear" in kinds and "Linear" not in kinds and "PackedLinear" not in kinds
    # The embedding table stays in the model dtype for lookups; the logits GEMM reads an
    # int8 copy, and no 16/32-bit lm_head is kept beside it.
    m = r.model
    assert m.embed_tokens.weight.dtype == torch.float32
    assert type(m.lm_head_int8).__name__ == "Int8Linear" and m.lm_head_int8.float_out
    assert m.lm_head_packed is None and m.lm_head_weight is None
    plain = ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=8)
    w = plain.model.embed_tokens.weight if tied else plain.model.lm_head_packed
    h = torch.randn(5, r.config.hidden_size, generator=torch.Generator().manual_seed(1))
    got = m.compute_logits(h)
    ref = plain.model.compute_logits(h)
    assert got.dtype == torch.float32 and w is not None
    torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0.05)


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    """(awq checkpoint, plain checkpoint of its dequantized weights), two archs."""
    out = {}
    for arch in ("llama", "qwen2"):  # qwen2: the fused qkv projection has a bias
        root = tmp_path_factory.mktemp(f"awq-{arch}")
        src = tiny_checkpoint(arch)
        out[arch] = (
            write_awq_checkpoint(src, root / "awq", 64, dequantized_copy=root / "ref"),
            root / "ref",
        )
    return out


def test_packing_follows_the_documented_order():
    # Column order_map[i] of each group of 8 sits in nibble i.
    vals = torch.arange(16, dtype=torch.int32).remainder(16).view(1, 16)
    word = int(pack(vals)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [ORDER_MAP[i] for i in range(8)]
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (6, 32), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_awq(pack(q)).to(torch.int32), q)
    assert torch.equal(pack_awq(q), pack(q))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_layer_matches_dequantized_reference(group, dtype):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(384, 256, generator=g) * 0.05
    q, z, s = quantize_groups(w, group)
    layer = AWQLinear(
        unpack_awq(pack(q)), unpack_awq(pack(z)), s, None, group, dtype, torch.device("cpu")
    )
    assert layer.packed is not None, "torch's int4 CPU kernel should be in use"
    ref_w = dequantized(q, z, s)
    assert torch.equal(awq_dequantize(unpack_awq(pack(q)), unpack_awq(pack(z)), s, group), ref_w)
    # 4-bit round-to-nearest with a rounded zero point: each weight within a step of the
    # original (half a step, plus up to half where the range end clamps at 15).
    step = s.float().repeat_interleave(group, 0).t()
    assert ((ref_w - w).abs() <= step + 1e-6).all()
    x = torch.randn(5, 256, generator=g).to(dtype)
    got = layer(x).float()
    ref = F.linear(x.float(), ref_w)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_awq_model_matches_dequantized_checkpoint(awq_dirs, arch):
    awq, ref = awq_dirs[arch]
    r_awq = ModelRunner(awq, dtype="float32", device="cpu", num_kv_blocks=16)
    r_ref = ModelRunner(ref, dtype="float32", device="cpu", num_kv_blocks=16)
    assert r_awq.quantization == "awq"
    layer = r_awq.model.layers[0]
    # float32 on a CPU: dequantized into plain projections at load (the CPU path's own)
    assert not isinstance(layer.self_attn.qkv_proj, AWQLinear)
    toks = list(range(7, 7 + 48))
    a = teacher_forced_logits(r_awq, toks, 32)
    b = teacher_forced_logits(r_ref, toks, 32)
    torch.testing.assert_close(a, b, atol=1e-3 * b.abs().max().item(), rtol=1e-3)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _with_qc(awq, tmp_path, **changes):
    d = tmp_path / "ckpt"
    shutil.copytree(awq, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **changes}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quantization method .bitsandbytes. is not supported"),
        ({"bits": 8}, "bits=8"),
        ({"version": "gemv"}, "version 'gemv'"),
        ({"zero_point": False}, "without zero points"),
        ({"desc_act": True}, "act-order"),
        ({"group_size": -1}, "group_size -1"),
        ({"group_size": 48}, "group_size 48"),
    ],
)
def test_unsupported_quantization_configs_fail_clearly(awq_dirs, tmp_path, changes, message):
    d = _with_qc(awq_dirs["llama"][0], tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        ModelRunner(d, dtype="float32", device="cpu", num_kv_blocks=8)


def test_quantization_flag_must_fit_the_checkpoint(awq_dirs):
    awq, ref = awq_dirs["llama"]
    with pytest.raises(ModelLoadError, match="already quantized"):
        ModelRunner(awq, dtype="float32", device="cpu", num_kv_blocks=8, quantization="int8")
    with pytest.raises(ModelLoadError, match="no AWQ quantization_config"):
        ModelRunner(ref, dtype="float32", device="cpu", num_kv_blocks=8, quantization="awq")
    with pytest.raises(ConfigError, match=r"quantization \(--quantization\) must be one of"):
        ModelRunner(ref, dtype="float32", device="cpu", num_kv_blocks=8, quantization="marlin")
