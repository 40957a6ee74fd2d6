"""GPTQ INT4 checkpoints (AutoGPTQ's "gptq" format, zero points stored minus one, and
GPTQModel's "gptq_v2"; symmetric and asymmetric), written here from random tiny models
with the format's documented packing: the loader unpacks them into the INT4 layers AWQ
checkpoints use, and the model's greedy tokens are transformers' on a plain checkpoint of
the dequantized weights (float32), served and offline; with act-order too (each layer
gathers its input into its groups' order).  GPTQ variants it cannot run are refused naming
what; a zero bias AutoGPTQ writes is read past."""

from __future__ import annotations

import shutil

import openai
import pytest
import torch

from gpu.config import ModelLoadError
from gpu.loader import _unpack_int4
from gpu.model_runner import ModelRunner
from gpu.quant_eval import teacher_forced_logits
from gpu.quant_linear import AWQLinear
from modelkit.gptq import pack_cols, pack_rows, write_gptq_checkpoint
from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.gpu.test_quant_weights import _with_qc
from tests.gpu.test_tensor_parallel import hf_greedy
from tests.service.live_server import live_server

CASES = {  # name: (arch, sym, checkpoint_format, zero_bias, act_order)
    "llama-asym-v1": ("llama", False, "gptq", True, False),
    "llama-sym-v1": ("llama", True, "gptq", False, False),
    "qwen2-asym-v2": ("qwen2", False, "gptq_v2", False, False),  # qwen2: q/k/v biases
    "llama-sym-act-order": ("llama", True, "gptq", False, True),
    "qwen2-asym-v2-act-order": ("qwen2", False, "gptq_v2", False, True),
}


@pytest.fixture(scope="module")
def gptq_dirs(tmp_path_factory):
    """(gptq checkpoint, plain checkpoint of its dequantized weights) per case."""
    out = {}
    for name, (arch, sym, fmt, zero_bias, act_order) in CASES.items():
        root = tmp_path_factory.mktemp(f"gptq-{name}")
        out[name] = (
            write_gptq_checkpoint(
                tiny_checkpoint(arch), root / "gptq", 64, sym=sym, checkpoint_format=fmt,
                zero_bias=zero_bias, act_order=act_order, dequantized_copy=root / "ref",
            ),
            root / "ref",
        )  # fmt: skip
    return out


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_packing_round_trips_through_the_loader(fmt):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 48), generator=g, dtype=torch.int32)
    z = torch.randint(1, 16, (2, 48), generator=g, dtype=torch.int32)
    # Input row 8 r + i of column c sits in nibble i of word (r, c).
    assert (pack_rows(q)[3, 5] >> 8) & 0xF == q[26, 5]
    hf = {"p.qweight": pack_rows(q), "p.qzeros": pack_cols(z - 1 if fmt == "gptq" else z),
          "p.g_idx": torch.arange(128, dtype=torch.int32) // 64}  # fmt: skip
    got_q, got_z, perm = _unpack_int4(hf, "p.", fmt, 64)
    assert torch.equal(got_q.to(torch.int32), q) and torch.equal(got_z.to(torch.int32), z)
    assert perm is None
    # Act-order: input order[i] in group i // 64; the rows come back grouped, with the
    # order that gathers the input alike.
    order = torch.randperm(128, generator=g)
    g_idx = torch.empty(128, dtype=torch.int32)
    g_idx[order] = torch.arange(128, dtype=torch.int32) // 64
    hf["p.g_idx"] = g_idx
    got_q, _, perm = _unpack_int4(hf, "p.", fmt, 64)
    assert torch.equal(got_q.to(torch.int32), q[perm])
    assert torch.equal(g_idx[perm].long(), torch.arange(128) // 64)
    hf["p.g_idx"] = torch.zeros(128, dtype=torch.int32)  # one group of 128, not two of 64
    with pytest.raises(ModelLoadError, match="not 64 inputs each"):
        _unpack_int4(hf, "p.", fmt, 64)


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_model_matches_transformers_on_the_dequantized_weights(gptq_dirs, case):
    gptq, ref = gptq_dirs[case]
    r = ModelRunner(gptq, dtype="float32", device="cpu", num_kv_blocks=16)
    r_ref = ModelRunner(ref, dtype="float32", device="cpu", num_kv_blocks=16)
    assert r.quantization == "gptq"
    layer = r.model.layers[0]
    # float32 on a CPU: dequantized into plain projections at load (the CPU path's own)
    assert not isinstance(layer.self_attn.qkv_proj, AWQLinear)
    toks = list(range(7, 7 + 48))
    a = teacher_forced_logits(r, toks, 32)
    b = teacher_forced_logits(r_ref, toks, 32)
    torch.testing.assert_close(a, b, atol=1e-3 * b.abs().max().item(), rtol=1e-3)
    del r, r_ref
    prompts = [[5 + i, 300, 17 * i + 2, 9, 41] for i in range(3)]
    llm = LLM(str(gptq), dtype="float32", threads=1, num_kv_blocks=64)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(str(ref), p, 8)


@pytest.mark.parametrize("case", ["llama-sym-act-order", "qwen2-asym-v2"])
def test_bf16_runs_torch_int4_kernel_with_act_order(gptq_dirs, case):
    """bfloat16 keeps the weights packed (torch's int4 kernel, act-order's input gathered
    in the layer): its logits are as near the dequantized weights' float32 logits as the
    dequantized checkpoint's own in bfloat16 (the error is bf16's, not the packing's)."""
    gptq, ref = gptq_dirs[case]
    r = ModelRunner(gptq, dtype="bfloat16", device="cpu", num_kv_blocks=16)
    qkv = r.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, AWQLinear) and qkv.packed is not None
    assert (qkv.perm is not None) == case.endswith("act-order")
    toks = list(range(7, 7 + 48))
    packed = teacher_forced_logits(r, toks, 32).float()
    del r
    dense = {
        dt: teacher_forced_logits(
            ModelRunner(ref, dtype=dt, device="cpu", num_kv_blocks=16), toks, 32
        ).float()
        for dt in ("bfloat16", "float32")
    }
    exact = dense["float32"]
    err = (packed - exact).abs().max()
    assert err <= 1.5 * (dense["bfloat16"] - exact).abs().max() + 1e-3 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_order_layer_gathers_its_input(dtype):
    """An INT4 layer whose rows are in act-order's group order (perm) equals the plain
    product with the dequantized weight in the inputs' own order: through torch's int4
    kernel, in both dtypes."""
    from modelkit.awq import quantize_groups

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g) * 0.05  # [N, K]
    perm = torch.randperm(256, generator=g)
    q, z, s = quantize_groups(w[:, perm], 64)  # groups over the permuted inputs
    layer = AWQLinear(q.to(torch.uint8), z.to(torch.uint8), s, None, 64, dtype,
                      torch.device("cpu"), perm)  # fmt: skip
    assert layer.packed is not None, "torch's int4 CPU kernel should be in use"
    w_deq = torch.empty(96, 256)
    w_deq[:, perm] = ((q.float() - z.float().repeat_interleave(64, 0))
                      * s.float().repeat_interleave(64, 0)).t()  # fmt: skip
    x = torch.randn(5, 256, generator=g)
    ref = x @ w_deq.t()
    got = layer(x.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_gptq_served_through_the_openai_client(gptq_dirs):
    gptq, ref = gptq_dirs["llama-sym-v1"]
    with live_server(str(gptq), engine_kwargs={"quantization": "gptq"}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        m = c.models.list().data[0].id
        ids = [17, 305, 1200, 44, 9]
        r = c.completions.create(
            model=m, prompt=ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert r.choices[0].model_extra["token_ids"] == hf_greedy(str(ref), ids, 8)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bits": 8}, "GPTQ with bits=8"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"lm_head": True}, "quantized lm_head"),
        ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
        ({"group_size": -1}, "GPTQ group_size -1"),
    ],
)
def test_gptq_variants_it_cannot_run_are_refused(gptq_dirs, tmp_path, changes, message):
    d = _with_qc(gptq_dirs["llama-asym-v1"][0], tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        ModelRunner(d, dtype="float32", device="cpu", num_kv_blocks=8)


def test_fused_parts_must_share_their_act_order(gptq_dirs, tmp_path):
    """q, k and v read one input, so GPTQ orders them alike; a file where they differ
    cannot run as one fused product and is refused naming the projection."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    shutil.copytree(gptq_dirs["llama-sym-act-order"][0], d)
    sd = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="qkv_proj differ in act-order"):
        ModelRunner(d, dtype="float32", device="cpu", num_kv_blocks=8)


def test_quantization_flag_must_fit_the_gptq_checkpoint(gptq_dirs):
    gptq, ref = gptq_dirs["llama-asym-v1"]
    for flag, message in (("int8", "GPTQ checkpoint is already quantized"),
                          ("awq", "no AWQ quantization_config")):  # fmt: skip
        with pytest.raises(ModelLoadError, match=message):
            ModelRunner(gptq, dtype="float32", device="cpu", num_kv_blocks=8, quantization=flag)
    with pytest.raises(ModelLoadError, match="no GPTQ quantization_config"):
        ModelRunner(ref, dtype="float32", device="cpu", num_kv_blocks=8, quantization="gptq")
