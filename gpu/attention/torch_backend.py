"""Attention in plain torch ops: the CPU path and the reference the kernels are held to."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.cpu import features as cpu_features
from gpu.cpu import kernels as cpu_kernels
from gpu.kv_quant import dequantize, write_quantized
from scheduler import envs


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
    """Decode and prefill through the compiled CPU kernels when they are there; else
    decode batched over a gathered context and one SDPA call per prefill chunk."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernel_ok: dict[torch.dtype, bool] = {}
        self._prefill_choice = envs.PAGESTREAM_PREFILL_ATTENTION

    def _use_cpu_kernel(self, q: torch.Tensor) -> bool:
        ok = self._kernel_ok.get(q.dtype)
        if ok is None:
            ok = q.device.type == "cpu" and cpu_kernels.supports(
                q.dtype, self.num_heads, self.num_kv_heads, self.head_dim
            )
            self._kernel_ok[q.dtype] = ok
        return ok

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
        kernel = self._use_cpu_kernel(q)
        # One compiled call for the K/V store where it takes these tensors (two or more
        # ATen ops, each an OpenMP region, otherwise).
        slots = meta.slot_mapping
        if not (kernel and cpu_kernels.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)):
            write_kv_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        if q.device.type == "cpu" and q.dim() == 3 and cpu_kernels.available():
            # o_proj's input: room for its bucketed oneDNN product (cpu_kernels.gemm_rows).
            out = cpu_kernels.empty_rows(q.shape[0], q.shape[1] * q.shape[2], q.dtype)
            out = out.view(q.shape)
        else:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        sc = (k_scale, v_scale)
        if nd and kernel:  # the kernel reads q and writes out at their strides: no copies
            self._decode(q[:nd], k_cache, v_cache, meta, sc, out=out[:nd])
        elif nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, sc)
        if meta.num_seqs > nd:
            self._prefill_all(q, k, v, k_cache, v_cache, meta, out, sc)
        return out

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
        """Every prefill chunk of the step (the requests after the decodes), into `out`.
        The compiled kernel takes runs of consecutive chunks in one call each, straight from
        the paged cache (the chunk's K/V are already written); chunks of sdpa_min_rows
        tokens or more, or all of them without the kernel, one SDPA call each."""
        nd, n = meta.num_decodes, meta.num_seqs
        min_rows: int | None = 0
        if self._use_cpu_kernel(q):
            min_rows = self.sdpa_min_rows(q.dtype) if sc[0] is None else None
        lens = meta.query_lens_cpu
        i, start = nd, nd  # decodes are one token each
        while i < n:
            j = i
            while j < n and (min_rows is None or lens[j] < min_rows):
                j += 1
            if j > i:
                tree = {} if meta.tree_bits is None else {"tree_bits": meta.tree_bits}
                cpu_kernels.prefill_attention(
                    q, k_cache, v_cache, meta.block_tables[i:j], meta.query_start_loc[i : j + 1],
                    meta.seq_lens[i:j], self.scale, out, *sc, **tree,
                )  # fmt: skip
                start += sum(lens[i:j])
                i = j
                continue
            end = start + lens[i]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i, sc,
                None if meta.tree_bits is None else meta.tree_bits[start:end],
            )  # fmt: skip
            i, start = i + 1, end

    # Fresh tokens from which a prefill chunk takes torch's SDPA under auto (bf16 on AMX):
    # torch's flash attention runs its products on the tiles, the kernel on vdpbf16ps.
    # Per layer SDPA pulls ahead as chunks grow, but a whole prompt's TTFT only gains from
    # about this size: below it SDPA's fixed cost (a call, transposes and a copy per chunk)
    # loses to the kernel, as it does over short prompts' steps (measured on an AMX Xeon;
    # docs/FLAGS.md, PAGESTREAM_PREFILL_ATTENTION).
    SDPA_MIN_ROWS = 320

    def sdpa_min_rows(self, dtype: torch.dtype) -> int | None:
        """The chunk length from which prefill takes SDPA over the kernel; None: never.
        PAGESTREAM_PREFILL_ATTENTION: auto, kernel (never) or sdpa (every chunk)."""
        if self._prefill_choice != "auto":
            return 0 if self._prefill_choice == "sdpa" else None
        if dtype == torch.bfloat16 and "amx_bf16" in cpu_features.detect().flags:
            return self.SDPA_MIN_ROWS
        return None

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sc: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        out: torch.Tensor | None = None,  # kernel path: written in place
    ) -> torch.Tensor:
        b = q.shape[0]
        if self._use_cpu_kernel(q):
            return cpu_kernels.decode_attention(
                q, k_cache, v_cache, meta.block_tables[:b], meta.seq_lens[:b], self.scale,
                k_scale=sc[0], v_scale=sc[1], out=out,
            )  # fmt: skip
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
        return torch.matmul(probs, vc).view(b, self.num_heads, d)  # [B, H, D]

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
