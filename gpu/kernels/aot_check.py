"""Compile the kernels for a CUDA GPU without one: Triton -> PTX -> cubin (bundled ptxas).

The interpreter ignores GPU limits (tl.dot shapes, register and shared-memory budgets,
types the code generator rejects); this catches those on a CPU-only machine, and reports
registers, spills and shared memory per variant as ptxas sees them for the target arch.

Run in a process where TRITON_INTERPRET is unset (kernels must be compiled functions):
    python -m gpu.kernels.aot_check [--arch 90] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

_PTR = "*"


@dataclass
class Variant:
    name: str
    kernel: Any  # a triton JITFunction
    types: dict[str, str]  # runtime args: "*bf16", "i32", "i64", "fp32"
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2


@dataclass
class Report:
    name: str
    ok: bool
    seconds: float
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    error: str | None = None


def _ptrs(dt: str, *names: str) -> dict[str, str]:
    return {n: f"*{dt}" for n in names}


# Quantized KV (QUANT 1: int8, 2: fp8 bytes): the cache's element type, and its scales.
_CACHE_ELEM = {0: None, 1: "i8", 2: "u8"}
_SCALES = _ptrs("bf16", "k_scale_ptr", "v_scale_ptr")


def _dtypes() -> tuple[dict[str, Any], dict[str, Any]]:
    """("bf16" -> triton dtype, "bf16" -> torch dtype), imported late: torch and triton
    are only needed once there is something to compile."""
    import torch
    import triton.language as tl

    tl_of = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    torch_of = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return tl_of, torch_of


def _write_kv_variants() -> list[Variant]:
    from gpu.kernels import kv_cache

    tl_of, _ = _dtypes()
    out = []
    for dt, heads, dim, quant in (("bf16", 8, 128, 0), ("fp32", 2, 64, 0), ("bf16", 8, 128, 1),
                                  ("bf16", 8, 128, 2)):  # fmt: skip
        out.append(
            Variant(
                f"write_kv/{dt}/h{heads}/d{dim}" + (f"/q{quant}" if quant else ""),
                kv_cache._write_kv_kernel,
                {
                    **_ptrs(dt, "k_ptr", "v_ptr"),
                    **_ptrs(_CACHE_ELEM[quant] or dt, "k_cache_ptr", "v_cache_ptr"),
                    **_SCALES,
                    "slot_ptr": "*i64",
                },
                dict(
                    NUM_KV_HEADS=heads,
                    HEAD_DIM=dim,
                    HEADS_PAD=heads,
                    DIM_PAD=dim,
                    BLOCK_SIZE=16,
                    CACHE_DTYPE=tl_of[dt],
                    QUANT=quant,
                ),
                num_warps=4 if heads * dim >= 1024 else 1,
            )
        )
    return out


# (label, dtype, group, head_dim, block_size, max_query_len, block_m override, quant)
_AttnCase = tuple[str, str, int, int, int, int, int | None, int]


def _attention_cases(quick: bool) -> list[_AttnCase]:
    cases: list[tuple[str, str, int, int, int, int, int | None]] = [
        ("decode/bf16/g4/d128/bs16", "bf16", 4, 128, 16, 1, None),
        ("prefill/bf16/g4/d128/bs16", "bf16", 4, 128, 16, 512, None),
        ("decode/fp16/g8/d64/bs32", "fp16", 8, 64, 32, 1, None),
        ("prefill/bf16/g1/d128/bs32", "bf16", 1, 128, 32, 512, None),
        ("prefill/bf16/g8/d128/bm128", "bf16", 8, 128, 16, 512, 128),
        ("mixed/bf16/g4/d128/q2", "bf16", 4, 128, 16, 2, None),
        ("decode/fp32/g1/d128/bs16", "fp32", 1, 128, 16, 1, None),
        ("prefill/fp32/g4/d64/bs16", "fp32", 4, 64, 16, 512, None),
        ("prefill/fp32/g1/d128/bs32", "fp32", 1, 128, 32, 512, None),
    ]
    if quick:
        cases = cases[:2] + cases[-1:]
    return [
        *((*c, 0) for c in cases),
        ("decode/bf16/g4/d128/bs16/int8", "bf16", 4, 128, 16, 1, None, 1),
        ("prefill/bf16/g4/d128/bs16/fp8", "bf16", 4, 128, 16, 512, None, 2),
    ]


def _attention_variants(quick: bool) -> list[Variant]:
    """The one-launch kernel, with the tiles `default_config` picks for each case."""
    from gpu.kernels import attention as pa

    _, torch_of = _dtypes()
    out = []
    for label, dt, group, dim, bs, max_q, bm, quant in _attention_cases(quick):
        gp = group  # the cases use power-of-two groups
        bq, block_m, tile_n, warps, stages = pa.default_config(max_q == 1, gp, max_q, torch_of[dt])
        if bm is not None:
            block_m, bq, warps = bm, bm // gp, 8
        # Chunked cases also as a Medusa verify would run them: with tree bits.
        for tree in (False, True) if max_q > 1 and not quant else (False,):
            out.append(_attention_variant(pa, label, dt, group, dim, bs, max_q, quant, tree,
                                          (bq, block_m, tile_n, warps, stages)))  # fmt: skip
    return out


def _attention_variant(
    pa: Any, label: str, dt: str, group: int, dim: int, bs: int, max_q: int, quant: int,
    tree: bool, tiles: tuple[int, int, int, int, int],
) -> Variant:  # fmt: skip
    tl_of, _ = _dtypes()
    bq, block_m, tile_n, warps, stages = tiles
    return Variant(
        f"attn/{label}" + ("/tree" if tree else ""),
        pa._paged_attention_kernel,
        {
            **_ptrs(dt, "out_ptr", "q_ptr"),
            **_ptrs(_CACHE_ELEM[quant] or dt, "k_cache_ptr", "v_cache_ptr"),
            **_ptrs("i32", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"),
            **_SCALES,
            "tree_ptr": "*i64",
            "scale_log2": "fp32",
        },
        dict(
            HAS_TREE=tree,
            QUANT=quant,
            GROUP=group,
            GROUP_PAD=group,  # the cases use power-of-two groups
            HEAD_DIM=dim,
            BLOCK_SIZE=bs,
            BLOCK_Q=bq,
            BLOCK_M=block_m,
            TILE_N=tile_n,
            SINGLE_TOKEN=max_q == 1,
            IN_DTYPE=tl_of[dt],
            DOT_DTYPE=tl_of[dt],
        ),
        num_warps=warps,
        num_stages=stages,
    )


def _split_variants() -> list[Variant]:
    """The flash-decoding pair: the split-context kernel and the merge."""
    from gpu.kernels import attention as pa

    tl_of, torch_of = _dtypes()
    out = []
    for dt, group, dim in (("bf16", 4, 128), ("fp32", 8, 128)):
        block_m, tile_n, warps, stages = pa.split_config(group, torch_of[dt])
        out.append(
            Variant(
                f"attn_split/{dt}/g{group}/d{dim}",
                pa._paged_attention_split_kernel,
                {
                    **_ptrs("fp32", "m_part_ptr", "l_part_ptr", "acc_part_ptr"),
                    **_ptrs(dt, "q_ptr", "k_cache_ptr", "v_cache_ptr"),
                    **_ptrs("i32", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"),
                    **_SCALES,
                    "scale_log2": "fp32",
                },
                dict(
                    QUANT=0,
                    GROUP=group,
                    HEAD_DIM=dim,
                    BLOCK_SIZE=16,
                    BLOCK_M=block_m,
                    TILE_N=tile_n,
                    IN_DTYPE=tl_of[dt],
                    DOT_DTYPE=tl_of[dt],
                ),
                num_warps=warps,
                num_stages=stages,
            )
        )
    out.append(
        Variant(
            "attn_merge/bf16/d128",
            pa._split_merge_kernel,
            {
                "out_ptr": "*bf16",
                **_ptrs("fp32", "m_part_ptr", "l_part_ptr", "acc_part_ptr"),
                "query_start_loc_ptr": "*i32",
            },
            dict(HEAD_DIM=128, SPLITS_PAD=32, OUT_DTYPE=tl_of["bf16"]),
            num_warps=2,
        )
    )
    return out


def _norm_rope_variants() -> list[Variant]:
    from gpu.kernels import norm_rope

    tl_of, _ = _dtypes()
    out = [
        Variant(
            f"rms_norm/bf16/4096/residual={res}",
            norm_rope._rms_norm_kernel,
            {
                **_ptrs("bf16", "x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"),
                "eps": "fp32",
            },
            dict(HAS_RESIDUAL=res, BLOCK=4096, DTYPE=tl_of["bf16"]),
            num_warps=8,
        )
        for res in (False, True)
    ]
    out.append(
        Variant(
            "rotary/bf16/q32/k8/d128",
            norm_rope._rotary_kernel,
            {
                **_ptrs("bf16", "q_ptr", "k_ptr"),
                **_ptrs("fp32", "cos_ptr", "sin_ptr"),
                "pos_ptr": "*i64",
            },
            dict(HALF=64, Q_HEADS_PAD=32, K_HEADS_PAD=8, DTYPE=tl_of["bf16"]),
        )
    )
    return out


def _variants(quick: bool) -> list[Variant]:
    """Every kernel in the shapes serving uses (`quick`: fewer attention tiles)."""
    return [
        *_write_kv_variants(),
        *_attention_variants(quick),
        *_split_variants(),
        *_norm_rope_variants(),
    ]


def _ptxas_stats(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from `ptxas -v` on the generated PTX."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [
            get_ptxas(arch).path,
            "-v",
            "--regAllocOptLevel=2",  # as Triton itself invokes ptxas
            f"--gpu-name={sm_arch_from_capability(arch)}",
            src,
            "-o",
            os.path.join(d, "k.o"),
        ]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return (int(regs.group(1)) if regs else None, max(spills) if spills else 0)


def compile_all(arch: int = 90, quick: bool = False) -> list[Report]:
    import triton
    from triton.backends.compiler import GPUTarget

    from gpu.kernels._common import is_interpreted
    from gpu.kernels.attention import _paged_attention_kernel

    if is_interpreted(_paged_attention_kernel):
        raise RuntimeError("aot_check: unset TRITON_INTERPRET (kernels are interpreted here)")
    target = GPUTarget("cuda", arch, 32)
    reports: list[Report] = []
    for var in _variants(quick):
        t0 = time.perf_counter()
        try:
            kernel = var.kernel
            signature: dict[str, str] = {}
            constexprs: dict[str, Any] = {}
            attrs: dict[tuple[int, ...], list[list[Any]]] = {}
            for i, p in enumerate(kernel.params):
                if p.is_constexpr:
                    signature[p.name] = "constexpr"
                    # SOFT_BF16 is the interpreter's workaround: always off on a GPU.
                    constexprs[p.name] = var.constexprs.get(p.name, False)
                    if p.name != "SOFT_BF16" and p.name not in var.constexprs:
                        raise KeyError(f"{var.name}: no value for constexpr {p.name}")
                    continue
                ty = var.types.get(p.name, "i32")
                signature[p.name] = ty
                # Pointers from torch's allocator and the strides of the real layouts are
                # multiples of 16, which is what the JIT specialises on at run time.
                fixed = not getattr(p, "do_not_specialize", False)
                if ty.startswith(_PTR) or (fixed and p.name.startswith("stride_")):
                    attrs[(i,)] = [["tt.divisibility", 16]]
            src = triton.compiler.ASTSource(
                fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs
            )
            compiled = triton.compile(
                src,
                target=target,
                options={"num_warps": var.num_warps, "num_stages": var.num_stages},
            )
            regs, spills = _ptxas_stats(compiled.asm["ptx"], arch)
            reports.append(
                Report(
                    var.name,
                    True,
                    time.perf_counter() - t0,
                    registers=regs,
                    spill_bytes=spills,
                    shared_bytes=int(compiled.metadata.shared),
                )
            )
        except Exception as e:  # report every variant, then fail as a whole
            msg = f"{type(e).__name__}: {e}".strip().splitlines()
            reports.append(
                Report(var.name, False, time.perf_counter() - t0, error=" | ".join(msg[:6]))
            )
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="a few representative variants")
    ap.add_argument("--json", action="store_true", help="print one JSON list")
    args = ap.parse_args(argv)
    reports = compile_all(args.arch, args.quick)
    if args.json:
        print(json.dumps([asdict(r) for r in reports]))
    else:
        print(f"{'variant':44} {'ok':>3} {'regs':>5} {'spill B':>8} {'smem B':>8} {'s':>6}")
        for r in reports:
            print(
                f"{r.name:44} {'yes' if r.ok else 'NO':>3} {r.registers or '-':>5} "
                f"{r.spill_bytes if r.spill_bytes is not None else '-':>8} "
                f"{r.shared_bytes if r.shared_bytes is not None else '-':>8} {r.seconds:6.1f}"
            )
            if r.error:
                print(f"    {r.error}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
