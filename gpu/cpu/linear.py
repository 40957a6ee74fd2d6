"""Linear layers with weights packed once at load (CPU only), on the kernel that is fastest
for the CPU, the dtype and the row count.

`F.linear` on CPU lays the weight out for the GEMM kernel on every call; packing once
saves that work each step, and in float32 the packed path also reaches oneDNN's faster
kernels.  The ops are the ones torch's own CPU compiler (inductor) emits for frozen linear
layers; when they are missing or disagree with `F.linear` on a probe, the model keeps
plain `nn.Linear`.

Where oneDNN leaves speed on the table, pagestream's own kernels take the products (the
measurements behind each choice: docs/PERFORMANCE.md, "What moved the numbers"):

- float32 without AVX-512: the AVX2 `sgemm` (gpu/cpu/kernels/sgemm.cpp) at every size.  It
  packs its own copy of the weight, which replaces oneDNN's, and a row's result does not
  depend on the batch it came in (every size runs the same sums).  Without it, products of
  512+ rows go to MKL's sgemm through the plain weight kept beside the packed one.
- bfloat16 with AMX tiles: the AMX kernel (gpu/cpu/kernels/amx_gemm.cpp) up to
  AMX_MAX_ROWS rows (decodes and mixed steps); larger products stay on oneDNN, so the layer
  keeps both copies of the weight, made only where it fits AMX_COPY_MEMORY_SHARE of the
  memory available.  An MLP's gate_up runs SiLU(gate) * up as the AMX product's epilogue
  (amx_silu) and as oneDNN post-ops at prefill sizes (gated_linear).
- bfloat16 with AVX512-BF16 and no AMX: the `vdpbf16ps` kernel
  (gpu/cpu/kernels/dpbf16_gemm.cpp) at every size, one copy of the weight in its layout;
  gate_up weights are packed for a gated epilogue (SiLU(gate) * up computed as the product
  is rounded: the same bits as the separate pass, and no [rows, 2 x inter] tensor).
- float32 with AVX-512 (AMX or not: AMX has no float32 product): the same kernel's float32
  twin (`sgemm512`), with the gated epilogue too.

PAGESTREAM_DECODE_GEMM (scheduler/envs.py) forces one kernel or oneDNN alone, for
comparisons.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import features as cpu_features
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.features import CpuFeatures
from scheduler import envs

log = logging.getLogger(__name__)


def _ops_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product at a bucketed row count (cpu_kernels.gemm_rows: a kernel built for
    every new shape would cost more than the product), the padding rows read from x's own
    storage where it has them (cpu_kernels.empty_rows), or from a zero-padded copy."""
    m = x.shape[0]
    xb = _bucketed(x) if x.dim() == 2 else x
    return torch.ops.mkldnn._linear_pointwise(xb, w, bias, "none", [None], "")[:m]


def gated_linear(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate.T) * (x @ up.T) as two oneDNN products with fused epilogues (SiLU on
    the first, the multiply on the second), bucketed like packed_linear: faster than the [gate; up]
    product + silu_mul at prefill sizes (docs/PERFORMANCE.md), the [rows, 2I] product never
    written.  SiLU takes the float32 sums, not their bf16 rounding, so the
    bits differ from the unfused path's (by bf16 rounding)."""
    xb = _bucketed(x)
    g = torch.ops.mkldnn._linear_pointwise(xb, gate, None, "swish", [None], "")
    return torch.ops.mkldnn._linear_pointwise.binary(xb, g, up, None, "mul")[: x.shape[0]]


def _bucketed(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] extended to cpu_kernels.gemm_rows(m) rows: x itself at a bucket's size; a
    view where x is row-dense and its storage goes on that far (the extra rows' values only
    feed output rows that are dropped); else a copy with zero rows."""
    m, k = x.shape
    rows = cpu_kernels.gemm_rows(m)
    if rows == m:
        return x
    if (
        x.stride() == (k, 1)
        and x.storage_offset() + rows * k <= x.untyped_storage().nbytes() // x.element_size()
    ):
        return x.as_strided((rows, k), (k, 1))
    buf = torch.zeros((rows, k), dtype=x.dtype)
    buf[:m] = x
    return buf


# Rows from which MKL's sgemm beats oneDNN's packed kernel where it is used: the two are
# level below it, MKL ahead above (an AVX2-only CPU's measurement; docs/PERFORMANCE.md).
MKL_FROM_ROWS = 512


def mkl_from_rows(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> int | None:
    """The row count from which a projection runs on MKL's sgemm; None: never.
    PAGESTREAM_PREFILL_GEMM: auto (float32 on a CPU without AVX-512 where pagestream's
    sgemm is not built: with it, the sgemm takes every size), mkl (any float32 model),
    onednn (never)."""
    choice = envs.PAGESTREAM_PREFILL_GEMM
    if dtype != torch.float32 or choice == "onednn" or not torch.backends.mkl.is_available():
        return None
    cpu = cpu or cpu_features.detect()
    if choice == "auto" and ("avx512f" in cpu.flags or use_sgemm(dtype, cpu)):
        return None
    return MKL_FROM_ROWS


# Rows up to which the AMX kernel runs a bf16 product: ahead of oneDNN's own AMX kernel at
# decode and mixed-step sizes, level around this size, behind at prefill sizes (measured
# per row count on an AMX Xeon; docs/PERFORMANCE.md).
AMX_MAX_ROWS = 192


def _decode_gemm() -> str:
    return envs.PAGESTREAM_DECODE_GEMM


def use_sgemm(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """Projections run on pagestream's sgemm (sgemm.cpp) rather than oneDNN.
    PAGESTREAM_DECODE_GEMM: auto (float32 on a CPU without AVX-512; bfloat16 on a CPU
    without AVX512-BF16 or AMX, where oneDNN emulates bf16 products: where each was
    measured), sgemm (any float32 or bf16 model), amx / dpbf16 / onednn (never)."""
    choice = _decode_gemm()
    if dtype not in (torch.float32, torch.bfloat16) or choice in ("onednn", "amx", "dpbf16"):
        return False
    if not cpu_kernels.sgemm_available():
        return False
    if choice == "sgemm":
        return True
    flags = (cpu or cpu_features.detect()).flags
    if dtype == torch.float32:
        return "avx512f" not in flags
    return not {"avx512_bf16", "amx_bf16"} & flags


def use_amx(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """bf16 products of up to AMX_MAX_ROWS rows run on pagestream's AMX kernel
    (amx_gemm.cpp).  PAGESTREAM_DECODE_GEMM: auto or amx (bf16 where the CPU has AMX and
    the kernel is built), sgemm / dpbf16 / onednn (never)."""
    choice = _decode_gemm()
    if dtype != torch.bfloat16 or choice in ("onednn", "sgemm", "dpbf16"):
        return False
    return "amx_bf16" in (cpu or cpu_features.detect()).flags and cpu_kernels.amx_available()


def use_dpbf16(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """bf16 projections of every size run on pagestream's AVX512-BF16 kernel
    (dpbf16_gemm.cpp) rather than oneDNN.  PAGESTREAM_DECODE_GEMM: auto (bf16 on a CPU with
    AVX512-BF16 and no AMX, where it was measured; with AMX the tiles' kernels run), dpbf16
    (any bf16 model where the kernel is built), sgemm / amx / onednn (never)."""
    choice = _decode_gemm()
    if dtype != torch.bfloat16 or choice in ("onednn", "sgemm", "amx"):
        return False
    if not cpu_kernels.dpbf16_available():
        return False
    if choice == "dpbf16":
        return True
    flags = (cpu or cpu_features.detect()).flags
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def use_sgemm512(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """float32 projections of every size run on dpbf16_gemm.cpp's float32 kernel rather
    than oneDNN.  PAGESTREAM_DECODE_GEMM: auto (float32 on a CPU with AVX-512, AMX or not:
    AMX has no float32 product, so an AMX CPU's float32 runs on the same FMAs, faster than
    oneDNN's there too: docs/PERFORMANCE.md), sgemm512 (any float32 model where the kernel is built), others (never)."""
    choice = _decode_gemm()
    if dtype != torch.float32 or choice not in ("auto", "sgemm512"):
        return False
    if not cpu_kernels.sgemm512_available():
        return False
    if choice == "sgemm512":
        return True
    return "avx512f" in (cpu or cpu_features.detect()).flags


class PackedLinear(nn.Module):
    """A drop-in for nn.Linear whose weight is pre-reordered once: for oneDNN, or with
    `sgemm` for pagestream's kernel; with `mkl_from`, products of at least that many rows
    run on the plain weight (MKL) instead; with `amx` (bf16), products of up to
    AMX_MAX_ROWS rows run on pagestream's AMX kernel from a copy in its own layout."""

    def __init__(
        self,
        linear: nn.Linear,
        mkl_from: int | None = None,
        sgemm: bool = False,
        amx: bool = False,
        dpbf16: bool = False,
        gated_inter: int | None = None,
        sgemm512: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        # Plain attributes, not parameters: the packed layouts are opaque tensors that
        # state_dict() and .to() must not touch.
        self.dpbf16 = dpbf16 and linear.weight.dtype == torch.bfloat16
        self.sgemm512 = sgemm512 and linear.weight.dtype == torch.float32
        self.sgemm = sgemm and not (self.dpbf16 or self.sgemm512)
        # An MLP's gate_up ([gate; up] rows, gated_inter each) is packed for silu_mul():
        # SiLU(gate) * up as the product's epilogue, for every product on the vdpbf16ps
        # kernel, its float32 twin or the float32 AVX2 sgemm where MKL does not take the
        # prefill rows (gated_ops), or on the AMX kernel for decode-sized ones (amx_gated).
        gated = (
            gated_inter is not None
            and linear.bias is None
            and linear.out_features == 2 * gated_inter
        )
        whole = (
            "dpbf16" if self.dpbf16
            else "sgemm512" if self.sgemm512
            else "sgemm" if self.sgemm and mkl_from is None and self.dtype == torch.float32
            else None
        )  # fmt: skip
        ops = cpu_kernels.gated_kernel(whole) if gated and whole else None
        self.gated_ops = ops if ops and gated_inter % ops.group == 0 else None
        # On AMX the gated layout serves decode-sized rows; prefill's take gated_linear
        # over oneDNN packs of the gate and up halves (instead of one of [gate; up]).
        amx = amx and linear.weight.dtype == torch.bfloat16 and self.in_features % 32 == 0
        self.amx_gated = (
            amx and not self.dpbf16 and gated and gated_inter % cpu_kernels.AMX_GATED_GROUP == 0
        )
        self.halves: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.gated_ops:
            self.packed = self.gated_ops.pack(linear.weight, gated_inter)
        elif self.amx_gated:
            w = linear.weight.detach()
            self.halves = (pack_weight(w[:gated_inter]), pack_weight(w[gated_inter:]))
            self.packed = None
        elif self.dpbf16:
            self.packed = cpu_kernels.dpbf16_pack(linear.weight)
        elif self.sgemm512:
            self.packed = cpu_kernels.sgemm512_pack(linear.weight)
        elif self.sgemm:
            self.packed = cpu_kernels.sgemm_pack(linear.weight)
        else:
            self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # pagestream's kernels add a float32 bias (exact for a bf16 one).
        self.bias_f32 = None if self.bias is None else self.bias.float()
        self.mkl_from = mkl_from
        self.plain = None if mkl_from is None else linear.weight.detach()
        self.scratch: Scratch | None = None  # see Scratch
        # The AMX kernel reads k in tiles of 32 (every model dimension we know is a multiple).
        if self.amx_gated:
            self.amx = cpu_kernels.amx_gated_pack(linear.weight, gated_inter)
        else:
            self.amx = cpu_kernels.amx_pack(linear.weight) if amx else None
        # silu_mul() is there (MLP.forward takes it).
        self.gated_inter = gated_inter if self.gated_ops or self.amx_gated else None

    @classmethod
    def of_weight(
        cls,
        weight: torch.Tensor,
        sgemm: bool = False,
        amx: bool = False,
        dpbf16: bool = False,
        sgemm512: bool = False,
    ) -> PackedLinear:
        """For a bare weight (the lm_head): no bias, no MKL path."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return cls(linear, sgemm=sgemm, amx=amx, dpbf16=dpbf16, sgemm512=sgemm512)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of this gate_up projection, [T, gated_inter], in one pass (on
        the AMX kernel: up to AMX_MAX_ROWS rows; more take gated_linear)."""
        inter = self.gated_inter
        assert inter is not None
        x2 = x.reshape(-1, self.in_features)
        if self.gated_ops or x2.shape[0] <= AMX_MAX_ROWS:
            out = None
            if self.scratch is not None:
                out = self.scratch.take(x2.shape[0], inter, x.dtype)
            if self.gated_ops:
                y = self.gated_ops.silu(x2, self.packed, inter, out)
            else:
                y = cpu_kernels.amx_silu(x2, self.amx, inter, out)
        else:
            assert self.halves is not None
            y = gated_linear(x2, *self.halves)
        return y.view(*x.shape[:-1], inter)

    def decode_kernel(self) -> str | None:
        """Which of pagestream's kernels forward() and silu_mul() call for decode-sized
        products (AMX: up to AMX_MAX_ROWS rows; the others: any), as the layer stack
        (gpu/cpu/layer_stack.py) calls them; None: oneDNN, or MKL from some row count."""
        if self.amx is not None:
            return "amx" if self.dtype == torch.bfloat16 else None
        if self.halves is not None:
            return None
        if self.dpbf16:
            return "dpbf16"
        if self.sgemm512:
            return "sgemm512"
        if self.sgemm and self.plain is None and self.dtype == torch.float32:
            return "sgemm"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amx = self.amx is not None and x.dtype == torch.bfloat16
        amx = amx and x.numel() <= AMX_MAX_ROWS * self.in_features
        if self.gated_ops or (amx and self.amx_gated):
            # The gated layout's plain product, back in [gate; up] order (MLPs take
            # silu_mul(); this serves any other caller).
            x2 = x.reshape(-1, self.in_features)
            if self.gated_ops:
                order = cpu_kernels.gated_order(self.out_features // 2, self.gated_ops.group)
                y = self.gated_ops.gemm(x2, self.packed, self.out_features, None)
            else:
                order = cpu_kernels.gated_order(self.out_features // 2, cpu_kernels.AMX_GATED_GROUP)
                y = cpu_kernels.amx_gemm(x2, self.amx, self.out_features, None)
            y = torch.empty_like(y).index_copy_(1, order, y)
            return y.view(*x.shape[:-1], self.out_features)
        if amx:
            y = cpu_kernels.amx_gemm(x.reshape(-1, self.in_features), self.amx,
                                     self.out_features, self.bias_f32)  # fmt: skip
            return y.view(*x.shape[:-1], self.out_features)
        if self.halves is not None:  # a gated gate_up's prefill-sized plain product
            return torch.cat([packed_linear(x, h, None) for h in self.halves], dim=-1)
        mkl = self.plain is not None and x.numel() >= self.mkl_from * self.in_features
        if not (mkl or self.sgemm or self.dpbf16 or self.sgemm512):
            return packed_linear(x, self.packed, self.bias)  # oneDNN allocates its own
        out = None
        if self.scratch is not None and x.dim() == 2:
            out = self.scratch.take(x.shape[0], self.out_features, x.dtype)
        if self.dpbf16 or self.sgemm512:
            gemm = cpu_kernels.dpbf16_gemm if self.dpbf16 else cpu_kernels.sgemm512
            y = gemm(x.reshape(-1, self.in_features), self.packed, self.out_features,
                     self.bias_f32, out)  # fmt: skip
            return y.view(*x.shape[:-1], self.out_features)
        if mkl:
            if out is None:
                return F.linear(x, self.plain, self.bias)
            if self.bias is None:
                return torch.mm(x, self.plain.t(), out=out)
            return torch.addmm(self.bias, x, self.plain.t(), out=out)
        y = cpu_kernels.sgemm(x.reshape(-1, self.in_features), self.packed,
                              self.out_features, self.bias_f32, out)  # fmt: skip
        return y.view(*x.shape[:-1], self.out_features)


def warm_onednn(model: nn.Module, max_rows: int, max_logit_rows: int) -> int:
    """Runs every oneDNN product `model` can meet once, at each bucketed row count
    (cpu_kernels.gemm_rows) up to max_rows (the step's token budget; the lm_head's up to
    max_logit_rows, the sequences a step samples), so that oneDNN builds its kernels at
    start-up and not in the first requests' steps (each build costs more than the product
    it serves; all of them take seconds at start for a mid-sized model).
    Returns the products run.  PAGESTREAM_CPU_WARMUP=0 skips it."""
    if not envs.PAGESTREAM_CPU_WARMUP:
        return 0
    head = getattr(model, "lm_head_packed", None)
    done: set[tuple] = set()
    runs = 0
    for layer in model.modules():
        if not isinstance(layer, PackedLinear) or layer.sgemm or layer.dpbf16 or layer.sgemm512:
            continue
        lo = AMX_MAX_ROWS + 1 if layer.amx is not None else 1
        hi = max_logit_rows if layer is head else max_rows
        if layer.plain is not None:  # MKL from mkl_from rows
            hi = min(hi, layer.mkl_from - 1)
        key = (layer.in_features, layer.out_features, layer.bias is None, layer.dtype, lo, hi)
        if key in done:
            continue
        done.add(key)
        for rows in sorted({cpu_kernels.gemm_rows(r) for r in range(lo, hi + 1)}):
            x = torch.zeros(rows, layer.in_features, dtype=layer.dtype)
            if layer.halves is not None:
                gated_linear(x, *layer.halves)  # what its MLP runs
            else:
                packed_linear(x, layer.packed, layer.bias)
            runs += 1
    return runs


class Scratch:
    """One output buffer reused by layers whose output is dead before the next of them
    runs (the MLPs' gate_up: SiLU * up consumes it).  A prefill chunk's gate_up output is
    tens of MB, above glibc's mmap threshold, so a fresh tensor is new pages every call:
    page faults and zeroing would cost a measurable share of that GEMM."""

    def __init__(self) -> None:
        self.buf = torch.empty(0)

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buf.dtype != dtype or self.buf.numel() < rows * cols:
            self.buf = torch.empty(rows * cols, dtype=dtype)
        return self.buf[: rows * cols].view(rows, cols)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Packed and plain linear agree on a random problem of this dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    x = torch.randn(5, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    try:
        got = packed_linear(x, pack_weight(w), b)
    except Exception as e:  # an op missing for this dtype / build
        log.info("packed oneDNN linear unavailable for %s: %s", dtype, e)
        return False
    ref = F.linear(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    return got.shape == ref.shape and bool(
        torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
    )


def packing_available(dtype: torch.dtype) -> bool:
    if not envs.PAGESTREAM_PACK_LINEAR:
        return False
    return dtype in (torch.float32, torch.bfloat16) and _ops_available() and _probe(dtype)


# Under PAGESTREAM_DECODE_GEMM=auto the AMX copy of the weights is made only when it takes
# at most this share of the memory available at load: it doubles the projections' memory,
# and a replica sized for one copy must not run out of memory for a faster decode.
AMX_COPY_MEMORY_SHARE = 0.25


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def amx_copy_fits(extra_bytes: int, available: int | None = None) -> bool:
    """The AMX layout's copy of `extra_bytes` of weights may be made: always when
    PAGESTREAM_DECODE_GEMM=amx, under auto when it fits AMX_COPY_MEMORY_SHARE of the memory
    available (unknown memory: yes)."""
    if _decode_gemm() == "amx":
        return True
    available = _mem_available() if available is None else available
    return available is None or extra_bytes <= AMX_COPY_MEMORY_SHARE * available


def amx_copy_bytes(model: nn.Module, extra: int = 0) -> int:
    """Bytes the AMX copies of `model`'s bf16 linears (those whose k tiles by 32) would
    take, plus `extra` (the lm_head's, which is not an nn.Linear)."""
    return extra + sum(
        m.weight.nbytes
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.in_features % 32 == 0
    )


def decode_on_amx(model: nn.Module, dtype: torch.dtype, extra_bytes: int = 0) -> bool:
    """Whether `model`'s bf16 decode products take the AMX kernel: use_amx, and its copy of
    the linears (plus `extra_bytes`, the lm_head's) fits the memory (amx_copy_fits); a
    refusal for memory is logged as a warning."""
    if not use_amx(dtype):
        return False
    need = amx_copy_bytes(model, extra_bytes)
    if amx_copy_fits(need):
        return True
    log.warning(
        "bf16 decode GEMMs stay on oneDNN: the AMX kernel's copy of the weights (%.1f GiB) "
        "exceeds %d%% of the memory available (PAGESTREAM_DECODE_GEMM=amx forces it)",
        need / 2**30, int(100 * AMX_COPY_MEMORY_SHARE),
    )  # fmt: skip
    return False


def linears_packable(dtype: torch.dtype) -> bool:
    """pack_model_linears will swap a `dtype` model's linears: oneDNN packs them, or
    pagestream's sgemm takes them (also where oneDNN has no packed kernel for the dtype:
    bf16 on AVX2-only CPUs, where torch's own bf16 product is emulated and slow)."""
    if not envs.PAGESTREAM_PACK_LINEAR:
        return False
    return use_sgemm(dtype) or use_dpbf16(dtype) or use_sgemm512(dtype) or packing_available(dtype)


def pack_model_linears(model: nn.Module, dtype: torch.dtype, amx: bool = False) -> int:
    """Swap every nn.Linear of a CPU model for a PackedLinear; returns how many.
    (Quantized layers are not nn.Linear and keep their own kernels.)  amx: the decode rows
    take the AMX kernel (decode_on_amx decides)."""
    if not linears_packable(dtype):
        return 0
    mkl_from = mkl_from_rows(dtype)
    if mkl_from is not None:
        log.info("float32 projections of >= %d rows run on MKL's sgemm", mkl_from)
    sgemm = use_sgemm(dtype)
    if sgemm:
        log.info("%s projections run on pagestream's AVX2 sgemm", str(dtype).split(".")[-1])
    if amx:
        log.info("bf16 projections of <= %d rows run on pagestream's AMX kernel", AMX_MAX_ROWS)
    dpbf16 = use_dpbf16(dtype)
    if dpbf16:
        log.info("bf16 projections run on pagestream's AVX512-BF16 kernel")
    sgemm512 = use_sgemm512(dtype)
    if sgemm512:
        log.info("float32 projections run on pagestream's AVX-512 kernel")
    # MLPs' gate_up projections (an `inter` beside a `gate_up_proj`): SiLU * up in the
    # GEMM's epilogue, unless the compiled elementwise kernels are turned off.
    gated = (
        {
            id(m.gate_up_proj): m.inter
            for m in model.modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Linear) and hasattr(m, "inter")
        }
        if cpu_kernels.fused_enabled()
        else {}
    )
    return swap_linears(
        model,
        lambda lin: PackedLinear(lin, mkl_from, sgemm, amx, dpbf16, gated.get(id(lin)), sgemm512),
    )


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain nn.Linear in `model` by `make(linear)`; returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
