"""Attention in plain torch ops: the portable path (any device torch runs on) and the
references every kernel is held to.  The CPU backend (gpu/cpu/attention.py) builds on it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.kv_quant import dequantize, write_quantized


def write_kv_reference(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] (quantized)
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each new token's K/V at its flat slot (block * block_size + offset);
    quantized caches store values and per-(token, head) scales."""
    if k_scale is not None and v_scale is not None:
        write_quantized(k, k_cache, k_scale, slot_mapping)
        write_quantized(v, v_cache, v_scale, slot_mapping)
        return
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, nb] int
    scales: torch.Tensor | None = None,  # [num_blocks, block_size, kv_heads] (quantized)
    dtype: torch.dtype | None = None,  # what quantized values are dequantized to
) -> torch.Tensor:  # [B, nb * block_size, kv_heads, head_dim]
    """The blocks of each table row, dense; quantized blocks are dequantized as they are
    gathered (only the blocks a step reads, never the whole cache)."""
    b, nb = block_tables.shape
    idx = block_tables.reshape(-1).long()
    gathered = cache.index_select(0, idx)
    if scales is not None:
        assert dtype is not None
        gathered = dequantize(gathered, scales.index_select(0, idx), dtype)
    return gathered.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, kv_heads]
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One sequence at a time, straight from the definition; slow, for tests."""
    if k_scale is not None and v_scale is not None:
        k_cache = dequantize(k_cache, k_scale, torch.float32)
        v_cache = dequantize(v_cache, v_scale, torch.float32)
    out = torch.empty_like(q)
    bs = meta.block_size
    qsl = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        nb = (seq_len + bs - 1) // bs
        blocks = meta.block_tables[i, :nb].long()
        kc = k_cache[blocks].reshape(nb * bs, *k_cache.shape[2:])[:seq_len].float()
        vc = v_cache[blocks].reshape(nb * bs, *v_cache.shape[2:])[:seq_len].float()
        qi = q[start:end].float()  # [L, H, D]
        group = q.shape[1] // kc.shape[1]
        kc = kc.repeat_interleave(group, dim=1)  # [S, H, D]
        vc = vc.repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", qi, kc) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [L, S]
        if meta.tree_bits is not None:
            mask &= tree_mask(meta.tree_bits[start:end], seq_len - (end - start), seq_len)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, vc).to(q.dtype)
    return out


def tree_mask(bits: torch.Tensor, ctx: int, seq_len: int) -> torch.Tensor:  # [L, S] bool
    """Which keys each of a chunk's rows may see under its tree bits (AttentionMetadata):
    every key before the chunk, chunk row j where bit j is set, and past 64 rows all."""
    rel = torch.arange(seq_len, device=bits.device) - ctx
    in_bits = (rel >= 0) & (rel < 64)
    seen = (bits[:, None] >> rel.clamp(0, 63)[None, :]) & 1
    return ~in_bits[None, :] | seen.bool()


class TorchAttentionBackend(AttentionBackend):
    """Decode batched over a gathered context, one SDPA call per prefill chunk.  The
    steps are hooks (`_write_kv`, `_empty_out`, `_decode`, `_prefill_all`) that the CPU
    backend replaces with its compiled kernels."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is not None:  # (only the piecewise CUDA graphs pass one, on Triton)
            return out.copy_(self.forward(q, k, v, k_cache, v_cache, meta, k_scale, v_scale))
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = self._empty_out(q)
        nd = meta.num_decodes
        sc = (k_scale, v_scale)
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta, sc, out=out[:nd])
        if meta.num_seqs > nd:
            self._prefill_all(q, k, v, k_cache, v_cache, meta, out, sc)
        return out

    def _write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        write_kv_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)

    def _empty_out(self, q: torch.Tensor) -> torch.Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def _prefill_all(
        self,
        q: torch.Tensor,  # [num_tokens, H, D], the whole step
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        sc: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> None:
        """Every prefill chunk of the step (the requests after the decodes), into `out`,
        one SDPA call each."""
        start = meta.num_decodes  # decodes are one token each
        for i in range(meta.num_decodes, meta.num_seqs):
            start = self._prefill_into(q, k, v, k_cache, v_cache, meta, out, sc, i, start)

    def _prefill_into(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        sc: tuple[torch.Tensor | None, torch.Tensor | None],
        i: int,
        start: int,
    ) -> int:
        """Chunk i (its rows from `start`) by one SDPA call, into `out`; its end row."""
        end = start + meta.query_lens_cpu[i]
        out[start:end] = self._prefill(
            q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i, sc,
            None if meta.tree_bits is None else meta.tree_bits[start:end],
        )  # fmt: skip
        return end

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sc: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b = q.shape[0]
        bs = meta.block_size
        max_len = max(meta.seq_lens_cpu[:b])
        nb = (max_len + bs - 1) // bs
        tables = meta.block_tables[:b, :nb]
        kv_heads, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        kc = _gather_context(k_cache, tables, sc[0], q.dtype).transpose(1, 2)  # [B, Hkv, S, D]
        vc = _gather_context(v_cache, tables, sc[1], q.dtype).transpose(1, 2)
        qg = q.view(b, kv_heads, group, d)  # [B, Hkv, G, D]
        scores = torch.matmul(qg, kc.transpose(2, 3)).float() * self.scale  # [B, Hkv, G, S]
        s = scores.shape[-1]
        valid = torch.arange(s, device=q.device)[None, :] < meta.seq_lens[:b, None]  # [B, S]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(vc.dtype)
        o = torch.matmul(probs, vc).view(b, self.num_heads, d)  # [B, H, D]
        return o if out is None else out.copy_(o)

    def _prefill(
        self,
        q: torch.Tensor,  # [L, H, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        sc: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        tree_bits: torch.Tensor | None = None,  # [L] this chunk's (AttentionMetadata)
    ) -> torch.Tensor:
        qlen = q.shape[0]
        seq_len = meta.seq_lens_cpu[i]
        ctx = seq_len - qlen
        group = self.num_heads // self.num_kv_heads
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if ctx == 0 and sc[0] is None and tree_bits is None:
            # Nothing cached before this chunk: attend over the fresh K/V directly.  (A
            # quantized cache reads the stored values, as every later step and the
            # kernels do.)
            kt = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vt = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=self.scale, enable_gqa=group > 1
            )
        else:
            bs = meta.block_size
            nb = (seq_len + bs - 1) // bs
            table = meta.block_tables[i : i + 1, :nb]
            kt = _gather_context(k_cache, table, sc[0], q.dtype)[:, :seq_len].transpose(1, 2)
            vt = _gather_context(v_cache, table, sc[1], q.dtype)[:, :seq_len].transpose(1, 2)
            # Query j sits at position ctx + j and sees keys 0..ctx + j (bottom-right causal).
            q_pos = torch.arange(ctx, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            if tree_bits is not None:
                mask &= tree_mask(tree_bits, ctx, seq_len)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=self.scale, enable_gqa=group > 1
            )
        return o.squeeze(0).transpose(0, 1)  # [L, H, D]
