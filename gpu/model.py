"""Llama-family decoder (Llama, Llama-3 rope scaling, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward pass takes the flattened new tokens of many requests (decode = 1 token,
prefill chunk = many) and returns their final hidden states; the caller picks the rows
it needs logits for.  Projections are fused (qkv, gate_up) so each layer issues few ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.config import ModelConfig
from gpu.cpu_linear import pack_model_linears, pack_weight, packed_linear, packing_available


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D/2]
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # kv_cache: (k, v), or (k, v, k_scale, v_scale) for a quantized cache.
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, *kv_cache[2:])
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, max_positions)
        # Tied checkpoints read the embedding matrix; keeping a single parameter (rather
        # than an alias) keeps state_dict() and assign-loading simple.
        self.lm_head_weight: nn.Parameter | None = None
        self.lm_head_packed: torch.Tensor | None = None  # set by pack_for_cpu()
        # --quantization int8: the logits GEMM reads an int8 copy (gpu/quant_linear.py).
        self.lm_head_int8: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head_weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V]
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(hidden)
        if self.lm_head_packed is not None:
            return packed_linear(hidden, self.lm_head_packed, None).float()
        w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        return F.linear(hidden, w).float()

    def pack_for_cpu(self) -> int:
        """Reorder every projection's weights for oneDNN once (CPU)."""
        dtype = self.embed_tokens.weight.dtype
        if not packing_available(dtype):
            return 0
        n = pack_model_linears(self, dtype)
        if self.lm_head_int8 is not None:
            return n
        w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        self.lm_head_packed = pack_weight(w)
        if self.lm_head_weight is not None:
            self.lm_head_weight = None  # only the packed copy is used from now on
        return n
