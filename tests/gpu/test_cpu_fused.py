"""The fused elementwise CPU kernels (residual add + RMSNorm, rotary, SiLU * up) against
the torch ops they replace, and a model run through them against the unfused one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from gpu.cpu import kernels as cpu_kernels
from gpu.model import RMSNorm, _rotate

if not cpu_kernels.available():
    if os.environ.get("CI") == "true":
        pytest.fail("the CPU kernels must build in CI (a C++ compiler is installed)")
    pytest.skip("no C++ compiler: the CPU kernels are unavailable", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: summation order apart; bf16: a bf16 step or two apart, rarely."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1.6e-2)
        assert (got != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 320: the threaded path
def test_add_rms_norm_matches_residual_add_then_rmsnorm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 320, generator=g).to(dtype)
    res = (3 * torch.randn(rows, 320, generator=g)).to(dtype)
    norm = RMSNorm(320, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(320, generator=g)).to(dtype)
    with torch.no_grad():
        want_res = res + x
        want = norm(want_res)
        got_res = res.clone()
        got = cpu_kernels.add_rms_norm(x, got_res, norm.weight, norm.eps)
        assert torch.equal(got_res, want_res)  # the add rounds exactly as torch's
        close(got, want)
        # Without an addend: normalise only, residual untouched.
        got2 = cpu_kernels.add_rms_norm(None, got_res, norm.weight, norm.eps)
        assert torch.equal(got_res, want_res)
        close(got2, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_matches_torch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 1408, generator=g)).to(dtype)
    gate, up = gate_up.split(1408, dim=-1)
    close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan(dtype):
    """Past gate = -88, e^-gate overflows float: the compiled SiLU once returned NaN there
    (inf * 0 under -ffast-math) where torch gives -0."""
    gate = torch.tensor([-89.0, -100.0, -1e4, -3e38, -88.0, -30.0, 0.0, 5.0] * 4)
    gate_up = torch.cat((gate, torch.full_like(gate, 3.0)))[None].to(dtype)
    got = cpu_kernels.silu_mul(gate_up).float()
    assert not got.isnan().any()
    want = (F.silu(gate.to(dtype)) * 3).float()[None]
    torch.testing.assert_close(got, want, atol=1e-30, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_fused_qkv_view(dtype):
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 9, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    positions = torch.tensor([0, 1, 2, 3, 100, 511, 7, 8, 300])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(512).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    c = cos[positions].to(dtype)[:, None, :]
    s = sin[positions].to(dtype)[:, None, :]
    want_q, want_k = _rotate(q, c, s), _rotate(k, c, s)
    cpu_kernels.rope_(q, k, positions, cos, sin)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_matches_unfused(dtype, arch):
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    model = str(tiny_checkpoint(arch))
    prompts = [[5, 6, 7], list(range(40, 90)), [9] * 18]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs, fused = {}, {}
    for flag in ("1", "0"):
        os.environ["PAGESTREAM_CPU_FUSED"] = flag
        try:
            llm = LLM(model, dtype=str(dtype).removeprefix("torch."), num_kv_blocks=64, threads=1)
        finally:
            del os.environ["PAGESTREAM_CPU_FUSED"]
        try:
            fused[flag] = llm.engine.runner.model.fused
            outs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert fused == {"1": True, "0": False}
    assert outs["1"] == outs["0"]
