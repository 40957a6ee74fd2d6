"""FP8 weights (W8A8): e4m3 weights with per-output-channel scales, activations quantized
per token, the product through torch._scaled_mm (or, where it refuses, the same product
with the FP8 values widened).  Layers against a float64 reference of the quantized
operands (tight) and against the unquantized product (a stated rounding bound); an FP8
checkpoint loads its own bytes and scales and matches quantizing at load; the engine
generates with it and its greedy tokens stay close to the unquantized model's."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from gpu.config import ModelLoadError
from gpu.model_runner import ModelRunner
from gpu.quant_eval import greedy_agreement, logit_drift, teacher_forced_logits
from gpu.quant_linear import FP8_DTYPE, Fp8Linear, quantize_fp8, quantize_fp8_rows
from modelkit.fp8 import write_fp8_checkpoint
from scheduler.config import ConfigError
from tests.checkpoints import tiny_checkpoint

# e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below the
# smallest normal (2^-6 of the scale unit) within half the subnormal step, 2^-10 units.
REL = 2.0**-4
SUB = 2.0**-10


def _layer_case(k: int, bias: bool, seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, 80, bias=bias)
    with torch.no_grad():
        # Rows of different magnitudes: the per-channel scale matters.
        lin.weight.copy_(torch.randn(80, k, generator=g) * torch.rand(80, 1, generator=g))
    x = torch.randn(7, 3, k, generator=g) * torch.rand(7, 3, 1, generator=g)
    return lin, x


def _no_scaled_mm(*args, **kwargs):
    raise RuntimeError("refused for this test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "k"), [(False, 256), (True, 200)])
@pytest.mark.parametrize("path", ["scaled_mm", "fallback"])
def test_fp8_layer_matches_quantized_reference(dtype, bias, k, path, monkeypatch):
    lin, x = _layer_case(k, bias, seed=k)
    lin, x = lin.to(dtype), x.to(dtype)
    if path == "fallback":
        monkeypatch.setattr(torch, "_scaled_mm", _no_scaled_mm)
    layer = Fp8Linear.from_linear(lin, dtype)
    assert (layer.mm_out is None) == (path == "fallback")
    q, s = quantize_fp8(lin.weight.detach())
    assert q.dtype == FP8_DTYPE and q.float().abs().amax(1).eq(448).all()  # full range
    # dequant(x) . dequant(w) in float64, from the same per-token activation rounding.
    xq, sa = quantize_fp8_rows(x.reshape(-1, k))
    ref = (xq.double() * sa.double()) @ (q.double() * s.double()[:, None]).T
    if bias:
        ref = ref + lin.bias.double()
    got = layer(x)
    assert got.shape == (7, 3, 80) and got.dtype == dtype
    # float32: float32 accumulation only; bf16: the output's rounding (and the bias add's).
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(
        got.reshape(-1, 80).double(), ref, atol=tol * ref.abs().max().item(), rtol=tol
    )


@pytest.mark.parametrize("k", [256, 200])
def test_fp8_layer_error_against_unquantized_is_bounded(k):
    """Each product x_i w_i is off by at most (2 * 2^-4 + 2^-8) |x_i w_i| when both round
    as normals, plus 2^-10 of a scale times the other operand where one is subnormal; the
    bound sums that over K.  Measured on these random rows the error is far smaller:
    relative RMS of the output ~3% (both operands at 3 mantissa bits)."""
    lin, x = _layer_case(k, True, seed=1)
    x2 = x.reshape(-1, k)
    layer = Fp8Linear.from_linear(lin, torch.float32)
    exact = F.linear(x2.double(), lin.weight.double(), lin.bias.double())
    got = layer(x2).double()
    ax, aw = x2.abs().double(), lin.weight.abs().double()
    sa = ax.amax(1, keepdim=True) / 448
    sw = aw.amax(1) / 448
    bound = (
        (2 * REL + REL * REL) * (ax @ aw.T)
        + SUB * (1 + REL) * (sa * aw.sum(1) + ax.sum(1, keepdim=True) * sw)
        + 1e-5 * exact.abs()
    )
    assert ((got - exact).abs() <= bound).all()
    rel_rms = ((got - exact).pow(2).mean() / (exact - lin.bias.double()).pow(2).mean()).sqrt()
    assert rel_rms < 0.05, rel_rms


@pytest.fixture(scope="module")
def bf16_src():
    return tiny_checkpoint("llama", init_std=0.02, dtype="bfloat16")


@pytest.mark.parametrize(
    ("per_tensor", "method"),
    [(False, "compressed-tensors"), (True, "compressed-tensors"), (False, "fbgemm_fp8")],
)
def test_fp8_checkpoint_loads_its_own_bytes_and_scales(bf16_src, tmp_path, per_tensor, method):
    ckpt = write_fp8_checkpoint(bf16_src, tmp_path / "fp8", per_tensor=per_tensor, method=method)
    kw = {"dtype": "bfloat16", "device": "cpu", "num_kv_blocks": 16}
    r = ModelRunner(ckpt, **kw)  # detected from config.json, no flag
    assert r.quantization == "fp8"
    layer = r.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
        stored_q = torch.cat([f.get_tensor(p + ".weight") for p in parts])
        stored_s = [f.get_tensor(p + ".weight_scale") for p in parts]
    # The stored bytes and scales as they are (no requantization).
    assert torch.equal(qkv.qweight.view(torch.uint8), stored_q.view(torch.uint8))
    rows = [
        s.expand(n) if s.numel() == 1 else s.reshape(-1)
        for s, n in zip(stored_s, (256, 128, 128), strict=True)
    ]
    assert torch.equal(qkv.scale_b.reshape(-1), torch.cat(rows).float())
    toks = [random.Random(0).randrange(3, 2000) for _ in range(64)]
    got = teacher_forced_logits(r, toks, 24)
    if not per_tensor:
        # Per-channel scales are what quantizing at load computes: the same model, bit for bit.
        at_load = ModelRunner(bf16_src, quantization="fp8", **kw)
        assert at_load.quantization == "fp8"
        assert torch.equal(at_load.model.layers[0].self_attn.qkv_proj.qweight.view(torch.uint8),
                           stored_q.view(torch.uint8))  # fmt: skip
        assert torch.equal(teacher_forced_logits(at_load, toks, 24), got)
    else:
        # One scale per projection is coarser; still close to the unquantized model.
        ref = teacher_forced_logits(ModelRunner(bf16_src, **kw), toks, 24)
        d = logit_drift(ref, got)
        assert d.mean_kl < 5e-3 and d.argmax_agree >= 0.85, d


def _edit(ckpt, tmp_path, qc=None, tensors=None):
    d = tmp_path / "edited"
    shutil.copytree(ckpt, d)
    if qc is not None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = qc(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(d / "model.safetensors"), {"format": "pt"})
    return d


def _group_weights(**change):
    def edit(qc):
        qc["config_groups"]["group_0"]["weights"].update(change)
        return qc

    return edit


def _dequantize_k_proj(sd):
    name = "model.layers.1.self_attn.k_proj"
    sd[name + ".weight"] = sd[name + ".weight"].float() * sd.pop(name + ".weight_scale")


def _drop_scale(sd):
    del sd["model.layers.1.mlp.down_proj.weight_scale"]


@pytest.mark.parametrize(
    ("qc", "tensors", "exc", "message"),
    [
        (_group_weights(strategy="block"), None, ModelLoadError, "strategy channel or tensor"),
        (_group_weights(num_bits=4), None, ModelLoadError, "8-bit float"),
        (lambda qc: {**qc, "format": "pack-quantized"}, None, ModelLoadError, "'pack-quantized'"),
        (None, _dequantize_k_proj, ModelLoadError, "mix FP8 and 16/32-bit"),
        (None, _drop_scale, ModelLoadError, "down_proj.weight is torch.float8_e4m3fn without"),
    ],
)
def test_unsupported_fp8_checkpoints_fail_clearly(bf16_src, tmp_path, qc, tensors, exc, message):
    ckpt = write_fp8_checkpoint(bf16_src, tmp_path / "fp8")
    d = _edit(ckpt, tmp_path, qc, tensors)
    with pytest.raises(exc, match=message):
        ModelRunner(d, dtype="bfloat16", device="cpu", num_kv_blocks=8)


def test_fp8_flag_must_fit_the_checkpoint(bf16_src, tmp_path):
    ckpt = write_fp8_checkpoint(bf16_src, tmp_path / "fp8")
    kw = {"dtype": "bfloat16", "device": "cpu", "num_kv_blocks": 8}
    with pytest.raises(ModelLoadError, match="already quantized; drop --quantization int8"):
        ModelRunner(ckpt, quantization="int8", **kw)
    assert ModelRunner(ckpt, quantization="fp8", **kw).quantization == "fp8"
    with pytest.raises(ConfigError, match=r"quantization \(--quantization\) must be one of"):
        ModelRunner(bf16_src, quantization="fp4", **kw)


def test_cli_refuses_an_unknown_quantization(capsys):
    from service.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp4"])
    assert "--quantization" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--quantization", "fp8"]).quantization == "fp8"


@pytest.fixture(scope="module")
def held_out():
    from modelkit import train

    _, held = train.token_streams(train._tokenizer(train.VOCAB_SIZE))
    return held


def test_fp8_teacher_forced_top1_on_the_trained_pair(held_out):
    """The trained pair's target over 368 held-out positions (32-token prefill, then one
    decode step each), bf16 activations and KV: measured top-1 agreement with bf16
    weights 96.7%, mean KL 6.7e-4 nats, max |logit diff| 0.16 of the logits' std."""
    toks = held_out[:400].tolist()
    kw = {"dtype": "bfloat16", "device": "cpu", "num_kv_blocks": 64}
    ref = teacher_forced_logits(ModelRunner(PAIR, **kw), toks, 32)
    got = teacher_forced_logits(ModelRunner(PAIR, quantization="fp8", **kw), toks, 32)
    d = logit_drift(ref, got)
    assert d.argmax_agree >= 0.93 and d.mean_kl < 2e-3 and d.rel_max < 0.5, d


def test_llm_generates_with_fp8_weights_close_to_bf16(held_out):
    """LLM(..., quantization="fp8") end to end, greedy, 12 held-out 16-token prompts, 32
    tokens each, against bf16 weights.  Measured: 9 of 12 sequences identical (the others
    part at tokens 1, 5 and 11), 79% of positions the same token."""
    from scheduler.sampling_params import SamplingParams
    from service import LLM

    prompts = [held_out[i * 97 : i * 97 + 16].tolist() for i in range(12)]
    params = SamplingParams(max_tokens=32, temperature=0)
    outs = {}
    for q in (None, "fp8"):
        llm = LLM(PAIR, dtype="bfloat16", num_kv_blocks=128, quantization=q)
        try:
            outs[q] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert all(len(r) == 32 for r in outs["fp8"])
    g = greedy_agreement(outs[None], outs["fp8"])
    assert g.identical >= 0.5 and g.mean_matched_prefix >= 0.6, g


PAIR = "modelkit/pair/target"


def test_fp8_checkpoints_are_refused_under_tp_and_pp(bf16_src, tmp_path):
    from gpu.config import ModelConfig
    from gpu.pp import check_pp_config
    from gpu.tp import check_tp_config

    cfg = ModelConfig.from_dir(write_fp8_checkpoint(bf16_src, tmp_path / "fp8"))
    assert cfg.fp8_format == "compressed-tensors"
    with pytest.raises(ModelLoadError, match="FP8 checkpoints"):
        check_tp_config(cfg, 2)
    with pytest.raises(ModelLoadError, match="FP8 checkpoints"):
        check_pp_config(cfg, 2)
    assert ModelConfig.from_dir(bf16_src).fp8_format is None
