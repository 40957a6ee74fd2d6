"""Generated checkpoints for tests, built once and reused.

`tiny_checkpoint("qwen3", seed=1)` returns a directory holding a random-weight HF checkpoint
made by `modelkit.make_model`.  Checkpoints are cached on disk under
`~/.cache/pagestream/test-checkpoints/<code version>/<arch>-<hash of the arguments>`; the
code version hashes `make_model.py`, so a change to it rebuilds them (and old versions are
pruned).  Treat them as read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch

from modelkit import make_model as mm

_MAKE_MODEL_ARGS = set(inspect.signature(mm.make_model).parameters) - {"out_dir", "arch"}
_READY = ".complete"
_built: dict[str, Path] = {}


def _code_version() -> str:
    src = Path(inspect.getfile(mm)).read_bytes()
    return hashlib.sha256(
        src + f"/{torch.__version__}/{tokenizers.__version__}".encode()
    ).hexdigest()[:16]


def _prune_other_versions(parent: Path, keep: str) -> None:
    # Checkpoints of an older make_model.py are never read again; an hour's grace leaves
    # a concurrent run of another checkout alone.
    if not parent.is_dir():
        return
    for d in parent.iterdir():
        if d.name != keep and d.is_dir() and time.time() - d.stat().st_mtime > 3600:
            shutil.rmtree(d, ignore_errors=True)


def tiny_checkpoint(arch: str = "llama", **overrides: Any) -> Path:
    """A tiny-preset checkpoint for `arch`.  Keyword arguments of `make_model` (seed,
    init_std, dtype, vocab_size, preset, ...) pass through; any other keyword overrides a
    config.json field (e.g. `num_hidden_layers=2`, `tie_word_embeddings=True`)."""
    kwargs = {k: v for k, v in overrides.items() if k in _MAKE_MODEL_ARGS}
    cfg_over = dict(kwargs.pop("config_overrides", None) or {})
    cfg_over.update({k: v for k, v in overrides.items() if k not in _MAKE_MODEL_ARGS})
    spec = {"arch": arch, **kwargs, "config_overrides": cfg_over}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]
    if key in _built:
        return _built[key]

    code = _code_version()
    root = mm.cache_root() / "test-checkpoints" / code
    path = root / f"{arch}-{key}"
    if not (path / _READY).is_file():
        if not root.is_dir():
            _prune_other_versions(root.parent, keep=code)
        root.mkdir(parents=True, exist_ok=True)
        # Build beside the final place and rename, so concurrent test processes never see
        # a half-written checkpoint.
        tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=root))
        try:
            mm.make_model(tmp, arch=arch, config_overrides=cfg_over or None, **kwargs)
            (tmp / _READY).write_text(json.dumps(spec, sort_keys=True, default=str))
            if not (path / _READY).is_file():
                if path.exists():  # a stale, incomplete build
                    shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(OSError):  # another process finished first
                    os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _built[key] = path
    return path


def peft_adapter(model: str | Path, out: Path, seed: int, **lora: Any) -> str:
    """A LoRA adapter for `model`, made and saved by PEFT (LoraConfig's keywords in
    `lora`), its A and B drawn at random (PEFT starts B at zero: no change), so it changes
    the model's output as a trained one would."""
    import peft
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    pm.save_pretrained(str(out))
    return str(out)


def classifier_checkpoint(
    out: Path,
    arch: str = "llama",
    labels: tuple[str, ...] = ("negative", "positive"),
    seed: int = 0,
) -> str:
    """A sequence classifier (`LlamaForSequenceClassification`, ...) saved by transformers
    in `out`: the tiny checkpoint's body and a random `score` head with a row per label,
    drawn large enough that the labels' logits differ by units (a real head's range)."""
    import transformers

    src = tiny_checkpoint(arch)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(src), dtype=torch.float32, num_labels=len(labels),
        id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)},
    )  # fmt: skip
    with torch.no_grad():
        hf.score.weight.normal_(0, 2 / hf.config.hidden_size**0.5)
    hf.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return str(out)


THINK_PROMPT = [{"role": "user", "content": "Think about the sea, then answer."}]


def thinking_model(out: Path, messages: list[dict[str, str]] = THINK_PROMPT) -> str:
    """A Qwen3-shaped thinking checkpoint in `out` (its template opens `<think>`) that
    closes its thinking after a few tokens when greedy on `messages`: `</think>`'s lm_head
    row is twice the row of a token the model writes a few tokens in, so `</think>` wins
    where that token would (or earlier)."""
    import transformers
    from safetensors.torch import load_file, save_file

    from service.tokenizer import Tokenizer

    src = tiny_checkpoint("qwen3", thinking=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tok = Tokenizer.from_dir(src)
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.inference_mode():
        gen = hf.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
    late = next(t for i, t in enumerate(gen) if i >= 4 and gen.index(t) == i)
    sd = load_file(src / "model.safetensors")
    sd["lm_head.weight"][tok.backend.token_to_id("</think>")] = 2 * sd["lm_head.weight"][late]
    save_file(sd, str(out / "model.safetensors"), {"format": "pt"})
    return str(out)
