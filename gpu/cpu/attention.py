"""The CPU attention backend: the compiled paged kernels (gpu/cpu/kernels/paged_decode.h,
paged_prefill.cpp) for what they cover, the torch path for the rest."""

from __future__ import annotations

import torch

from gpu.attention.base import AttentionMetadata
from gpu.attention.torch_backend import TorchAttentionBackend, write_kv_reference
from gpu.cpu import features as cpu_features
from gpu.cpu import kernels as cpu_kernels
from scheduler import envs


class CpuAttentionBackend(TorchAttentionBackend):
    """Decode and prefill through the compiled CPU kernels when they take the model's
    heads and dtype; else the torch path it extends."""

    name = "cpu"

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
        # One compiled call for the K/V store where it takes these tensors (two or more
        # ATen ops, each an OpenMP region, otherwise).
        if not (
            self._use_cpu_kernel(k)
            and cpu_kernels.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        ):
            write_kv_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)

    def _empty_out(self, q: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cpu" and q.dim() == 3 and cpu_kernels.available():
            # o_proj's input: room for its bucketed oneDNN product (cpu_kernels.gemm_rows).
            out = cpu_kernels.empty_rows(q.shape[0], q.shape[1] * q.shape[2], q.dtype)
            return out.view(q.shape)
        return super()._empty_out(q)

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
        """The compiled kernel takes runs of consecutive chunks in one call each, straight
        from the paged cache (the chunk's K/V are already written); chunks of sdpa_min_rows
        tokens or more, or all of them without the kernel, one SDPA call each."""
        if not self._use_cpu_kernel(q):
            return super()._prefill_all(q, k, v, k_cache, v_cache, meta, out, sc)
        nd, n = meta.num_decodes, meta.num_seqs
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
            start = self._prefill_into(q, k, v, k_cache, v_cache, meta, out, sc, i, start)
            i += 1

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
        out: torch.Tensor | None = None,  # written in place: the kernel reads q and writes
    ) -> torch.Tensor:  # out at their strides, no copies
        if not self._use_cpu_kernel(q):
            return super()._decode(q, k_cache, v_cache, meta, sc, out)
        b = q.shape[0]
        return cpu_kernels.decode_attention(
            q, k_cache, v_cache, meta.block_tables[:b], meta.seq_lens[:b], self.scale,
            k_scale=sc[0], v_scale=sc[1], out=out,
        )  # fmt: skip
