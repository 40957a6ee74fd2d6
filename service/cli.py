"""`pagestream` command line: serve, make-model, train-pair, bench serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from service.async_engine import EngineArgs


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=_env("PAGESTREAM_MODEL"),
        help="HF checkpoint directory (default: the embedded model, made on first use)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks to allocate (default: from --kv-cache-memory)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="KV cache size (default: 2 GiB on CPU, 85%% of free memory on CUDA)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: 512 on CPU, 2048 on CUDA)",
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's, capped by the KV cache)",
    )
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (they are on by default on CUDA)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--redis-url",
        default=_env("PAGESTREAM_REDIS_URL"),
        help="Redis for the cross-replica prefix index (default: in-process only)",
    )
    g.add_argument(
        "--redis-hit-threshold",
        type=int,
        default=1,
        help="local prefix hits before a block's KV is published to Redis",
    )
    g.add_argument(
        "--redis-max-kv-memory",
        type=float,
        default=1.0,
        metavar="GiB",
        help="cap on KV bytes this model keeps in Redis",
    )
    g.add_argument(
        "--redis-lookup-deadline",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="longest a request waits for a Redis look-up",
    )
    g.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default=None,
        help="speculative decoding: n-gram prompt lookup or a draft model (default: off)",
    )
    g.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="draft tokens verified per step"
    )
    g.add_argument(
        "--speculative-model", default=None, help="draft checkpoint (same tokenizer as --model)"
    )
    g.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram prompt lookup")
    g.add_argument("--ngram-max", type=int, default=4, help="longest n-gram prompt lookup")
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=8,
        help="no speculation in steps with more requests running or queued than this",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")  # fmt: skip


def engine_args(a: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=a.model,
        dtype=a.dtype,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        kv_cache_bytes=int(a.kv_cache_memory * (1 << 30)) if a.kv_cache_memory else None,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        seed=a.seed,
        attention_backend=a.attention_backend,
        threads=a.threads,
        cuda_graphs=False if a.enforce_eager else None,
        enable_prefix_caching=not a.no_prefix_caching,
        redis_url=a.redis_url,
        redis_hit_threshold=a.redis_hit_threshold,
        redis_max_kv_bytes=int(a.redis_max_kv_memory * (1 << 30)),
        redis_lookup_deadline=a.redis_lookup_deadline,
        device=a.device,
        speculative_config=speculative_config(a),
    )


def speculative_config(a: argparse.Namespace) -> dict[str, object] | None:
    method = a.speculative_method or ("draft" if a.speculative_model else None)
    if method is None:
        return None
    return {
        "method": method,
        "num_speculative_tokens": a.num_speculative_tokens,
        "model": a.speculative_model,
        "prompt_lookup_min": a.ngram_min,
        "prompt_lookup_max": a.ngram_max,
        "disable_by_batch_size": a.speculative_disable_by_batch_size,
    }


def cmd_serve(a: argparse.Namespace) -> int:
    from service.app import ServerConfig, run_server

    origins = [o for o in (a.allowed_origins or "").split(",") if o]
    run_server(
        ServerConfig(
            engine=engine_args(a),
            host=a.host,
            port=a.port,
            api_key=a.api_key,
            served_model_name=a.served_model_name,
            allowed_origins=origins,
            max_request_bytes=a.max_request_bytes,
            shutdown_timeout=a.shutdown_timeout,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagestream", description="streaming LLM inference server")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API, WebSocket and chat page")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=_env("PAGESTREAM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (and ?api_key= on /v1/ws)",
    )
    s.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    s.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated extra origins allowed to open /v1/ws ('*' for any)",
    )
    s.add_argument("--max-request-bytes", type=int, default=4 << 20)
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight streams")  # fmt: skip
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    m = sub.add_parser("make-model", help="write a random-weight HF checkpoint", add_help=False)
    m.set_defaults(func=None)

    t = sub.add_parser(
        "train-pair", help="train the small target + draft model pair", add_help=False
    )
    t.set_defaults(func=None)

    b = sub.add_parser("bench", help="benchmarks against a running server", add_help=False)
    b.set_defaults(func=None)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These two own their argument parsing.
    if argv[:1] == ["make-model"]:
        from modelkit.make_model import main as make_model_main

        return make_model_main(argv[1:])
    if argv[:1] == ["train-pair"]:
        from modelkit.train import main as train_main

        return train_main(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        from bench.serve import main as bench_main

        return bench_main(argv[2:])
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if a.func is None:
        ap.error(f"usage: pagestream {a.command} ... (see pagestream {a.command} --help)")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
