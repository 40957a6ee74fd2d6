"""LoRA adapters served beside their base model (vLLM's `--lora-modules name=path`).

A request names an adapter as its `model`; the engine batches requests of every adapter
and of the base model into one step.  Each projection an adapter targets computes
`base(x) + scale * (x A^T) B^T` for that adapter's rows, as PEFT's unmerged `LoraLayer`
does (the scale folded into B; HF transformers + PEFT in float32 is the oracle): the base
GEMM runs once for every row, each adapter present in the step adds its low-rank product
to its own rows.  Weights stay unmerged, so adapters cost their own bytes (rank x (in + out)
per projection) and any number of them shares one copy of the base.

Adapters are PEFT checkpoints (`adapter_config.json` + `adapter_model.safetensors`)
targeting any of q/k/v/o_proj and gate/up/down_proj; everything else PEFT can save
(DoRA, biases, extra trained modules, per-module ranks or alphas, embedding targets) is
refused at start with the reason, not served wrongly.  A step with adapter rows runs every
layer for every row (the last layer's cut to the sampled rows assumes one weight per row),
layer by layer on CPU (not the compiled all-layer call, which reads the base weights
itself) and without CUDA graphs, which are captured for the base alone; a step without
any runs as it would with no adapter loaded.  Under tensor and pipeline parallelism each
rank serves its share of every adapter (_shard; its stage's layers).
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
from gpu.tp import TPGroup, local_config, shard_range
from scheduler.config import LoRAInUse

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
    "lora_bias": False,
}


__all__ = ["LoRAError", "LoRAInUse", "LoRAManager", "attach", "read_adapter", "read_files"]


class LoRAError(ValueError):
    """An adapter that cannot be served with this model (said at start, or to the call
    that loads it)."""


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
    """One adapter's low-rank update of one fused projection: per part it targets, where
    the part's outputs are and its A [rank, in] and B [out, rank]."""

    parts: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # out offset, out size, A, B


@dataclass
class _Stack:
    """The updates of one projection by every adapter of a step, stacked: one GEMM gives
    x A^T for all of them and all parts (columns part by part, each part's adapters side by
    side), then one product per part adds its (x A^T) B^T, each adapter's scale folded into
    its B.  Rows of another adapter (or the base) have their columns masked to zero."""

    a: torch.Tensor  # [columns, in]
    parts: list[tuple[int, int, int, int, torch.Tensor]]  # out offset, size, column, width, B
    owner: torch.Tensor  # [columns]: the step's index of the adapter each column is of
    layout: tuple[tuple[int, int], ...]  # (adapter, rank) per column run: equal layouts mask alike


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    deltas: dict[tuple[int, str], _Delta] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for d in self.deltas.values() for _, _, a, b in d.parts)


AdapterFiles = tuple[dict, dict[str, torch.Tensor]]
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes ~1 KB  # adapter_config.json, the tensors


def read_files(name: str, path: str | Path) -> AdapterFiles:
    """An adapter's files as stored (the I/O alone: a server reads them off its step
    thread, then `read_adapter` checks and converts them between steps)."""
    from safetensors.torch import load_file

    root = Path(path)
    try:
        with open(root / "adapter_config.json", "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)  # bounded: the path comes from a client too
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        conf = json.loads(text)
    except (OSError, ValueError, RecursionError) as e:
        raise LoRAError(
            f"LoRA adapter {name!r}: cannot read {root}/adapter_config.json: {e}"
        ) from e
    if not isinstance(conf, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    weights = root / "adapter_model.safetensors"
    try:
        return conf, load_file(str(weights))
    except Exception as e:  # a missing file, a .bin-only adapter, a torn file
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {weights}: {e}") from e


def read_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
    device: torch.device, files: AdapterFiles | None = None, tp: TPGroup | None = None,
    layers: range | None = None,
) -> Adapter:  # fmt: skip
    """A PEFT LoRA checkpoint, checked against the base model's shapes; with `tp`, this
    rank's share of it (_shard); with `layers` (a pipeline stage's), those layers' updates
    alone, numbered from the stage's first."""
    root = Path(path)
    conf, tensors = files if files is not None else read_files(name, root)
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, default in _UNSUPPORTED.items():
        value = conf.get(key, default)
        if value and value != default:  # (null, [], {} and false say "none" too)
            raise LoRAError(f"LoRA adapter {name!r}: {key}={value!r} is not supported")
    rank, alpha = int(conf.get("r", 0)), float(conf.get("lora_alpha", 0))
    if not 0 < rank <= max_rank:
        raise LoRAError(
            f"LoRA adapter {name!r}: rank {rank} is not in [1, --max-lora-rank {max_rank}]"
        )
    scale = alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)
    weights = root / "adapter_model.safetensors"
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
    parts, local = _parts(cfg), _parts(local_config(cfg, tp))
    per_module: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, target), ab in sorted(found.items()):
        module, part = TARGETS[target]
        _, out, inp = parts[module][part]
        a, b = ab.get("A"), ab.get("B")
        where = f"LoRA adapter {name!r}: layer {layer} {target}"
        if a is None or b is None:
            raise LoRAError(f"{where}: lora_A and lora_B must both be there")
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoRAError(
                f"{where}: A {tuple(a.shape)} / B {tuple(b.shape)}, the model needs "
                f"({rank}, {inp}) / ({out}, {rank})"
            )
        if layers is not None and layer not in layers:
            continue
        if tp is not None:
            a, b = _shard(a, b, f"model.layers.{layer}.{module.split('.')[0]}.{target}", cfg, tp)
        off, out, _ = local[module][part]
        here = layer if layers is None else layer - layers.start
        per_module.setdefault((here, module), []).append((off, out, a, b))
    if not found:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights in {weights}")
    adapter = Adapter(name, str(root), rank, scale)
    for key, items in per_module.items():
        adapter.deltas[key] = _Delta(
            [
                # B scaled in float32, then stored in the model dtype (one rounding).
                (off, out, a.to(device=device, dtype=dtype), (b.float() * scale).to(device, dtype))
                for off, out, a, b in items
            ]
        )
    return adapter


def _shard(
    a: torch.Tensor, b: torch.Tensor, hf_name: str, cfg: ModelConfig, tp: TPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (A, B) of a projection the base shards as its weight is sharded: a
    column-parallel one (q/k/v, gate/up) by B's output rows; a row-parallel one (o, down)
    by A's input columns, so each rank adds its partial product to its partial sum before
    the all-reduce, which adds them up as it adds the base's."""
    rng = shard_range(hf_name + ".weight", cfg, tp)
    if rng is None:
        return a, b
    dim, lo, hi = rng
    return (a, b[lo:hi]) if dim == 0 else (a[:, lo:hi], b)


def _stack(adapters: list[Adapter], key: tuple[int, str]) -> _Stack | None:
    by_part: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for i, ad in enumerate(adapters):
        d = ad.deltas.get(key)
        for off, out, a, b in d.parts if d is not None else ():
            by_part.setdefault(off, []).append((i, out, a, b))
    if not by_part:
        return None
    a_rows, parts, owner, layout, col = [], [], [], [], 0
    for off in sorted(by_part):
        items = by_part[off]
        width = sum(a.shape[0] for _, _, a, _ in items)
        parts.append((off, items[0][1], col, width, torch.cat([b for *_, b in items], dim=1)))
        for i, _, a, _ in items:
            a_rows.append(a)
            owner += [i] * a.shape[0]
            layout.append((i, a.shape[0]))
        col += width
    a_all = torch.cat(a_rows)
    return _Stack(a_all, parts, torch.tensor(owner, device=a_all.device), tuple(layout))


class LoRAManager:
    """The adapters one runner serves, and the current step's: which rows are whose, and
    the stacked updates that reach them.

    A run of at least LONG_RUN rows of one adapter (a prompt chunk; or every row of the
    step) computes its update on its slice of rows alone, from that adapter's own stack.
    The other adapter rows (decodes, short chunks) share one product over every adapter of
    the step, each row's columns of other adapters masked to zero: a few skinny GEMMs for
    all of them rather than a few per adapter, the masked FLOPs small at their row counts.
    """

    LONG_RUN = 16

    def __init__(
        self, adapters: Mapping[str, Adapter], model: nn.Module | None = None,
        cfg: ModelConfig | None = None, max_rank: int = 64, dtype: torch.dtype = torch.float32,
        device: torch.device | None = None, tp: TPGroup | None = None,
        layers: range | None = None,
    ) -> None:  # fmt: skip
        """model ... device: what `load` reads adapters for and wraps (None: a manager over
        `adapters` alone, which `add` needs no model for)."""
        self.adapters = dict(adapters)
        self._model, self._cfg, self._max_rank = model, cfg, max_rank
        self._dtype, self._device = dtype, device or torch.device("cpu")
        # cfg is the whole model's; each adapter is cut to this rank's share: its tensor
        # slice, its pipeline stage's layers.
        self._tp, self._layers = tp, layers
        # Each adapter's own stacks (its runs'), made once; the stacks of sets of adapters
        # that shared a step (copies of their weights), kept while they fit in as many
        # bytes as the adapters themselves, least recently used out first.
        self._own = {n: self._build((n,)) for n in self.adapters}
        self._stacks: dict[tuple[str, ...], dict[tuple[int, str], _Stack | None]] = {}
        self._stack_bytes: dict[tuple[str, ...], int] = {}
        self.max_stack_bytes = sum(ad.nbytes for ad in self.adapters.values())
        self.active = False
        # This step's: long runs (first row, end, their adapter's stacks); the short rows'
        # shared stacks, the rows (a range, or indices) and their mask per stack layout.
        self._runs: list[tuple[int, int, dict[tuple[int, str], _Stack | None]]] = []
        self._shared: dict[tuple[int, str], _Stack | None] = {}
        self._rows: slice | torch.Tensor | None = None
        self._owner: torch.Tensor | None = None
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}

    def load(self, name: str, path: str | Path, files: AdapterFiles | None = None) -> Adapter:
        """Read an adapter (`files`: as read_files read them already) and serve it: the
        projections it targets that no adapter did yet are wrapped.  Between steps only
        (the runner's executor thread)."""
        assert self._model is not None and self._cfg is not None
        if name in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        ad = read_adapter(
            name, path, self._cfg, self._max_rank, self._dtype, self._device, files, self._tp,
            self._layers,
        )  # fmt: skip
        for layer, module in ad.deltas:
            owner_name, attr = module.split(".")
            owner = getattr(self._model.layers[layer], owner_name)
            if not isinstance(getattr(owner, attr), LoRALinear):
                setattr(owner, attr, LoRALinear(getattr(owner, attr), (layer, module), self))
        self.adapters[name] = ad
        self._own[name] = self._build((name,))
        self.max_stack_bytes += ad.nbytes
        return ad

    def unload(self, name: str) -> None:
        """Stop serving an adapter (its wrapped projections stay, passing the base
        through).  Between steps only, and once no request that runs it is registered."""
        ad = self.adapters.pop(name)
        del self._own[name]
        self.max_stack_bytes -= ad.nbytes
        for names in [k for k in self._stacks if name in k]:
            del self._stacks[names], self._stack_bytes[names]

    def _build(self, names: tuple[str, ...]) -> dict[tuple[int, str], _Stack | None]:
        ads = [self.adapters[n] for n in names]
        return {k: _stack(ads, k) for k in {k for ad in ads for k in ad.deltas}}

    def _stacks_of(self, names: tuple[str, ...]) -> dict[tuple[int, str], _Stack | None]:
        if len(names) == 1:
            return self._own[names[0]]
        stacks = self._stacks.pop(names, None)
        if stacks is None:
            stacks = self._build(names)
            self._stack_bytes[names] = sum(self.adapters[n].nbytes for n in names)
            while self._stacks and (
                sum(self._stack_bytes[k] for k in self._stacks) + self._stack_bytes[names]
                > self.max_stack_bytes
            ):
                oldest = next(iter(self._stacks))
                del self._stacks[oldest], self._stack_bytes[oldest]
        self._stacks[names] = stacks  # most recently used last
        return stacks

    def set_rows(self, spans: list[tuple[str | None, int]], device: torch.device) -> bool:
        """The step's rows, in order, as spans of (adapter, or None for the base; rows):
        a request's query rows are one span, so the work is per request, not per row.
        False when no row has an adapter."""
        self.clear()
        merged: list[list] = []  # neighbouring spans of one adapter are one run
        for name, n in spans:
            if merged and merged[-1][0] == name:
                merged[-1][1] += n
            else:
                merged.append([name, n])
        total = sum(n for _, n in merged)
        runs, short, short_names = [], [], []
        row = 0
        for name, n in merged:
            if name is not None:
                if n >= self.LONG_RUN or n == total:
                    runs.append((row, row + n, self._stacks_of((name,))))
                else:
                    short += range(row, row + n)
                    short_names += [name] * n
            row += n
        if not runs and not short:
            return False
        self.active = True
        self._runs = runs
        if short:
            present = tuple(sorted(set(short_names)))
            index = {n: k for k, n in enumerate(present)}
            self._shared = self._stacks_of(present)
            lo, hi = short[0], short[-1] + 1
            # One range (the decode rows lead the step) is a slice; else the rows gathered.
            if hi - lo == len(short):
                self._rows = slice(lo, hi)
            else:
                self._rows = torch.tensor(short, dtype=torch.int64, device=device)
            owner = [index[n] for n in short_names]
            self._owner = torch.tensor(owner, dtype=torch.int64, device=device)
        return True

    def clear(self) -> None:
        self.active, self._runs, self._shared = False, [], {}
        self._rows, self._owner, self._masks = None, None, {}

    def add(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus the step's adapters' updates, in place."""
        for lo, hi, stacks in self._runs:
            s = stacks.get(key)
            if s is not None:
                xa = x[lo:hi] @ s.a.T
                for off, out, col, width, b in s.parts:
                    y[lo:hi, off : off + out].addmm_(xa[:, col : col + width], b.T)
        s = self._shared.get(key)
        if s is None:
            return y
        rows, owner = self._rows, self._owner
        assert rows is not None and owner is not None
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        xa = xs @ s.a.T  # [rows, columns]
        mask = self._masks.get(s.layout)
        if mask is None:  # the same for every projection of this layout in the step
            mask = (owner[:, None] == s.owner[None, :]).to(xa.dtype)
            self._masks[s.layout] = mask
        xa.mul_(mask)
        for off, out, col, width, b in s.parts:
            if isinstance(rows, slice):
                y[rows, off : off + out].addmm_(xa[:, col : col + width], b.T)
            else:
                y[:, off : off + out].index_add_(0, rows, xa[:, col : col + width] @ b.T)
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
    """Read every adapter and wrap the projections any of them targets (none may be given
    yet: adapters loaded while serving come through `LoRAManager.load`)."""
    pp = getattr(model, "pp", None)
    layers = None if pp is None else range(pp.start, pp.stop)
    manager = LoRAManager(
        {}, model, cfg, max_rank, dtype, device, getattr(model, "tp", None), layers
    )
    for name, path in modules.items():
        manager.load(name, path)
    # The compiled all-layer CPU call reads the packed base weights itself: the model runs
    # it only for steps no adapter takes part in.
    model.lora = manager
    return manager
