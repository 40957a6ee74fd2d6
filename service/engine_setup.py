"""EngineArgs, and building an engine's parts from them: where the model comes from (the embedded
default pair, the small preset), the shared prefix tier and its namespace, and the
tensor-parallel executor."""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.executor import ThreadExecutor
from scheduler.faults import FaultPlan
from scheduler.prefix_tier import PrefixTier, TierConfig, make_store

log = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """Everything needed to build an engine; mirrors the `serve` flags and LLM(...) kwargs."""

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    threads: int | None = None  # torch CPU threads (default: torch's, i.e. all cores)
    # The engine core on its own thread with its own loop (True), on the caller's loop
    # (False); None: on for CUDA, off on CPU (service.async_engine.engine_thread_default).
    engine_thread: bool | None = None
    cuda_graphs: bool | None = None  # None: on for CUDA + Triton; False = vLLM's enforce_eager
    enable_prefix_caching: bool = True
    redis_url: str | None = None  # redis://... shares prefixes across replicas; memory://
    redis_hit_threshold: int = 1  # local hits before a block's KV is published
    redis_max_kv_bytes: int = 1 << 30  # cap on KV bytes this model keeps in Redis
    redis_lookup_deadline: float = 1.0  # seconds a Redis look-up may take
    # Fraction of redis_max_kv_bytes one tenant (API key) may hold in the shared tier;
    # 1.0: no per-key share (see scheduler.prefix_tier, "Per-tenant share").
    prefix_tier_key_share: float = 1.0
    device: str | None = None
    # Fault injection for tests and drills (see scheduler/faults.py); None reads the
    # PAGESTREAM_FAULT_INJECTION environment variable, which is unset in normal serving.
    fault_injection: str | None = None
    # Admission: past these, new requests get EngineOverloaded (HTTP 429).  None: unbounded
    # (the offline LLM API queues everything it is given).
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    # One API key's own bound on its waiting requests (None: only the global ones).
    max_waiting_per_key: int | None = None
    # Waiting-queue policy: "fair" (deficit round robin on prompt tokens across API keys,
    # weighted by tenant_weights: tenant id -> weight, default 1) or "fcfs".
    scheduling_policy: str = "fair"
    tenant_weights: dict[str, float] | None = None
    # Conversation KV pins: at most this fraction of the KV blocks, for session_ttl s.
    pinned_kv_fraction: float = 0.25
    session_ttl: float = 300.0
    kv_cache_dtype: str = "auto"  # auto (the model dtype), int8 or fp8 (e4m3)
    # weights: None (as stored, or AWQ when the checkpoint says), int8
    quantization: str | None = None
    # Speculative decoding, in vLLM's speculative_config shape (see scheduler.spec):
    # {"method": "ngram"|"draft", "num_speculative_tokens": k, "model": DIR, ...}.
    speculative_config: dict[str, Any] | None = None
    # Tensor parallelism: ranks (processes) one model is split over, and how long a
    # collective may wait for a rank before the step fails (a dead or hung rank).
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0
    # Pipeline parallelism: stages the layers are split over (each of
    # tensor_parallel_size ranks), and micro-batches a step is cut into so they overlap.
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int = 2
    # Several hosts (torchrun's names): node 0 serves the API and holds rank 0, whose
    # torch.distributed store listens on master_addr:master_port; the step connections
    # of the other nodes' ranks go to master_port + 1.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0


def namespace_fingerprint(
    model_dir: Path,
    dtype: str,
    block_size: int,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> str:
    """What must match for two replicas to share KV: the weights (and how they are
    quantized at load), dtype, KV cache dtype (the payload layout), block size and
    tokenizer.  Weights are identified by their safetensors headers (names, shapes,
    offsets) plus sampled bytes, which is cheap even for large checkpoints."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"v1|{dtype}|{block_size}|".encode())
    if kv_cache_dtype != "auto" or quantization:
        # Quantized KV payloads carry their scales; "s=bf16" since the scales went from
        # float32 to bf16, so replicas on either side of that change never share blocks.
        scales = "|s=bf16" if kv_cache_dtype != "auto" else ""
        h.update(f"kv={kv_cache_dtype}{scales}|w={quantization}|".encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        f = model_dir / name
        if f.is_file():
            h.update(name.encode() + f.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}|{size}|".encode())
        with f.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(min(header_len, 1 << 24)))
            for frac in (0.25, 0.5, 0.75, 1.0):
                fh.seek(max(8 + header_len, int(size * frac) - 65536))
                h.update(fh.read(65536))
    return h.hexdigest()


def build_prefix_tier(args: EngineArgs, runner: object, model_dir: Path) -> PrefixTier:
    dtype = str(runner.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    quant = runner.quantization  # type: ignore[attr-defined]
    fp = namespace_fingerprint(model_dir, dtype, args.block_size, args.kv_cache_dtype, quant)
    cfg = TierConfig(
        namespace=f"pagestream:{fp}",
        payload_bytes=runner.kv_payload_bytes,  # type: ignore[attr-defined]
        lookup_deadline=args.redis_lookup_deadline,
        hit_threshold=args.redis_hit_threshold,
        max_kv_bytes=args.redis_max_kv_bytes,
        tenant_share=args.prefix_tier_key_share,
        meta={
            "model": str(model_dir),
            "dtype": dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": str(quant),
            "block_size": str(args.block_size),
            "payload_bytes": str(runner.kv_payload_bytes),  # type: ignore[attr-defined]
        },
    )
    store, kind = make_store(args.redis_url or "", cfg)
    log.info("shared prefix tier: %s, namespace %s", kind, cfg.namespace)
    return PrefixTier(store, cfg, name=kind)


def tp_executor(
    args: EngineArgs, model_dir: Path, runner_kwargs: dict[str, Any], faults: FaultPlan | None
) -> ThreadExecutor:
    """Check what tensor and pipeline parallelism cannot do before any process starts,
    then spawn."""
    from gpu.config import ModelConfig, ModelLoadError
    from gpu.pp import check_pp_config
    from gpu.tp import check_tp_config
    from gpu.tp_executor import TPExecutor

    cfg = ModelConfig.from_dir(model_dir)
    check_tp_config(cfg, args.tensor_parallel_size)
    check_pp_config(cfg, args.pipeline_parallel_size, args.quantization)
    if args.speculative_config:
        raise ModelLoadError(
            "--tensor-parallel-size / --pipeline-parallel-size > 1 do not work with "
            "speculative decoding"
        )
    if args.pipeline_micro_batches < 1:
        raise ModelLoadError(
            f"pipeline_micro_batches must be at least 1, got {args.pipeline_micro_batches}"
        )
    return TPExecutor(
        args.tensor_parallel_size,
        runner_kwargs,
        faults=faults,
        threads=args.threads,
        timeout_s=args.tensor_parallel_timeout,
        pipeline_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        master_addr=args.master_addr,
        master_port=args.master_port,
        micro_batches=args.pipeline_micro_batches,
    )


def run_worker_node(args: EngineArgs, health: tuple[str, int] | None = None) -> int:
    """`serve --node-rank k` (k > 0): this node's ranks only, no API server; returns the
    process's exit code (non-zero when a rank failed).  `health`: an address where GET
    /health and /live answer 200 while the node runs (its ranks' supervisor is alive),
    so the probes of a pod template shared with node 0 hold on every node."""
    from gpu.tp_executor import Topology
    from gpu.tp_executor import run_worker_node as run_node

    if health is not None:
        _serve_node_health(*health, args.node_rank)
    topo = Topology(
        args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes, args.master_addr,
        args.master_port, args.tensor_parallel_timeout, args.pipeline_micro_batches,
    )  # fmt: skip
    return run_node(topo, args.node_rank, args.threads)


def _serve_node_health(host: str, port: int, node_rank: int) -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps({"status": "ok", "role": "worker node", "node_rank": node_rank}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            known = self.path.split("?")[0] in ("/health", "/live")
            self.send_response(200 if known else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if known else 0))
            self.end_headers()
            if known:
                self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:  # probes every few seconds: not logged
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="node-health", daemon=True).start()


def default_model_dir() -> Path:
    """The embedded default model: the target of the trained pair shipped in modelkit/pair
    (`pagestream train-pair` made it), which writes plausible Python-flavoured text."""
    from modelkit.train import PAIR_DIR

    return PAIR_DIR / "target"


def default_draft_dir() -> Path:
    """Its draft model (same tokenizer), for `--speculative-method draft`."""
    from modelkit.train import PAIR_DIR

    return PAIR_DIR / "draft"


class DefaultModelMissing(FileNotFoundError):
    """The shipped default model is not there (a trimmed install); the server never trains
    one at start-up, it says which command writes it."""


def ensure_default_model() -> Path:
    """The embedded default model, or DefaultModelMissing naming the command that writes
    it (`make run` runs that command first when it is missing)."""
    path = default_model_dir()
    if (path / "config.json").is_file():
        return path
    raise DefaultModelMissing(
        f"the default model is missing ({path / 'config.json'} not found): write it with "
        f"`pagestream train-pair {path.parent}` (a few CPU minutes), or pass --model DIR"
    )


def ensure_small_model() -> Path:
    """The random-weight `small` preset (SmolLM-135M's shape), for benchmarks."""
    from modelkit.make_model import cache_root, make_model

    path = cache_root() / "models" / "default-small"
    if not (path / "config.json").is_file():
        log.info("writing the small preset to %s (first use)", path)
        make_model(path, preset="small")
    return path
