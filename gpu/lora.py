"""LoRA adapters served beside their base model (vLLM's `--lora-modules name=path`).

A request names an adapter as its `model`; the engine batches requests of every adapter
and of the base model into one step.  Each projection an adapter targets computes
`base(x) + scale * (x A^T) B^T` for that adapter's rows, the way PEFT's unmerged
`LoraLayer` does (so HF transformers + PEFT in float32 is the oracle): the base GEMM runs
once for every row, each adapter present in the step adds its low-rank product to its
own rows.  Weights stay unmerged, so adapters cost their own bytes (rank x (in + out)
per projection) and any number of them shares one copy of the base.

Adapters are PEFT checkpoints (`adapter_config.json` + `adapter_model.safetensors`)
targeting any of q/k/v/o_proj and gate/up/down_proj; everything else PEFT can save
(DoRA, biases, extra trained modules, per-module ranks or alphas, embedding targets) is
refused at start with the reason, not served wrongly.  A step with adapter rows runs every
layer for every row (the last layer's cut to the sampled rows assumes one weight per row),
layer by layer on CPU (not the compiled all-layer call, which reads the base weights
itself) and without CUDA graphs, which are captured for the base alone; a step without
any runs as it would with no adapter loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gpu.config import ModelConfig
from scheduler.config import lora_fingerprint

# PEFT's module name -> (our fused projection, its part)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)
# Adapter settings that change what the layer computes: refused unless at their default.
_UNSUPPORTED = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
}


class LoRAError(ValueError):
    """An adapter that cannot be served with this model (said at start)."""


def _parts(cfg: ModelConfig) -> dict[str, list[tuple[int, int, int]]]:
    """Each fused projection's parts: (output offset, output size, input size)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "self_attn.qkv_proj": [(0, q, h), (q, kv, h), (q + kv, kv, h)],
        "self_attn.o_proj": [(0, h, q)],
        "mlp.gate_up_proj": [(0, inter, h), (inter, inter, h)],
        "mlp.down_proj": [(0, h, inter)],
    }


@dataclass
class _Delta:
    """One adapter's low-rank update of one fused projection: its parts' A matrices
    stacked (one GEMM for all of them), and per part where its rank rows and outputs are."""

    a: torch.Tensor  # [sum of ranks, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # out offset, size, rank offset, rank, B


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    fingerprint: str  # of its weights' bytes: what the prefix cache keys its KV with
    deltas: dict[tuple[int, str], _Delta] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = 0
        for d in self.deltas.values():
            n += d.a.nbytes + sum(p[4].nbytes for p in d.parts)
        return n


def read_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
    device: torch.device,
) -> Adapter:  # fmt: skip
    """A PEFT LoRA checkpoint, checked against the base model's shapes."""
    from safetensors.torch import load_file

    root = Path(path)
    try:
        conf = json.loads((root / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(
            f"LoRA adapter {name!r}: cannot read {root}/adapter_config.json: {e}"
        ) from e
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, default in _UNSUPPORTED.items():
        if conf.get(key, default) not in (default, None, {}, False):
            raise LoRAError(f"LoRA adapter {name!r}: {key}={conf[key]!r} is not supported")
    rank, alpha = int(conf.get("r", 0)), float(conf.get("lora_alpha", 0))
    if not 0 < rank <= max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {rank} is not in [1, --max-lora-rank {max_rank}]"
        )
    scale = alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)
    weights = root / "adapter_model.safetensors"
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # a missing file, a .bin-only adapter, a torn file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {weights}: {e}") from e
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} targets no projection we serve")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: {key!r}: the model has {cfg.num_layers} layers"
            )
        found.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    parts = _parts(cfg)
    per_module: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, target), ab in sorted(found.items()):
        module, part = TARGETS[target]
        off, out, inp = parts[module][part]
        a, b = ab.get("A"), ab.get("B")
        where = f"LoRA adapter {name!r}: layer {layer} {target}"
        if a is None or b is None:
            raise LoRAError(f"{where}: lora_A and lora_B must both be there")
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoRAError(
                f"{where}: A {tuple(a.shape)} / B {tuple(b.shape)}, the model needs "
                f"({rank}, {inp}) / ({out}, {rank})"
            )
        per_module.setdefault((layer, module), []).append((off, out, a, b))
    if not per_module:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights in {weights}")
    adapter = Adapter(name, str(root), rank, scale, lora_fingerprint(root))
    for key, items in per_module.items():
        a_cat = torch.cat([a for _, _, a, _ in items]).to(device=device, dtype=dtype)
        listed = []
        for i, (off, out, _, b) in enumerate(items):
            listed.append((off, out, i * rank, rank, b.to(device=device, dtype=dtype)))
        adapter.deltas[key] = _Delta(a_cat.contiguous(), listed)
    return adapter


class LoRAManager:
    """The adapters one runner serves and which rows of the current step each one has."""

    def __init__(self, adapters: Mapping[str, Adapter]) -> None:
        self.adapters = dict(adapters)
        # This step's adapters and their rows (None: every row).
        self.active: list[tuple[Adapter, torch.Tensor | None]] = []

    def set_rows(self, names: list[str | None], device: torch.device) -> bool:
        """The step's row -> adapter (None: the base); False when no row has one."""
        present = {n for n in names if n is not None}
        self.active = []
        if not present:
            return False
        for n in sorted(present):
            ad = self.adapters[n]
            if len(present) == 1 and all(x == n for x in names):
                self.active.append((ad, None))
            else:
                rows = [i for i, x in enumerate(names) if x == n]
                self.active.append((ad, torch.tensor(rows, dtype=torch.int64, device=device)))
        return True

    def clear(self) -> None:
        self.active = []

    def add(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for ad, rows in self.active:
            d = ad.deltas.get(key)
            if d is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            xa = xs @ d.a.T  # [n, sum of ranks]
            delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
            for off, out, r0, r, b in d.parts:
                # PEFT's order: (x A^T) B^T, then the scale.
                delta[:, off : off + out] = (xa[:, r0 : r0 + r] @ b.T) * ad.scale
            if rows is None:
                y = y + delta
            else:
                y = y.index_add(0, rows, delta)
        return y


class LoRALinear(nn.Module):
    """A projection whose output takes the step's adapters' updates."""

    def __init__(self, base: nn.Module, key: tuple[int, str], manager: LoRAManager) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.manager = manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.manager.active:
            return y
        return self.manager.add(self.key, x, y)

    # A packed gate_up projection's SiLU * up epilogue (gpu/model.py, MLP): the base's,
    # for steps no adapter takes part in; the others take the unfused path, whose
    # gate_up output the adapters' updates reach.
    @property
    def gated_inter(self) -> int | None:
        if self.manager.active:
            return None
        return getattr(self.base, "gated_inter", None)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.silu_mul(x)  # type: ignore[no-any-return]


def attach(
    model: nn.Module, cfg: ModelConfig, modules: Mapping[str, str], max_rank: int,
    dtype: torch.dtype, device: torch.device,
) -> LoRAManager:  # fmt: skip
    """Read every adapter and wrap the projections any of them targets."""
    adapters = {
        name: read_adapter(name, path, cfg, max_rank, dtype, device)
        for name, path in modules.items()
    }
    manager = LoRAManager(adapters)
    targeted = {key for ad in adapters.values() for key in ad.deltas}
    for layer, module in targeted:
        owner_name, attr = module.split(".")
        owner = getattr(model.layers[layer], owner_name)
        setattr(owner, attr, LoRALinear(getattr(owner, attr), (layer, module), manager))
    # The compiled all-layer CPU call reads the packed base weights itself: the model runs
    # it only for steps no adapter takes part in.
    model.lora = manager
    return manager
