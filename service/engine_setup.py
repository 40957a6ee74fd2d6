"""Building an engine's parts from its EngineConfig (scheduler/config.py): where the model
comes from (the embedded default pair, the small preset), the shared prefix tier and its
namespace, and the tensor-parallel executor."""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any

from scheduler.config import EngineConfig
from scheduler.executor import ThreadExecutor
from scheduler.faults import FaultPlan
from scheduler.prefix_tier import PrefixTier, TierConfig, make_store

log = logging.getLogger(__name__)


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


def build_prefix_tier(config: EngineConfig, runner: object, model_dir: Path) -> PrefixTier:
    dtype = str(runner.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    quant = runner.quantization  # type: ignore[attr-defined]
    t, block_size, kv_dtype = (
        config.prefix_tier,
        config.cache.block_size,
        config.cache.kv_cache_dtype,
    )
    fp = namespace_fingerprint(model_dir, dtype, block_size, kv_dtype, quant)
    cfg = TierConfig(
        namespace=f"pagestream:{fp}",
        payload_bytes=runner.kv_payload_bytes,  # type: ignore[attr-defined]
        lookup_deadline=t.redis_lookup_deadline,
        hit_threshold=t.redis_hit_threshold,
        max_kv_bytes=t.redis_max_kv_bytes,
        tenant_share=t.prefix_tier_key_share,
        meta={
            "model": str(model_dir),
            "dtype": dtype,
            "kv_cache_dtype": kv_dtype,
            "quantization": str(quant),
            "block_size": str(block_size),
            "payload_bytes": str(runner.kv_payload_bytes),  # type: ignore[attr-defined]
        },
    )
    store, kind = make_store(t.redis_url or "", cfg)
    log.info("shared prefix tier: %s, namespace %s", kind, cfg.namespace)
    return PrefixTier(store, cfg, name=kind)


def tp_executor(config: EngineConfig, model_dir: Path, faults: FaultPlan | None) -> ThreadExecutor:
    """Check what tensor and pipeline parallelism cannot do with this model before any
    process starts (EngineConfig already refused what they cannot do at all), then
    spawn.  `model_dir` is the checkpoint's own: each rank applies --hf-overrides where
    it runs (its node's cache)."""
    from gpu.config import ModelConfig, with_hf_overrides
    from gpu.pp import check_pp_config
    from gpu.tp import check_tp_config
    from gpu.tp_executor import TPExecutor

    cfg = ModelConfig.from_dir(with_hf_overrides(model_dir, config.model.hf_overrides))
    par = config.parallel
    check_tp_config(cfg, par.tensor_parallel_size)
    check_pp_config(cfg, par.pipeline_parallel_size, config.model.quantization)
    return TPExecutor(config, model_dir, faults=faults)


def run_worker_node(config: EngineConfig, health: tuple[str, int] | None = None) -> int:
    """`serve --node-rank k` (k > 0): this node's ranks only, no API server; returns the
    process's exit code (non-zero when a rank failed).  `health`: an address where GET
    /health and /live answer 200 while the node runs (its ranks' supervisor is alive),
    so the probes of a pod template shared with node 0 hold on every node."""
    from gpu.tp_executor import Topology
    from gpu.tp_executor import run_worker_node as run_node

    par = config.parallel
    if health is not None:
        _serve_node_health(*health, par.node_rank)
    return run_node(Topology.from_settings(par), par.node_rank, config.device.threads)


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
