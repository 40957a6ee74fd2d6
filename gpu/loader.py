"""Load a Hugging Face checkpoint directory into a CausalLM, failing early and clearly."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gpu.attention.base import AttentionBackend
from gpu.config import ModelConfig, ModelLoadError
from gpu.model import CausalLM, Rotary
from gpu.pp import PPStage
from gpu.quant_linear import (
    FP8_DTYPE,
    AWQLinear,
    Fp8Linear,
    awq_dequantize,
    quantize_model_fp8,
    quantize_model_int8,
    unpack_awq,
)
from gpu.tp import TPGroup, local_config, shard_range

log = logging.getLogger(__name__)

# Keys some checkpoints carry that hold no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Our fused projections and the checkpoint projections they concatenate (output dim).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
_PROJECTIONS = tuple(p for parts in _FUSED.values() for p in parts)
QUANTIZATION_METHODS = ("int8", "awq", "gptq", "fp8")
# An FP8 checkpoint's per-projection scales: weight_scale per channel ([N, 1] or [N]) or
# per tensor; input_scale (a static activation scale) is read past: activations are
# quantized per token at run time.
_FP8_SCALE_SUFFIXES = (".weight_scale", ".input_scale")


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are supported)"
    )


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.num_labels and not cfg.classifier_from_token:
        shapes["score.weight"] = (cfg.num_labels, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (cfg.q_size,),
                p + "self_attn.k_proj.bias": (cfg.kv_size,),
                p + "self_attn.v_proj.bias": (cfg.kv_size,),
            }
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if cfg.awq_group_size:
        _int4_shapes(shapes, cfg.awq_group_size, cfg.int4_format == "awq")
    return shapes


def _int4_shapes(shapes: dict[str, tuple[int, ...]], g: int, awq: bool) -> None:
    """Projection weights [N, K] become AWQ's qweight [K, N/8], qzeros [K/g, N/8] and
    scales [K/g, N]; or GPTQ's qweight [K/8, N] (packed along the input), the same
    qzeros and scales, and g_idx [K] (each input's group)."""
    for name in [n for n in shapes if n.removesuffix(".weight").endswith(_PROJECTIONS)]:
        n_out, k_in = shapes.pop(name)
        base = name.removesuffix(".weight")
        if n_out % 8 or k_in % g:
            raise ModelLoadError(
                f"{base}: shape [{n_out}, {k_in}] does not fit INT4 packing (out % 8, in % "
                f"group_size {g})"
            )
        shapes[base + ".qweight"] = (k_in, n_out // 8) if awq else (k_in // 8, n_out)
        shapes[base + ".qzeros"] = (k_in // g, n_out // 8)
        shapes[base + ".scales"] = (k_in // g, n_out)
        if not awq:
            shapes[base + ".g_idx"] = (k_in,)


def _fmt(names: list[str]) -> str:
    head = ", ".join(sorted(names)[:5])
    return head + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def _read_sliced(
    f: object, name: str, cfg: ModelConfig, tp: TPGroup | None, key: str | None = None
) -> torch.Tensor:
    """The whole tensor, or only this rank's slice of it (read from the file as such);
    key: its HF name where the file's differs (a base model's, without `model.`)."""
    rng = None if tp is None else shard_range(key or name, cfg, tp)
    if rng is None:
        t = f.get_tensor(name)  # type: ignore[attr-defined]
        if tp is not None and tp.rank != 0 and name.endswith("self_attn.o_proj.bias"):
            # o_proj is row-parallel: the ranks' partial sums are added up, so its bias is
            # added on one rank only.
            t = torch.zeros_like(t)
        return t
    dim, lo, hi = rng
    sl = f.get_slice(name)  # type: ignore[attr-defined]
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def read_checkpoint(
    path: str | Path,
    cfg: ModelConfig,
    tp: TPGroup | None = None,
    pp: PPStage | None = None,
    tokenizer_dir: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, checked against the config (names and shapes).  With
    `tp`, each sharded tensor is only this rank's slice (gpu.tp.shard_range); with `pp`,
    only the tensors this pipeline stage holds are read (the others' shapes are checked).
    tokenizer_dir: where classifier_from_token's words are looked up (default: `path`)."""
    expected = _expected_shapes(cfg)
    wanted = set(expected)
    if pp is not None:
        wanted = {n for n in expected if pp.holds(n, cfg.tie_word_embeddings)}
    tensors: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name.endswith(_FP8_SCALE_SUFFIXES) and cfg.fp8_format:
                    _fp8_scale(f, name, expected, wanted, tensors, path)
                    continue
                key = name
                if name not in expected and cfg.embedding_only and f"model.{name}" in expected:
                    key = f"model.{name}"  # a base model saved on its own: no prefix
                if key not in expected:
                    # Tied checkpoints sometimes store lm_head too; it equals the embedding.
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    # AutoGPTQ writes a zero bias for projections that have none.
                    if _zero_gptq_bias(f, name, cfg):
                        continue
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[key]:
                    raise ModelLoadError(
                        f"{path}: tensor {name} has shape {shape}, "
                        f"config.json implies {expected[key]}"
                    )
                if key in wanted:
                    tensors[key] = _read_sliced(f, name, cfg, tp, key)
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: checkpoint is missing tensors: {_fmt(missing)}")
    if unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint has tensors {cfg.architecture} does not use: {_fmt(unexpected)}"
        )
    if cfg.classifier_from_token:
        tensors["score.weight"] = _head_from_tokens(Path(path), cfg, tokenizer_dir)
    return tensors


def _zero_gptq_bias(f: Any, name: str, cfg: ModelConfig) -> bool:
    base = name.removesuffix(".bias")
    if not (cfg.int4_format or "").startswith("gptq") or base == name:
        return False
    return base.endswith(_PROJECTIONS) and not f.get_tensor(name).any()


def _head_from_tokens(
    path: Path, cfg: ModelConfig, tokenizer_dir: str | Path | None = None
) -> torch.Tensor:
    """A classifier head made of the LM head's rows for cfg.classifier_from_token (the
    whole rows, read from the file whatever this rank's share of the LM head): one row
    per token, or for a two-way head (one label) the second token's row minus the
    first's (gpu/hf_labels.py)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(Path(tokenizer_dir or path) / "tokenizer.json"))
    except Exception as e:
        raise ModelLoadError(f"{path}: classifier_from_token needs tokenizer.json ({e})") from e
    ids = []
    for t in cfg.classifier_from_token:
        i = tok.token_to_id(t)
        if i is None:
            raise ModelLoadError(f"{path}: classifier_from_token {t!r} is not a vocabulary token")
        ids.append(i)
    names = ["embed_tokens.weight", "model.embed_tokens.weight"]
    if not cfg.tie_word_embeddings:
        names = ["lm_head.weight"]
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            name = next((n for n in names if n in f.keys()), None)  # noqa: SIM118
            if name is None:
                continue
            sl = f.get_slice(name)
            rows = torch.cat([sl[i : i + 1] for i in ids]).float()
            return rows if cfg.num_labels == len(ids) else rows[1:] - rows[:1]
    raise ModelLoadError(f"{path}: no LM head to build the classifier from")


def _fp8_scale(
    f: object,
    name: str,
    expected: dict[str, tuple[int, ...]],
    wanted: set[str],
    tensors: dict[str, torch.Tensor],
    path: str | Path,
) -> None:
    """Check one FP8 scale tensor's place and shape; keep the weight scales read."""
    base, kind = name.rsplit(".", 1)
    weight = expected.get(base + ".weight")
    if weight is None or not base.endswith(_PROJECTIONS):
        raise ModelLoadError(f"{path}: FP8 scale {name} belongs to no projection")
    shape = tuple(f.get_slice(name).get_shape())  # type: ignore[attr-defined]
    per_tensor = shape in ((), (1,), (1, 1))
    if not per_tensor and not (kind == "weight_scale" and shape in ((weight[0], 1), (weight[0],))):
        raise ModelLoadError(
            f"{path}: tensor {name} has shape {shape}; an FP8 {kind} is per tensor"
            + (f" or per output channel ({weight[0]}, 1)" if kind == "weight_scale" else "")
        )
    if kind == "weight_scale" and base + ".weight" in wanted:
        tensors[name] = f.get_tensor(name).float().reshape(-1)  # type: ignore[attr-defined]


def _to_state_dict(
    cfg: ModelConfig, hf: dict[str, torch.Tensor], pp: PPStage | None = None
) -> dict[str, torch.Tensor]:
    """HF names -> ours, fusing q/k/v and gate/up so each layer runs two fewer matmuls.
    (AWQ checkpoints: everything but the projection weights; see _awq_layers.)  A
    pipeline stage's layers are numbered from 0 in its model."""
    if cfg.awq_group_size:
        for i in range(cfg.num_layers):
            for part in _PROJECTIONS:
                hf[f"model.layers.{i}.{part}.weight"] = torch.empty(0)  # placeholders
    empty = torch.empty(0, cfg.hidden_size)  # an embedding this stage does not hold
    sd = {
        "embed_tokens.weight": hf.get("model.embed_tokens.weight", empty),
        "norm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings and "lm_head.weight" in hf:
        sd["lm_head_weight"] = hf["lm_head.weight"]
    if "score.weight" in hf:
        sd["score_weight"] = hf["score.weight"]
    start, stop = (0, cfg.num_layers) if pp is None else (pp.start, pp.stop)
    for i in range(start, stop):
        p, q = f"model.layers.{i}.", f"layers.{i - start}."
        attn = p + "self_attn."
        sd[q + "self_attn.qkv_proj.weight"] = torch.cat(
            [hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]]
        )
        if cfg.attention_bias:
            sd[q + "self_attn.qkv_proj.bias"] = torch.cat(
                [hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]]
            )
        if cfg.qk_norm:
            sd[q + "self_attn.q_norm.weight"] = hf[attn + "q_norm.weight"]
            sd[q + "self_attn.k_norm.weight"] = hf[attn + "k_norm.weight"]
        sd[q + "self_attn.o_proj.weight"] = hf[attn + "o_proj.weight"]
        if cfg.o_proj_bias:
            sd[q + "self_attn.o_proj.bias"] = hf[attn + "o_proj.bias"]
        sd[q + "mlp.gate_up_proj.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
        sd[q + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        sd[q + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        sd[q + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
    if cfg.awq_group_size:
        sd = {k: v for k, v in sd.items() if v.numel() or not k.endswith("proj.weight")}
    return sd


def _awq_layers(
    cfg: ModelConfig,
    hf: dict[str, torch.Tensor],
    model: CausalLM,
    sd: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Replace each fused projection with an AWQLinear built from its parts' INT4 tensors
    (AWQ's or GPTQ's, unpacked, concatenated along the output dim, repacked for torch's
    int4 kernel); or, in float32 on a CPU, put their dequantized weight in `sd`."""
    g = cfg.awq_group_size
    assert g is not None
    fmt = cfg.int4_format or "awq"
    # In float32 on a CPU the weights are dequantized here into plain projections, which
    # the CPU path then packs and fuses like any checkpoint's: torch's int4 CPU kernel is
    # quick with 16-bit activations and very slow with float32 ones (a [1, 1024] x
    # [1024, 3072] product on a Zen 3: 3.5 ms against 0.44 dense and 0.29 with bf16
    # activations; 26x dense at 16 rows).  Exact: every INT4 value times its scale is a
    # float32.
    dense = device.type == "cpu" and dtype == torch.float32
    if dense:
        log.info(
            "INT4 weights in float32 on CPU: dequantized at load (torch's int4 kernel is far "
            "slower than dense with float32 activations; --dtype bfloat16 keeps them packed)"
        )
    for i in range(cfg.num_layers):
        layer = model.layers[i]
        for fused, parts in _FUSED.items():
            names = [f"model.layers.{i}.{p}." for p in parts]
            unpacked = [_unpack_int4(hf, n, fmt, g) for n in names]
            q = torch.cat([u[0] for u in unpacked], dim=1)
            z = torch.cat([u[1] for u in unpacked], dim=1)
            s = torch.cat([hf[n + "scales"] for n in names], dim=1)
            perm = unpacked[0][2]
            # Parts that share an input share its Hessian, so GPTQ orders them alike.
            if any(not _same_order(perm, u[2]) for u in unpacked[1:]):
                raise ModelLoadError(
                    f"{names[0]}: the parts of {fused} differ in act-order (g_idx); they "
                    "cannot share one product"
                )
            key = f"layers.{i}.{fused}"
            if dense:
                w = awq_dequantize(q, z, s, g)  # [N, K], inputs in perm's order
                if perm is not None:
                    w = torch.empty_like(w).index_copy_(1, perm, w)
                sd[key + ".weight"] = w.to(device, dtype)
                continue
            bias = sd.pop(key + ".bias", None)
            parent_name, attr = fused.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, AWQLinear(q, z, s, bias, g, dtype, device, perm))


def _unpack_int4(
    hf: dict[str, torch.Tensor], name: str, fmt: str, g: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One projection's INT4 values [K, N] and zero points [K/g, N] (uint8), from AWQ's
    or GPTQ's packing, and for an act-order GPTQ checkpoint the input order that puts its
    groups together (the rows come back in that order; the layer gathers its input so).
    GPTQ: qweight packs 8 inputs a word (nibble i = input 8 r + i), qzeros 8 outputs a word
    in order; the "gptq" format stores each zero point minus one (AutoGPTQ's convention,
    read back as readers do: plus one, 1..16), "gptq_v2" as is.  g_idx is each input's
    group: input // g without act-order, a permutation of that with it (GPTQ quantizes the
    inputs in decreasing Hessian order, each group g of them)."""
    if fmt == "awq":
        return unpack_awq(hf[name + "qweight"]), unpack_awq(hf[name + "qzeros"]), None
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    packed = hf[name + "qweight"]  # [K/8, N]
    q = ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, packed.shape[1])
    zp = hf[name + "qzeros"]  # [K/g, N/8]
    z = ((zp[:, :, None] >> shifts) & 0xF).reshape(zp.shape[0], -1)
    if fmt == "gptq":
        z = z + 1
    k = q.shape[0]
    groups = torch.arange(k, dtype=torch.int64) // g
    perm = None
    g_idx = hf.get(name + "g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), groups):
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int64)[perm], groups):
            raise ModelLoadError(
                f"{name}g_idx: its groups are not {g} inputs each, as group_size says"
            )
        q = q[perm]
    return q.to(torch.uint8), z.to(torch.uint8), perm


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _fp8_layers(
    cfg: ModelConfig,
    hf: dict[str, torch.Tensor],
    path: str | Path,
    pp: PPStage | None,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """An FP8 checkpoint's projections: {(layer, fused name): (float8 weight [N, K], float32
    scale [N])}, the parts' bytes and scales concatenated as stored (a per-tensor scale
    repeated over its part's rows).  Their entries in `hf` become placeholders.  A part
    stored in 16/32 bits (the checkpoint's ignore list) keeps its fused projection
    unquantized; one fused projection with both kinds of parts is refused."""
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    start, stop = (0, cfg.num_layers) if pp is None else (pp.start, pp.stop)
    for i in range(start, stop):
        for fused, parts in _FUSED.items():
            names = [f"model.layers.{i}.{p}" for p in parts]
            fp8 = [hf[n + ".weight"].dtype == FP8_DTYPE for n in names]
            scaled = [n + ".weight_scale" in hf for n in names]
            for n, a, b in zip(names, fp8, scaled, strict=True):
                if a != b:
                    raise ModelLoadError(
                        f"{path}: {n}.weight is {hf[n + '.weight'].dtype} "
                        + ("without a weight_scale" if a else "but has a weight_scale")
                        + " (FP8 weights are float8_e4m3fn, each with its weight_scale)"
                    )
            if not any(fp8):
                continue
            if not all(fp8):
                raise ModelLoadError(
                    f"{path}: layer {i}: {', '.join(parts)} mix FP8 and 16/32-bit weights "
                    "(they run as one fused projection)"
                )
            qs, ss = [], []
            for n in names:
                q = hf[n + ".weight"]
                s = hf.pop(n + ".weight_scale")
                qs.append(q)
                ss.append(s.expand(q.shape[0]) if s.numel() == 1 else s)
                hf[n + ".weight"] = torch.empty(0)  # placeholder for _to_state_dict
            out[(i, fused)] = (torch.cat(qs), torch.cat(ss))
    return out


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str | None = None,
    tp: TPGroup | None = None,
    pp: PPStage | None = None,
    tokenizer_dir: str | Path | None = None,
) -> CausalLM:
    """Build the model on the meta device and assign the checkpoint's tensors into it.
    quantization: None, "int8" (weight-only, quantized here from a 16/32-bit checkpoint),
    "awq" / "gptq" (asserts the checkpoint is that INT4 format, which is detected from
    config.json anyway) or
    "fp8" (W8A8: quantized here from a 16/32-bit checkpoint; an FP8 checkpoint, detected
    from config.json, loads its own bytes and scales with or without the flag)."""
    if quantization not in (None, *QUANTIZATION_METHODS):
        raise ModelLoadError(
            f"quantization {quantization!r} is not supported; use {' or '.join(QUANTIZATION_METHODS)}"
        )
    int4 = (cfg.int4_format or "").removesuffix("_v2")  # awq, gptq or ""
    if quantization in ("awq", "gptq") and quantization != int4:
        raise ModelLoadError(
            f"{path}: --quantization {quantization}, but config.json has no "
            f"{quantization.upper()} quantization_config"
        )
    if quantization in ("int8", "fp8") and cfg.awq_group_size:
        raise ModelLoadError(
            f"{path}: this {int4.upper()} checkpoint is already quantized; drop "
            f"--quantization {quantization}"
        )
    if quantization in ("int8", "awq", "gptq") and cfg.fp8_format:
        raise ModelLoadError(
            f"{path}: an FP8 ({cfg.fp8_format}) checkpoint is already quantized; drop "
            f"--quantization {quantization} (or pass fp8)"
        )
    hf = read_checkpoint(path, cfg, tp, pp, tokenizer_dir)
    fp8 = _fp8_layers(cfg, hf, path, pp) if cfg.fp8_format else {}
    if cfg.fp8_format and not fp8:
        raise ModelLoadError(
            f"{path}: config.json names {cfg.fp8_format}, but no projection holds FP8 weights"
        )
    # Copies, never views: safetensors hands out tensors that view its mapping of the file,
    # and one of them kept as is (the embedding; a linear the CPU path does not pack) held
    # the whole file's pages mapped into the process beside the packed copies of them.
    copy = device.type == "cpu"
    start = 0 if pp is None else pp.start
    fp8_keys = {f"layers.{i - start}.{fused}.weight" for i, fused in fp8}
    sd = {
        k: v.to(device=device, dtype=dtype, copy=copy)
        for k, v in _to_state_dict(cfg, hf, pp).items()
        if k not in fp8_keys
    }
    with torch.device("meta"):
        model = CausalLM(local_config(cfg, tp, pp), backend, max_positions, tp, pp)
    if cfg.awq_group_size:
        _awq_layers(cfg, hf, model, sd, dtype, device)  # (the biases it takes leave sd)
    for (i, fused), (q, s) in fp8.items():
        # The checkpoint's FP8 bytes and scales as they are, no requantization.
        prefix = f"layers.{i - start}.{fused}"
        layer = Fp8Linear(q.to(device), s.to(device), sd.pop(prefix + ".bias", None), dtype)
        parent_name, attr = fused.split(".")
        setattr(getattr(model.layers[i - start], parent_name), attr, layer)
        sd |= {f"{prefix}.{k}": v for k, v in layer.state_dict().items()}
    del hf
    model.load_state_dict(sd, strict=True, assign=True)
    # Non-persistent buffers were built on meta; rebuild them for real.
    model.rotary = Rotary(cfg, max_positions).to(device)
    if quantization == "int8":
        quantize_model_int8(model, dtype)
    elif quantization == "fp8" and not cfg.fp8_format:
        quantize_model_fp8(model, dtype)
    return model.eval().requires_grad_(False)
