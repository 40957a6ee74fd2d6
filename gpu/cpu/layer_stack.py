"""A step's decoder layers in one compiled call (cpu/kernels/layer_stack.cpp).

The fused CPU path (gpu/model.py) crosses from Python into the compiled kernels ~9 times
a layer; each crossing is interpreter work while the other core's OpenMP thread waits,
and in the server every return from C takes the GIL back from the event loop.
`LayerStack.run` makes the same kernel calls, with the same arguments in the same
order, from C: the same bits, one crossing a step.

It takes a model only where every projection runs on one of pagestream's packed kernels
(vdpbf16ps or AMX in bf16, AMX up to AMX_MAX_ROWS rows under
PAGESTREAM_PREFILL_GEMM=onednn; the AVX-512 or AVX2 sgemm in float32) with the gate_up's
SiLU·up as its epilogue, attention on the compiled kernels, an unquantized K/V cache, no
per-head q/k norm and no tensor or pipeline parallelism; and a step with prompt rows only
where the backend gives every chunk to the compiled prefill kernel (not SDPA).  Anything
else keeps the Python path.  PAGESTREAM_LAYER_STACK=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from gpu.attention.base import AttentionMetadata
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.attention import CpuAttentionBackend
from gpu.cpu.kernels import bindings
from gpu.cpu.linear import PackedLinear, amx_max_rows
from scheduler import envs

log = logging.getLogger(__name__)

# entry_points.h's structures (bindings.py derives their fields from the header).
_Layer = bindings.structure("PsLayer")
_Step = bindings.structure("PsStep")


# The packed kernels a stack runs on (layer_stack.cpp's Step::kind).
KINDS = {"dpbf16": 0, "sgemm512": 1, "sgemm": 2, "amx": 3, "sgemm_w16": 4}


def linear_kind(lin: nn.Module) -> str | None:
    """The packed kernel of a stack's projection, or None (a quantized layer, oneDNN...)."""
    return lin.strategy.kernel if isinstance(lin, PackedLinear) else None


def enabled() -> bool:
    return envs.PAGESTREAM_LAYER_STACK


class LayerStack:
    def __init__(self, model: nn.Module, kind: str) -> None:
        self.model = model
        self.kind = KINDS[kind]
        self.amx = kind == "amx"
        # PackedLinear.forward leaves AMX past this many rows.
        self.max_rows = amx_max_rows() if self.amx else None
        cfg = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter = cfg.intermediate_size
        backend = model.layers[0].self_attn.backend
        self.scale = backend.scale
        # Prompt chunks too, where the backend would give every chunk to the compiled
        # prefill kernel (not SDPA: AMX bf16 long chunks, PAGESTREAM_PREFILL_ATTENTION).
        self.prefill = backend.sdpa_min_rows(self.dtype) is None
        self._kv: list[tuple[torch.Tensor, ...]] | None = None
        self._layers: ctypes.Array[_Layer] | None = None
        # Each layer's packed projections as built: a model serving LoRA adapters wraps
        # them afterwards (gpu/lora.py) and runs the stack only for steps without adapter
        # rows, which are the base weights' alone.
        self.projections = [
            (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj)
            for ly in model.layers
        ]
        lib = cpu_kernels.load()
        assert lib is not None
        self._fn = lib.ps_layer_stack  # typed by bindings.declare

    @classmethod
    def build(cls, model: nn.Module) -> LayerStack | None:
        """A stack for `model` (packed and fused for the CPU), or None where it does not
        take it (see the module's docstring)."""
        if not enabled() or getattr(model, "tp", None) is not None or getattr(model, "pp", None):
            return None
        lib = cpu_kernels.load()
        if lib is None or not hasattr(lib, "ps_layer_stack"):
            return None
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        if not cpu_kernels.supports(dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            return None
        cos, sin = model.rotary.cos, model.rotary.sin
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()):
            return None
        kinds = set()
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (
                attn.qk_norm
                or attn.tp is not None
                or mlp.tp is not None
                or type(attn.backend) is not CpuAttentionBackend
                or attn.o_proj.bias is not None
                or getattr(mlp.gate_up_proj, "gated_inter", None) is None
                or mlp.down_proj.bias is not None
            ):
                return None
            kinds |= {linear_kind(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                mlp.down_proj)}  # fmt: skip
        if len(kinds) != 1 or None in kinds:
            return None
        kind = kinds.pop()
        if (kind in ("dpbf16", "amx")) != (dtype == torch.bfloat16):
            return None
        log.info("CPU: a step runs its %d decoder layers in one compiled call", cfg.num_layers)
        return cls(model, kind)

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> ctypes.Array[_Layer]:
        """Every layer's pointers (weights and cache), built again when the cache changes."""
        if self._layers is not None and kv_caches is self._kv:
            return self._layers
        layers = (_Layer * len(self.model.layers))()
        for row, layer, kv, (qkv, o, gate_up, down) in zip(
            layers, self.model.layers, kv_caches, self.projections, strict=True
        ):
            row.in_norm = layer.input_layernorm.weight.data_ptr()
            row.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            row.in_eps = layer.input_layernorm.eps
            row.post_eps = layer.post_attention_layernorm.eps
            row.qkv = self._weight(qkv)
            bias = qkv.strategy.bias_f32
            row.qkv_bias = None if bias is None else bias.data_ptr()
            row.o = self._weight(o)
            row.gate_up = self._weight(gate_up)
            row.down = self._weight(down)
            row.k_cache, row.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
        self._kv, self._layers = kv_caches, layers
        return layers

    def _weight(self, lin: PackedLinear) -> int:
        """Where the step's kernel reads `lin`'s weight (AMX: its own copy)."""
        w = lin.strategy.stack_weight()
        assert w is not None
        return w.data_ptr()

    def _takes(self, residual: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> bool:
        t = residual.shape[0]
        if not (t > 0 and meta.num_seqs > 0 and meta.num_tokens == t):
            return False
        if meta.num_decodes < meta.num_seqs and not self.prefill:
            return False
        if meta.tree_bits is not None:  # tree attention: the per-layer path applies it
            return False
        if self.max_rows is not None and t > self.max_rows:
            return False
        if residual.dtype != self.dtype or residual.stride(1) != 1:
            return False
        kv = kv_caches[0]
        return (
            len(kv) == 2
            and kv[0].dtype == self.dtype
            and kv[0].is_contiguous()
            and kv[1].is_contiguous()
            and meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
            and meta.query_start_loc.dtype == torch.int32
            and meta.slot_mapping.dtype == torch.int64
        )

    def run(
        self,
        residual: torch.Tensor,  # [T, hidden], the embeddings; updated in place
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        keep: list[int] | None = None,
    ) -> torch.Tensor | None:
        """The final norm's output [T, hidden], as the fused path returns it, or with
        `keep` (see CausalLM.forward) only those rows' [len(keep), hidden]; None (nothing
        done) for a step the stack does not take."""
        if not self._takes(residual, kv_caches, meta):
            return None
        t = residual.shape[0]
        pruned = self._pruned(keep, meta)
        if pruned is None and keep is not None and len(keep) < t:
            return None  # rows it cannot attend for alone: the Python path cuts them later
        model = self.model
        layers = self._layer_table(kv_caches)
        pos = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        n = meta.num_seqs
        tables = meta.block_tables[:n].contiguous()
        lens = meta.seq_lens[:n].contiguous()
        qsl = meta.query_start_loc[: n + 1].contiguous()
        rows = t if pruned is None else len(keep or ())
        out = cpu_kernels.empty_rows(rows, self.hidden, self.dtype)  # the lm_head's input
        step = _Step(
            self.kind, t, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
            kv_caches[0][0].shape[1], torch.get_num_threads(), self.scale, model.norm.eps,
            pos.data_ptr(), model.rotary.cos.data_ptr(), model.rotary.sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            qsl.data_ptr(), n, meta.num_decodes, residual.data_ptr(), residual.stride(0),
            model.norm.weight.data_ptr(), out.data_ptr(), None, -1,
        )  # fmt: skip
        if pruned is not None:
            kept_rows, ktables, klens, kqsl = pruned
            step.keep, step.nkeep = kept_rows.data_ptr(), kept_rows.shape[0]
            step.ktables, step.klens = ktables.data_ptr(), klens.data_ptr()
            step.kqsl, step.kseqs = kqsl.data_ptr(), klens.shape[0]
        failed = self._fn(ctypes.byref(step), layers, len(layers))
        if failed:
            raise RuntimeError(f"layer stack: layer {failed - 1}'s gated product was refused")
        return out

    @staticmethod
    def _pruned(keep: list[int] | None, meta: AttentionMetadata) -> tuple[torch.Tensor, ...] | None:
        """The last layer's view of the kept rows (rows, tables, lens, query starts), or
        None: where `keep` keeps every row, or is not every decode row plus, for some of
        the prompt chunks, each one's last row (a row inside a chunk would need the
        chunk's other rows as queries too)."""
        t, nd = meta.num_tokens, meta.num_decodes
        if keep is None or len(keep) >= t or keep[:nd] != list(range(nd)):
            return None
        qsl = meta.query_start_loc.tolist()
        ends = {qsl[i + 1] - 1: i for i in range(nd, meta.num_seqs)}
        seqs = list(range(nd))
        for row in keep[nd:]:
            i = ends.get(row)
            if i is None or (seqs and i <= seqs[-1]):
                return None
            seqs.append(i)
        idx = torch.tensor(seqs, dtype=torch.int64)
        return (
            torch.tensor(keep, dtype=torch.int64),
            meta.block_tables.index_select(0, idx).contiguous(),
            meta.seq_lens.index_select(0, idx).contiguous(),
            torch.arange(len(seqs) + 1, dtype=torch.int32),
        )
