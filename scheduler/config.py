"""The engine's configuration: one typed tree, built once and passed whole.

`pagestream serve`'s flags (service/cli.py `engine_config`) and `LLM(**kwargs)`
(service/llm.py) both end in `EngineConfig.from_kwargs`, which puts each setting in its
group and validates every value once, with an error that names the setting and its flag.
The engine (service/async_engine.py) hands the whole tree to the model runner
(gpu/model_runner.py) and builds the scheduler's runtime config from its groups
(scheduler/scheduler_types.py `SchedulerConfig.from_engine`); each reads the group it
needs, so adding a setting means adding a field here and a flag, not a keyword to every
constructor on the way down (as vLLM's `VllmConfig`).

The groups are frozen: a config does not change once the engine is built from it.  Every
field name is unique across groups, so a flat keyword (`block_size=32`) names one field.
This module sits on the bottom floor (pure Python) so every layer may read the tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.spec import SpecConfig


class ConfigError(ValueError):
    """A setting out of range or unknown; the message names the setting and its flag."""


# Flags whose name is not `--` + the field name with dashes.  None: no flag (LLM or
# tests only).  service/cli.py's parser is checked against this
# (tests/service/test_engine_config.py).
FLAGS: dict[str, str | None] = {
    "kv_cache_bytes": "--kv-cache-memory",
    "enable_prefix_caching": "--no-prefix-caching",
    "cuda_graphs": "--enforce-eager",
    "redis_max_kv_bytes": "--redis-max-kv-memory",
    "max_waiting_per_key": "--max-waiting-requests-per-key",
    "tenant_weights": "--api-key-file",
    "speculative_config": "--speculative-*",
    "fault_injection": None,
}

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("int8", "awq", "gptq", "fp8")  # --quantization
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")  # gpu/attention's BACKEND_NAMES
SCHEDULING_POLICIES = ("fair", "fcfs")
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


class LoRAInUse(RuntimeError):
    """A LoRA adapter a running or queued request still runs with cannot be unloaded."""


def lora_fingerprint(path: str | Path) -> str:
    """A LoRA adapter's weights' hash (gpu/lora.py reads them; a missing file is its
    error to report)."""
    try:
        blob = (Path(path) / "adapter_model.safetensors").read_bytes()
    except OSError:
        return "unreadable"
    return hashlib.sha256(blob).hexdigest()[:16]


def flag_of(name: str) -> str | None:
    return FLAGS[name] if name in FLAGS else "--" + name.replace("_", "-")


def _fail(name: str, must: str, value: object) -> ConfigError:
    flag = flag_of(name)
    where = f"{name} ({flag})" if flag else name
    return ConfigError(f"{where} {must}, got {value!r}")


def _check(obj: object, name: str, ok: bool, must: str) -> None:
    if not ok:
        raise _fail(name, must, getattr(obj, name))


def _one_of(obj: object, name: str, choices: tuple[str, ...]) -> None:
    _check(obj, name, getattr(obj, name) in choices, f"must be one of {', '.join(choices)}")


def _positive_or_none(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(obj, name, value is None or value >= 1, "must be at least 1 (or unset)")


@dataclass(frozen=True)
class ModelSettings:
    """Which weights, in which dtype, how long a sequence may get."""

    model: str | None = None  # checkpoint directory; None: the embedded default model
    dtype: str = "auto"
    # weights: as stored (AWQ / FP8 when the checkpoint says), int8, fp8 (W8A8)
    quantization: str | None = None
    max_model_len: int | None = None  # None: the model's, capped by the KV cache
    seed: int = 0  # of unseeded sampling
    # LoRA adapters served beside the model (gpu/lora.py): name (what a request's `model`
    # says) -> PEFT checkpoint directory; the largest rank they may have.
    lora_modules: Mapping[str, str] | None = None
    max_lora_rank: int = 64
    # Adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter, which it
    # gates behind VLLM_ALLOW_RUNTIME_LORA_UPDATING): any path the server can read.
    allow_runtime_lora: bool = False
    # vLLM's hf_overrides: merged into the checkpoint's config.json as read
    # (gpu/config.with_hf_overrides), e.g. to serve a causal LM as a classifier.
    hf_overrides: Mapping[str, Any] | None = None
    # vLLM's --tokenizer: the directory whose tokenizer files (tokenizer.json, its config,
    # the chat template) serve this model; None: the checkpoint's own.
    tokenizer: str | None = None

    @property
    def lora(self) -> bool:
        """The engine serves LoRA adapters (some now, or loaded later)."""
        return bool(self.lora_modules) or self.allow_runtime_lora

    def __post_init__(self) -> None:
        _one_of(self, "dtype", DTYPES)
        _check(self, "max_lora_rank", self.max_lora_rank >= 1, "must be at least 1")
        for name in self.lora_modules or {}:
            ok = bool(LORA_NAME.fullmatch(name))
            _check(self, "lora_modules", ok, f"names must match {LORA_NAME.pattern}")
        if self.quantization is not None:
            _one_of(self, "quantization", QUANTIZATIONS)
        # Whether it fits the checkpoint is checked at load (gpu/loader.py), which knows
        # what it holds (an AWQ or FP8 checkpoint, an already quantized one).
        _positive_or_none(self, "max_model_len")
        ok = self.hf_overrides is None or isinstance(self.hf_overrides, Mapping)
        _check(self, "hf_overrides", ok, "must be a JSON object")


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache: its blocks, their storage, prefix caching and conversation pins."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: the runner's default for the device
    # vLLM's: on CUDA, the share of the GPU's memory this engine may take; the KV cache
    # gets what the weights leave of it (gpu/model_runner.kv_budget).  None: 85% of the
    # memory free after the weights.  A CPU ignores it (PAGESTREAM_CPU_KVCACHE_SPACE).
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype), int8 or fp8 (e4m3)
    enable_prefix_caching: bool = True
    # Conversation KV pins: at most this fraction of the blocks, each for session_ttl s.
    pinned_kv_fraction: float = 0.25
    session_ttl: float = 300.0

    def __post_init__(self) -> None:
        b = self.block_size
        _check(self, "block_size", b > 0 and not b & (b - 1), "must be a positive power of two")
        _positive_or_none(self, "num_kv_blocks", "kv_cache_bytes")
        _one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        u = self.gpu_memory_utilization
        _check(self, "gpu_memory_utilization", u is None or 0 < u <= 1, "must be in (0, 1]")
        _check(self, "pinned_kv_fraction", 0 <= self.pinned_kv_fraction <= 1, "must be in [0, 1]")
        _check(self, "session_ttl", self.session_ttl >= 0, "must be >= 0")


@dataclass(frozen=True)
class PrefixTierSettings:
    """The prefix tier shared across replicas (scheduler/prefix_tier.py)."""

    redis_url: str | None = None  # redis://... or memory://; None: in-process only
    redis_hit_threshold: int = 1  # local hits before a block's KV is published
    redis_max_kv_bytes: int = 1 << 30  # cap on KV bytes this model keeps in the tier
    redis_lookup_deadline: float = 1.0  # seconds a look-up may take
    # Fraction of redis_max_kv_bytes one API key may hold; 1.0: no per-key share.
    prefix_tier_key_share: float = 1.0

    def __post_init__(self) -> None:
        _check(self, "redis_hit_threshold", self.redis_hit_threshold >= 1, "must be at least 1")
        _check(self, "redis_max_kv_bytes", self.redis_max_kv_bytes > 0, "must be > 0")
        _check(self, "redis_lookup_deadline", self.redis_lookup_deadline > 0, "must be > 0")
        share = self.prefix_tier_key_share
        _check(self, "prefix_tier_key_share", 0 < share <= 1, "must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerSettings:
    """One step's budget, the waiting queue's policy and its admission bounds."""

    max_num_batched_tokens: int | None = None  # None: the engine's default for the device
    max_num_seqs: int = 256
    # "fair": deficit round robin on prompt tokens across API keys, weighted by
    # tenant_weights (tenant id -> weight, default 1); "fcfs": one line for all.
    scheduling_policy: str = "fair"
    tenant_weights: Mapping[str, float] | None = None
    # Past these, new requests get EngineOverloaded (HTTP 429); None: unbounded (the
    # offline LLM queues everything it is given).  The last is one API key's own bound.
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    max_waiting_per_key: int | None = None
    # vLLM's max_loras: distinct LoRA adapters among the running requests (so in any one
    # step); a waiting request of another adapter waits its turn.  None: unbounded (every
    # loaded adapter's weights are on the device anyway; each one in a step adds its own
    # low-rank products).
    max_loras: int | None = None

    def __post_init__(self) -> None:
        _positive_or_none(self, "max_num_batched_tokens", "max_waiting_requests")
        _positive_or_none(self, "max_waiting_tokens", "max_waiting_per_key", "max_loras")
        _check(self, "max_num_seqs", self.max_num_seqs >= 1, "must be at least 1")
        _one_of(self, "scheduling_policy", SCHEDULING_POLICIES)
        weights = (self.tenant_weights or {}).values()
        _check(self, "tenant_weights", all(w > 0 for w in weights), "must all be > 0")


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor and pipeline parallelism, over one or several nodes (torchrun's names)."""

    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0  # longest a collective waits for a rank
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 2  # a step's rows cut into this many, so stages overlap
    # Node 0 serves the API and holds rank 0, whose torch.distributed store listens on
    # master_addr:master_port; the other nodes' step connections go to master_port + 1.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 with one node: a free port
    # Whole engines, each in its own process on its own cores or GPU, behind one API
    # server (service/data_parallel.py).
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        names = ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches",
                 "data_parallel_size")  # fmt: skip
        for name in names:
            _check(self, name, getattr(self, name) >= 1, "must be at least 1")
        _check(self, "nnodes", self.nnodes >= 1, "must be at least 1")
        _check(self, "node_rank", 0 <= self.node_rank < self.nnodes, "must be in [0, --nnodes)")
        _check(self, "tensor_parallel_timeout", self.tensor_parallel_timeout > 0, "must be > 0")
        _check(self, "master_port", 0 <= self.master_port < 65536, "must be a port number")

    @property
    def enabled(self) -> bool:
        """More than one rank: the engine needs the parallel executor."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.nnodes > 1


@dataclass(frozen=True)
class DeviceSettings:
    """Where and how steps compute, and where the engine core runs."""

    device: str | None = None  # cpu, cuda, cuda:N; None: cuda when available
    threads: int | None = None  # torch CPU threads; None: sized to the free cores each step
    attention_backend: str = "auto"
    cuda_graphs: bool | None = None  # None: on for CUDA + Triton; False = --enforce-eager
    # The engine core on its own thread (True) or the caller's loop (False); None: on for
    # CUDA, off on CPU (service/async_engine.py engine_thread_default).
    engine_thread: bool | None = None
    # The engine core (model, executor, scheduler, grammar masks) in a child process,
    # the HTTP process keeping tokenization, detokenization and stream writes
    # (service/engine_proc.py; the shared prefix tier and the TP/PP executor live there
    # too); None: `serve` takes it on CUDA unless engine_thread is set
    # (service/async_engine.py engine_process_default), an engine built directly (the
    # offline LLM, tests) never.
    engine_process: bool | None = None
    # Schedule step N+1 while step N runs (scheduler/ahead.py); None: on for CUDA, off on
    # CPU (service/async_engine.py async_scheduling_default).
    async_scheduling: bool | None = None
    # CPython's thread switch interval (sys.setswitchinterval), process-wide; None: keep
    # the interpreter's (service/async_engine.py switch_interval).
    switch_interval_ms: float | None = None

    def __post_init__(self) -> None:
        ok = self.device is None or self.device.split(":")[0] in ("cpu", "cuda")
        _check(self, "device", ok, "must be cpu, cuda or cuda:N")
        _positive_or_none(self, "threads")
        ms = self.switch_interval_ms
        _check(self, "switch_interval_ms", ms is None or 0 < ms <= 1000, "must be in (0, 1000]")
        _one_of(self, "attention_backend", ATTENTION_BACKENDS)
        if self.engine_process and self.engine_thread:
            raise ConfigError("--engine-process does not combine with --engine-thread on")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (vLLM's VllmConfig)."""

    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    prefix_tier: PrefixTierSettings = field(default_factory=PrefixTierSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    device: DeviceSettings = field(default_factory=DeviceSettings)
    speculative: SpecConfig | None = None  # vLLM's speculative_config (scheduler/spec.py)
    # Fault injection for tests and drills (scheduler/faults.py); None reads
    # PAGESTREAM_FAULT_INJECTION, which is unset in normal serving.
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        spec, par = self.speculative, self.parallel
        if par.data_parallel_size > 1:
            if par.enabled:
                raise ConfigError(
                    "data_parallel_size (--data-parallel-size): not with tensor or pipeline "
                    "parallelism (each rank is one whole engine)"
                )
            if self.device.engine_process is False or self.device.engine_thread:
                raise ConfigError(
                    "data_parallel_size (--data-parallel-size): every rank is an engine "
                    "process (not with --engine-process off or --engine-thread on)"
                )
        if spec is not None and par.pipeline_parallel_size > 1 and spec.method != "ngram":
            raise ConfigError(
                f"speculative decoding with a {spec.method} proposer (--speculative-*) does not "
                "run with --pipeline-parallel-size > 1 (n-gram drafts do)"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """From flat settings, each a field of one group (`block_size=32`); also
        `speculative_config` (vLLM's dict, or a SpecConfig) and `enforce_eager`."""
        if kwargs.pop("enforce_eager", False):
            kwargs["cuda_graphs"] = False
        spec = _speculative(kwargs.pop("speculative_config", None))
        groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for name, value in kwargs.items():
            if name == "fault_injection":
                continue
            if name not in FIELD_GROUP:
                raise ConfigError(f"unknown engine setting {name!r}")
            groups[FIELD_GROUP[name]][name] = value
        built = {name: GROUPS[name](**values) for name, values in groups.items()}
        return cls(**built, speculative=spec, fault_injection=kwargs.get("fault_injection"))

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some flat settings changed (validated as from_kwargs does)."""
        return EngineConfig.from_kwargs(**(self.flat() | kwargs))

    def flat(self) -> dict[str, Any]:
        """The inverse of from_kwargs: every setting by its flat name."""
        out: dict[str, Any] = {}
        for name in GROUPS:
            out.update(dataclasses.asdict(getattr(self, name)))
        spec = self.speculative
        out["speculative_config"] = dataclasses.asdict(spec) if spec is not None else None
        out["fault_injection"] = self.fault_injection
        return out


def _speculative(value: SpecConfig | Mapping[str, Any] | None) -> SpecConfig | None:
    if value is None or isinstance(value, SpecConfig):
        return value
    try:
        return SpecConfig.from_dict(dict(value))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"speculative_config (--speculative-*): {e}") from e


GROUPS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(EngineConfig)
    if f.default_factory is not dataclasses.MISSING
}
# Flat setting name -> the group that holds it (names are unique across groups).
FIELD_GROUP: dict[str, str] = {
    f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)
}
assert len(FIELD_GROUP) == sum(len(dataclasses.fields(c)) for c in GROUPS.values())


def default_of(name: str) -> Any:
    """A setting's default, for a flag that keeps it (declared once, in its group)."""
    (f,) = (f for f in dataclasses.fields(GROUPS[FIELD_GROUP[name]]) if f.name == name)
    return f.default
