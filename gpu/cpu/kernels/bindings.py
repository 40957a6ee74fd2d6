"""The ctypes side of the kernel library, derived from entry_points.h.

entry_points.h declares every C entry point and structure once; the C++ files include it
(a definition that differs fails to compile), and this module reads it to give each
function its argtypes/restype and each structure its fields, so nothing on the Python side
is typed by hand.  tests/gpu/test_cpu_bindings.py checks the result against the compiler
(sizeof, offsetof and each field's and argument's type) and against the library's exports.

Why ctypes over torch custom ops (torch.library): the library builds from plain C++ with
no torch headers (a compiler and seconds, on any torch), and the hot path calls it with
integer pointers through ctypes; a torch extension would compile against torch's headers
(minutes, per torch version) to move these same calls behind the dispatcher.  The header
parser is small because the header keeps to a strict form (see its preamble).
"""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path
from typing import Any, NamedTuple

HEADER = Path(__file__).with_name("entry_points.h")

# C type (qualifiers dropped, `*` kept) -> ctypes.  Pointers travel as integer addresses
# (tensor.data_ptr()) or None, hence c_void_p; struct pointers are typed (see _ctype).
_SCALARS: dict[str, Any] = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "float": ctypes.c_float,
}
_POINTEES = {"void", "float", "uint16_t", "int8_t", "int32_t", "int64_t"}


class Param(NamedTuple):
    ctype: str  # as written, normalised: "const int64_t*"
    name: str


class Prototype(NamedTuple):
    restype: str
    name: str
    params: tuple[Param, ...]


class Header(NamedTuple):
    functions: dict[str, Prototype]
    structs: dict[str, tuple[Param, ...]]  # in declaration order


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _decl(text: str, where: str) -> Param:
    """`const int64_t* pos` -> Param("const int64_t*", "pos")."""
    m = re.fullmatch(r"\s*((?:const\s+)?[A-Za-z_]\w*(?:\s*\*+\s*|\s+))([A-Za-z_]\w*)\s*", text)
    if m is None:
        raise ValueError(f"{where}: cannot read the declaration {text.strip()!r}")
    ctype = re.sub(r"\s*\*", "*", " ".join(m.group(1).split()))
    return Param(ctype, m.group(2))


def parse(text: str) -> Header:
    """The prototypes and structures of an extern "C" header in entry_points.h's form;
    ValueError on anything else (a macro, a default argument, two names in a field)."""
    body = _strip_comments(text)
    body = re.sub(r"^\s*#.*$", " ", body, flags=re.M)
    m = re.search(r'extern\s+"C"\s*\{(.*)\}\s*$', body, flags=re.S)
    if m is None:
        raise ValueError('no extern "C" { ... } block')
    body = m.group(1)
    structs: dict[str, tuple[Param, ...]] = {}
    for s in re.finditer(r"struct\s+(\w+)\s*\{(.*?)\}\s*;", body, flags=re.S):
        fields = [f for f in s.group(2).split(";") if f.strip()]
        structs[s.group(1)] = tuple(_decl(f, f"struct {s.group(1)}") for f in fields)
    body = re.sub(r"struct\s+\w+\s*\{.*?\}\s*;", " ", body, flags=re.S)
    functions: dict[str, Prototype] = {}
    for stmt in (x for x in body.split(";") if x.strip()):
        f = re.fullmatch(r"\s*(.+?)\(([^()]*)\)\s*", stmt, flags=re.S)
        if f is None:
            raise ValueError(f"cannot read the declaration {' '.join(stmt.split())!r}")
        head = _decl(f.group(1), "prototype")
        args = f.group(2).strip()
        params = () if args in ("", "void") else tuple(
            _decl(a, head.name) for a in args.split(",")
        )  # fmt: skip
        if head.name in functions:
            raise ValueError(f"{head.name} declared twice")
        functions[head.name] = Prototype(head.ctype, head.name, params)
    return Header(functions, structs)


@functools.cache
def header() -> Header:
    return parse(HEADER.read_text())


def _ctype(ctype: str, is_return: bool = False) -> Any:
    """The ctypes type of a C type of the header; ValueError for one it does not map."""
    base = ctype.removeprefix("const ")
    if base == "void" and is_return:
        return None
    if base in _SCALARS:
        return _SCALARS[base]
    if base == "char*" and is_return:
        return ctypes.c_char_p
    if base.endswith("*") and base[:-1] in header().structs:
        return ctypes.POINTER(structure(base[:-1]))
    if base.endswith("*") and base[:-1] in _POINTEES:
        return ctypes.c_void_p
    raise ValueError(f"no ctypes mapping for the C type {ctype!r}")


@functools.cache
def structure(name: str) -> type[ctypes.Structure]:
    """The ctypes.Structure of entry_points.h's `struct name` (one class per name)."""
    fields = [(p.name, _ctype(p.ctype)) for p in header().structs[name]]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def signature(name: str) -> tuple[Any, list[Any]]:
    """(restype, argtypes) of entry point `name`."""
    proto = header().functions[name]
    return _ctype(proto.restype, is_return=True), [_ctype(p.ctype) for p in proto.params]


def declare(lib: ctypes.CDLL) -> None:
    """Sets restype and argtypes of every function entry_points.h declares; a function the
    library lacks raises AttributeError (a stale or foreign build)."""
    for name in header().functions:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = signature(name)
