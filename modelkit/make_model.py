"""`pagestream make-model`: write a random-weight Hugging Face checkpoint.

Nothing can be downloaded here, so tests and benchmarks run on checkpoints made locally:
random weights in exactly the layout Hugging Face's Llama/Mistral/Qwen2/Qwen3 classes save,
plus a byte-level BPE tokenizer trained on text found on this machine and a ChatML template.
Everything is a pure function of (preset, arch, seed, overrides) and the local corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu.config import ModelConfig
from gpu.config import cache_root as gpu_cache_root

# Bump when the tokenizer recipe changes, so cached tokenizers are retrained.
TOKENIZER_RECIPE_VERSION = 1

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# ChatML in SmolLM's style: an optional system message, which must come first.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' and not loop.first %}\n"
    "{{- raise_exception('The system message must be the first message.') }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Reasoning models' tags (`thinking=True`): added tokens, not special (decoding keeps
# them, as Qwen3's and DeepSeek-R1's tokenizers do), so `--reasoning-parser` can split
# the text at them.
THINK_TOKENS: tuple[str, str] = ("<think>", "</think>")
# Fill-in-the-middle tokens (`fim=True`), Qwen2.5-Coder's names: special tokens, the
# vocabulary's last three; a completion's `suffix` is laid out with them (service/fim.py).
FIM_TOKENS: tuple[str, str, str] = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

# The ChatML template above, as a Qwen3 thinking model's: the generation prompt opens
# `<think>` (closed and empty with `enable_thinking=False`), and an earlier assistant
# turn's thinking is dropped from the history.
THINKING_CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' and not loop.first %}\n"
    "{{- raise_exception('The system message must be the first message.') }}\n"
    "{%- endif %}\n"
    "{%- set content = message['content'] %}\n"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}\n"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- else %}\n"
    "{{- '<think>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)


@dataclass(frozen=True)
class Preset:
    """Shape and initialisation of a generated model (arch-independent parts)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    init_std: float
    dtype: str
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


PRESETS: dict[str, Preset] = {
    # Tests.  A large std makes the logits of a random model well separated (so float32
    # rounding cannot flip a greedy argmax between implementations); untied embeddings, as a
    # tied random model mostly predicts its input token again.
    "tiny": Preset(
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=2048,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        init_std=0.15,
        dtype="float32",
    ),
    # Shaped like SmolLM-135M.
    "small": Preset(
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        init_std=0.02,
        dtype="bfloat16",
    ),
    # Shaped like the 156M Llama of the performance anchors.
    "mid": Preset(
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2816,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        init_std=0.02,
        dtype="bfloat16",
    ),
    # Llama-3.2-1B's shape (tied embeddings, GQA 32/8), with the local 32k vocabulary
    # instead of its 128k one: the size users run on a CPU, where the projections'
    # weights (2 GB in bf16) stream from memory every decode step.
    "llama1b": Preset(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        init_std=0.02,
        dtype="bfloat16",
    ),
    # Llama-3.1-8B's shape (untied, GQA 32/8, head_dim 128), again with the local 32k
    # vocabulary: the tokenizer trained here tops out near 33k merges, and token ids the
    # tokenizer cannot decode would break detokenization in served benchmarks.
    "llama8b": Preset(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        init_std=0.02,
        dtype="bfloat16",
    ),
}

ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "llama3": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _arch_numbers(p: Preset, arch: str) -> tuple[int, float, float, int]:
    """(head_dim, rope_theta, rms_norm_eps, max_position_embeddings) as `arch` sets them."""
    head_dim = p.head_dim
    rope_theta = p.rope_theta
    rms_eps = p.rms_norm_eps
    max_pos = p.max_position_embeddings
    if arch == "qwen3":
        # Qwen3 decouples head_dim from hidden/heads (Qwen3-0.6B: 16 x 128 on hidden 1024);
        # doubling it makes a loader that derives head_dim from hidden_size fail loudly.
        head_dim = 2 * p.head_dim
    if arch in ("qwen2", "qwen3"):
        rope_theta, rms_eps = 1_000_000.0, 1e-6
    if arch == "llama3":
        rope_theta = 500_000.0
        # HF requires max_position_embeddings > original_max_position_embeddings; the
        # extended context is the original one times the factor, as in Llama 3.1.
        orig = LLAMA3_ROPE_SCALING["original_max_position_embeddings"]
        max_pos = max(max_pos, int(orig * LLAMA3_ROPE_SCALING["factor"]))
    return head_dim, rope_theta, rms_eps, max_pos


def _arch_fields(p: Preset, arch: str) -> dict[str, Any]:
    """The fields only some architectures' config.json files carry."""
    if arch in ("llama", "llama3"):
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if arch == "mistral":
        return {"sliding_window": None}
    # Qwen2 has q/k/v biases implicitly (no config field), as in the real checkpoints.
    extra: dict[str, Any] = {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": p.num_layers,
    }
    if arch == "qwen3":
        extra["attention_bias"] = False
    return extra


def build_config(
    preset: str | Preset = "tiny",
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    dtype: str | None = None,
    init_std: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `config.json` dict for a preset and architecture (old-style top-level rope keys)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    dtype = dtype or p.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    architecture, model_type = ARCHS[arch]
    head_dim, rope_theta, rms_eps, max_pos = _arch_numbers(p, arch)
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size or p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "initializer_range": init_std if init_std is not None else p.init_std,
        "rms_norm_eps": rms_eps,
        "rope_theta": rope_theta,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if arch == "llama3" else None,
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        # End of text and end of turn: a chat reply stops at <|im_end|>.
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "use_cache": True,
        "torch_dtype": dtype,
    }
    cfg.update(_arch_fields(p, arch))
    if overrides:
        cfg.update(overrides)
    return cfg


def state_dict_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes, in HF's order, for a config made by `build_config`."""
    # Shapes, biases and norms as the loader reads the config (transformers' rules).
    mc = ModelConfig.from_dict(cfg)
    hidden, inter = mc.hidden_size, mc.intermediate_size
    head_dim, q_size, kv_size = mc.head_dim, mc.q_size, mc.kv_size
    qkv_bias, o_bias, qk_norm = mc.attention_bias, mc.o_proj_bias, mc.qk_norm
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        attn = f"{pre}.self_attn"
        shapes[f"{attn}.q_proj.weight"] = (q_size, hidden)
        shapes[f"{attn}.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{attn}.v_proj.weight"] = (kv_size, hidden)
        if qkv_bias:
            shapes[f"{attn}.q_proj.bias"] = (q_size,)
            shapes[f"{attn}.k_proj.bias"] = (kv_size,)
            shapes[f"{attn}.v_proj.bias"] = (kv_size,)
        shapes[f"{attn}.o_proj.weight"] = (hidden, q_size)
        if o_bias:
            shapes[f"{attn}.o_proj.bias"] = (hidden,)
        if qk_norm:
            shapes[f"{attn}.q_norm.weight"] = (head_dim,)
            shapes[f"{attn}.k_norm.weight"] = (head_dim,)
        shapes[f"{pre}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{pre}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{pre}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{pre}.input_layernorm.weight"] = (hidden,)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def param_count(cfg: dict[str, Any]) -> int:
    """Number of parameters of the model a config describes (tied weights counted once)."""
    total = 0
    for shape in state_dict_shapes(cfg).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def random_state_dict(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for `cfg`, drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    std = float(cfg["initializer_range"])
    dtype = DTYPES[cfg.get("torch_dtype") or "float32"]
    out: dict[str, torch.Tensor] = {}
    for name, shape in state_dict_shapes(cfg).items():
        if name.endswith("norm.weight"):
            # Around 1 but not 1, so a model that forgets a norm weight is caught.
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype).contiguous()
    return out


def write_fast_weights(
    cfg: dict[str, Any],
    out: Path,
    seed: int = 0,
    device: str = "cpu",
    shard_bytes: int = 4 << 30,
) -> list[Path]:
    """Random weights for `cfg`, written in seconds at billions of parameters.

    `random_state_dict` draws every element from one CPU generator, minutes at the 8B
    shape; here one random block (drawn on `device`, a GPU when there is one) is tiled
    into each tensor from a seeded offset. The values repeat with the block's period, which
    a benchmark of speed does not see; they are not for accuracy tests. Shards of at most
    `shard_bytes` with an index, so no file needs the whole model in memory at once."""
    dtype = DTYPES[cfg.get("torch_dtype") or "float32"]
    std = float(cfg["initializer_range"])
    gen = torch.Generator(device=device).manual_seed(seed)
    period = (1 << 24) + 7  # odd, so tensors of power-of-two sizes do not start aligned
    block = (std * torch.randn(2 * period, generator=gen, device=device)).to(dtype)
    norm = (1.0 + 0.1 * torch.randn(1 << 16, generator=gen, device=device)).to(dtype)
    rng = torch.Generator().manual_seed(seed + 1)
    # Each shard is saved as soon as it is full, so memory holds one shard at a time;
    # the names are fixed once the count is known (one file: no index).
    shard: dict[str, torch.Tensor] = {}
    parts: list[tuple[Path, list[str]]] = []
    size = total = 0

    def flush() -> None:
        part = out / f"model.part{len(parts)}.safetensors"
        save_file(shard, str(part), {"format": "pt"})
        parts.append((part, list(shard)))
        shard.clear()

    for name, shape in state_dict_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        src = norm if name.endswith("norm.weight") else block
        half = src.numel() // 2
        reps = -(-n // half)
        off = int(torch.randint(half, (1,), generator=rng))
        t = src[off : off + half].repeat(reps)[:n] if reps > 1 else src[off : off + n]
        t = t.reshape(shape).to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    files: list[Path] = []
    if len(parts) == 1:
        files.append(out / "model.safetensors")
        os.replace(parts[0][0], files[0])
    else:
        weight_map: dict[str, str] = {}
        for i, (part, names) in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.replace(part, out / fname)
            files.append(out / fname)
            weight_map.update(dict.fromkeys(names, fname))
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    for f in files:
        f.chmod(0o644)
    return files


# ---------------------------------------------------------------------------------------
# Tokenizer


def cache_root() -> Path:
    return gpu_cache_root()


@cache
def _corpus_files() -> tuple[Path, ...]:
    """Local text in a fixed order: the license texts (English prose), then the stdlib."""
    files: list[Path] = []
    lic = Path("/usr/share/common-licenses")
    if lic.is_dir():
        files += sorted((f for f in lic.rglob("*") if f.is_file()), key=lambda f: f.as_posix())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    py: list[str] = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in skip]  # pruned: site-packages is huge
        rel = Path(root).relative_to(stdlib)
        py += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    files += [stdlib / r for r in sorted(py)]
    return tuple(files)


def default_corpus_bytes(vocab_size: int) -> int:
    # Enough distinct words for the merges a vocabulary needs (4 MB tops out near 33k).
    return max(1 << 20, vocab_size * 400)


@cache
def load_corpus(max_bytes: int) -> tuple[str, ...]:
    """Texts of the local corpus, in order, until `max_bytes` UTF-8 bytes are collected."""
    texts: list[str] = []
    total = 0
    for f in _corpus_files():
        if total >= max_bytes:
            break
        try:
            raw = f.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(raw) > max_bytes:
            text = raw[: max_bytes - total].decode("utf-8", errors="ignore")
        texts.append(text)
        total += len(text.encode("utf-8"))
    if not texts:
        raise RuntimeError("no local text found to train a tokenizer on")
    return tuple(texts)


# Pre-tokenizer regexes of the real families, so that transformers, which rebuilds some
# tokenizers from their vocab with a hard-coded pipeline (Qwen2Tokenizer), agrees with
# our tokenizer.json.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# arch -> tokenizer flavour: "gpt2" (GPT-2/SmolLM byte-level), "llama3" (its split regex
# and a post-processor that prepends the bos token), "qwen2" (NFC + its split regex).
TOKENIZER_FLAVORS: dict[str, str] = {
    "llama": "gpt2",
    "mistral": "gpt2",
    "llama3": "llama3",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
}


def _train_tokenizer(texts: Sequence[str], vocab_size: int, flavor: str) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    if flavor == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif flavor in ("llama3", "qwen2"):
        regex = _LLAMA3_REGEX if flavor == "llama3" else _QWEN2_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if flavor == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        raise ValueError(f"unknown tokenizer flavor {flavor!r}")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is a token, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if flavor == "llama3":
        bos = SPECIAL_TOKENS[ENDOFTEXT_ID]
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, ENDOFTEXT_ID)],
                ),
            ]
        )
    else:
        tok.post_processor = byte_level
    return tok


def trained_tokenizer_json(
    vocab_size: int, corpus_bytes: int | None = None, flavor: str = "gpt2"
) -> str:
    """The tokenizer.json text for a vocabulary size, trained once and cached on disk."""
    import tokenizers

    texts = load_corpus(corpus_bytes or default_corpus_bytes(vocab_size))
    h = hashlib.sha256()
    h.update(f"{TOKENIZER_RECIPE_VERSION}/{tokenizers.__version__}/{flavor}/{vocab_size}".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    name = f"bpe-{flavor}-{vocab_size}-{h.hexdigest()[:20]}.json"
    path = cache_root() / "tokenizers" / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    text = _train_tokenizer(texts, vocab_size, flavor).to_str(pretty=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: parallel test workers may train the same tokenizer at once.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return text


def _added_token(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def tokenizer_files(
    max_pos: int,
    flavor: str = "gpt2",
    think_ids: tuple[int, int] | None = None,
    fim_ids: tuple[int, int, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json for the generated tokenizer
    (think_ids: the ids of THINK_TOKENS, for a thinking model; fim_ids: FIM_TOKENS')."""
    eot, start, end = SPECIAL_TOKENS
    added = {str(i): _added_token(t) for i, t in enumerate(SPECIAL_TOKENS)}
    if think_ids is not None:
        for i, t in zip(think_ids, THINK_TOKENS, strict=True):
            added[str(i)] = {**_added_token(t), "special": False}
    if fim_ids is not None:
        for i, t in zip(fim_ids, FIM_TOKENS, strict=True):
            added[str(i)] = _added_token(t)
    tok_cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [start, end],
        "bos_token": eot,
        "eos_token": end,
        "pad_token": eot,
        "unk_token": eot,
        "chat_template": THINKING_CHAT_TEMPLATE if think_ids else CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_pos,
        # What the real families declare; transformers picks its class from this (and
        # from config.json's model_type).
        "tokenizer_class": "Qwen2Tokenizer" if flavor == "qwen2" else "PreTrainedTokenizerFast",
    }
    special_map = {
        "additional_special_tokens": [start, end],
        "bos_token": eot,
        "eos_token": end,
        "pad_token": eot,
        "unk_token": eot,
    }
    return {"tokenizer_config.json": tok_cfg, "special_tokens_map.json": special_map}


# ---------------------------------------------------------------------------------------
# Checkpoint


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    init_std: float | None = None,
    dtype: str | None = None,
    vocab_size: int | None = None,
    corpus_bytes: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    fast_weights: str | None = None,
    thinking: bool = False,
    fim: bool = False,
) -> Path:
    """Write a random-weight HF checkpoint with a locally trained tokenizer; return its dir.

    `dtype` defaults to the preset's ("float32" for tiny, "bfloat16" otherwise).
    `config_overrides` are applied last to config.json (e.g. a shorter
    max_position_embeddings); the weights follow the overridden shapes.
    `fast_weights` names a torch device ("cpu", "cuda") to draw speed-benchmark weights
    on (`write_fast_weights`) instead of the exact seeded draw.
    `thinking` makes a reasoning model's tokenizer and template: `<think>` and `</think>`
    are the vocabulary's last two tokens, and the generation prompt opens `<think>`.
    `fim` adds fill-in-the-middle tokens (FIM_TOKENS) as the vocabulary's last three.
    """
    if thinking and fim:
        raise ValueError("a checkpoint is made with thinking or fim tokens, not both")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    cfg = build_config(
        preset,
        arch,
        vocab_size=vocab_size,
        dtype=dtype,
        init_std=init_std,
        overrides=config_overrides,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    flavor = TOKENIZER_FLAVORS[arch]
    think_ids = fim_ids = None
    if thinking:
        tok_json, ids = _tokenizer_with(cfg["vocab_size"], corpus_bytes, flavor, THINK_TOKENS)
        think_ids = ids  # type: ignore[assignment]
    elif fim:
        tok_json, ids = _tokenizer_with(cfg["vocab_size"], corpus_bytes, flavor, FIM_TOKENS)
        fim_ids = ids  # type: ignore[assignment]
    else:
        tok_json = trained_tokenizer_json(cfg["vocab_size"], corpus_bytes, flavor)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    files = tokenizer_files(cfg["max_position_embeddings"], flavor, think_ids, fim_ids)
    for name, obj in files.items():
        _write_json(out / name, obj)

    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
            "pad_token_id": ENDOFTEXT_ID,
        },
    )
    if fast_weights:
        write_fast_weights(cfg, out, seed, fast_weights)
    else:
        weights = out / "model.safetensors"
        save_file(random_state_dict(cfg, seed), str(weights), {"format": "pt"})
        # safetensors writes 0600; the checkpoint may be served by another user
        weights.chmod(0o644)
    # Last, so that a directory with a config.json is a complete checkpoint.
    _write_json(out / "config.json", cfg)
    return out


def _tokenizer_with(
    vocab_size: int, corpus_bytes: int | None, flavor: str, tokens: tuple[str, ...]
) -> tuple[str, tuple[int, ...]]:
    """A tokenizer trained len(tokens) short, then `tokens` added as its last ones:
    THINK_TOKENS as plain added tokens (decoding keeps them), FIM_TOKENS as special."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(trained_tokenizer_json(vocab_size - len(tokens), corpus_bytes, flavor))
    special = tokens == FIM_TOKENS
    added = [AddedToken(t, special=special, normalized=False) for t in tokens]
    if special:
        tok.add_special_tokens(added)
    else:
        tok.add_tokens(added)
    ids = tuple(tok.token_to_id(t) for t in tokens)
    assert ids == tuple(range(vocab_size - len(tokens), vocab_size)), ids
    return tok.to_str(pretty=True), ids


def _human(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def main(argv: Sequence[str] | None = None) -> int:
    """`pagestream make-model DIR --preset NAME ...`."""
    ap = argparse.ArgumentParser(
        prog="pagestream make-model",
        description="Write a random-weight Hugging Face checkpoint with a locally trained "
        "byte-level BPE tokenizer (for tests and benchmarks; nothing is downloaded).",
    )
    ap.add_argument("dir", type=Path, help="output directory (created if missing)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--arch", choices=list(ARCHS), default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=None, help="weight std (preset default)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="(preset default)")
    ap.add_argument("--vocab-size", type=int, default=None, help="(preset default)")
    ap.add_argument(
        "--thinking",
        action="store_true",
        help="a reasoning model's tokenizer (<think>, </think>) and template, for "
        "--reasoning-parser qwen3",
    )
    ap.add_argument(
        "--fim",
        action="store_true",
        help="fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), "
        "for a completion's `suffix`",
    )
    args = ap.parse_args(argv)
    out = make_model(
        args.dir,
        preset=args.preset,
        arch=args.arch,
        seed=args.seed,
        init_std=args.init_std,
        dtype=args.dtype,
        vocab_size=args.vocab_size,
        thinking=args.thinking,
        fim=args.fim,
    )
    cfg = json.loads((out / "config.json").read_text())
    print(
        f"wrote {out}: {cfg['architectures'][0]} preset={args.preset} "
        f"params={_human(param_count(cfg))} dtype={cfg['torch_dtype']}",
        file=sys.stderr,
    )
    return 0


def with_overrides(name: str, **changes: Any) -> Preset:
    """A preset with some fields changed, e.g. to register a new one in PRESETS."""
    return replace(PRESETS[name], **changes)


if __name__ == "__main__":
    raise SystemExit(main())
