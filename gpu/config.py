"""Model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu.cpu import features as cpu_features
from gpu.cpu.features import CpuFeatures
from gpu.hf_labels import classifier_labels, from_tokens
from scheduler import envs

log = logging.getLogger(__name__)

# architecture name -> (biases, per-head q/k RMSNorm).  Biases as transformers builds the
# attention: "config" = q/k/v and o_proj all follow config.json's attention_bias (default
# false), "qkv" = q/k/v always and o_proj never (Qwen2), "none" = never (Mistral: it has
# no such field and ignores one).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("config", False),
    "MistralForCausalLM": ("none", False),
    "Qwen2ForCausalLM": ("qkv", False),
    "Qwen3ForCausalLM": ("config", True),
    # The base models, without an LM head: embedding checkpoints saved from them (their
    # tensors without the `model.` prefix, as sentence-transformers writes Qwen3-Embedding
    # and gte-Qwen2).  They serve /v1/embeddings only (ModelConfig.embedding_only).
    "LlamaModel": ("config", False),
    "MistralModel": ("none", False),
    "Qwen2Model": ("qkv", False),
    "Qwen3Model": ("config", True),
    # Sequence classifiers: the base model and a `score` head read at the last position
    # (cross-encoder rerankers, reward and label models).  They serve /classify, and
    # /score and /rerank as cross-encoders (ModelConfig.num_labels).
    "LlamaForSequenceClassification": ("config", False),
    "MistralForSequenceClassification": ("none", False),
    "Qwen2ForSequenceClassification": ("qkv", False),
    "Qwen3ForSequenceClassification": ("config", True),
}


def cache_root() -> Path:
    """Where pagestream keeps what it builds on first use (default model, test
    checkpoints, compiled CPU kernels): $PAGESTREAM_CACHE, else $XDG_CACHE_HOME/pagestream,
    else ~/.cache/pagestream."""
    explicit = envs.PAGESTREAM_CACHE
    if explicit:
        return Path(explicit)
    base = envs.XDG_CACHE_HOME or str(Path.home() / ".cache")
    return Path(base) / "pagestream"


class ModelLoadError(ValueError):
    """A checkpoint the server cannot run; the message names what is wrong."""


def _tensor_names(path: Path) -> list[str] | None:
    """The checkpoint's tensor names (its index's, or its one file's header), None when
    there is no safetensors checkpoint here (the loader says so)."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            return list(json.loads(index.read_text()).get("weight_map", {}))
        single = path / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return list(f.keys())
    except (OSError, ValueError):
        return None  # unreadable: the loader reports it
    return None


def _need(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ModelLoadError(f"config.json: missing required field {key!r}")
    return raw[key]


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _attention_shape(raw: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden size, query heads, KV heads, head dim), with the defaults HF applies."""
    hidden = int(_need(raw, "hidden_size"))
    heads = int(_need(raw, "num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    return hidden, heads, kv_heads, head_dim


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, llama3 scaling or None).  transformers 5 nests rope settings in
    rope_parameters; older files keep rope_theta + rope_scaling at top level.  Accept both."""
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    if scaling is None:
        return rope_theta, None
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default":
        return rope_theta, None
    if rtype != "llama3":
        raise ModelLoadError(
            f"config.json: rope scaling type {rtype!r} is not supported (llama3 only)"
        )
    return rope_theta, {**scaling, "rope_type": "llama3"}


def with_hf_overrides(model_dir: Path, overrides: Mapping[str, Any] | None) -> Path:
    """vLLM's hf_overrides (`--hf-overrides`): a directory that is `model_dir` but for its
    config.json, which has `overrides` merged in (dicts key by key), so every reader of the
    checkpoint (the runner, tensor-parallel ranks, the pooling rules, the prefix tier's
    fingerprint) sees the same config.  It holds links to the other files, under the cache
    directory, named by the checkpoint's path, its config and the overrides."""
    if not overrides:
        return model_dir
    source = model_dir.resolve()
    raw = (source / "config.json").read_bytes()
    cfg = _merged(json.loads(raw), overrides)
    key = hashlib.blake2b(digest_size=10)
    for part in (str(source).encode(), raw, json.dumps(overrides, sort_keys=True).encode()):
        key.update(part + b"\0")
    out = cache_root() / "hf-overrides" / key.hexdigest()
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".overlay-", dir=out.parent))
    try:
        for f in source.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        with contextlib.suppress(OSError):  # another process made it first
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("config.json with --hf-overrides %s: %s", json.dumps(overrides), out)
    return out


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = v
    return out


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None
    # An INT4 checkpoint's group size: AutoAWQ (GEMM) or GPTQ (int4_format says which;
    # both run as the same INT4 layers, GPTQ's tensors repacked at load).
    awq_group_size: int | None = None
    int4_format: str | None = None  # "awq", "gptq" (zero points stored minus one), "gptq_v2"
    # An FP8 checkpoint's quant_method ("compressed-tensors" or "fbgemm_fp8"): projection
    # weights stored float8_e4m3fn with a `weight_scale` each, loaded as they are.
    fp8_format: str | None = None
    o_proj_bias: bool = False
    # A base model (no LM head): it embeds and does not generate.  The embedding matrix
    # stands in for the head, for the one token an embedding request samples and no one
    # reads (tie_word_embeddings is set for it).
    embedding_only: bool = False
    # A sequence classifier's labels: the runner returns score.weight @ the pooled state
    # (its logits) in place of the state itself.  0: no classification head.
    num_labels: int = 0
    # The head built from these tokens' LM-head rows (gpu/hf_labels.py), not read.
    classifier_from_token: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest context the model supports as we run it (no sliding-window attention)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = _architecture(raw)
        biases, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        from_config = biases == "config" and bool(raw.get("attention_bias", False))
        hidden, heads, kv_heads, head_dim = _attention_shape(raw)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (silu only)")
        rope_theta, scaling = _rope(raw)
        sliding = None
        embedding_only = not arch.endswith("ForCausalLM")
        num_labels, tokens = 0, []
        if arch.endswith("ForSequenceClassification"):
            try:
                num_labels, tokens = len(classifier_labels(raw)), from_tokens(raw)
            except ValueError as e:
                raise ModelLoadError(f"config.json: {e}") from None
        # A head built from LM-head rows keeps the checkpoint's LM head (tied or not).
        tied = bool(raw.get("tie_word_embeddings", False)) or (embedding_only and not tokens)
        if arch.startswith("Mistral") or raw.get("use_sliding_window"):
            sliding = raw.get("sliding_window") or None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=int(_need(raw, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_need(raw, "intermediate_size")),
            num_layers=int(_need(raw, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=tied,
            embedding_only=embedding_only,
            attention_bias=biases == "qkv" or from_config,
            o_proj_bias=from_config,
            qk_norm=qk_norm,
            sliding_window=int(sliding) if sliding else None,
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            awq_group_size=_awq_group_size(raw.get("quantization_config"), hidden),
            int4_format=_int4_format(raw.get("quantization_config")),
            fp8_format=_fp8_format(raw.get("quantization_config")),
            num_labels=num_labels,
            classifier_from_token=tuple(tokens),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face checkpoint?)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path}: invalid JSON: {e}") from e
        cfg = cls.from_dict(raw)
        names = _tensor_names(Path(path))
        if (
            not cfg.embedding_only
            and names
            and "lm_head.weight" not in names
            and not any(n.startswith("model.") for n in names)
        ):
            # A base model's tensors under a CausalLM architecture (how sentence-transformers
            # saves an embedding model it built on one): no head, an embedding model.
            cfg = dataclasses.replace(cfg, embedding_only=True, tie_word_embeddings=True)
        return cfg

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim // 2], float32, as transformers computes them."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_scaling is None:
            return inv
        s = self.rope_scaling
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def _int4_format(qc: dict[str, Any] | None) -> str | None:
    """ "awq", "gptq" or "gptq_v2" for an INT4 checkpoint _awq_group_size takes, else None."""
    method = str((qc or {}).get("quant_method", "")).lower()
    if method == "awq":
        return "awq"
    if method == "gptq":
        return str(qc.get("checkpoint_format", "gptq")).lower()  # type: ignore[union-attr]
    return None


def _awq_group_size(qc: dict[str, Any] | None, hidden: int) -> int | None:
    """The group size of an INT4 checkpoint (AutoAWQ GEMM, or GPTQ with or without act-order);
    None when it is not quantized; a clear error for every quantized format this loader
    cannot run."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in FP8_METHODS:
        return None
    if method not in ("awq", "gptq"):
        raise ModelLoadError(
            f"config.json: quantization method {method or qc!r} is not supported "
            "(INT4 checkpoints in the AutoAWQ 'gemm' or the GPTQ format and FP8 ones in the "
            "compressed-tensors or fbgemm_fp8 format load; for INT8 or FP8 weights start "
            "from a 16/32-bit checkpoint with --quantization int8 / fp8)"
        )
    name = method.upper()
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"config.json: {name} with bits={bits} is not supported (4 only)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                f"config.json: AWQ version {version!r} is not supported (the 'gemm' packing only)"
            )
        if not qc.get("zero_point", True):
            raise ModelLoadError("config.json: AWQ without zero points is not supported")
    else:
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(
                f"config.json: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)"
            )
        if qc.get("lm_head"):
            raise ModelLoadError("config.json: GPTQ with a quantized lm_head is not supported")
        if qc.get("dynamic"):
            raise ModelLoadError(
                "config.json: GPTQ per-module (dynamic) settings are not supported"
            )
    if method == "awq" and (qc.get("desc_act") or qc.get("act_order")):
        raise ModelLoadError("config.json: AWQ act-order (desc_act) is not supported")
    if qc.get("modules_to_not_convert"):
        raise ModelLoadError(f"config.json: {name} modules_to_not_convert is not supported")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0 or group % 32 or hidden % group:
        raise ModelLoadError(
            f"config.json: {name} group_size {group!r} is not supported (a positive multiple "
            f"of 32 dividing hidden_size {hidden}; per-channel (-1) is not)"
        )
    return group


FP8_METHODS = ("compressed-tensors", "fbgemm_fp8")


def _fp8_format(qc: dict[str, Any] | None) -> str | None:
    """The quant_method of an FP8 checkpoint this loader runs (float8 e4m3 weights, a
    per-channel or per-tensor `weight_scale`; activations are quantized per token at run
    time whatever the checkpoint planned, which is at least as fine as a static scale);
    None when it is not one; a clear error for the variants it cannot run."""
    method = str((qc or {}).get("quant_method", "")).lower()
    if not qc or method not in FP8_METHODS:
        return None
    if method == "fbgemm_fp8":
        return method  # always per-channel e4m3 weights, dynamic per-token activations
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("config.json: compressed-tensors without config_groups")
    for name, group in groups.items():
        # The storage format, top-level or (newer files) per group; the weights' dtype is
        # checked against it at load.
        fmt = str(group.get("format") or qc.get("format") or "float-quantized").lower()
        if fmt != "float-quantized":
            raise ModelLoadError(
                f"config.json: compressed-tensors format {fmt!r} is not supported (FP8 "
                "weights stored 'float-quantized' only)"
            )
        w = group.get("weights") or {}
        ok = (
            w.get("type") == "float"
            and w.get("num_bits") == 8
            and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True)
        )
        if not ok:
            raise ModelLoadError(
                f"config.json: compressed-tensors group {name!r} weights {w} are not supported "
                "(8-bit float, symmetric, strategy channel or tensor)"
            )
        a = group.get("input_activations") or {}
        if a and (a.get("type") != "float" or a.get("num_bits") != 8):
            raise ModelLoadError(
                f"config.json: compressed-tensors group {name!r} activations {a} are not "
                "supported (8-bit float)"
            )
    return method


def resolve_dtype(
    name: str | torch.dtype, device: torch.device, cpu: CpuFeatures | None = None
) -> torch.dtype:
    """`auto` is bfloat16 on CUDA; on CPU it is what the CPU computes natively: bfloat16
    with AVX512-BF16 or AMX (`cpu`, default: this machine's features), else float32
    (bf16 GEMMs there are emulated, several times slower than float32)."""
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if device.type != "cpu":
            return torch.float32
        return torch.bfloat16 if (cpu or cpu_features.detect()).native_bf16 else torch.float32
    if name not in table:
        raise ModelLoadError(
            f"dtype {name!r} is not supported; use auto, float32, bfloat16 or float16"
        )
    return table[name]


def read_eos_token_ids(path: str | Path, cfg: ModelConfig) -> tuple[int, ...]:
    """EOS ids from config.json, extended by generation_config.json (chat models list the
    end-of-turn token there)."""
    ids = list(cfg.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen}: invalid JSON: {e}") from e
        for e in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)
