"""The kernel library's typed bindings (gpu/cpu/kernels/bindings.py): every ctypes
signature and structure the Python side uses is derived from entry_points.h, and here
checked against what the C++ compiler makes of that header (the type and size of every
argument, return and field, every field's offset, every structure's size) and against what
the built library exports.  The C++ definitions are held to the header by the compiler
itself: each defining file includes it (test_a_definition_that_differs_fails_to_compile)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.kernels import bindings

CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
if CXX is None or not cpu_kernels.available():
    if os.environ.get("CI") == "true":
        pytest.fail("the CPU kernels must build in CI (a C++ compiler is installed)")
    pytest.skip("no C++ compiler: the CPU kernels are unavailable", allow_module_level=True)

_PROBE_HEAD = r"""
#include <cstddef>
#include <cstdio>
#include <type_traits>

#include "entry_points.h"

template <typename T>
void code() {
  if constexpr (std::is_void_v<T>) std::printf(" v");
  else if constexpr (std::is_pointer_v<T>) std::printf(" p");
  else if constexpr (std::is_floating_point_v<T>) std::printf(" f%zu", sizeof(T));
  else if constexpr (std::is_integral_v<T>)
    std::printf(" %c%zu", std::is_signed_v<T> ? 'i' : 'u', sizeof(T));
  else std::printf(" ?");
}
template <typename R, typename... A>
void sig(const char* name, R (*)(A...)) {
  std::printf("fn %s", name);
  code<R>();
  std::printf(" :");
  (code<A>(), ...);
  std::printf("\n");
}
#define FIELD(S, f)                                 \
  std::printf("field " #S " " #f " %zu", offsetof(S, f)); \
  code<decltype(S::f)>();                           \
  std::printf("\n");
"""


def _code(t) -> str:
    """A ctypes type as the probe's code() spells a C type: v, p, f4, i4, i8, u2..."""
    if t is None:
        return "v"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "p"
    if t in (ctypes.c_float, ctypes.c_double):
        return f"f{ctypes.sizeof(t)}"
    return f"{'i' if t(-1).value < 0 else 'u'}{ctypes.sizeof(t)}"


def _compiled_view(tmp_path: Path) -> list[str]:
    """What the compiler says of entry_points.h: one line per function, field, size."""
    h = bindings.header()
    lines = [_PROBE_HEAD, "int main() {"]
    # decltype: the type only, nothing to link against
    lines += [f'  sig("{n}", static_cast<decltype(&{n})>(nullptr));' for n in h.functions]
    for s, fields in h.structs.items():
        lines.append(f'  std::printf("size {s} %zu\\n", sizeof({s}));')
        lines += [f"  FIELD({s}, {f.name})" for f in fields]
    lines.append("}")
    src = tmp_path / "probe.cpp"
    src.write_text("\n".join(lines))
    exe = tmp_path / "probe"
    inc = f"-I{bindings.HEADER.parent}"
    subprocess.run([CXX, "-std=c++17", inc, str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split(
        "\n"
    )[:-1]


def _derived_view() -> list[str]:
    """The same lines from the ctypes side bindings.py derives."""
    h = bindings.header()
    lines = []
    for name in h.functions:
        res, args = bindings.signature(name)
        lines.append(f"fn {name} {_code(res)} :" + "".join(f" {_code(a)}" for a in args))
    for s in h.structs:
        cls = bindings.structure(s)
        lines.append(f"size {s} {ctypes.sizeof(cls)}")
        for fname, ftype in cls._fields_:
            lines.append(f"field {s} {fname} {getattr(cls, fname).offset} {_code(ftype)}")
    return lines


def test_ctypes_side_matches_the_compiler(tmp_path):
    """Argument counts, each argument's and return's kind and size, each structure's size
    and each field's name, order, offset, kind and size: as the compiler lays them out."""
    compiled, derived = _compiled_view(tmp_path), _derived_view()
    assert len(compiled) == len(derived)
    diff = [(c, d) for c, d in zip(compiled, derived) if c != d]
    assert diff == []
    # The layer stack's own classes are the ones derived (one class per structure).
    from gpu.cpu import layer_stack as cpu_layer_stack

    assert cpu_layer_stack._Step is bindings.structure("PsStep")
    assert cpu_layer_stack._Layer is bindings.structure("PsLayer")


def test_the_library_exports_exactly_the_declared_entry_points():
    """Nothing callable from Python goes undeclared (so untyped), nothing declared is
    missing; and every function the loaded library hands out carries the header's types."""
    lib = cpu_kernels.load()
    out = subprocess.run(
        ["nm", "-D", "--defined-only", lib._name], check=True, capture_output=True, text=True
    ).stdout
    exported = {ln.split()[-1] for ln in out.splitlines() if ln.split()[-1].startswith("ps_")}
    assert exported == set(bindings.header().functions)
    for name in exported:
        fn = getattr(lib, name)
        assert (fn.restype, fn.argtypes) == bindings.signature(name), name
    with pytest.raises(ctypes.ArgumentError):  # a float where the header says a pointer
        lib.ps_argmax(0, 1.5, 0, 0, 0, None, 1)
    with pytest.raises(TypeError):  # one argument short
        lib.ps_argmax(0, None, 0, 0, 0, None)


def test_built_with_warnings_as_errors():
    """The product build compiled under -Wall -Wextra -Werror, not its fallback."""
    assert cpu_kernels.load() is not None
    assert cpu_kernels.werror_fallback == ""


def test_a_definition_that_differs_fails_to_compile(tmp_path):
    """The defining files include the header: a definition whose signature moved away from
    its declaration is a compile error, not a silently different ABI."""
    src = tmp_path / "drift.cpp"
    src.write_text(
        '#include "entry_points.h"\nextern "C" int ps_max_dim(int extra) { return extra; }\n'
    )
    inc = f"-I{bindings.HEADER.parent}"
    r = subprocess.run(
        [CXX, "-std=c++17", inc, "-c", str(src), "-o", str(tmp_path / "drift.o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "ps_max_dim" in r.stderr


def test_parser_reads_the_header_form_and_refuses_others():
    h = bindings.parse(
        """#pragma once
        extern "C" {
        struct S {
          const float* w;  // a comment
          int64_t n;
        };
        /* a block comment */
        int f(const S* s, float eps, int64_t n);
        const char* g();
        }"""
    )
    assert h.structs["S"] == (
        bindings.Param("const float*", "w"),
        bindings.Param("int64_t", "n"),
    )
    assert h.functions["f"].params == (
        bindings.Param("const S*", "s"),
        bindings.Param("float", "eps"),
        bindings.Param("int64_t", "n"),
    )
    assert h.functions["g"] == bindings.Prototype("const char*", "g", ())
    for bad in (
        'extern "C" { void f(int a = 1); }',  # a default argument
        'extern "C" { struct S { int a, b; }; }',  # two names in one field
        'extern "C" { void f(int); }',  # an unnamed parameter
        'extern "C" { void f(int a); void f(int a); }',  # declared twice
    ):
        with pytest.raises(ValueError):
            bindings.parse(bad)
    with pytest.raises(ValueError):  # a type with no ctypes mapping
        bindings._ctype("size_t")
