"""Llama-family decoder (Llama, Llama-3 rope scaling, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward pass takes the flattened new tokens of many requests (decode = 1 token,
prefill chunk = many) and returns their final hidden states; the caller picks the rows
it needs logits for.  Projections are fused (qkv, gate_up) so each layer issues few ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.config import ModelConfig
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.layer_stack import LayerStack
from gpu.cpu.linear import (
    PackedLinear,
    Scratch,
    decode_on_amx,
    linears_packable,
    pack_head,
    pack_model_linears,
)
from gpu.pp import PPStage
from gpu.tp import TPGroup, vocab_parallel_embed
from scheduler import envs

if TYPE_CHECKING:
    from gpu.lora import LoRAManager


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Triton's fused RMSNorm, set by CausalLM.use_triton_elementwise()
        self.triton: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and x.dtype != torch.float32 and x.dim() == 2:
            # One launch instead of torch's seven in bf16/fp16, same op order (normalise
            # in float32, round, then scale); float32's F.rms_norm is one launch already.
            return self.triton(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused op; in float32 it computes what transformers computes.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: transformers' op order (normalise in float32, round, then
        # scale) so bf16 runs round where the reference rounds.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # Built on the meta device (the loader's first pass, which rebuilds this module
            # for real): shapes only.  Arithmetic on meta tensors runs torch's Python
            # references, whose first call imports torch._dynamo (~0.9 s of a start-up).
            shape = (max_positions, config.head_dim // 2)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
            return
        inv_freq = config.inv_freq()  # [D/2] float32
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of a step's positions, [T, 1, D/2]; looked up once per forward
        and shared by every layer."""
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # == x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), term for term.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """config holds this rank's head counts under tensor parallelism (gpu/tp.py)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp  # row-parallel o_proj: partial sums, reduced over ranks
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend = backend
        # Triton's in-place rotary, set by CausalLM.use_triton_elementwise()
        self.triton_rope: Callable[..., None] | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, ...],  # cos, sin: [T, 1, D/2]; fused: positions, tables
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # the last layer: the rows read after it
    ) -> torch.Tensor:  # [T, hidden], or [len(rows), hidden]
        q, k, v = self.qkv(x, rope)
        # kv_cache: (k, v), or (k, v, k_scale, v_scale) for a quantized cache.
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, *kv_cache[2:])
        o = o.reshape(x.shape[0], self.q_size)
        if rows is not None:  # every row's K/V is stored: the rest goes on for `rows` only
            o = o.index_select(0, rows)
        return self.output(o)

    def qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, H, D] each, rotated
        """What comes before the attention: the projections, q/k norms and rotary."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.triton_rope is not None:  # (positions, cos table, sin table), in place
            positions, cos_table, sin_table = rope
            self.triton_rope(q, k, cos_table, sin_table, positions)
        elif len(rope) == 3:  # the fused CPU path: (positions, cos table, sin table)
            cpu_kernels.rope_(q, k, *rope)
        else:
            cos, sin = rope
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:  # [T, q_size] -> [T, hidden]
        out = self.o_proj(o)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)
        self.fused = False  # SiLU(gate) * up in one compiled pass (CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "gated_inter", None) is not None:
            # Packed for the vdpbf16ps kernel (pack_model_linears, where the fused kernels
            # are allowed): SiLU * up as the GEMM's epilogue, the same bits as silu_mul.
            out = self.down_proj(self.gate_up_proj.silu_mul(x))
            return out if self.tp is None else self.tp.all_reduce(out)
        gate_up = self.gate_up_proj(x)
        if self.fused:
            out = self.down_proj(cpu_kernels.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.inter, dim=-1)  # [T, inter] each
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # see Attention.forward
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, rows)
        x = (x if rows is None else x.index_select(0, rows)) + a
        return x + self.mlp(self.post_attention_layernorm(x))

    # The layer split around its attention, for the piecewise CUDA graphs
    # (gpu/cuda_graphs.py): forward == after_attention(x, attention(*before_attention(x))).
    def before_attention(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.qkv(self.input_layernorm(x), rope)

    def after_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.output(o)  # o: [T, q_size], the attention's output
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        h: torch.Tensor,  # [T, hidden]: input_layernorm(residual), computed by the caller
        residual: torch.Tensor,  # [T, hidden], updated in place
        rope: tuple[torch.Tensor, ...],
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # see Attention.forward
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU path: each residual add is fused into the norm that follows it, so the
        layer returns its MLP output for the next layer's (or the final) norm to add, and
        the residual (`rows`' rows of it where given)."""
        a = self.self_attn(h, rope, kv_cache, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        norm = self.post_attention_layernorm
        return self.mlp(cpu_kernels.add_rms_norm(a, residual, norm.weight, norm.eps)), residual


def _carried_rows(keep: list[int] | None, x: torch.Tensor) -> torch.Tensor | None:
    """The rows the Python paths carry past the last layer's attention (see
    CausalLM.forward), or None for all.  A step that reads no row still carries one (not
    every kernel takes an empty product); forward returns none."""
    if keep is None or len(keep) >= x.shape[0]:
        return None
    return torch.tensor(keep or [0], dtype=torch.int64).to(x.device)


class CausalLM(nn.Module):
    """Under tensor parallelism `config` is this rank's share (gpu.tp.local_config) and
    `tp` its group: the embedding and lm_head hold a vocabulary slice each."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        # Pipeline parallelism: `config.num_layers` is this stage's share; the embedding is
        # held where it is read (stage 0, and the last stage when the lm_head is tied to
        # it), elsewhere it has no rows.
        self.pp = pp
        vocab = config.vocab_size
        if pp is not None and not (pp.first or (pp.last and config.tie_word_embeddings)):
            vocab = 0
        # Its weight given, not drawn: the checkpoint overwrites it, and nn.Embedding's own
        # normal_ init imports torch._dynamo (~0.9 s of every process's start-up).
        self.embed_tokens = nn.Embedding(
            vocab, config.hidden_size, _weight=torch.empty(vocab, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, tp) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, max_positions)
        self.fused = False  # set by fuse_for_cpu()
        self.layer_stack: LayerStack | None = None  # set by fuse_for_cpu()
        self.lora: LoRAManager | None = None  # set by gpu.lora.attach
        if backend.name == "triton" and envs.PAGESTREAM_TRITON_ELEMENTWISE:
            self.use_triton_elementwise()
        # Tied checkpoints read the embedding matrix; keeping a single parameter (rather
        # than an alias) keeps state_dict() and assign-loading simple.
        self.lm_head_weight: nn.Parameter | None = None
        self.lm_head_packed: PackedLinear | None = None  # set by pack_for_cpu()
        # --quantization int8: the logits GEMM reads an int8 copy (gpu/quant_linear.py).
        self.lm_head_int8: nn.Module | None = None
        if not config.tie_word_embeddings and (pp is None or pp.last):
            self.lm_head_weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        # A sequence classifier's head (a few rows; every pipeline stage reads it).
        self.score_weight: nn.Parameter | None = None
        if config.num_labels:
            self.score_weight = nn.Parameter(torch.empty(config.num_labels, config.hidden_size))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        keep: list[int] | None = None,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        """keep: the rows the caller reads (ascending), or None; then only those rows'
        [len(keep), hidden] come back, in that order, where keep is not every row.  Every
        row's K/V is still stored in every layer, but past the last layer's attention
        nothing of one row reaches another, so the rest of that layer (o_proj, the MLP:
        ~1/num_layers of a prompt's FLOPs) runs for the kept rows only.  The CPU layer
        stack also attends for them only."""
        return self.forward_layers(self.embed_input(input_ids), positions, kv_caches, meta, keep)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp is None:
            # Fused CPU path: a plain row copy, not an ATen index_select (an OpenMP region)
            x = cpu_kernels.gather_rows(self.embed_tokens.weight, input_ids) if self.fused else None
            if x is None:
                x = self.embed(input_ids)
            return x
        return vocab_parallel_embed(self.embed_tokens.weight, input_ids, self.tp)

    def forward_layers(
        self,
        x: torch.Tensor,  # [T, hidden]: the embeddings, or the previous stage's output
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        keep: list[int] | None = None,
    ) -> torch.Tensor:
        """This model's layers (a pipeline stage's: then `x` may come from the previous
        stage), then the final norm; a stage that is not the last returns the residual
        stream after its last layer instead, every row (what the next stage takes)."""
        last_stage = self.pp is None or self.pp.last
        if self.fused:
            h = self._forward_fused(x, positions, kv_caches, meta, keep, last_stage)
        else:
            rows = _carried_rows(keep, x) if last_stage else None
            rope = self.rope(positions, x.dtype)
            last = len(self.layers) - 1
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x = layer(x, rope, kv, meta, rows if i == last else None)
            h = self.norm(x) if last_stage else x
        return h[:0] if keep == [] and last_stage else h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # the generic (GPU) path
        return self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What every layer's rotary takes for these positions (see Attention.qkv)."""
        if self.layers[0].self_attn.triton_rope is not None:
            return (positions, self.rotary.cos, self.rotary.sin)
        return self.rotary.tables(positions, dtype)

    def _forward_fused(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        keep: list[int] | None = None,
        last_stage: bool = True,
    ) -> torch.Tensor:
        # Every layer in one compiled call, which reads the base weights itself: not for a
        # step whose rows run LoRA adapters (gpu/lora.py), whose updates come per layer.
        if self.layer_stack is not None and not (self.lora is not None and self.lora.active):
            h = self.layer_stack.run(residual, positions, kv_caches, meta, keep)
            if h is not None:
                return h
        rows = _carried_rows(keep, residual) if last_stage else None
        rope = (positions, self.rotary.cos, self.rotary.sin)
        norms: list[RMSNorm | None] = [layer.input_layernorm for layer in self.layers[1:]]
        norms.append(self.norm if last_stage else None)
        first = self.layers[0].input_layernorm
        h = cpu_kernels.add_rms_norm(None, residual, first.weight, first.eps)
        last = len(self.layers) - 1
        for i, (layer, kv, norm) in enumerate(zip(self.layers, kv_caches, norms, strict=True)):
            m, residual = layer.forward_fused(
                h, residual, rope, kv, meta, rows if i == last else None
            )
            if norm is None:  # a pipeline stage before the last: the residual stream goes on
                return residual + m
            h = cpu_kernels.add_rms_norm(m, residual, norm.weight, norm.eps)
        return h

    def use_triton_elementwise(self) -> None:
        """With the Triton attention backend (a GPU, or the interpreter in tests): RMSNorm
        and rotary as one Triton launch each (gpu/kernels/norm_rope.py) instead of torch's
        chains of small ops, where an eager decode step's time goes to launches, not to the
        device (docs/PERFORMANCE.md, "NVIDIA H200").  The rotary kernel
        rounds where torch rounds (same bits); RMSNorm's float32 path stays torch's one op.
        PAGESTREAM_TRITON_ELEMENTWISE=0 keeps the torch ops."""
        from gpu.kernels import norm_rope  # Triton only where its backend runs

        d = self.config.head_dim
        pow2 = d % 2 == 0 and d & (d - 1) == 0  # what the rotary kernel takes
        norms = [self.norm]
        for layer in self.layers:
            layer.self_attn.triton_rope = norm_rope.apply_rotary if pow2 else None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        for norm in norms:
            norm.triton = norm_rope.rms_norm

    def fuse_for_cpu(self) -> bool:
        """Run the elementwise chain (residual adds + RMSNorm, rotary, SiLU * up) through
        the compiled CPU kernels; False (the torch ops stay) where they cannot."""
        dtype = self.embed_tokens.weight.dtype
        ok = (
            cpu_kernels.fused_enabled()
            and dtype in (torch.float32, torch.bfloat16)
            and self.embed_tokens.weight.device.type == "cpu"
            and cpu_kernels.available()
        )
        self.fused = ok
        for layer in self.layers:
            layer.mlp.fused = ok
        self.layer_stack = LayerStack.build(self) if ok else None
        return ok

    def compute_logits(
        self, hidden: torch.Tensor, float32: bool = True
    ) -> torch.Tensor:  # [R, hidden] -> [R, V]
        """float32=False keeps the model dtype: enough for a batch that only takes argmaxes
        (widening bf16 is exact, so the argmax is the same) and spares a [R, V] copy."""
        if self.lm_head_int8 is not None:
            logits = self.lm_head_int8(hidden)  # float32 straight out of the int8 kernel
        elif self.lm_head_packed is not None:
            logits = self.lm_head_packed(hidden)
        else:
            w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
            logits = F.linear(hidden, w)
        logits = logits.float() if float32 else logits
        # Vocab-parallel: every rank gets the whole row (each samples the same token from
        # the same generator state; rank 0's is the one returned).
        return logits if self.tp is None else self.tp.gather_last_dim(logits)

    def pack_for_cpu(self) -> int:
        """Pack every projection's weights once for the CPU kernel that runs it
        (gpu/cpu/linear.py); returns how many linears were swapped."""
        dtype = self.embed_tokens.weight.dtype
        if not linears_packable(dtype):
            return 0
        w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        has_head = self.pp is None or self.pp.last  # a pipeline stage before the last has none
        head = 0 if self.lm_head_int8 is not None or not has_head else w.nbytes
        amx = decode_on_amx(self, dtype, head)
        n = pack_model_linears(self, dtype, amx)
        scratch = Scratch()
        for layer in self.layers:
            if isinstance(layer.mlp.gate_up_proj, PackedLinear):
                layer.mlp.gate_up_proj.scratch = scratch  # each dead once SiLU * up ran
        if self.lm_head_int8 is not None or not has_head:
            return n
        self.lm_head_packed = pack_head(w, amx)
        if self.lm_head_weight is not None:
            self.lm_head_weight = None  # only the packed copy is used from now on
        return n
