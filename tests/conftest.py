"""Shared test set-up.

TRITON_INTERPRET must be set before any module that defines a @triton.jit kernel is
imported (triton reads it at decoration time), so it is set here, at conftest import.
PAGESTREAM_CPU_WARMUP=0: the engines tests build (hundreds, servers included) skip
building oneDNN's kernels for every step size at start (~1.5 s each for a tiny float32
model); tests/gpu/test_cpu_linear.py turns it back on where it tests the warm-up.
PAGESTREAM_CPU_KVCACHE_SPACE=0.25: their KV caches at 256 MiB, not the 2 GiB default,
which every engine faulted in on huge pages at start (~2-3 s each on a 2-core VM, memory a
previous engine gave back included); 131,072 tokens of the tiny models.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PAGESTREAM_CPU_WARMUP", "0")
os.environ.setdefault("PAGESTREAM_CPU_KVCACHE_SPACE", "0.25")

if not os.environ.get("PAGESTREAM_NO_TRITON_INTERPRET"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _memoize_interpreter_builtins() -> None:
    """Triton's interpreter patches triton.language's builtins around every kernel launch:
    it finds them with inspect.getmembers over the language modules and wraps each anew,
    ~15% of an interpreted test's time (the suite runs ~200 s of interpreted kernels).
    Both come out the same every launch, so they are made once, here, by the
    interpreter's own _patch_attr, before any kernel has patched the modules (a list taken
    mid-launch would hold patched members); each launch then only sets and restores them
    in its scope, as before.  Other packages, or another Triton, keep the original."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None:  # pragma: no cover - another Triton
        return

    class Record:  # a patch scope that keeps what it is given
        def __init__(self) -> None:
            self.attrs: list[tuple[object, str, object]] = []

        def set_attr(self, obj: object, name: str, value: object) -> None:
            self.attrs.append((obj, name, value))

    wrapped: dict[int, list[tuple[object, str, object]]] = {}
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        record = Record()
        for name, member in inspect.getmembers(pkg):
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, interpreter.interpreter_builder, record)
        wrapped[id(pkg)] = record.attrs

    def patch_builtin(pkg, builder, scope):
        attrs = wrapped.get(id(pkg))
        if attrs is None:
            return original(pkg, builder, scope)
        for obj, name, value in attrs:
            scope.set_attr(obj, name, value)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _memoize_interpreter_builtins()


# `make test` runs the suite in two passes: the tests that only assert behaviour (kernels,
# interpreted Triton, engine parity, the scheduler, bench sections' rows, and the live
# servers' API, error and client tests) two at a time (pytest-xdist, a file per worker:
# one test at a time left much of a 2-core machine idle), then these alone.  They bound
# latencies (/health, stream gaps, the loop's stalls), grace timers and kill deadlines,
# hold grammars and templates to a per-token or wall budget, watch for busy neighbours or
# drive fleets and a browser: a neighbour test's load would turn them flaky.  A test in a
# new directory is alone; a new module under the shared ones that times anything must be
# listed here.
_ALONE = (
    "reliability/",
    "fleet/",
    "e2e/test_browser",
    "e2e/test_structured_property.py",
    "e2e/test_bench_structured.py",
    "gpu/test_cpu_threads.py",
    "service/test_auth_and_shutdown.py",
    "service/test_bench_serve.py",
    "service/test_drain_keepalive.py",
    "service/test_engine_process_grammar.py",
    "service/test_engine_thread_http.py",
    "service/test_fuzz.py",  # a WebSocket read with a 0.4 s window for late frames
    "service/test_grammar_compiler.py",
    "service/test_host_path.py",
    "service/test_render_pool_heals.py",
    "service/test_request_limits.py",
    "service/test_response_store.py",
    "service/test_responses_background.py",
    "service/test_resume.py",
    "service/test_template_sandbox.py",
    "service/test_tenancy.py",
    "service/test_tokenize_pool.py",
    "test_bench_host.py",
    "test_bench_crowded.py",
    "test_bench_charts.py",
    "test_bench_cpu_gemm.py",  # its ceilings: the machine's copy bandwidth and FMA peak
)
_SHARED = ("gpu/", "e2e/", "scheduler/", "service/", "clients/", "test_")
_ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        rel = path.relative_to(_ROOT).as_posix() if path.is_relative_to(_ROOT) else ""
        if not rel or rel.startswith(_ALONE) or not rel.startswith(_SHARED):
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytest.mark.usefixtures("one_torch_thread")`):
    thousands of tiny tensor ops, or HF's generate() beside a server on a loaded 2-core
    machine, where a second spinning OpenMP thread only adds contention (an order of
    magnitude slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
