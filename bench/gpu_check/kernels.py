"""Part 2: kernel bandwidth and FLOP rates against the copy bandwidth, SDPA and torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.gpu_check.common import Report, Row, Sizes, bench_ms, fmt_pct, fmt_time, guarded

# Forced split counts of the long-context sweep: around the heuristic's cap (MAX_SPLITS) and
# past it, to keep checking the cap and SPLIT_TARGET_PROGRAMS_PER_SM against the card.
SPLIT_SWEEP = (8, 16, 32, 64, 128)


class KernelBench:
    """Part 2.  One method per measurement; each runs under `guarded`, so a failure costs
    one row, and its tensors are freed when the method returns."""

    def __init__(self, report: Report, device: Any, s: Sizes) -> None:
        import torch

        from gpu.kernels.attention import _sm_count

        self.report = report
        self.device = device
        self.s = s
        self.dtype = torch.bfloat16
        self.elem = 2
        self.copy_bw: float | None = None  # bytes/s
        self.sms = _sm_count(device)
        self.shape = f"Hq{s.heads}/Hkv{s.kv_heads} d{s.head_dim} bs{s.block_size}"

    def run(self) -> float | None:
        s, g = self.s, self.report
        with guarded(g, "kernels", "device copy bandwidth"):
            self.copy_bandwidth()
        with guarded(g, "attention", f"decode b{s.batch} ctx{s.ctx}"):
            self.decode_main()
        for nseq, ctx in ((4, s.long_ctx), (1, s.longest_ctx)):
            with guarded(g, "attention", f"decode b{nseq} ctx{ctx}"):
                self.decode_split(nseq, ctx)
        with guarded(g, "attention", "prefill"):
            self.prefill(
                f"prefill 1x{s.prefill_len} causal, {self.shape}", [s.prefill_len], [0], True
            )
        with guarded(g, "attention", "chunked prefill"):
            self.prefill(
                f"chunked prefill {s.chunk_len} on {s.chunk_ctx} cached",
                [s.chunk_len],
                [s.chunk_ctx],
                False,
            )
        with guarded(g, "attention", "mixed step"):
            nd = s.batch // 2
            self.prefill(
                f"mixed step: {nd} decodes ctx{s.ctx // 2} + 1x512 chunk on 1024",
                [1] * nd + [512],
                [s.ctx // 2] * nd + [1024],
                False,
            )
        if s.sweep:
            with guarded(g, "attention", "prefill tile sweep"):
                self.prefill_sweep()
        with guarded(g, "kernels", "kv write"):
            self.kv_write()
        for tokens in s.norm_tokens:
            with guarded(g, "fused", f"rms_norm T={tokens}"):
                self.rms_norm(tokens)
            with guarded(g, "fused", f"rotary T={tokens}"):
                self.rotary(tokens)
        return self.copy_bw

    # ------------------------------------------------------------------ helpers
    def ceiling(self) -> tuple[str, float]:
        bw = self.copy_bw
        return (f"{bw / 1e9:.0f} GB/s copy", bw) if bw else ("", 0.0)

    def batch(self, qlens: list[int], ctxs: list[int], seed: int) -> Any:
        from gpu.kernels.testing import make_paged_batch

        s = self.s
        return make_paged_batch(
            qlens,
            ctxs,
            num_heads=s.heads,
            num_kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            block_size=s.block_size,
            dtype=self.dtype,
            device=self.device,
            seed=seed,
            poison=0.0,
        )

    def attention_fn(self, b: Any, num_splits: int | None, cfg: Any = None) -> Callable[[], Any]:
        import torch

        from gpu.kernels import paged_attention

        m = b.meta
        out = torch.empty_like(b.q)
        scale = self.s.head_dim**-0.5

        def fn() -> Any:
            return paged_attention(
                b.q,
                b.k_cache,
                b.v_cache,
                m.query_start_loc,
                m.seq_lens,
                m.block_tables,
                max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len,
                num_decodes=m.num_decodes,
                scale=scale,
                out=out,
                num_splits=num_splits,
                config=cfg,
            )

        return fn

    def decode_bytes(self, b: Any) -> int:
        s = self.s
        kv = 2 * sum(b.meta.seq_lens_cpu) * s.kv_heads * s.head_dim * self.elem  # K and V once
        return kv + 2 * b.q.numel() * self.elem  # q in, o out

    def bw_row(self, part: str, label: str, ms: float, moved: float, notes: str = "") -> None:
        bw = moved / (ms * 1e-3)
        ceil, cbw = self.ceiling()
        ratio = fmt_pct(bw / cbw) if cbw else ""
        self.report.add(Row(part, label, fmt_time(ms), f"{bw / 1e9:.0f} GB/s", ceil, ratio, notes))

    def attn_flops(self, qlens: list[int], ctxs: list[int]) -> float:
        visible = sum(c * q + q * (q + 1) // 2 for q, c in zip(qlens, ctxs))
        return 4.0 * self.s.heads * self.s.head_dim * visible  # QK^T and PV: 2 FLOPs a MAC

    # ------------------------------------------------------------------ cases
    def copy_bandwidth(self) -> None:
        import torch

        n = self.s.copy_mib * (1 << 20) // 4
        src = torch.empty(n, dtype=torch.float32, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = bench_ms(lambda: dst.copy_(src), self.device)
        self.copy_bw = 2 * src.numel() * 4 / (ms * 1e-3)  # read + write
        self.report.add(
            Row(
                "kernels",
                f"device copy, {self.s.copy_mib} MiB",
                fmt_time(ms),
                f"{self.copy_bw / 1e9:.0f} GB/s",
                notes="read + write bytes; the ceiling of the GB/s rows",
            )
        )

    def decode_main(self) -> None:
        """Decode at batch 64, context 4k: the main target (70%+ of copy bandwidth)."""
        from gpu.attention.torch_backend import TorchAttentionBackend
        from gpu.kernels import AttentionKernelConfig, choose_num_splits

        s = self.s
        b = self.batch([1] * s.batch, [s.ctx - 1] * s.batch, 1)
        moved = self.decode_bytes(b)
        nsplit = choose_num_splits(s.batch, s.batch, s.kv_heads, s.ctx, self.sms)
        label = f"decode b{s.batch} ctx{s.ctx} {self.shape}"
        ms = bench_ms(self.attention_fn(b, 1), self.device)
        self.bw_row("attention", f"{label}, one launch", ms, moved, "target 70%+")
        ms = bench_ms(self.attention_fn(b, 4), self.device)
        self.bw_row(
            "attention", f"{label}, split 4 (forced)", ms, moved, f"heuristic picks {nsplit}"
        )
        with guarded(self.report, "attention", "torch backend decode"):
            be = TorchAttentionBackend(s.heads, s.kv_heads, s.head_dim, s.head_dim**-0.5)
            ms = bench_ms(lambda: be._decode(b.q, b.k_cache, b.v_cache, b.meta), self.device, 2, 5)
            self.bw_row("attention", f"{label}, torch backend", ms, moved, "for comparison")
        if not s.sweep:
            return
        results = []
        for tile_n, warps, stages in [
            (64, 4, 2),
            (32, 4, 2),
            (128, 4, 2),
            (64, 4, 3),
            (128, 8, 3),
            (64, 2, 2),
        ]:
            cfg = AttentionKernelConfig(tile_n=tile_n, num_warps=warps, num_stages=stages)
            t = bench_ms(self.attention_fn(b, 1, cfg), self.device)
            results.append((t, f"tile_n={tile_n} warps={warps} stages={stages}"))
        results.sort()
        self.bw_row(
            "attention",
            "decode tile sweep (one launch), best",
            results[0][0],
            moved,
            results[0][1] + "; all: " + ", ".join(f"{c} {fmt_time(t)}" for t, c in results),
        )

    def decode_split(self, nseq: int, ctx: int) -> None:
        """Few sequences, long contexts: where splitting the context should pay."""
        from gpu.kernels import choose_num_splits

        b = self.batch([1] * nseq, [ctx - 1] * nseq, 2 + nseq)
        moved = self.decode_bytes(b)
        nsplit = choose_num_splits(nseq, nseq, self.s.kv_heads, ctx, self.sms)
        t1 = bench_ms(self.attention_fn(b, 1), self.device)
        t2 = bench_ms(self.attention_fn(b, None), self.device)
        self.bw_row("attention", f"decode b{nseq} ctx{ctx}, one launch", t1, moved)
        self.bw_row(
            "attention",
            f"decode b{nseq} ctx{ctx}, heuristic ({nsplit} splits)",
            t2,
            moved,
            f"{t1 / t2:.2f}x vs one launch",
        )
        if self.s.sweep:  # which split count the heuristic should pick
            times = {n: bench_ms(self.attention_fn(b, n), self.device) for n in SPLIT_SWEEP}
            best = min(times, key=times.__getitem__)
            self.bw_row(
                "attention",
                f"decode b{nseq} ctx{ctx}, split sweep, best",
                times[best],
                moved,
                f"{best} splits; all: "
                + ", ".join(f"{n} {fmt_time(t)}" for n, t in sorted(times.items())),
            )

    def prefill(self, label: str, qlens: list[int], ctxs: list[int], sdpa: bool) -> None:
        """TFLOP/s; for a fresh prompt also torch SDPA (FlashAttention) on the same shape."""
        import torch.nn.functional as F

        s = self.s
        b = self.batch(qlens, ctxs, 7)
        flops = self.attn_flops(qlens, ctxs)
        ms = bench_ms(self.attention_fn(b, 1), self.device)
        base, ratio = "", ""
        if sdpa and self.device.type == "cuda":
            group = s.heads // s.kv_heads
            q4 = b.q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            k4 = b.k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
            v4 = b.v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
            ms_ref = bench_ms(
                lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True), self.device
            )
            base = f"SDPA {flops / (ms_ref * 1e-3) / 1e12:.0f} TFLOP/s ({fmt_time(ms_ref)})"
            ratio = fmt_pct(ms_ref / ms)
        tflops = flops / (ms * 1e-3) / 1e12
        self.report.add(Row("attention", label, fmt_time(ms), f"{tflops:.1f} TFLOP/s", base, ratio))

    def prefill_sweep(self) -> None:
        from gpu.kernels import AttentionKernelConfig

        s = self.s
        b = self.batch([s.prefill_len], [0], 8)
        flops = self.attn_flops([s.prefill_len], [0])
        results = []
        for block_m, tile_n, warps, stages in [
            (64, 64, 4, 2),
            (128, 64, 8, 2),
            (64, 32, 4, 3),
            (128, 32, 8, 3),
            (64, 128, 4, 2),
        ]:
            cfg = AttentionKernelConfig(
                block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages
            )
            t = bench_ms(self.attention_fn(b, 1, cfg), self.device)
            results.append((t, f"block_m={block_m} tile_n={tile_n} warps={warps} stages={stages}"))
        results.sort()
        best = results[0][0]
        self.report.add(
            Row(
                "attention",
                "prefill tile sweep, best",
                fmt_time(best),
                f"{flops / (best * 1e-3) / 1e12:.1f} TFLOP/s",
                notes=results[0][1]
                + "; all: "
                + ", ".join(f"{c} {fmt_time(t)}" for t, c in results),
            )
        )

    def kv_write(self) -> None:
        from gpu.kernels import write_kv

        s = self.s
        b = self.batch([s.prefill_len], [0], 9)
        slots = b.meta.slot_mapping
        ms = bench_ms(lambda: write_kv(b.k, b.v, b.k_cache, b.v_cache, slots), self.device)
        moved = 2 * 2 * b.k.numel() * self.elem  # K and V, each read + written
        self.bw_row("kernels", f"kv write, {s.prefill_len} tokens", ms, moved)

    def rms_norm(self, tokens: int) -> None:
        import torch

        from gpu.kernels import rms_norm, rms_norm_reference

        h, dev = self.s.norm_hidden, self.device
        gen = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(tokens, h, device=dev, generator=gen).to(self.dtype)
        r = torch.randn(tokens, h, device=dev, generator=gen).to(self.dtype)
        w = torch.randn(h, device=dev, generator=gen).to(self.dtype)
        ms_k = bench_ms(lambda: rms_norm(x, w, 1e-5, residual=r), dev)
        ms_t = bench_ms(lambda: rms_norm_reference(x, w, 1e-5, residual=r), dev)
        moved = 4 * x.numel() * self.elem  # x, residual in; out, new residual out
        self.report.add(
            Row(
                "fused",
                f"rms_norm + residual, T={tokens} H={h}",
                fmt_time(ms_k),
                f"{moved / (ms_k * 1e-3) / 1e9:.0f} GB/s",
                f"torch {fmt_time(ms_t)}",
                f"{ms_t / ms_k:.2f}x",
                "speed-up over torch; worth using above 1",
            )
        )

    def rotary(self, tokens: int) -> None:
        import torch

        from gpu.kernels import apply_rotary, rotary_cos_sin_cache, rotary_reference

        s, dev = self.s, self.device
        d = s.head_dim
        gen = torch.Generator(device=dev).manual_seed(tokens + 1)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
        cos, sin = rotary_cos_sin_cache(inv, 8192)
        pos = torch.randint(0, 8192, (tokens,), device=dev, generator=gen)
        q = torch.randn(tokens, s.heads, d, device=dev, generator=gen).to(self.dtype)
        k = torch.randn(tokens, s.kv_heads, d, device=dev, generator=gen).to(self.dtype)
        ms_k = bench_ms(lambda: apply_rotary(q, k, cos, sin, pos), dev)
        ms_t = bench_ms(lambda: rotary_reference(q, k, cos, sin, pos), dev)
        moved = 2 * (q.numel() + k.numel()) * self.elem
        self.report.add(
            Row(
                "fused",
                f"rotary q+k in place, T={tokens} Hq{s.heads}/Hkv{s.kv_heads} d{d}",
                fmt_time(ms_k),
                f"{moved / (ms_k * 1e-3) / 1e9:.0f} GB/s",
                f"torch {fmt_time(ms_t)}",
                f"{ms_t / ms_k:.2f}x",
                "speed-up over torch; worth using above 1",
            )
        )
