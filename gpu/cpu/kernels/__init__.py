"""CPU kernels compiled on first use (a C++ compiler is all they need; no torch headers).

`decode_attention` and `prefill_attention` read K/V rows straight from the paged cache,
which the torch path cannot do without first gathering (and transposing) every sequence's
blocks into a dense copy; prefill is a flash-attention style kernel several times faster
than torch's CPU SDPA.  `int8_gemv` is the decode matmul of `--quantization int8`
(int8_gemv.cpp).  `write_kv` and `argmax` replace a step's small ATen ops (step_ops.cpp).
`sgemm` is the float32 projection on AVX2-only CPUs (sgemm.cpp; `sgemm_silu` its gated
form for the MLP's gate_up) and
`amx_gemm` the bfloat16 one on CPUs with AMX tiles (amx_gemm.cpp), `dpbf16_gemm` every
bfloat16 projection on CPUs with AVX512-BF16 but no AMX (dpbf16_gemm.cpp), `sgemm512` every
float32 one on AVX-512 CPUs without AMX (the same file and loop with float32 FMAs), all used by
gpu/cpu/linear.py.  When no compiler is available, or PAGESTREAM_CPU_KERNELS=0,
`available()` is False and the torch path runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from gpu.config import cache_root
from gpu.cpu import features as cpu_features
from gpu.cpu.features import CpuFeatures
from gpu.cpu.kernels import bindings
from scheduler import envs

log = logging.getLogger(__name__)

# Compiled together into one shared library.
_SRCS = [
    Path(__file__).with_name(n)
    for n in (
        "paged_decode.cpp",
        "paged_decode_int8.cpp",
        "paged_decode_fp8.cpp",
        "paged_prefill.cpp",
        "elementwise.cpp",
        "int8_gemv.cpp",
        "step_ops.cpp",
        "sgemm.cpp",
        "amx_gemm.cpp",
        "dpbf16_gemm.cpp",
        "layer_stack.cpp",
    )
]
# Every header beside them (all part of the cache key: a new one cannot be left out).
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_lib: ctypes.CDLL | None = None
_tried = False
_sanitize = False  # use_sanitizers()


def _cache_dir() -> Path:
    return cache_root() / "cpu-kernels"


def _flags() -> list[str]:
    """Compile flags (compile_shared links without them)."""
    # -march=native: built on the machine that runs it (cached per source + flags + CPU).
    march = envs.PAGESTREAM_CPU_MARCH
    return ["-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]


# No -ffast-math when linking: with it gcc adds crtfastmath.o, whose constructor sets
# flush-to-zero and denormals-are-zero in MXCSR on dlopen, and every float32 op torch then
# runs on that thread (and threads it starts) flushes subnormals to zero.
_LINK_FLAGS = ["-shared", "-fopenmp"]
# The library's own sources build warning-free and -Werror keeps them so (not in _flags():
# bench/kernel_rev.py compiles past revisions with those).  A compiler newer than CI's may
# warn where CI's does not: then _build retries with -Wno-error, logs the warnings, and
# `werror_fallback` holds them (tests assert it stays empty).
_WARNINGS = ["-Wall", "-Wextra", "-Werror"]
werror_fallback = ""
# use_sanitizers()'s test build: AddressSanitizer + UndefinedBehaviorSanitizer, aborting at
# the first report, under its own library name.
_SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def use_sanitizers() -> None:
    """For tests only, before the first load(): build and load the ASan + UBSan variant of
    the library (libpagestream_cpu_sanitized-*.so), never the product's.  The process must
    have libasan loaded first (LD_PRELOAD): tests/gpu/test_cpu_sanitizers.py runs kernel
    tests in a subprocess so."""
    global _sanitize
    assert not _tried, "use_sanitizers() must come before the kernels are loaded"
    _sanitize = True


def compile_shared(
    cxx: str, flags: list[str], srcs: list[Path], out: Path | str, link: list[str] = _LINK_FLAGS
) -> None:
    """Compiles srcs with flags into objects, then links them (with `link`) into the shared
    library out."""
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in srcs]
        # Compiled side by side: the two cores of a CI machine halve a cold build.
        cmds = [[cxx, *flags, "-c", str(src), "-o", obj] for src, obj in zip(srcs, objs)]
        env = envs.without_preload()
        procs = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True, env=env) for c in cmds]
        errors = [p.communicate()[1] for p in procs]
        failed = [src.name for src, p in zip(srcs, procs) if p.returncode != 0]
        if failed:
            raise subprocess.CalledProcessError(1, [cxx, *failed], stderr="".join(errors))
        subprocess.run(
            [cxx, *objs, *link, "-o", str(out)], check=True, capture_output=True, text=True,
            env=env,
        )  # fmt: skip


def _cpu_id() -> str:
    """The whole flags line: -march=native may use any of them, not just the ISA set."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def cache_key(
    cxx: str, flags: list[str], cpu: CpuFeatures | None = None, link: list[str] = _LINK_FLAGS
) -> str:
    """Names the library: the kernels' ISA variant in clear (avx512-bf16, avx512, avx2,
    generic: a different build for each) and a hash over the sources, the compiler and its
    flags, the CPU model and its flags."""
    cpu = cpu or cpu_features.detect()
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in (*_SRCS, *_HEADERS))
        + " ".join([cxx, *flags, "link:", *link]).encode()
        + cpu.model.encode()
        + " ".join(sorted(cpu.flags)).encode()
        + _cpu_id().encode()
    ).hexdigest()[:16]
    march = next((f.removeprefix("-march=") for f in flags if f.startswith("-march=")), "")
    variant = cpu.isa if march in ("", "native") else f"march-{march}"
    return f"{variant}-{digest}"


def _build() -> Path:
    global werror_fallback
    cxx = envs.CXX or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    flags, link, name = [*_flags(), *_WARNINGS], _LINK_FLAGS, "libpagestream_cpu"
    if _sanitize:  # -O1: the instrumented -O3 build takes several times as long
        # Without -Werror: at -O1 gcc 12 flags its own AVX-512 headers' self-initialised
        # temporaries (maybe-uninitialized), and a failed build is not cached, so every
        # run paid for it before the fallback (~40 s of a ~55 s test).  The product's -O3
        # build keeps -Werror and the sources clean.
        flags = [*(f for f in flags if f not in ("-O3", "-Werror")), "-O1", *_SANITIZE]
        link, name = [*link, *_SANITIZE], f"{name}_sanitized"
    try:
        return _build_as(cxx, flags, link, name)
    except RuntimeError as e:
        if "-Werror=" not in str(e):
            raise
        werror_fallback = str(e)
        log.warning("the CPU kernels have compiler warnings, built without -Werror: %s", e)
        return _build_as(cxx, [*flags, "-Wno-error"], link, name)


def _build_as(cxx: str, flags: list[str], link: list[str], name: str) -> Path:
    out = _cache_dir() / f"{name}-{cache_key(cxx, flags, link=link)}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        compile_shared(cxx, flags, _SRCS, tmp, link)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            f"compiling {' '.join(p.name for p in _SRCS)} failed: {e.stderr[-2000:]}"
        ) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> ctypes.CDLL | None:
    """The compiled library, building it once per machine; None if it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not envs.PAGESTREAM_CPU_KERNELS:
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no compiler, no OpenMP, read-only cache...
        log.warning("CPU attention kernel unavailable, using the torch path: %s", e)
        return None
    bindings.declare(lib)  # every argtypes/restype, from entry_points.h
    log.info("CPU attention kernels: %s build", isa(lib))
    _lib = lib
    return lib


def isa(lib: ctypes.CDLL | None = None) -> str | None:
    """The compiled variant (avx512-bf16, avx512, avx2, generic); None without kernels."""
    lib = lib or load()
    return None if lib is None else lib.ps_isa().decode()


def fused_enabled() -> bool:
    """The elementwise chain may run in the compiled kernels (PAGESTREAM_CPU_FUSED, default
    on; 0 keeps torch's ops, for comparisons)."""
    return envs.PAGESTREAM_CPU_FUSED


def available() -> bool:
    return load() is not None


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    lib = load()
    return (
        lib is not None
        and dtype in (torch.float32, torch.bfloat16)
        and num_heads // num_kv_heads <= lib.ps_max_group()
        and head_dim <= lib.ps_max_dim()
    )


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]: heads x dim dense, any token stride
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_threads: int | None = None,  # default: torch.get_num_threads()
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, Hkv] bf16
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D], written in place (any token stride)
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence against its whole paged context (zeros where the
    context is empty).  With scales, the cache holds int8 / fp8 values (gpu.kv_quant),
    dequantized as each row is loaded.  q may be a view into the fused qkv projection and
    out one into the step's output: the kernel reads and writes them at their strides."""
    lib = load()
    assert lib is not None
    assert q.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
    _check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    assert hq % hkv == 0 and hq // hkv <= lib.ps_max_group() and d <= lib.ps_max_dim()
    if not _rows_dense(q):
        q = q.contiguous()
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype)
    assert out.dtype == q.dtype and out.shape == q.shape
    dst = out if _rows_dense(out) else torch.empty((b, hq, d), dtype=q.dtype)
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    nt = num_threads or torch.get_num_threads()
    if k_scale is not None and v_scale is not None:
        lib.ps_decode_quant(
            _quant_kind(k_cache), int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), dst.data_ptr(),
            dst.stride(0), b, hq, hkv, d, k_cache.shape[1], scale, nt,
        )  # fmt: skip
    else:
        fn = lib.ps_decode_bf16 if q.dtype == torch.bfloat16 else lib.ps_decode_f32
        fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), dst.data_ptr(),
            dst.stride(0), b, hq, hkv, d, k_cache.shape[1], scale, nt,
        )  # fmt: skip
    if dst is not out:
        out.copy_(dst)
    return out


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]: rows query_start_loc[i]..[i + 1] are request i's
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the chunk's K/V already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, absolute rows of q/out
    seq_lens: torch.Tensor,  # [B] int32, context after the chunk
    scale: float,
    out: torch.Tensor | None = None,  # written in place at the requests' rows
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, Hkv] bf16
    v_scale: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64 (AttentionMetadata.tree_bits)
) -> torch.Tensor:
    """Causal attention of every request's chunk over its paged context, in one call:
    query j of a chunk of length L sits at position seq_len - L + j and sees keys up to it
    (and, with tree_bits, only the chunk keys its bits name).
    Rows of q/out outside the requests' ranges are left alone."""
    lib = load()
    assert lib is not None
    assert q.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
    _check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
    b = seq_lens.shape[0]
    assert query_start_loc.shape[0] == b + 1 and block_tables.shape[0] >= b
    # Tokens may be strided (a view into a fused qkv projection); heads x dim must be dense.
    if not _rows_dense(q):
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.dtype == q.dtype and out.shape == q.shape
    dst = out if _rows_dense(out) else torch.empty_like(q, memory_format=torch.contiguous_format)
    tables = block_tables.contiguous()
    qsl = query_start_loc.contiguous()
    lens = seq_lens.contiguous()
    _, hq, d = q.shape
    tree = None
    if tree_bits is not None:
        assert tree_bits.dtype == torch.int64 and tree_bits.shape[0] >= q.shape[0]
        tree_bits = tree_bits.contiguous()
        tree = tree_bits.data_ptr()
    if k_scale is not None and v_scale is not None:
        lib.ps_prefill_quant(
            _quant_kind(k_cache), int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr(),
            dst.data_ptr(), dst.stride(0), b, hq, k_cache.shape[2], d, k_cache.shape[1], scale,
            torch.get_num_threads(), tree,
        )  # fmt: skip
    else:
        fn = lib.ps_prefill_bf16 if q.dtype == torch.bfloat16 else lib.ps_prefill_f32
        fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), lens.data_ptr(),
            dst.data_ptr(), dst.stride(0), b, hq, k_cache.shape[2], d, k_cache.shape[1], scale,
            torch.get_num_threads(), tree,
        )  # fmt: skip
    if dst is not out:
        lo, hi = int(qsl[0]), int(qsl[-1])
        out[lo:hi] = dst[lo:hi]
    return out


def sgemm_available() -> bool:
    """The AVX2 float32 GEMM (sgemm.cpp, also over bf16 weights) is built: it needs AVX2
    and FMA."""
    lib = load()
    return lib is not None and bool(lib.ps_sgemm_available())


_HUGE = 2 << 20  # an x86-64 transparent huge page
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise(addr, length, advice) == 0


def huge_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(numel) whose whole 2 MB stretches are transparent huge pages where the
    kernel gives them (best effort: plain pages otherwise).  For the packed weights, which a
    decode step streams end to end: in 4 KB pages every 4 KB of weight is a TLB miss and a
    page walk, and the hardware prefetchers stop at every page boundary.  Most distributions
    set THP to `madvise`, so an allocation gets huge pages only when asked."""
    size = dtype.itemsize
    if numel * size < _HUGE or not envs.PAGESTREAM_HUGE_PAGES:
        return torch.empty(numel, dtype=dtype)
    buf = torch.empty(numel + _HUGE // size, dtype=dtype)
    skip = (-buf.data_ptr() % _HUGE) // size  # elements up to the first 2 MB boundary
    out = buf[skip : skip + numel]
    # Before the first touch, so faults take huge pages (collapse_huge after the fill).
    _madvise(out.data_ptr(), _huge_span(out), _MADV_HUGEPAGE)
    return out


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape) on huge pages where it is 2 MB or more (huge_empty).  For the
    paged KV cache: a decode step reads each sequence's blocks wherever the pool put them,
    a few KB per block and layer, so in 4 KB pages nearly every block read is a TLB miss
    and a page walk, which huge pages avoid (decode attention over a shuffled cache reads
    K/V measurably faster in them)."""
    out = huge_empty(math.prod(shape), dtype).zero_()
    # Memory the allocator hands back (freed by the load before it) may be faulted in
    # already, in 4 KB pages: MADV_HUGEPAGE does not convert those, MADV_COLLAPSE does.
    collapse_huge(out)
    return out.view(shape)


def _huge_span(t: torch.Tensor) -> int:
    """The bytes of t's whole 2 MB pages, from its start (0 unless it starts on one)."""
    return 0 if t.data_ptr() % _HUGE else t.numel() * t.element_size() // _HUGE * _HUGE


def collapse_huge(t: torch.Tensor) -> None:
    """MADV_COLLAPSE (Linux 6.1+, whatever the THP setting) over huge_empty's memory once
    filled: pages the allocator had already touched were faulted in 4 KB at a time."""
    span = _huge_span(t)
    if span and envs.PAGESTREAM_HUGE_PAGES:
        _madvise(t.data_ptr(), span, _MADV_COLLAPSE)


def _pack(kernel: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] `dtype` (nn.Linear's weight) -> the panel layout of ps_{kernel}_pack."""
    lib = load()
    assert lib is not None and weight.dtype == dtype and weight.dim() == 2
    w = weight.detach().contiguous()
    n, k = w.shape
    out = huge_empty(getattr(lib, f"ps_{kernel}_packed_size")(n, k), dtype)
    getattr(lib, f"ps_{kernel}_pack")(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    collapse_huge(out)
    return out


def _packed_gemm(
    kernel: str,
    dtype: torch.dtype,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """x @ weight.T (+ float32 bias) through ps_{kernel}: x [M, K] and out [M, N] in `dtype`
    with unit column stride (any row stride)."""
    lib = load()
    assert lib is not None and x.dtype == dtype and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    assert packed.numel() == getattr(lib, f"ps_{kernel}_packed_size")(n, k)
    if out is None:
        out = torch.empty(m, n, dtype=dtype)
    assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == dtype
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n
    getattr(lib, f"ps_{kernel}")(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _sgemm_kernel(dtype: torch.dtype) -> str:
    assert dtype in (torch.float32, torch.bfloat16), dtype
    return "sgemm" if dtype == torch.float32 else "sgemm_bf16"


def sgemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 or bfloat16 (nn.Linear's weight) -> sgemm's panel layout in that
    dtype (flat, N rounded up to 16 columns)."""
    return _pack(_sgemm_kernel(weight.dtype), weight, weight.dtype)


def sgemm(
    x: torch.Tensor,  # [M, K] float32 or bfloat16 (the weight's), unit column stride
    packed: torch.Tensor,  # sgemm_pack(weight)
    n: int,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [M, N] x's dtype, unit column stride
) -> torch.Tensor:
    """x @ weight.T (+ bias) through the packed layout; bf16 is computed in float32 and
    rounded once."""
    assert packed.dtype == x.dtype, (packed.dtype, x.dtype)
    return _packed_gemm(_sgemm_kernel(x.dtype), x.dtype, x, packed, n, bias, out)


def bf16_exact(weight: torch.Tensor) -> bool:
    """Every value of a float32 tensor is a bf16 one (the low 16 bits of each are zero): a
    bf16 checkpoint's weight run in float32."""
    if weight.dtype != torch.float32:
        return False
    low = weight.detach().contiguous().view(torch.int16)[..., 0::2]  # little-endian
    return not bool(low.any())


def sgemm_w16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16_exact float32 weight [N, K] -> sgemm_w16's layout: the bf16 sgemm's, of its
    values in bf16."""
    return sgemm_pack(weight.to(torch.bfloat16))


def sgemm_w16(
    x: torch.Tensor,  # [M, K] float32, unit column stride
    packed: torch.Tensor,  # sgemm_w16_pack(weight)
    n: int,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [M, N] float32, unit column stride
) -> torch.Tensor:
    """sgemm over the float32 weight, bit for bit, from half its bytes (each weight
    widened as it loads)."""
    assert packed.dtype == torch.bfloat16, packed.dtype
    return _packed_gemm("sgemm_w16", torch.float32, x, packed, n, bias, out)


def amx_available() -> bool:
    """The bf16 AMX GEMM (amx_gemm.cpp) is built and the kernel lets this process use the
    tile registers."""
    lib = load()
    return lib is not None and bool(lib.ps_amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 (nn.Linear's weight, K a multiple of 32) -> the AMX panel layout
    (flat, N rounded up to 16 columns)."""
    assert weight.shape[-1] % 32 == 0, weight.shape
    return _pack("amx_gemm", weight, torch.bfloat16)


def amx_gemm(
    x: torch.Tensor,  # [M, K] bfloat16, unit column stride, K a multiple of 32
    packed: torch.Tensor,  # amx_pack(weight)
    n: int,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [M, N] bfloat16, unit column stride
) -> torch.Tensor:
    """x @ weight.T (+ bias) on AMX tiles, float32 accumulation, rounded once to bf16."""
    assert x.shape[-1] % 32 == 0, x.shape
    return _packed_gemm("amx_gemm", torch.bfloat16, x, packed, n, bias, out)


def wide_l1() -> bool:
    """The kernels prefetch weights and K/V into L1 rather than L2: an AMD core with an L1d
    of 48 KB or more (cpu_cache.h says why)."""
    lib = load()
    return lib is not None and bool(lib.ps_wide_l1())


def dpbf16_available() -> bool:
    """The AVX512-BF16 GEMM (dpbf16_gemm.cpp) is built: it needs AVX512F/BW and
    AVX512-BF16."""
    lib = load()
    return lib is not None and bool(lib.ps_dpbf16_available())


def dpbf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 (nn.Linear's weight) -> dpbf16_gemm's layout of k pairs in groups of
    panels (flat, N rounded up to 16 columns, K to even)."""
    return _pack("dpbf16", weight, torch.bfloat16)


def dpbf16_gemm(
    x: torch.Tensor,  # [M, K] bfloat16, unit column stride
    packed: torch.Tensor,  # dpbf16_pack(weight)
    n: int,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [M, N] bfloat16, unit column stride
) -> torch.Tensor:
    """x @ weight.T (+ bias) on vdpbf16ps, float32 accumulation, rounded once to bf16."""
    return _packed_gemm("dpbf16", torch.bfloat16, x, packed, n, bias, out)


def sgemm512_available() -> bool:
    """dpbf16_gemm.cpp's float32 kernel is built: it needs AVX-512F/BW."""
    lib = load()
    return lib is not None and bool(lib.ps_sgemm512_available())


def sgemm512_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> sgemm512's layout (dpbf16_pack's, one value of k a word)."""
    return _pack("sgemm512", weight, torch.float32)


def sgemm512(
    x: torch.Tensor,  # [M, K] float32, unit column stride
    packed: torch.Tensor,  # sgemm512_pack(weight)
    n: int,
    bias: torch.Tensor | None = None,  # [N] float32
    out: torch.Tensor | None = None,  # [M, N] float32, unit column stride
) -> torch.Tensor:
    """x @ weight.T (+ bias) on AVX-512 FMAs, one sequential sum over k per element."""
    return _packed_gemm("sgemm512", torch.float32, x, packed, n, bias, out)


# Outputs per group of the gated layout: a group's 4 panels of 16 columns are 2 of gate, 2
# of up (kNR x kNP in dpbf16_gemm.cpp).
GATED_GROUP = 32
# The AMX kernel's and the AVX2 sgemm's: one 16-column panel of gate beside its panel of up.
AMX_GATED_GROUP = 16
SGEMM_GATED_GROUP = 16


def gated_order(inter: int, group: int = GATED_GROUP) -> torch.Tensor:
    """The gate_up weight's rows ([gate; up], 2 * inter) in a gated layout's order: for
    each `group` outputs, their gate rows, then their up rows."""
    assert inter % group == 0, (inter, group)
    g = torch.arange(inter).view(-1, group)
    return torch.cat((g, g + inter), dim=1).reshape(-1)


def _gated_rows(weight: torch.Tensor, inter: int, group: int = GATED_GROUP) -> torch.Tensor:
    """The MLP's gate_up weight [2 * inter, K] with its rows in gated_order."""
    assert weight.shape[0] == 2 * inter, (weight.shape, inter)
    return weight.detach().index_select(0, gated_order(inter, group))


def dpbf16_gated_pack(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """The MLP's gate_up weight [2 * inter, K] bf16 -> dpbf16_silu's layout (inter a
    multiple of GATED_GROUP)."""
    return _pack("dpbf16", _gated_rows(weight, inter), torch.bfloat16)


def sgemm512_gated_pack(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """The MLP's gate_up weight [2 * inter, K] float32 -> sgemm512_silu's layout."""
    return _pack("sgemm512", _gated_rows(weight, inter), torch.float32)


def sgemm512_silu(
    x: torch.Tensor,  # [M, K] float32, unit column stride
    packed: torch.Tensor,  # sgemm512_gated_pack(gate_up weight, inter)
    inter: int,
    out: torch.Tensor | None = None,  # [M, inter] float32, unit column stride
) -> torch.Tensor:
    """dpbf16_silu in float32: the bits of sgemm512 followed by silu_mul."""
    return _gated_gemm("sgemm512", x, packed, inter, out)


def sgemm_gated_pack(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """The MLP's gate_up weight [2 * inter, K] float32 -> sgemm_silu's layout (inter a
    multiple of SGEMM_GATED_GROUP)."""
    return _pack("sgemm", _gated_rows(weight, inter, SGEMM_GATED_GROUP), torch.float32)


def sgemm_w16_gated_pack(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """sgemm_gated_pack's layout for a bf16_exact float32 weight, in bf16 (narrowed before
    the rows are reordered: half the copy)."""
    return sgemm_pack(_gated_rows(weight.to(torch.bfloat16), inter, SGEMM_GATED_GROUP))


def sgemm_w16_silu(
    x: torch.Tensor,  # [M, K] float32, unit column stride
    packed: torch.Tensor,  # sgemm_w16_gated_pack(gate_up weight, inter)
    inter: int,
    out: torch.Tensor | None = None,  # [M, inter] float32, unit column stride
) -> torch.Tensor:
    """sgemm_silu's bits from the weight held in bf16."""
    return _gated_gemm("sgemm_w16", x, packed, inter, out)


def sgemm_silu(
    x: torch.Tensor,  # [M, K] float32, unit column stride
    packed: torch.Tensor,  # sgemm_gated_pack(gate_up weight, inter)
    inter: int,
    out: torch.Tensor | None = None,  # [M, inter] float32, unit column stride
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) on the AVX2 sgemm: the bits of sgemm followed by
    silu_mul, without the [M, 2 * inter] product in between."""
    return _gated_gemm("sgemm", x, packed, inter, out)


class GatedKernel(NamedTuple):
    """A kernel whose gated layout serves products of every size: its pack of the gate_up
    weight, the fused SiLU·up product, its plain product (in gated column order) and the
    outputs per group of that order."""

    pack: Callable[[torch.Tensor, int], torch.Tensor]
    silu: Callable[..., torch.Tensor]
    gemm: Callable[..., torch.Tensor]
    group: int


def gated_kernel(kernel: str) -> GatedKernel:
    """ "dpbf16", "sgemm512", "sgemm" or "sgemm_w16"."""
    return {
        "dpbf16": GatedKernel(dpbf16_gated_pack, dpbf16_silu, dpbf16_gemm, GATED_GROUP),
        "sgemm512": GatedKernel(sgemm512_gated_pack, sgemm512_silu, sgemm512, GATED_GROUP),
        "sgemm": GatedKernel(sgemm_gated_pack, sgemm_silu, sgemm, SGEMM_GATED_GROUP),
        "sgemm_w16": GatedKernel(
            sgemm_w16_gated_pack, sgemm_w16_silu, sgemm_w16, SGEMM_GATED_GROUP
        ),
    }[kernel]


def amx_gated_pack(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """The MLP's gate_up weight [2 * inter, K] bf16 -> amx_silu's layout (inter a multiple
    of AMX_GATED_GROUP, K of 32); amx_gemm on it gives the product in that order."""
    return amx_pack(_gated_rows(weight, inter, AMX_GATED_GROUP))


def _gated_gemm(
    kernel: str, x: torch.Tensor, packed: torch.Tensor, inter: int, out: torch.Tensor | None
) -> torch.Tensor:
    """ps_{kernel}_silu: x [M, K] (bf16; sgemm512 and sgemm: float32) -> silu(x @ gate.T)
    * (x @ up.T) [M, inter]."""
    lib = load()
    dtype = torch.float32 if kernel in ("sgemm512", "sgemm", "sgemm_w16") else torch.bfloat16
    assert lib is not None and x.dtype == dtype and x.dim() == 2
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    name = "amx_gemm" if kernel == "amx" else kernel
    assert packed.numel() == getattr(lib, f"ps_{name}_packed_size")(2 * inter, k)
    if out is None:
        out = torch.empty(m, inter, dtype=dtype)
    assert out.shape == (m, inter) and out.stride(1) == 1 and out.dtype == dtype
    ok = getattr(lib, f"ps_{kernel}_silu")(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), 2 * inter, out.data_ptr(),
        out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    assert ok, f"{kernel}_silu: kernel not built, or inter {inter} not a whole group"
    return out


def dpbf16_silu(
    x: torch.Tensor,  # [M, K] bfloat16, unit column stride
    packed: torch.Tensor,  # dpbf16_gated_pack(gate_up weight, inter)
    inter: int,
    out: torch.Tensor | None = None,  # [M, inter] bfloat16, unit column stride
) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in one pass, rounded as the gate_up GEMM followed by
    silu_mul rounds: the [M, 2 * inter] product is never written."""
    return _gated_gemm("dpbf16", x, packed, inter, out)


def amx_silu(
    x: torch.Tensor,  # [M, K] bfloat16, unit column stride, K a multiple of 32
    packed: torch.Tensor,  # amx_gated_pack(gate_up weight, inter)
    inter: int,
    out: torch.Tensor | None = None,  # [M, inter] bfloat16, unit column stride
) -> torch.Tensor:
    """dpbf16_silu on AMX tiles: the same bits as amx_gemm followed by silu_mul."""
    return _gated_gemm("amx", x, packed, inter, out)


# Up to this many activation rows the int8 GEMV below is used; more rows (prefill) are
# compute-bound, where a dequantized weight through oneDNN's GEMM wins.
INT8_GEMV_MAX_ROWS = 16


def int8_gemv_supports(in_features: int) -> bool:
    lib = load()
    lanes = lib.ps_int8_lanes() if lib is not None else 0
    return lanes > 0 and in_features % lanes == 0


INT8_TILE = 8  # rows per tile of int8_pack's layout (kTile in int8_gemv.cpp)


def int8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> the GEMV's layout, N * K bytes: tiles of INT8_TILE rows interleaved
    in 32-byte column groups (one sequential stream per tile), the N % INT8_TILE last rows
    row-major."""
    lib = load()
    assert lib is not None and qweight.dtype == torch.int8 and qweight.dim() == 2
    q = qweight.contiguous()
    out = torch.empty(q.numel(), dtype=torch.int8)
    lib.ps_int8_pack(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())
    return out


def int8_unpack(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """int8_pack's inverse, widened to `dtype` in the same pass: [N, K]."""
    assert packed.dtype == torch.int8 and packed.numel() == n * k and packed.is_contiguous()
    if dtype not in (torch.float32, torch.bfloat16):
        return int8_unpack(packed, n, k, torch.float32).to(dtype)
    lib = load()
    assert lib is not None
    out = torch.empty(n, k, dtype=dtype)
    lib.ps_int8_unpack(
        packed.data_ptr(), n, k, out.data_ptr(), _is_bf16(out), torch.get_num_threads()
    )
    return out


def int8_gemv(
    x: torch.Tensor,  # [M, K] float32 or bfloat16, unit column stride
    qweight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N] float32 or bfloat16, added before rounding
    out_dtype: torch.dtype | None = None,  # float32 or bfloat16; default x's
) -> torch.Tensor:  # [M, N]
    """x @ (qweight * scale[:, None]).T (+ bias) with the weight read as int8 (int8_gemv.cpp).
    Packs the weight on every call: layers keep an Int8Gemv instead."""
    lib = load()
    assert lib is not None and qweight.dtype == torch.int8 and scale.dtype == torch.float32
    assert qweight.is_contiguous() and scale.is_contiguous()
    n, k = qweight.shape
    assert x.dim() == 2 and x.shape[1] == k and k % lib.ps_int8_lanes() == 0
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    return Int8Gemv(int8_pack(qweight), n, k, scale, bias, out_dtype)(x)


class Int8Gemv:
    """One int8 weight's decode GEMV with its pointers bound once: the call runs every
    projection of every decode step, so its Python share is kept to the ctypes call."""

    def __init__(
        self,
        packed: torch.Tensor,  # int8_pack(qweight [N, K])
        n: int,
        k: int,
        scale: torch.Tensor,  # [N] float32
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None,
    ) -> None:
        lib = load()
        assert lib is not None and packed.numel() == n * k and packed.is_contiguous()
        assert scale.dtype == torch.float32 and scale.is_contiguous()
        self._fn = lib.ps_int8_gemv
        self._w = (packed, scale, bias)  # keeps the pointers below alive
        self._n, self._k = n, k
        self._args = (
            packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
            0 if bias is None else _is_bf16(bias), n,
        )  # fmt: skip
        self._out_dtype = out_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        dtype = x.dtype
        x_bf16 = _BF16_FLAG[dtype]  # also rejects other dtypes
        out_dtype = self._out_dtype or dtype
        m = x.shape[0]
        y = torch.empty(m, self._n, dtype=out_dtype)
        self._fn(
            x.data_ptr(), x_bf16, x.stride(0), m, self._k, *self._args, y.data_ptr(),
            _BF16_FLAG[out_dtype], self._n, torch.get_num_threads(),
        )  # fmt: skip
        return y


_BF16_FLAG = {torch.float32: 0, torch.bfloat16: 1}


def _quant_kind(values: torch.Tensor) -> int:
    return 0 if values.dtype == torch.int8 else 1  # int8, else fp8 e4m3 bytes (uint8)


def _check_cache_dtypes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    assert q.dtype in (torch.float32, torch.bfloat16)
    if k_scale is None:
        assert q.dtype == k_cache.dtype == v_cache.dtype
        return
    assert v_scale is not None and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype in (torch.int8, torch.uint8)
    for t in (k_scale, v_scale):
        assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape == k_cache.shape[:3]


def _rows_dense(t: torch.Tensor) -> bool:
    """[tokens, heads, dim] with each token's heads x dim contiguous (any token stride)."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


# ---- the fused elementwise chain (elementwise.cpp) --------------------------------------


def gemm_rows(m: int) -> int:
    """The row count a oneDNN product of m rows runs at (gpu/cpu_linear.packed_linear): m
    rounded up to a bucket.  oneDNN builds (JIT-compiles) a kernel for every new shape,
    which costs more than the product itself even at a prefill chunk's size, and a server
    sees a new chunk size at nearly every prefill step.  Exact up to 64 rows (float32
    decode is compute-bound: padding decode rows costs its step's products in proportion),
    then steps of 4 to 128, 8 to 512, and a 16th of the power of two below m beyond: under
    180 kernels per weight up to 4,096 rows, all it ever builds, and a product padded by
    less than 1/16 (by at most 7 rows to 512)."""
    if m <= 64:
        return m
    g = 4 if m <= 128 else 8 if m <= 512 else 1 << (m.bit_length() - 5)
    return -(-m // g) * g


def empty_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty((rows, cols)) whose storage holds gemm_rows(rows) rows, the extra ones
    zero: a oneDNN product of it runs at its bucketed size without copying it."""
    full = gemm_rows(rows)
    buf = torch.empty((full, cols), dtype=dtype)
    if full > rows:
        buf[rows:].zero_()
    return buf[:rows]


def _is_bf16(t: torch.Tensor) -> int:
    assert t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu"
    return int(t.dtype == torch.bfloat16)


def add_rms_norm(
    x: torch.Tensor | None,  # [T, H], added into residual first (None: normalise only)
    residual: torch.Tensor,  # [T, H], updated in place to residual + x
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # rmsnorm(residual) * weight, [T, H]
    lib = load()
    assert lib is not None and residual.stride(-1) == 1 and weight.is_contiguous()
    rows, dim = residual.shape
    out = empty_rows(rows, dim, residual.dtype)  # a projection's input
    xp, xs = (None, 0) if x is None else (x.data_ptr(), x.stride(0))
    if x is not None:
        assert x.shape == residual.shape and x.dtype == residual.dtype and x.stride(-1) == 1
    lib.ps_add_rms_norm(
        _is_bf16(residual), xp, xs, residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        out.data_ptr(), out.stride(0), rows, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> silu(gate) * up, [T, I]
    lib = load()
    assert lib is not None and gate_up.stride(-1) == 1
    rows, width = gate_up.shape
    out = empty_rows(rows, width // 2, gate_up.dtype)  # down_proj's input
    lib.ps_silu_mul(
        _is_bf16(gate_up), gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
        out.stride(0), rows, width // 2, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_(
    q: torch.Tensor,  # [T, Hq, D], rotated in place (each token's heads dense)
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_positions, D/2] float32
    sin: torch.Tensor,
) -> None:
    """Rotate-half rotary embedding of q and k at their positions, in place."""
    lib = load()
    assert lib is not None and q.dtype == k.dtype and positions.dtype == torch.int64
    assert _rows_dense(q) and _rows_dense(k) and cos.is_contiguous() and sin.is_contiguous()
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] * 2 == q.shape[2]
    pos = positions.contiguous()
    lib.ps_rope(
        _is_bf16(q), q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0),
        k.shape[1], pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.shape[0], q.shape[2],
        torch.get_num_threads(),
    )  # fmt: skip


# ---- a step's small ops (step_ops.cpp) -----------------------------------------------


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D], each token's heads x dim dense (any token stride)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; negative: not stored
    k_scale: torch.Tensor | None = None,  # quantized cache: [num_blocks, block_size, Hkv] bf16
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Store the step's K/V rows at their slots in one call, as write_kv_reference does
    (quantized caches: values and scales exactly as gpu.kv_quant.quantize makes them).
    False, having written nothing, where the kernel does not take these tensors (the
    caller then runs the torch ops)."""
    lib = load()
    quant = k_scale is not None and v_scale is not None
    if (
        lib is None
        or k.dtype not in (torch.float32, torch.bfloat16)
        or v.dtype != k.dtype
        or (not quant and k_cache.dtype != k.dtype)
        or (quant and k_cache.dtype not in (torch.int8, torch.uint8))
        or v_cache.dtype != k_cache.dtype
        or k.device.type != "cpu"
        or slot_mapping.dtype != torch.int64
        or not (_rows_dense(k) and _rows_dense(v))
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k.shape[1:] != k_cache.shape[2:]
        or v.shape != k.shape
    ):
        return False
    sc: tuple[int | None, int | None] = (None, None)
    if quant:
        assert k_scale is not None and v_scale is not None
        assert k_scale.is_contiguous() and v_scale.is_contiguous()
        assert k_scale.dtype == v_scale.dtype == torch.bfloat16
        sc = (k_scale.data_ptr(), v_scale.data_ptr())
    slots = slot_mapping.contiguous()
    t, hkv, d = k.shape
    lib.ps_write_kv(
        _quant_kind(k_cache) if quant else -1, int(k.dtype == torch.bfloat16), k.data_ptr(),
        k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *sc,
        slots.data_ptr(), t, hkv, d, torch.get_num_threads(),
    )  # fmt: skip
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] float32 / bfloat16 -> [R] int64
    """torch.argmax(x, -1): the first index of each row's maximum, a NaN counting as the
    maximum.  One pass on the calling thread (ATen's bf16 argmax is several times slower,
    and an OpenMP region each call)."""
    lib = load()
    assert lib is not None and x.dim() == 2 and x.device.type == "cpu"
    rows, cols = x.shape
    if cols == 0 and rows:
        raise IndexError("argmax of an empty row")  # as torch.argmax refuses it
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows and cols:
        lib.ps_argmax(
            _is_bf16(x), x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """table[idx] for a [N, H] table and [T] int64 indices (the embedding lookup), as
    F.embedding gives it; None (nothing done) where an index is out of range or the tensors
    are not what the kernel takes, so the caller's torch op raises or runs instead."""
    lib = load()
    if (
        lib is None
        or table.dim() != 2
        or table.stride(1) != 1
        or table.device.type != "cpu"
        or idx.dim() != 1
        or idx.dtype != torch.int64
    ):
        return None
    idx = idx.contiguous()
    out = torch.empty((idx.shape[0], table.shape[1]), dtype=table.dtype)
    es = table.element_size()
    bad = lib.ps_gather_rows(
        table.data_ptr(), table.stride(0) * es, table.shape[0], idx.data_ptr(), idx.shape[0],
        out.data_ptr(), table.shape[1] * es, torch.get_num_threads(),
    )  # fmt: skip
    return out if bad < 0 else None
