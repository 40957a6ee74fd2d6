"""The compiled layer stack (cpu/kernels/layer_stack.cpp) and gpu/model.py's fused CPU
path are one layer definition: for the same step they make the same kernel calls, in the
same order, with the same arguments.

How: both sides are recorded at the one boundary they share, entry_points.h's C functions.
The Python path's calls are recorded through a proxy of the loaded library; the stack's
through a trace build of layer_stack.cpp linked against a shim generated from the header,
whose every entry point records its arguments and forwards to the real kernel.  Then the
two plans are compared call for call: every scalar exactly (eps of each norm, head counts
and head_dim, rows, block size, softmax scale, bf16 and quant-kind flags, strides, thread
count; floats as the float32 the C side receives), every pointer by what it points into
(the layer's norm weight, packed weight or bias, its K/V cache, the rotary tables, the
step's metadata, each at its byte offset; null where no bias or no residual add), and the
step's activations as such.  A changed eps, a swapped weight, a dropped bias, another
rope table or head count, a different kernel or call order on either side fails here.

Chosen over generating both from one description: the Python layer is also the GPU's and
the reference's, and the stack is a hand-scheduled C loop (buffer reuse, pruning); a
recorded plan checks the two as they are, wherever they are edited, without a code
generator in the product.  Since every C argument is in the plan, no list of "the
arguments that matter" is kept by hand.  The existing bit-equality tests
(test_cpu_layer_stack.py) stay: they check the activations this test treats as opaque.

The arguments not compared are the strides no kernel reads: the row stride of a null
pointer (the first norm has no residual to add: Python passes 0, the stack the row width)
and of a call with a single row (torch gives a one-row view whatever stride it likes)."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.kernels import bindings
from gpu.cpu.layer_stack import LayerStack

if not cpu_kernels.available():
    if os.environ.get("CI") == "true":
        pytest.fail("the CPU kernels must build in CI (a C++ compiler is installed)")
    pytest.skip("no C++ compiler: the CPU kernels are unavailable", allow_module_level=True)

KERNELS = {
    "dpbf16": ("bfloat16", cpu_kernels.dpbf16_available),
    "sgemm512": ("float32", cpu_kernels.sgemm512_available),
    "sgemm": ("float32", cpu_kernels.sgemm_available),
    "amx": ("bfloat16", cpu_kernels.amx_available),
}
SRC = bindings.HEADER.parent
# The parameters that count a call's rows (see _plan).
_ROW_COUNTS = ("rows", "ntok", "m", "nseq")


def _cxx() -> str:
    import shutil

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    assert cxx is not None
    return cxx


def _shim(names: list[str]) -> str:
    """C++ defining each of `names` as a forward through ps_trace_fns[i]."""
    fns = bindings.header().functions
    lines = ['#include "entry_points.h"', f'extern "C" void* ps_trace_fns[{len(names)}];']
    lines.append(f"void* ps_trace_fns[{len(names)}];")
    for i, n in enumerate(names):
        p = fns[n]
        params = ", ".join(f"{a.ctype} {a.name}" for a in p.params)
        args = ", ".join(a.name for a in p.params)
        lines.append(
            f'extern "C" {p.restype} {n}({params}) {{\n'
            f"  return reinterpret_cast<decltype(&{n})>(ps_trace_fns[{i}])({args});\n}}"
        )
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def trace_lib(tmp_path_factory):
    """(the trace build of layer_stack.cpp, the entry points it calls, in table order)."""
    tmp: Path = tmp_path_factory.mktemp("trace")
    cxx, flags = _cxx(), [*cpu_kernels._flags(), f"-I{SRC}"]
    obj = tmp / "layer_stack.o"
    subprocess.run([cxx, *flags, "-c", str(SRC / "layer_stack.cpp"), "-o", str(obj)], check=True)
    undefined = subprocess.run(
        ["nm", "-u", str(obj)], check=True, capture_output=True, text=True
    ).stdout.split()
    called = sorted(s for s in undefined if s.startswith("ps_"))
    assert called and set(called) <= set(bindings.header().functions)
    (tmp / "shim.cpp").write_text(_shim(called))
    so = tmp / "libtrace.so"
    subprocess.run(
        [cxx, *flags, "-shared", str(tmp / "shim.cpp"), str(obj), "-o", str(so)], check=True
    )
    lib = ctypes.CDLL(str(so))
    lib.ps_layer_stack.restype, lib.ps_layer_stack.argtypes = bindings.signature("ps_layer_stack")
    return lib, called


class _Recorder:
    """The loaded library, with calls to `names` appended to `log` as (name, args)."""

    def __init__(self, lib: ctypes.CDLL, names: set[str], log: list) -> None:
        self._lib, self._names, self._log = lib, names, log

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        if name not in self._names:
            return fn

        def recorded(*args):
            self._log.append((name, args))
            return fn(*args)

        return recorded


def _install(trace: ctypes.CDLL, called: list[str], real: ctypes.CDLL, log: list) -> list:
    """Points the shim's table at callbacks that record and call the real kernels; returns
    the callbacks (to be kept alive)."""
    table = (ctypes.c_void_p * len(called)).in_dll(trace, "ps_trace_fns")
    keep = []
    for i, name in enumerate(called):
        restype, argtypes = bindings.signature(name)
        fn = getattr(real, name)

        def cb(*args, _name=name, _fn=fn):
            log.append((_name, args))
            return _fn(*args)

        c = ctypes.CFUNCTYPE(restype, *argtypes)(cb)
        keep.append(c)
        table[i] = ctypes.cast(c, ctypes.c_void_p).value
    return keep


def _spans(model, kv_caches, meta, positions) -> list[tuple[int, int, str]]:
    """(start, end, name) of every tensor a kernel argument may point into, bar activations."""
    named: list[tuple[str, torch.Tensor | None]] = [
        ("positions", positions), ("slots", meta.slot_mapping), ("tables", meta.block_tables),
        ("seq_lens", meta.seq_lens), ("qsl", meta.query_start_loc), ("cos", model.rotary.cos),
        ("sin", model.rotary.sin), ("norm", model.norm.weight),
    ]  # fmt: skip
    for i, (layer, kv) in enumerate(zip(model.layers, kv_caches, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        named += [
            (f"L{i}.in_norm", layer.input_layernorm.weight),
            (f"L{i}.post_norm", layer.post_attention_layernorm.weight),
            (f"L{i}.k_cache", kv[0]), (f"L{i}.v_cache", kv[1]),
        ]  # fmt: skip
        for pname, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                           ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):  # fmt: skip
            for attr in ("packed", "amx", "bias_f32"):
                named.append((f"L{i}.{pname}.{attr}", getattr(lin.strategy, attr, None)))
    return [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in named
        # oneDNN's packed weights (AMX CPUs) are opaque, with no storage a kernel could see
        if t is not None and t.numel() and not t.is_mkldnn
    ]


def _plan(log: list, spans: list[tuple[int, int, str]]) -> list[tuple[str, ...]]:
    """The recorded calls with each argument as it is compared (see the module docstring)."""
    fns = bindings.header().functions
    plan = []
    for name, args in log:
        params = fns[name].params
        assert len(args) == len(params), name
        rows = next((v for p, v in zip(params, args) if p.name in _ROW_COUNTS), None)
        shown, after = [], None
        for p, v in zip(params, args, strict=True):
            if p.ctype.endswith("*"):
                where = "null" if not v else next(
                    (f"{n}+{v - a}" for a, b, n in spans if a <= v < b), "activation"
                )  # fmt: skip
                shown.append(f"{p.name}={where}")
                after = v or 0  # 0: null
                continue
            if p.ctype == "float":
                v = struct.unpack("f", struct.pack("f", v))[0]
            elif p.ctype == "int64_t" and after is not None and (not after or rows == 1):
                v = "(unread stride)"  # of a null pointer, or of a single row
            shown.append(f"{p.name}={v}")
            after = None
        plan.append((name, *shown))
    return plan


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_stack_makes_the_python_layers_calls(kernel, trace_lib, monkeypatch):
    """Prompt steps, a mixed step (decode rows beside a prompt chunk) and decode steps of a
    model with a qkv bias (qwen2): the stack's plan is the Python path's, call for call."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM
    from tests.checkpoints import tiny_checkpoint

    dtype, built = KERNELS[kernel]
    if not built():
        pytest.skip(f"the {kernel} kernel is not built on this CPU")
    monkeypatch.setenv("PAGESTREAM_DECODE_GEMM", kernel)
    monkeypatch.setenv("PAGESTREAM_PREFILL_ATTENTION", "kernel")
    trace, called = trace_lib
    real = cpu_kernels.load()
    plans: list[tuple[list, list, int, int]] = []
    real_run = LayerStack.run

    def compared(self, residual, positions, kv_caches, meta, keep=None):
        if len(plans) < 6 and self._takes(residual, kv_caches, meta):
            spans = _spans(self.model, kv_caches, meta, positions)
            py_log: list = []
            self.model.layer_stack = None
            cpu_kernels._lib = _Recorder(real, set(called), py_log)
            try:  # every row: the stack's pruning of unread rows is its own (and tested)
                self.model._forward_fused(residual.clone(), positions, kv_caches, meta)
            finally:
                cpu_kernels._lib = real
                self.model.layer_stack = self
            c_log: list = []
            callbacks = _install(trace, called, real, c_log)
            fn, self._fn = self._fn, trace.ps_layer_stack
            try:
                assert real_run(self, residual.clone(), positions, kv_caches, meta) is not None
            finally:
                self._fn = fn
                del callbacks
            plans.append(
                (_plan(py_log, spans), _plan(c_log, spans), meta.num_decodes, meta.num_seqs)
            )
        return real_run(self, residual, positions, kv_caches, meta, keep)

    monkeypatch.setattr(LayerStack, "run", compared)
    # A 64-token budget: the long prompt is fed in chunks beside the short ones' decodes.
    llm = LLM(
        str(tiny_checkpoint("qwen2")), dtype=dtype, num_kv_blocks=64, threads=2,
        max_num_batched_tokens=64,
    )  # fmt: skip
    try:
        model = llm.engine.runner.model
        assert isinstance(model.layer_stack, LayerStack)
        layers = len(model.layers)
        # A different eps for every norm (the checkpoint has one for all), so that reading
        # one norm's eps for another's shows.
        for i, layer in enumerate(model.layers):
            layer.input_layernorm.eps = 1e-6 * (2 + 2 * i)
            layer.post_attention_layernorm.eps = 1e-6 * (3 + 2 * i)
        model.norm.eps = 1e-5
        model.layer_stack._layers = None  # the stack's table of them, built again
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([[5, 6, 7], list(range(40, 150)), [9] * 18], params)
    finally:
        llm.shutdown()
    kinds = {(nd > 0, nd < n) for _, _, nd, n in plans}
    assert (True, True) in kinds and (False, True) in kinds, kinds  # mixed, prompts only
    for py, c, _, _ in plans:
        assert len(py) == len(c)
        assert [(a, b) for a, b in zip(py, c) if a != b] == []
        names = {call[0] for call in c}
        assert {"ps_add_rms_norm", "ps_rope", "ps_write_kv"} <= names, names
        # A norm per layer and sublayer, and the final one.
        assert sum(call[0] == "ps_add_rms_norm" for call in c) == 2 * layers + 1
        assert any("bias=L0.qkv." in a for call in c for a in call)  # the qkv bias is passed
