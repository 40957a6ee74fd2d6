"""Linear layers with weights packed once at load (CPU only), each on the kernel family
that is fastest for the CPU, the dtype and the row count.

`F.linear` on CPU lays the weight out for the GEMM kernel on every call; packing once
saves that work each step, and in float32 the packed path also reaches oneDNN's faster
kernels.  The ops are the ones torch's own CPU compiler (inductor) emits for frozen linear
layers; when they are missing or disagree with `F.linear` on a probe, the model keeps
plain `nn.Linear`.

`choose` picks one family per projection, once, from the dtype, the CPU's features
(gpu/cpu/features.py), the kernel choices PAGESTREAM_DECODE_GEMM / PAGESTREAM_PREFILL_GEMM
(scheduler/envs.py) and the weight's shape; a `PackedLinear` holds that family's strategy,
which packs the weight and runs its products.  Why each family runs where it does
(measured: docs/PERFORMANCE.md, "What moved the numbers"):

- `OneDnnLinear`: oneDNN's packed weight, where no kernel of ours is ahead.  Float32
  products of MKL_FROM_ROWS+ rows go to MKL's sgemm (ahead there) on CPUs without AVX-512
  where pagestream's sgemm is not built, from a plain copy of the weight.
- `SgemmLinear`: pagestream's AVX2 sgemm (gpu/cpu/kernels/sgemm.cpp) at every size, for
  float32 without AVX-512 and for bf16 without a native bf16 product (oneDNN emulates it).
  A row's result does not depend on the batch it came in.
- `Sgemm512Linear`: the AVX-512 float32 kernel (gpu/cpu/kernels/dpbf16_gemm.cpp) at every
  size, for float32 on any AVX-512 CPU (AMX has no float32 product).
- `Dpbf16Linear`: the `vdpbf16ps` kernel (same file) at every size, for bf16 on
  AVX512-BF16 CPUs without AMX.
- `AmxLinear`: the AMX kernel (gpu/cpu/kernels/amx_gemm.cpp) at every size, one copy of
  the weight: ahead of oneDNN's own AMX kernel at decode and mixed-step sizes, and on an
  Emerald Rapids Xeon at prompt sizes too; a row's result does not depend on its batch, so
  a prompt's KV is the same whether it came in one step or in chunks.  Under
  PAGESTREAM_PREFILL_GEMM=onednn products above AMX_MAX_ROWS rows run on oneDNN from a
  second copy of the weight (ahead at prompt sizes on another AMX Xeon, a measurement of
  an earlier kernel), made only where it fits AMX_COPY_MEMORY_SHARE of the memory.

An MLP's gate_up is packed for `PackedLinear.silu_mul` where the family allows: SiLU(gate)
* up as the product's epilogue (the bits of the separate pass, and no [rows, 2 x inter]
tensor); on AMX at every size (under PAGESTREAM_PREFILL_GEMM=onednn, prompt-sized rows as
oneDNN post-ops, `gated_linear`).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

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

# Under PAGESTREAM_PREFILL_GEMM=onednn, rows up to which the AMX kernel runs a bf16 product
# (oneDNN's AMX kernel above): where the two were level on the AMX Xeon that measured
# oneDNN ahead at prompt sizes (docs/PERFORMANCE.md).
AMX_MAX_ROWS = 192


def amx_max_rows() -> int | None:
    """Rows up to which the AMX kernel runs a bf16 product; None: every size (one copy of
    each weight).  PAGESTREAM_PREFILL_GEMM=onednn: AMX_MAX_ROWS, oneDNN's kernel above."""
    return AMX_MAX_ROWS if envs.PAGESTREAM_PREFILL_GEMM == "onednn" else None


def mkl_from_rows(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> int | None:
    """The row count from which a projection runs on MKL's sgemm; None: never.
    PAGESTREAM_PREFILL_GEMM: auto (float32 on a CPU without AVX-512 where pagestream's
    sgemm is not built: with it, the sgemm takes every size), mkl (any float32 model; choose
    applies it to oneDNN and the AVX2 sgemm, the kernels it was measured beside), onednn
    (never)."""
    choice = envs.PAGESTREAM_PREFILL_GEMM
    if dtype != torch.float32 or choice == "onednn" or not torch.backends.mkl.is_available():
        return None
    cpu = cpu or cpu_features.detect()
    if choice == "auto" and ("avx512f" in cpu.flags or use_sgemm(dtype, cpu)):
        return None
    return MKL_FROM_ROWS


def _decode_gemm() -> str:
    return envs.PAGESTREAM_DECODE_GEMM


def use_sgemm(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """PAGESTREAM_DECODE_GEMM lets the AVX2 sgemm take `dtype`'s projections: auto (float32
    without AVX-512; bf16 without AVX512-BF16 or AMX), sgemm (float32 or bf16), amx /
    dpbf16 / onednn (never); where it is built."""
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
    """PAGESTREAM_DECODE_GEMM lets the AMX kernel take bf16 products (of up to
    amx_max_rows() rows): auto or amx (where the CPU has AMX and the kernel is built),
    sgemm / dpbf16 / onednn (never)."""
    choice = _decode_gemm()
    if dtype != torch.bfloat16 or choice in ("onednn", "sgemm", "dpbf16"):
        return False
    return "amx_bf16" in (cpu or cpu_features.detect()).flags and cpu_kernels.amx_available()


def use_dpbf16(dtype: torch.dtype, cpu: CpuFeatures | None = None) -> bool:
    """PAGESTREAM_DECODE_GEMM lets the vdpbf16ps kernel take bf16 projections of every
    size: auto (AVX512-BF16 without AMX: with AMX the tiles' kernels run), dpbf16 (any bf16
    model), sgemm / amx / onednn (never); where it is built."""
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
    """PAGESTREAM_DECODE_GEMM lets the AVX-512 float32 kernel take float32 projections of
    every size: auto (any AVX-512 CPU, AMX or not), sgemm512 (any float32 model), others
    (never); where it is built."""
    choice = _decode_gemm()
    if dtype != torch.float32 or choice not in ("auto", "sgemm512"):
        return False
    if not cpu_kernels.sgemm512_available():
        return False
    if choice == "sgemm512":
        return True
    return "avx512f" in (cpu or cpu_features.detect()).flags


@dataclass(frozen=True)
class Choice:
    """One projection's kernel family (a key of FAMILIES) and its options."""

    family: str
    mkl_from: int | None = None  # onednn / sgemm: products of this many rows on MKL's sgemm
    gated_inter: int | None = None  # an MLP's gate_up packed for PackedLinear.silu_mul

    def describe(self) -> str:
        mkl = "" if self.mkl_from is None else f", MKL from {self.mkl_from} rows"
        return self.family + mkl + (", SiLU·up epilogue" if self.gated_inter else "")


def choose(
    dtype: torch.dtype,
    shape: tuple[int, int],  # the weight's [out, in]
    *,
    bias: bool = False,
    gated_inter: int | None = None,
    mkl: bool = True,
    amx_copy: bool = True,
    cpu: CpuFeatures | None = None,
) -> Choice:
    """The kernel family of a `dtype` projection on `cpu` (this machine's by default) under
    the kernel choices (use_* and mkl_from_rows read them).  gated_inter: an MLP's gate_up
    ([gate; up], gated_inter rows each), gated where the family's epilogue takes it (no
    bias, inter whole groups of its layout); mkl=False: never MKL (the lm_head: logits rows
    never reach its sizes); amx_copy=False: no AMX copy (decode_on_amx: no room for it)."""
    cpu = cpu or cpu_features.detect()
    n, k = shape
    family = _family(dtype, cpu, amx_copy)
    if family == "amx" and k % 32:  # the AMX kernel reads k in tiles of 32
        family = "onednn"
    mkl_from = mkl_from_rows(dtype, cpu) if mkl and family in ("onednn", "sgemm") else None
    group = _gated_group(family, dtype, mkl_from)
    gated = gated_inter is not None and not bias and n == 2 * gated_inter
    if not (gated and group and gated_inter % group == 0):
        gated_inter = None
    return Choice(family, mkl_from, gated_inter)


def _family(dtype: torch.dtype, cpu: CpuFeatures, amx_copy: bool) -> str:
    # At most one of these holds for a dtype, CPU and choice, but for DECODE_GEMM=sgemm512
    # on a CPU without AVX-512, where the forced kernel wins over the AVX2 sgemm.
    if use_dpbf16(dtype, cpu):
        return "dpbf16"
    if use_sgemm512(dtype, cpu):
        return "sgemm512"
    if amx_copy and use_amx(dtype, cpu):
        return "amx"
    return "sgemm" if use_sgemm(dtype, cpu) else "onednn"


def _gated_group(family: str, dtype: torch.dtype, mkl_from: int | None) -> int | None:
    """Outputs per group of the family's gated layout; None: none here (oneDNN, the bf16
    sgemm, or the sgemm beside MKL, which reads the plain weight for the prefill rows)."""
    if family == "amx":
        return cpu_kernels.AMX_GATED_GROUP
    if family == "sgemm" and (dtype != torch.float32 or mkl_from is not None):
        return None
    if family in ("dpbf16", "sgemm512", "sgemm"):
        return cpu_kernels.gated_kernel(family).group
    return None


def _take(scratch: Scratch | None, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
    return None if scratch is None else scratch.take(rows, cols, dtype)


def _checkpoint_order(y: torch.Tensor, group: int) -> torch.Tensor:
    """A gated layout's plain product [rows, 2 x inter] back in [gate; up] order (MLPs take
    silu_mul(); this serves any other caller)."""
    order = cpu_kernels.gated_order(y.shape[1] // 2, group)
    return torch.empty_like(y).index_copy_(1, order, y)


class LinearStrategy:
    """One kernel family's packed weight and its products.  `packed` is the layout its
    products read (`amx`: the AMX copy); `kernel` names the compiled kernel the layer stack
    (gpu/cpu/layer_stack.py) runs for it, None where it takes none."""

    family = ""  # its key in FAMILIES
    kernel: str | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: Choice) -> None:
        assert choice.family == self.family, (choice, self.family)
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        # pagestream's kernels add a float32 bias (exact for a bf16 one).
        self.bias_f32 = None if bias is None else bias.float()
        self.gated_inter = choice.gated_inter
        self.mkl_from = choice.mkl_from
        self.plain = None if choice.mkl_from is None else weight
        self.packed: torch.Tensor | None = None
        self.amx: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        raise NotImplementedError

    def silu_mul(self, x2: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        """SiLU(gate) * up [rows, gated_inter] of x2 [rows, in] (a gated gate_up only)."""
        raise NotImplementedError

    def stack_weight(self) -> torch.Tensor | None:
        """The layout `kernel` reads in the layer stack."""
        return self.packed if self.kernel else None

    def onednn_rows(self) -> tuple[int, int | None] | None:
        """The row counts (first, last or None: no end) whose products run on oneDNN, which
        warm_onednn builds at start; None: none do."""
        return None

    def warm(self, x: torch.Tensor) -> None:
        """Run the oneDNN product the model runs at x's rows."""
        packed_linear(x, self.packed, self.bias)

    def _on_mkl(self, x: torch.Tensor) -> bool:
        return self.plain is not None and x.numel() >= self.mkl_from * self.in_features

    def _mkl(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return F.linear(x, self.plain, self.bias)
        if self.bias is None:
            return torch.mm(x, self.plain.t(), out=out)
        return torch.addmm(self.bias, x, self.plain.t(), out=out)


class OneDnnLinear(LinearStrategy):
    """oneDNN's packed weight at every size (and MKL's sgemm from mkl_from rows)."""

    family = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: Choice) -> None:
        super().__init__(weight, bias, choice)
        self.packed = pack_weight(weight)

    def forward(self, x: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        if not self._on_mkl(x):
            return packed_linear(x, self.packed, self.bias)  # oneDNN allocates its own
        out = _take(scratch, x.shape[0], self.out_features, x.dtype) if x.dim() == 2 else None
        return self._mkl(x, out)

    def onednn_rows(self) -> tuple[int, int | None] | None:
        return 1, None if self.mkl_from is None else self.mkl_from - 1


class _EverySize(LinearStrategy):
    """One of pagestream's kernels at every size, from its own layout of the weight (an
    MLP's gate_up: its gated layout, `gated`)."""

    pack_fn = gemm_fn = ""  # cpu_kernels' names, looked up at each call

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: Choice) -> None:
        super().__init__(weight, bias, choice)
        self.gated = cpu_kernels.gated_kernel(self.kernel) if self.gated_inter else None
        if self.gated is not None:
            self.packed = self.gated.pack(weight, self.gated_inter)
        else:
            self.packed = getattr(cpu_kernels, self.pack_fn)(weight)

    def forward(self, x: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        n = self.out_features
        if self.gated is not None:
            y = _checkpoint_order(self.gated.gemm(x2, self.packed, n, None), self.gated.group)
            return y.view(*x.shape[:-1], n)
        out = _take(scratch, x.shape[0], n, x.dtype) if x.dim() == 2 else None
        if self._on_mkl(x):
            return self._mkl(x, out)
        y = getattr(cpu_kernels, self.gemm_fn)(x2, self.packed, n, self.bias_f32, out)
        return y.view(*x.shape[:-1], n)

    def silu_mul(self, x2: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        assert self.gated is not None and self.gated_inter is not None
        out = _take(scratch, x2.shape[0], self.gated_inter, x2.dtype)
        return self.gated.silu(x2, self.packed, self.gated_inter, out)


class SgemmLinear(_EverySize):
    """The AVX2 sgemm (float32 or bf16 weights; MKL's sgemm from mkl_from rows where asked).
    The layer stack takes it in float32 without MKL.

    A float32 weight whose values are all bf16 ones (a bf16 checkpoint run in float32, as
    `--dtype auto` does on a CPU without a native bf16 product) is held in bf16 and
    widened as it loads (`sgemm_w16`): the same bits from half the bytes, so half the
    memory, and decode steps, which stream every weight, read half as much."""

    family = kernel = "sgemm"
    pack_fn, gemm_fn = "sgemm_pack", "sgemm"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: Choice) -> None:
        if (
            envs.PAGESTREAM_BF16_WEIGHTS
            and choice.mkl_from is None
            and cpu_kernels.bf16_exact(weight)
        ):
            self.kernel = "sgemm_w16"
            self.pack_fn, self.gemm_fn = "sgemm_w16_pack", "sgemm_w16"
        super().__init__(weight, bias, choice)
        if weight.dtype != torch.float32 or self.plain is not None:
            self.kernel = None


class Sgemm512Linear(_EverySize):
    """The AVX-512 float32 kernel."""

    family = kernel = "sgemm512"
    pack_fn, gemm_fn = "sgemm512_pack", "sgemm512"


class Dpbf16Linear(_EverySize):
    """The AVX512-BF16 (vdpbf16ps) bf16 kernel."""

    family = kernel = "dpbf16"
    pack_fn, gemm_fn = "dpbf16_pack", "dpbf16_gemm"


class AmxLinear(LinearStrategy):
    """bf16 on the AMX kernel from its own copy (`amx`), at every size; under
    PAGESTREAM_PREFILL_GEMM=onednn only up to AMX_MAX_ROWS rows, oneDNN above from `packed`
    or, for a gated gate_up, the gate and up halves packed apart (`halves`: gated_linear's
    operands)."""

    family = kernel = "amx"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: Choice) -> None:
        super().__init__(weight, bias, choice)
        inter = self.gated_inter
        self.max_rows = amx_max_rows()
        self.halves: tuple[torch.Tensor, torch.Tensor] | None = None
        onednn = self.max_rows is not None
        if inter is None:
            self.packed = pack_weight(weight) if onednn else None
            self.amx = cpu_kernels.amx_pack(weight)
        else:
            if onednn:
                self.halves = (pack_weight(weight[:inter]), pack_weight(weight[inter:]))
            self.amx = cpu_kernels.amx_gated_pack(weight, inter)

    def _on_onednn(self, rows: int) -> bool:
        return self.max_rows is not None and rows > self.max_rows

    def forward(self, x: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        n = self.out_features
        x2 = x.reshape(-1, self.in_features)
        if self._on_onednn(x2.shape[0]):
            if self.halves is not None:  # a gated gate_up's prefill-sized plain product
                return torch.cat([packed_linear(x, h, None) for h in self.halves], dim=-1)
            return packed_linear(x, self.packed, self.bias)
        if self.gated_inter is not None:
            y = cpu_kernels.amx_gemm(x2, self.amx, n, None)
            y = _checkpoint_order(y, cpu_kernels.AMX_GATED_GROUP)
        else:
            y = cpu_kernels.amx_gemm(x2, self.amx, n, self.bias_f32)
        return y.view(*x.shape[:-1], n)

    def silu_mul(self, x2: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
        inter = self.gated_inter
        assert inter is not None
        if self._on_onednn(x2.shape[0]):
            assert self.halves is not None
            return gated_linear(x2, *self.halves)
        out = _take(scratch, x2.shape[0], inter, x2.dtype)
        return cpu_kernels.amx_silu(x2, self.amx, inter, out)

    def stack_weight(self) -> torch.Tensor | None:
        return self.amx

    def onednn_rows(self) -> tuple[int, int | None] | None:
        return None if self.max_rows is None else (self.max_rows + 1, None)

    def warm(self, x: torch.Tensor) -> None:
        if self.halves is not None:
            gated_linear(x, *self.halves)  # what its MLP runs
        elif self.packed is not None:
            packed_linear(x, self.packed, self.bias)


FAMILIES: dict[str, type[LinearStrategy]] = {
    "onednn": OneDnnLinear,
    "sgemm": SgemmLinear,
    "sgemm512": Sgemm512Linear,
    "dpbf16": Dpbf16Linear,
    "amx": AmxLinear,
}


class PackedLinear(nn.Module):
    """A drop-in for nn.Linear whose weight is packed once, run by the strategy of the
    kernel family `choice` names (see `choose`)."""

    def __init__(self, linear: nn.Linear, choice: Choice) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = linear.weight.dtype
        self.choice = choice
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # A plain attribute, not parameters: the packed layouts are opaque tensors that
        # state_dict() and .to() must not touch.
        self.strategy = FAMILIES[choice.family](linear.weight.detach(), self.bias, choice)
        self.scratch: Scratch | None = None  # see Scratch

    @classmethod
    def of_weight(cls, weight: torch.Tensor, choice: Choice) -> PackedLinear:
        """For a bare weight (the lm_head): no bias."""
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        return cls(linear, choice)

    @property
    def gated_inter(self) -> int | None:
        """Set where silu_mul() is there (MLP.forward takes it)."""
        return self.strategy.gated_inter

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of this gate_up projection, [..., gated_inter], in one pass."""
        inter = self.gated_inter
        assert inter is not None
        y = self.strategy.silu_mul(x.reshape(-1, self.in_features), self.scratch)
        return y.view(*x.shape[:-1], inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.strategy.forward(x, self.scratch)


def pack_head(weight: torch.Tensor, amx_copy: bool = False) -> PackedLinear:
    """The lm_head's PackedLinear (amx_copy: as decode_on_amx decided for the model)."""
    return PackedLinear.of_weight(
        weight, choose(weight.dtype, tuple(weight.shape), mkl=False, amx_copy=amx_copy)
    )


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
        span = layer.strategy.onednn_rows() if isinstance(layer, PackedLinear) else None
        if span is None:
            continue
        lo, last = span
        hi = max_logit_rows if layer is head else max_rows
        hi = hi if last is None else min(hi, last)
        key = (layer.in_features, layer.out_features, layer.bias is None, layer.dtype, lo, hi)
        if key in done:
            continue
        done.add(key)
        for rows in sorted({cpu_kernels.gemm_rows(r) for r in range(lo, hi + 1)}):
            layer.strategy.warm(torch.zeros(rows, layer.in_features, dtype=layer.dtype))
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


# Under PAGESTREAM_PREFILL_GEMM=onednn (two copies) and PAGESTREAM_DECODE_GEMM=auto the AMX
# copy of the weights is made only when it takes at most this share of the memory available
# at load: it doubles the projections' memory, and a replica sized for one copy must not run
# out of memory for a faster decode.
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
    """Whether `model`'s bf16 products take the AMX kernel: use_amx, and, where the AMX
    copy is a second one (amx_max_rows), the copy of the linears (plus `extra_bytes`, the
    lm_head's) fits the memory (amx_copy_fits); a refusal for memory is logged as a warning."""
    if not use_amx(dtype):
        return False
    if amx_max_rows() is None:  # the AMX layout is the weights' only copy
        return True
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
    """Swap every nn.Linear of a CPU model for a PackedLinear on the family `choose` picks
    for it; returns how many.  (Quantized layers are not nn.Linear and keep their own
    kernels.)  amx: the AMX copies may be made (decode_on_amx decides)."""
    if not linears_packable(dtype):
        return 0
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
    chosen: Counter[str] = Counter()

    def make(lin: nn.Linear) -> PackedLinear:
        choice = choose(dtype, (lin.out_features, lin.in_features), bias=lin.bias is not None,
                        gated_inter=gated.get(id(lin)), amx_copy=amx)  # fmt: skip
        chosen[choice.describe()] += 1
        return PackedLinear(lin, choice)

    n = swap_linears(model, make)
    log.info("%s projections: %s", str(dtype).split(".")[-1],
             "; ".join(f"{c} on {kind}" for kind, c in chosen.most_common()))  # fmt: skip
    return n


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
