"""Every environment variable pagestream reads or sets, in one place (as vLLM's envs.py).

Product code (service/, scheduler/, gpu/) touches `os.environ` nowhere else:
`tests/test_envs.py` fails on a read or a write outside this module, and on a variable read
here that is not documented here.  The module sits in scheduler/, the bottom floor of the
layers (pure Python, no imports of ours), so every layer may import it.

Read a variable as an attribute, `envs.PAGESTREAM_CACHE`: each read looks at the
environment again (tests and bench children set variables after import).  An unset or
empty variable reads as its default.

The kernel choices at the end pick between CPU kernels that compute the same thing, for
comparisons: the product never needs them set.  Tests set them to reach each path;
benchmarks set them for their child processes with `kernel_env`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str
    choices: tuple[str, ...] = ()
    # How the text becomes the value the code reads (default: the text itself).
    parse: Callable[[str | None], Any] | None = None


def _on(value: str | None) -> bool:
    """On/off switches: anything but "0" is on."""
    return value != "0"


def _gib(value: str | None) -> int:
    """A size in GiB (a decimal number above 0) as bytes."""
    try:
        gib = float(value or "")
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ValueError(f"a size in GiB must be a number above 0, not {value!r}")
    return int(gib * (1 << 30))


_VARS = [
    # --------------------------------------------------------------- serving defaults
    EnvVar("PAGESTREAM_MODEL", None, "default of `serve --model`: checkpoint directory"),
    EnvVar("PAGESTREAM_REDIS_URL", None, "default of `serve --redis-url`"),
    EnvVar("PAGESTREAM_API_KEY", None, "an API key, when no --api-key is given"),
    EnvVar("PAGESTREAM_API_KEY_FILE", None, "default of `serve --api-key-file`"),
    EnvVar("PAGESTREAM_ADMIN_API_KEY", None, "an admin key, when no --admin-api-key is given"),
    EnvVar(
        "PAGESTREAM_ALLOWED_HOSTS", None, "default of `serve --allowed-hosts` (comma-separated)"
    ),
    EnvVar(
        "FORWARDED_ALLOW_IPS",
        None,
        "default of `serve --forwarded-allow-ips` (uvicorn's name for the same setting)",
    ),
    EnvVar(
        "PAGESTREAM_FAULT_INJECTION",
        None,
        "fault-injection rules for tests (scheduler/faults.py `FaultPlan.parse`); unset in "
        "normal serving",
    ),
    EnvVar(
        "PAGESTREAM_CPU_KVCACHE_SPACE",
        "2",
        "GiB of KV cache on a CPU when neither --kv-cache-memory nor --num-kv-blocks is "
        "given (vLLM's VLLM_CPU_KVCACHE_SPACE); the whole cache is faulted in, on huge "
        "pages, at start-up (tests set 0.25)",
        parse=_gib,
    ),
    # --------------------------------------------------------------- where things live
    EnvVar(
        "PAGESTREAM_CACHE",
        None,
        "where pagestream keeps what it builds on first use (test checkpoints, compiled CPU "
        "kernels); default $XDG_CACHE_HOME/pagestream, else ~/.cache/pagestream",
    ),
    EnvVar("XDG_CACHE_HOME", None, "the XDG cache base, when PAGESTREAM_CACHE is not set"),
    # --------------------------------------------------------------- build and devices
    EnvVar(
        "PAGESTREAM_CPU_MARCH",
        "native",
        "-march of the compiled CPU kernels (they are built on the machine that runs them)",
    ),
    EnvVar("CXX", None, "the C++ compiler for the CPU kernels (default: c++, else g++)"),
    EnvVar(
        "OMP_WAIT_POLICY",
        None,
        "OpenMP's own (libgomp reads it when torch loads): passive makes a thread waiting at a "
        "barrier sleep instead of spin, and gpu/cpu/threads.py then keeps every usable CPU in "
        "the team beside busy processes (a waiting thread gives its CPU back to a descheduled "
        "one instead of holding it)",
        parse=lambda v: (v or "").lower(),
    ),
    EnvVar(
        "PAGESTREAM_CPU_KERNELS",
        "1",
        "0: do not build or load the compiled CPU kernels (torch paths only)",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_CPU_WARMUP",
        "1",
        "0: skip building every step size's oneDNN GEMMs at start-up (faster start, slower "
        "first requests; tests use it)",
        parse=_on,
    ),
    EnvVar(
        "TRITON_INTERPRET",
        None,
        "1: Triton's interpreter, so the Triton backend runs (slowly) on a CPU (tests)",
        parse=lambda v: v == "1",
    ),
    # --------------------------------------------------------------- kernel choices (A/B)
    EnvVar(
        "PAGESTREAM_CPU_FUSED",
        "1",
        "0: the elementwise chain in torch ops instead of the compiled kernels",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_LAYER_STACK",
        "1",
        "0: decoder layers one by one from Python instead of the compiled layer stack",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_PACK_LINEAR",
        "1",
        "0: torch's own linear layers instead of the packed GEMMs",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_BF16_WEIGHTS",
        "1",
        "0: float32 weights stay float32 where all their values are bf16 ones (AVX2 sgemm)",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_HUGE_PAGES",
        "1",
        "0: no transparent huge pages for the packed weights",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_TRITON_ELEMENTWISE",
        "1",
        "0: the elementwise chain in torch ops instead of Triton kernels (CUDA)",
        parse=_on,
    ),
    EnvVar(
        "PAGESTREAM_PREFILL_ATTENTION",
        "auto",
        "CPU prefill attention: auto, kernel (the compiled kernel) or sdpa (torch's)",
        choices=("auto", "kernel", "sdpa"),
    ),
    EnvVar(
        "PAGESTREAM_PREFILL_GEMM",
        "auto",
        "prompt-sized GEMMs: auto, mkl (float32) or onednn",
        choices=("auto", "mkl", "onednn"),
    ),
    EnvVar(
        "PAGESTREAM_DECODE_GEMM",
        "auto",
        "decode-sized GEMM kernel: auto, sgemm, amx, dpbf16, sgemm512 or onednn",
        choices=("auto", "sgemm", "amx", "dpbf16", "sgemm512", "onednn"),
    ),
]

VARS: Mapping[str, EnvVar] = {v.name: v for v in _VARS}

# The variables pagestream sets, for libraries that read them: not read by pagestream.
SETS: Mapping[str, str] = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "compiled oneDNN GEMMs kept (serve --onednn-cache-capacity)",
    "LRU_CACHE_CAPACITY": "the same cap under its older name",
    "TOKENIZERS_PARALLELISM": "false in tokenizer worker processes: one core each",
    "RAYON_NUM_THREADS": "1 in tokenizer worker processes: one core each",
}

# The comparison switches (the last section of _VARS): bench sets them for its children.
KERNEL_CHOICES = (
    "PAGESTREAM_CPU_FUSED",
    "PAGESTREAM_LAYER_STACK",
    "PAGESTREAM_PACK_LINEAR",
    "PAGESTREAM_BF16_WEIGHTS",
    "PAGESTREAM_HUGE_PAGES",
    "PAGESTREAM_TRITON_ELEMENTWISE",
    "PAGESTREAM_PREFILL_ATTENTION",
    "PAGESTREAM_PREFILL_GEMM",
    "PAGESTREAM_DECODE_GEMM",
)


def raw(name: str) -> str | None:
    """The variable's text, or its default when unset or empty."""
    var = VARS[name]
    value = os.environ.get(name) or var.default
    if var.choices and value not in var.choices:
        raise ValueError(f"{name} must be one of {', '.join(var.choices)}, not {value!r}")
    return value


def __getattr__(name: str) -> Any:
    if name not in VARS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    parse = VARS[name].parse
    value = raw(name)
    return parse(value) if parse else value


def __dir__() -> list[str]:
    return sorted([*globals(), *VARS])


def set_default(name: str, value: str) -> None:
    """Set one of SETS for a library this process loads later; the operator's own value
    wins."""
    if name not in SETS:
        raise KeyError(f"{name} is not in envs.SETS")
    os.environ.setdefault(name, value)


def set_value(name: str, value: str) -> None:
    """Set one of SETS in this process (a worker process's own set-up)."""
    if name not in SETS:
        raise KeyError(f"{name} is not in envs.SETS")
    os.environ[name] = value


def kernel_env(choices: Mapping[str, str]) -> dict[str, str]:
    """A child process's environment with the given kernel choices
    ({"PAGESTREAM_DECODE_GEMM": "onednn", ...}); refuses names that are not kernel
    choices and values a choice does not take."""
    for name, value in choices.items():
        if name not in KERNEL_CHOICES:
            raise KeyError(f"{name} is not a kernel choice: {', '.join(KERNEL_CHOICES)}")
        var = VARS[name]
        if var.choices and value not in var.choices:
            raise ValueError(f"{name} must be one of {', '.join(var.choices)}, not {value!r}")
    return {**os.environ, **choices}


def with_import_root(root: str) -> dict[str, str]:
    """A child process's environment that imports this project from `root` first
    (PYTHONPATH), whatever directory it starts in (the engine process)."""
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def without_preload() -> dict[str, str]:
    """This process's environment less LD_PRELOAD, for a tool that has no use for what the
    server preloads (the C++ compiler: under the sanitizer tests' libasan, cc1plus ran
    about twice as slow, its every allocation intercepted)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def documentation() -> str:
    """A markdown table of every variable, for docs/FLAGS.md."""
    rows = ["| variable | default | what |", "|---|---|---|"]
    for v in _VARS:
        rows.append(f"| `{v.name}` | {v.default or ''} | {v.doc} |")
    return "\n".join(rows)


if TYPE_CHECKING:
    PAGESTREAM_MODEL: str | None
    PAGESTREAM_REDIS_URL: str | None
    PAGESTREAM_API_KEY: str | None
    PAGESTREAM_API_KEY_FILE: str | None
    PAGESTREAM_ALLOWED_HOSTS: str | None
    FORWARDED_ALLOW_IPS: str | None
    PAGESTREAM_FAULT_INJECTION: str | None
    PAGESTREAM_CPU_KVCACHE_SPACE: int
    PAGESTREAM_CACHE: str | None
    XDG_CACHE_HOME: str | None
    PAGESTREAM_CPU_MARCH: str
    CXX: str | None
    PAGESTREAM_CPU_KERNELS: bool
    PAGESTREAM_CPU_WARMUP: bool
    TRITON_INTERPRET: bool
    PAGESTREAM_CPU_FUSED: bool
    PAGESTREAM_LAYER_STACK: bool
    PAGESTREAM_PACK_LINEAR: bool
    PAGESTREAM_BF16_WEIGHTS: bool
    PAGESTREAM_HUGE_PAGES: bool
    PAGESTREAM_TRITON_ELEMENTWISE: bool
    PAGESTREAM_PREFILL_ATTENTION: str
    PAGESTREAM_PREFILL_GEMM: str
    PAGESTREAM_DECODE_GEMM: str
