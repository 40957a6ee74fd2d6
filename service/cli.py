"""`pagestream` command line: serve, make-model, train-pair; `bench ...` runs `python -m bench`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler import envs
from scheduler.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    FIELD_GROUP,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    ConfigError,
    EngineConfig,
    default_of,
)
from scheduler.spec import SpecConfig
from service.chat_template import CONTENT_FORMATS
from service.cli_config import expand_config_file
from service.limits import Limits

if TYPE_CHECKING:
    from service.app import ServerConfig

# What add_argument_group returns; argparse exports no public name for it.
Group = argparse._ArgumentGroup
log = logging.getLogger(__name__)


def _env(name: str) -> str | None:
    return envs.raw(name)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    # One group, filled topic by topic; the order of the calls is the order of --help.
    g = p.add_argument_group("engine")
    _add_model_args(g)
    _add_kv_cache_args(g)
    _add_step_args(g)
    _add_redis_args(g)
    _add_queue_args(g)
    _add_conversation_args(g)
    _add_speculative_args(g)
    _add_device_args(g)


def _add_model_args(g: Group) -> None:
    g.add_argument(
        "--model",
        default=_env("PAGESTREAM_MODEL"),
        help="HF checkpoint directory (default: the embedded model, made on first use)",
    )
    g.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="a directory whose tokenizer files (tokenizer.json, tokenizer_config.json, "
        "the chat template) serve the model in place of the checkpoint's own",
    )  # fmt: skip
    g.add_argument(
        "--dtype",
        default=default_of("dtype"),
        choices=DTYPES,
        help="weights and KV dtype; auto = bfloat16 on CUDA, and on CPU its native dtype "
        "(bfloat16 with AVX512-BF16 or AMX-BF16, else float32)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=default_of("kv_cache_dtype"),
        choices=KV_CACHE_DTYPES,
        help="KV cache storage: auto = the model dtype; int8 / fp8 (e4m3) with a scale per "
        "token and KV head hold ~2x the tokens of a 16-bit cache in the same memory",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weights: int8 = weight-only INT8 quantized at load (per-output-channel scales); "
        "awq / gptq = expect an AutoAWQ or a GPTQ INT4 checkpoint (detected from "
        "config.json anyway); "
        "fp8 = FP8 W8A8 (e4m3 weights with per-output-channel scales, activations per "
        "token, torch._scaled_mm), quantized at load, or an FP8 checkpoint's own "
        "(compressed-tensors / fbgemm_fp8, detected from config.json anyway)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT checkpoints) served beside the model: a request whose "
        "`model` is NAME runs with that adapter; requests of every adapter and of the base "
        "share each step",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="distinct adapters among the running requests (vLLM's flag, there default 1); "
        "a request of another adapter waits while the ones behind it go on (default: any)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=default_of("max_lora_rank"),
        help="largest rank an adapter of --lora-modules may have",
    )
    g.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="vLLM's: keys merged into the checkpoint's config.json as read, e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' serves Qwen3-Reranker as a '
        "cross-encoder",
    )
    g.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters "
        "from any path this server can read, loaded and unloaded while serving",
    )


def _add_kv_cache_args(g: Group) -> None:
    g.add_argument(
        "--block-size", type=int, default=default_of("block_size"), help="tokens per KV block"
    )
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
        help="KV cache size (default: 2 GiB on CPU, or PAGESTREAM_CPU_KVCACHE_SPACE; 85%% of free memory on CUDA)",
    )
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
        help="vLLM's: on CUDA, the share of the GPU's memory this engine may take; the KV "
        "cache gets 85%% of what it leaves after the memory in use once the weights are "
        "loaded (default: 85%% of the free memory; ignored on a CPU)",
    )  # fmt: skip


def _add_step_args(g: Group) -> None:
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step (default: 1024 on CPU, 2048 on CUDA)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=default_of("max_num_seqs"),
        help="most sequences in one step",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's, capped by the KV cache)",
    )
    g.add_argument(
        "--attention-backend", default=default_of("attention_backend"), choices=ATTENTION_BACKENDS
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs for decode steps (they are on by default on CUDA)",
    )
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="disable prefix caching")  # fmt: skip


def _add_redis_args(g: Group) -> None:
    g.add_argument(
        "--redis-url",
        default=_env("PAGESTREAM_REDIS_URL"),
        help="Redis for the cross-replica prefix index (default: in-process only)",
    )
    g.add_argument(
        "--redis-hit-threshold",
        type=int,
        default=default_of("redis_hit_threshold"),
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
        default=default_of("redis_lookup_deadline"),
        metavar="SECONDS",
        help="longest a request waits for a Redis look-up",
    )
    g.add_argument(
        "--prefix-tier-key-share",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="most of --redis-max-kv-memory one API key's published prefixes may hold (at "
        "least 1/number of keys, so a few keys can fill it; no share with one key or none); "
        "past it a key's own oldest entries are evicted, never another key's",
    )


def _add_conversation_args(g: Group) -> None:
    g.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=default_of("scheduling_policy"),
        help="admission from the waiting queue: fair = deficit round robin on prompt tokens "
        "across API keys (weights from --api-key-file), `priority` within a key; fcfs = "
        "one line for all, by priority then arrival",
    )
    g.add_argument(
        "--max-waiting-requests-per-key",
        type=int,
        default=512,
        help="requests one API key may have waiting; past it that key gets 429 while others "
        "still queue (0: only the global bounds)",
    )
    g.add_argument(
        "--pinned-kv-fraction",
        type=float,
        default=default_of("pinned_kv_fraction"),
        metavar="FRACTION",
        help="most of the KV cache conversations may pin (conversation_id / session_id, a "
        "WebSocket's session): their last turn's blocks are evicted after unpinned ones "
        "(0: no pinning)",
    )
    g.add_argument(
        "--session-ttl",
        type=float,
        default=default_of("session_ttl"),
        metavar="SECONDS",
        help="how long a conversation's last turn stays pinned",
    )


def _add_queue_args(g: Group) -> None:
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="sequences that may wait for their first step; past it new requests get 429 "
        "(0: unbounded)",
    )
    g.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=0,
        help="prompt tokens that may wait for their first step; past it 429 (0: unbounded)",
    )


def _add_speculative_args(g: Group) -> None:
    g.add_argument(
        "--speculative-method",
        choices=["ngram", "draft", "medusa"],
        default=None,
        help="speculative decoding: n-gram prompt lookup, a draft model, or Medusa heads "
        "(--speculative-model: their directory; `pagestream train-medusa` makes them) "
        "(default: off)",
    )
    g.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help="vLLM's form of the speculative settings, in place of the flags below: "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', "
        "method draft (or draft_model) with `model`, or medusa with `model`",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="draft tokens verified per step"
    )
    g.add_argument(
        "--speculative-model", default=None,
        help="draft checkpoint (same tokenizer as --model), or the Medusa heads' directory",
    )  # fmt: skip
    g.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram prompt lookup")
    g.add_argument("--ngram-max", type=int, default=4, help="longest n-gram prompt lookup")
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=SpecConfig.disable_by_batch_size,
        help="no speculation in steps with more requests running or queued than this "
        "(default: none; a step speculates when its measured cost pays for the tokens its "
        "drafts are expected to add)",
    )
    g.add_argument(
        "--speculative-min-acceptance-rate",
        type=float,
        default=SpecConfig.min_acceptance_rate,
        help="a request drafts j tokens while its estimated acceptance rate ** j stays at or "
        "above this; below it for one token it stops (but for occasional probes)",
    )


def _add_device_args(g: Group) -> None:
    g.add_argument("--seed", type=int, default=default_of("seed"), help="seed of unseeded sampling")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")  # fmt: skip
    g.add_argument(
        "--engine-thread", choices=["auto", "on", "off"], default="auto",
        help="run the engine core (scheduling, update, grammar masks) on its own thread, "
        "off the HTTP event loop (auto: on for CUDA, off on CPU; docs/HOST_PATH.md)",
    )  # fmt: skip
    g.add_argument(
        "--engine-process", choices=["auto", "on", "off"], nargs="?", const="on",
        default="auto",
        help="run the engine core (model, scheduler, grammar masks) in a child process; "
        "this one keeps HTTP, tokenization and detokenization (auto: on for CUDA unless "
        "--engine-thread, tensor/pipeline parallelism or --redis-url is given; bare: on; "
        "docs/HOST_PATH.md)",
    )  # fmt: skip
    g.add_argument(
        "--switch-interval-ms", type=float, default=None, metavar="MS",
        help="Python's thread switch interval: how long a thread that wants the interpreter "
        "waits for one running Python code (default: 0.5 with --engine-thread or "
        "--async-scheduling on, else the interpreter's 5 ms; docs/HOST_PATH.md)",
    )  # fmt: skip
    g.add_argument(
        "--async-scheduling", choices=["auto", "on", "off"], default="auto",
        help="schedule step N+1 while step N runs, plain decode steps only (auto: on for "
        "CUDA, off on CPU; docs/HOST_PATH.md)",
    )  # fmt: skip
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=default_of("tensor_parallel_size"),
        metavar="N",
        help="split the model over N ranks (processes; one GPU each on CUDA, disjoint cores "
        "on CPU) joined by torch.distributed",
    )
    g.add_argument(
        "--tensor-parallel-timeout",
        type=float,
        default=default_of("tensor_parallel_timeout"),
        metavar="SECONDS",
        help="longest a collective waits for a rank; a dead or hung rank fails the engine",
    )
    g.add_argument(
        "--pipeline-parallel-size", type=int, default=default_of("pipeline_parallel_size"),
        metavar="P",
        help="split the layers into P stages (each of --tensor-parallel-size ranks: P x T "
        "processes), each holding its layers' weights and KV blocks",
    )  # fmt: skip
    g.add_argument(
        "--data-parallel-size", "-dp", type=int, default=default_of("data_parallel_size"),
        metavar="N",
        help="N whole engines, each in its own process on its own cores (CPU) or GPU (CUDA), "
        "behind this one server; requests go to the rank holding their conversation or "
        "prefix, else the least loaded (docs/PARALLELISM.md)",
    )  # fmt: skip
    g.add_argument(
        "--pipeline-micro-batches", type=int, default=default_of("pipeline_micro_batches"),
        metavar="M",
        help="micro-batches a step's rows are cut into, so the stages work at once",
    )  # fmt: skip
    g.add_argument(
        "--nnodes", type=int, default=default_of("nnodes"),
        help="hosts the ranks are spread over (the same flags on each, but --node-rank)",
    )  # fmt: skip
    g.add_argument(
        "--node-rank", type=int, default=default_of("node_rank"),
        help="this host's index: 0 serves the API and holds rank 0; others run ranks only",
    )  # fmt: skip
    g.add_argument(
        "--master-addr", default=default_of("master_addr"),
        help="node 0's address, where the ranks rendezvous (torch.distributed)",
    )  # fmt: skip
    g.add_argument(
        "--master-port", type=int, default=default_of("master_port"),
        help="node 0's rendezvous port; the other nodes' step connections use the next one "
        "(default with one node: a free port)",
    )  # fmt: skip


def same_names(a: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed flags named as the dataclass `cls`'s fields, by field; a flag in other
    units or senses is converted by the caller (tests/service/test_engine_config.py checks
    that every flag of `serve` lands in exactly one field)."""
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if hasattr(a, f.name)}


def lora_modules(items: list[str] | None) -> dict[str, str] | None:
    """--lora-modules NAME=PATH ... as a dict (ConfigError names the flag)."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"lora_modules (--lora-modules) takes NAME=PATH, got {item!r}")
        if name in out:
            raise ConfigError(f"lora_modules (--lora-modules): {name!r} is given twice")
        out[name] = path
    return out or None


def _take_model_tag(a: argparse.Namespace) -> None:
    """`serve MODEL` (vLLM's form) is --model MODEL; the two must not disagree."""
    tag = getattr(a, "model_tag", None)
    if tag is None:
        return
    if a.model is not None and a.model != tag and a.model != _env("PAGESTREAM_MODEL"):
        raise ConfigError(f"model: serve {tag} and --model {a.model} name different models")
    a.model, a.model_tag = tag, None


def engine_config(a: argparse.Namespace, **settings: object) -> EngineConfig:
    """The engine's config from `serve`'s flags: a flag named as its setting lands there
    as parsed; the few in other units or senses are converted here; `settings` (what
    other flags decide, as server_config's key shares) win.  ConfigError names the flag."""
    _take_model_tag(a)
    same = {name: getattr(a, name) for name in FIELD_GROUP if hasattr(a, name)}
    converted = {
        "kv_cache_bytes": int(a.kv_cache_memory * (1 << 30)) if a.kv_cache_memory else None,
        "redis_max_kv_bytes": int(a.redis_max_kv_memory * (1 << 30)),
        "cuda_graphs": False if a.enforce_eager else None,
        "enable_prefix_caching": not a.no_prefix_caching,
        "engine_thread": {"on": True, "off": False}.get(a.engine_thread),
        "engine_process": {"on": True, "off": False}.get(a.engine_process),
        "async_scheduling": {"on": True, "off": False}.get(a.async_scheduling),
        # 0: unbounded
        "max_waiting_requests": a.max_waiting_requests or None,
        "max_waiting_tokens": a.max_waiting_tokens or None,
        "max_waiting_per_key": a.max_waiting_requests_per_key or None,
        "prefix_tier_key_share": key_share(a.prefix_tier_key_share, 0),
        "speculative_config": speculative_config(a),
        "lora_modules": lora_modules(a.lora_modules),
    }
    return EngineConfig.from_kwargs(**(same | converted | settings))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    d = Limits()
    g = p.add_argument_group("limits (every byte from a client is hostile)")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="stop strings in one request")  # fmt: skip
    g.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
                   help="characters in one stop string")  # fmt: skip
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="prompts in one /v1/completions body; inputs in one /v1/embeddings body, distinct texts in one /score or /rerank")  # fmt: skip
    g.add_argument("--max-choices-per-request", type=int, default=d.max_choices_per_request,
                   help="n x prompts: sequences one request may start")  # fmt: skip
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="logprobs / top_logprobs (at most 20)")  # fmt: skip
    g.add_argument("--max-prompt-logprob-entries", type=int,
                   default=d.max_prompt_logprob_entries,
                   help="prompt logprobs one response may carry: prompt tokens x (logprobs + 1), "
                   "for each choice that repeats them (echo, prompt_logprobs)")  # fmt: skip
    g.add_argument("--max-ws-frame-bytes", type=int, default=d.max_ws_frame_bytes,
                   help="largest WebSocket frame; a bigger one closes the socket (1009)")  # fmt: skip
    g.add_argument("--max-ws-generations", type=int, default=d.max_ws_generations,
                   help="generations in flight on one WebSocket")  # fmt: skip
    g.add_argument("--max-websockets", type=int, default=d.max_websockets,
                   help="open WebSockets per server")  # fmt: skip
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests supply their own chat template (chat_template)")  # fmt: skip
    g.add_argument("--template-workers", type=int, default=d.template_workers,
                   help="processes that render chat templates")  # fmt: skip
    g.add_argument("--template-timeout", type=float, default=d.template_timeout,
                   metavar="SECONDS", help="longest one chat-template render")  # fmt: skip
    g.add_argument("--tokenize-timeout", type=float, default=d.tokenize_timeout,
                   metavar="SECONDS",
                   help="longest one tokenization or detokenization, waiting included")  # fmt: skip
    g.add_argument("--tokenize-workers", type=int, default=d.tokenize_workers,
                   help="tokenizer threads, and tokenizer processes for large inputs")  # fmt: skip
    g.add_argument("--tokenize-process-bytes", type=int, default=d.tokenize_process_bytes,
                   help="inputs larger than this (UTF-8 bytes; 4 per token id) are tokenized "
                   "in a worker process that is killed at --tokenize-timeout")  # fmt: skip
    g.add_argument("--template-memory", type=float, default=d.template_memory_bytes / (1 << 30),
                   metavar="GiB", help="memory a template render process may add")  # fmt: skip
    g.add_argument("--max-template-output-chars", type=int,
                   default=d.max_template_output_chars,
                   help="longest rendered chat prompt, in characters")  # fmt: skip


def limits(a: argparse.Namespace) -> Limits:
    if not 0 <= a.max_logprobs <= 20:
        raise SystemExit("--max-logprobs must be in [0, 20]")
    if a.tokenize_timeout <= 0 or a.tokenize_workers < 1 or a.tokenize_process_bytes < 0:
        raise SystemExit("--tokenize-timeout must be > 0, --tokenize-workers >= 1, "
                         "--tokenize-process-bytes >= 0")  # fmt: skip
    bytes_ = {"template_memory_bytes": int(a.template_memory * (1 << 30))}
    return Limits(**(same_names(a, Limits) | bytes_))


def bound_onednn_caches(capacity: int) -> None:
    """Cap oneDNN's primitive caches (CPU).  They hold one compiled GEMM per distinct
    (tokens in the step, weight shape), ~0.8 MB each with the tiny model, 1024 by
    default: RSS rose by hundreds of MB over a few storms before this, with no Python
    object left behind.  Read once when torch first runs a oneDNN op, so this must run
    before torch is imported; an operator's own environment wins."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        envs.set_default(var, str(capacity))


def _split(values: list[str] | None) -> list[str]:
    """Repeatable flags that also take comma-separated lists, or a JSON list (vLLM's
    form: --allowed-origins '["https://a.example"]')."""
    out = []
    for item in values or []:
        if item.lstrip().startswith("["):
            import json

            try:
                parsed = json.loads(item)
            except ValueError as e:
                raise SystemExit(f"not a JSON list: {item!r} ({e})") from None
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise SystemExit(f"not a JSON list of strings: {item!r}")
            out += [v.strip() for v in parsed if v.strip()]
        else:
            out += [v.strip() for v in item.split(",") if v.strip()]
    return out


def read_key_file(path: str) -> list[str]:
    """One API key per line; blank lines and lines starting with # are skipped."""
    return [key for key, _ in parse_key_file(path)]


def parse_key_file(path: str) -> list[tuple[str, float]]:
    """(key, weight) per line: `KEY` or `KEY weight=W` (W > 0, the key's share of the
    waiting queue under --scheduling-policy fair; default 1).  A line of one key, the
    older format, reads as before."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            key, *attrs = parts
            weight = 1.0
            for attr in attrs:
                name, _, value = attr.partition("=")
                try:
                    weight = float(value) if name == "weight" else -1.0
                except ValueError:
                    weight = -1.0
                if not 0 < weight < float("inf"):
                    raise SystemExit(
                        f"--api-key-file {path}, line {n}: expected `KEY` or `KEY weight=W` "
                        "with W > 0"
                    )
            out.append((key, weight))
    if not out:
        raise SystemExit(f"--api-key-file {path}: no keys in it")
    return out


def speculative_config(a: argparse.Namespace) -> dict[str, object] | None:
    method = a.speculative_method or ("draft" if a.speculative_model else None)
    if a.speculative_config is not None:
        if method is not None:
            raise ConfigError(
                "speculative_config (--speculative-config) replaces --speculative-method and "
                "--speculative-model: give one form"
            )
        try:
            SpecConfig.from_dict(a.speculative_config)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"speculative_config (--speculative-config): {e}") from None
        return dict(a.speculative_config)
    if method is None:
        return None
    return {
        "method": method,
        "num_speculative_tokens": a.num_speculative_tokens,
        "model": a.speculative_model,
        "prompt_lookup_min": a.ngram_min,
        "prompt_lookup_max": a.ngram_max,
        "disable_by_batch_size": a.speculative_disable_by_batch_size,
        "min_acceptance_rate": a.speculative_min_acceptance_rate,
    }


def key_share(share: float, num_keys: int) -> float:
    """The fraction of the shared prefix tier one API key may hold: --prefix-tier-key-share,
    but at least 1/num_keys (a few keys can still fill the tier between them), and no
    share at all (1.0) with one key or none."""
    if not 0 < share <= 1:
        raise SystemExit("--prefix-tier-key-share must be in (0, 1]")
    return 1.0 if num_keys < 2 else max(share, 1.0 / num_keys)


def _check_reasoning_parser(name: str, model: str | None) -> None:
    """Refuse at start a parser whose tags the model's tokenizer lacks."""
    from service.engine_setup import default_model_dir
    from service.reasoning import ReasoningParser
    from service.tokenizer import Tokenizer

    path = Path(model) if model else default_model_dir()
    if not (path / "tokenizer.json").is_file():
        return  # the load says what is wrong with the directory
    try:
        ReasoningParser.load(name, Tokenizer.from_dir(path))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_generation_config(mode: str, override: dict[str, Any] | None, model: str | None) -> None:
    """Refuse at start a generation config whose values a request could not carry."""
    from service.engine_setup import default_model_dir
    from service.generation_defaults import GenerationDefaults

    GenerationDefaults.load(mode, Path(model) if model else default_model_dir(), override)


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return obj


def server_config(a: argparse.Namespace) -> ServerConfig:
    """The server's configuration from `serve`'s flags (bench.host_server builds its own
    engine around the same)."""
    from service.app import ServerConfig
    from service.chat_template import ChatTemplates, load_chat_template
    from service.pooling import check_pooler_config
    from service.security import key_tenant, server_ssl_context

    keys = list(a.api_key or [])
    if not keys and _env("PAGESTREAM_API_KEY"):
        keys = [_env("PAGESTREAM_API_KEY")]
    weighted = parse_key_file(a.api_key_file) if a.api_key_file else []
    keys += [k for k, _ in weighted]
    forwarded = _split(
        a.forwarded_allow_ips
        or ([_env("FORWARDED_ALLOW_IPS")] if _env("FORWARDED_ALLOW_IPS") else [])
    )
    hosts = a.allowed_hosts or (
        [_env("PAGESTREAM_ALLOWED_HOSTS")] if _env("PAGESTREAM_ALLOWED_HOSTS") else None
    )
    if a.response_store == "redis" and not (a.redis_url or "").startswith(
        ("redis://", "rediss://", "unix://")
    ):
        raise SystemExit("--response-store redis needs --redis-url redis://...")
    engine = engine_config(
        a,
        prefix_tier_key_share=key_share(a.prefix_tier_key_share, len(dict.fromkeys(keys))),
        tenant_weights={key_tenant(k): w for k, w in weighted if w != 1.0} or None,
    )
    if a.reasoning_parser:
        _check_reasoning_parser(a.reasoning_parser, a.tokenizer or a.model)
    _check_generation_config(a.generation_config, a.override_generation_config, a.model)
    admin = list(a.admin_api_key or [])
    if not admin and _env("PAGESTREAM_ADMIN_API_KEY"):
        admin = [_env("PAGESTREAM_ADMIN_API_KEY")]
    if set(admin) & set(keys):
        raise SystemExit("--admin-api-key: an admin key must not also be an API key")
    if a.allow_runtime_lora and keys and not admin:
        log.warning(
            "--allow-runtime-lora without --admin-api-key: every API key may load adapters "
            "from any path this server can read"
        )
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if a.pooler_config is not None:
        try:
            check_pooler_config(a.pooler_config)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if a.max_log_len is not None and a.max_log_len < 0:
        raise SystemExit("--max-log-len must be >= 0")
    try:
        chat_template = load_chat_template(a.chat_template) if a.chat_template else None
        if chat_template is not None:
            ChatTemplates(chat_template).compile(chat_template)  # a syntax error: now
    except ValueError as e:
        msg = str(e)
        why = msg if msg.startswith("--chat-template") else f"--chat-template: {msg}"
        raise SystemExit(why) from None
    converted = {
        "engine": engine,
        "chat_template": chat_template,
        "openapi_docs": not a.disable_fastapi_docs,
        "api_key": None,  # the flag's list is api_keys
        "api_keys": keys,
        "admin_api_keys": admin,
        "allowed_origins": _split(a.allowed_origins),
        "allowed_methods": _split(a.allowed_methods) or ["*"],
        "allowed_headers": _split(a.allowed_headers) or ["*"],
        "allowed_hosts": _split(hosts) if hosts else None,
        "forwarded_allow_ips": forwarded,
        "limits": limits(a),
        "access_log": not a.disable_access_log,
    }
    config = ServerConfig(**(same_names(a, ServerConfig) | converted))
    try:
        server_ssl_context(config)  # unreadable or mismatched files: now, not at bind
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return config


def cmd_serve(a: argparse.Namespace) -> int:
    bound_onednn_caches(a.onednn_cache_capacity)
    try:  # the whole configuration, checked before anything starts
        config = engine_config(a) if a.node_rank > 0 else server_config(a)
    except ConfigError as e:
        print(f"pagestream serve: error: {e}", file=sys.stderr)
        return 2
    if isinstance(config, EngineConfig):  # a worker node: its ranks only; node 0 serves
        from service.app import ENGINE_FAILURE_EXIT
        from service.engine_setup import run_worker_node

        code = run_worker_node(config, health=(a.host, a.port))
        return ENGINE_FAILURE_EXIT if code else 0
    from service.engine_setup import DefaultModelMissing, ensure_default_model

    if not a.model:  # said before the server starts, not as a load failure behind /health
        try:
            ensure_default_model()
        except DefaultModelMissing as e:
            print(f"pagestream serve: {e}", file=sys.stderr)
            return 2
    from service.app import run_server
    from service.async_engine import engine_process_default

    # serve's own choice of where the engine runs; an app or engine built directly (the
    # offline LLM, the tests' servers) keeps it in its process on auto.
    engine = config.engine.replace(engine_process=engine_process_default(config.engine))
    code = run_server(dataclasses.replace(config, engine=engine))
    if code:
        # The engine failed.  Exit now, even if a step is stuck in a broken device: the
        # executor's worker thread is not a daemon, and interpreter exit would join it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagestream", description="streaming LLM inference server")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API, WebSocket and chat page")
    s.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the checkpoint directory, as `vllm serve MODEL` takes it (or --model)",
    )  # fmt: skip
    _add_access_args(s)
    _add_listen_args(s)
    _add_stream_args(s)
    _add_chat_args(s)
    add_engine_args(s)
    add_limit_args(s)
    _add_accepted_args(s)
    s.set_defaults(func=cmd_serve)

    m = sub.add_parser("make-model", help="write a random-weight HF checkpoint", add_help=False)
    m.set_defaults(func=None)

    t = sub.add_parser(
        "train-pair", help="train the small target + draft model pair", add_help=False
    )
    t.set_defaults(func=None)

    tm = sub.add_parser(
        "train-medusa", help="train Medusa heads for a target checkpoint", add_help=False
    )
    tm.set_defaults(func=None)

    b = sub.add_parser("bench", help="benchmarks against a running server", add_help=False)
    b.set_defaults(func=None)
    return ap


def _subparser(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
    return sub.choices[name]  # type: ignore[no-any-return]


def _add_access_args(s: argparse.ArgumentParser) -> None:
    """Address, keys, origins and proxies: who may reach the server, and how."""
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY' on /v1 (and ?api_key= on /v1/ws); "
        "repeat for several keys (default: PAGESTREAM_API_KEY)",
    )
    s.add_argument(
        "--admin-api-key",
        action="append",
        help="the key the operator's routes take (LoRA load and unload, /debug), and no "
        "API key opens them; repeat for several (default: PAGESTREAM_ADMIN_API_KEY; unset: "
        "those routes take any API key, as vLLM's do)",
    )
    s.add_argument(
        "--api-key-file",
        default=_env("PAGESTREAM_API_KEY_FILE"),
        help="file with one API key per line (# comments), added to --api-key; a line may "
        "add `weight=W`, the key's fair share of the queue (default 1)",
    )
    s.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let all API keys share prefix-cache blocks (default: each key's are its own)",
    )
    s.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    s.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="the names requests may give as `model` (the first is the one responses "
        "report; default: the checkpoint's directory name)",
    )  # fmt: skip
    s.add_argument(
        "--allowed-origins",
        action="append",
        help="origins (besides the server's own) whose pages may open /v1/ws and call the "
        "API (CORS), e.g. https://chat.example.com (repeatable or comma-separated; '*' for "
        "any; default none)",
    )
    s.add_argument("--allowed-methods", action="append",
                   help="methods a cross-origin call may use (default: any)")  # fmt: skip
    s.add_argument("--allowed-headers", action="append",
                   help="headers a cross-origin call may send (default: any)")  # fmt: skip
    s.add_argument("--allow-credentials", action="store_true",
                   help="cross-origin calls may carry the browser's credentials")  # fmt: skip
    s.add_argument(
        "--allowed-hosts",
        action="append",
        help="Host header names the server answers (DNS rebinding guard; others get 421): "
        "names, .example.com for a domain and its subdomains, '*' for any; repeatable or "
        "comma-separated.  IP addresses and localhost always pass.  Default "
        "(PAGESTREAM_ALLOWED_HOSTS, else): the --host name, plus this machine's hostname "
        "on 0.0.0.0 / ::; behind a proxy or ingress list the public names (or '*')",
    )
    s.add_argument(
        "--public-tokenize",
        action="store_true",
        help="serve /tokenize and /detokenize without the API key (default: behind it "
        "when keys are set)",
    )
    s.add_argument(
        "--forwarded-allow-ips",
        action="append",
        help="proxies (IPs or CIDRs, comma-separated; '*' = any) whose X-Forwarded-Host/"
        "-Proto/-Port and Forwarded headers are trusted (default: FORWARDED_ALLOW_IPS, "
        "else none)",
    )


def _add_listen_args(s: argparse.ArgumentParser) -> None:
    """TLS and Unix sockets (vLLM's uvicorn flags)."""
    s.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help="serve HTTPS (and wss://) with this certificate chain")  # fmt: skip
    s.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                   help="the certificate's private key")  # fmt: skip
    s.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help="CA certificates client certificates are checked against")  # fmt: skip
    s.add_argument(
        "--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
        help="client certificates: 0 not asked for, 1 checked when given, 2 required "
        "(mutual TLS; Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)",
    )  # fmt: skip
    s.add_argument(
        "--root-path", default="", metavar="PREFIX",
        help="the path prefix a reverse proxy serves this server under (it strips it): "
        "the OpenAPI document's servers entry (the chat page needs none)",
    )  # fmt: skip
    s.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host / --port")  # fmt: skip


def _add_chat_args(s: argparse.ArgumentParser) -> None:
    """How chat requests become prompts, and how responses name things."""
    s.add_argument(
        "--chat-template", default=None, metavar="FILE|TEMPLATE",
        help="the chat template every chat request renders with, in place of the "
        "checkpoint's: a Jinja file, or the template itself",
    )  # fmt: skip
    s.add_argument(
        "--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
        help="message content as the template sees it: string (text parts joined), openai "
        "(a list of {type, text} parts), auto (openai for a template that loops over a "
        "message's content, else string)",
    )  # fmt: skip
    s.add_argument(
        "--pooler-config", "--override-pooler-config", type=_json_object, default=None,
        metavar="JSON",
        help='how embeddings pool, over the checkpoint\'s own rule: {"pooling_type": '
        '"LAST"|"MEAN"|"CLS", "normalize": true|false}',
    )  # fmt: skip
    s.add_argument("--response-role", default="assistant",
                   help="a chat reply's role after a generation prompt")  # fmt: skip
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:N", whatever a request asks')  # fmt: skip
    s.add_argument(
        "--enable-force-include-usage", action="store_true",
        help="every streamed chat or completion ends with a usage chunk, asked for or not",
    )  # fmt: skip
    s.add_argument("--disable-fastapi-docs", action="store_true",
                   help="do not serve /openapi.json")  # fmt: skip
    s.add_argument(
        "--enable-log-requests", action="store_true",
        help="log each queued prompt (text and token ids) and its sampling parameters at "
        "INFO on pagestream.requests (prompts are private: off by default)",
    )  # fmt: skip
    s.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="characters and token ids of a prompt --enable-log-requests logs")  # fmt: skip


# vLLM flags that ask for what pagestream does anyway; accepted so a `vllm serve` line runs
# unchanged (docs/FLAGS.md says what each means here).
ACCEPTED_VLLM_FLAGS = {
    "--trust-remote-code": "no checkpoint code is ever run: only the architectures "
    "pagestream implements load, and others are refused at load",
    "--enable-prefix-caching": "prefix caching is on unless --no-prefix-caching",
    "--enable-chunked-prefill": "prompts are always cut into chunks that share steps with decodes",
    "--enable-auto-tool-choice": "tool_choice auto is served whenever --tool-call-parser "
    "is given (it is refused without one)",
    "--enable-lora": "LoRA adapters are served whenever --lora-modules or "
    "--allow-runtime-lora is given",
    "--disable-log-requests": "requests are not logged unless --enable-log-requests",
    "--disable-log-stats": "no periodic statistics are logged (GET /metrics has them)",
}


def _add_accepted_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("vLLM flags accepted for what pagestream does anyway")
    for flag, meaning in ACCEPTED_VLLM_FLAGS.items():
        g.add_argument(flag, action="store_true", help=meaning)
    g.add_argument(
        "--config", default=None, metavar="YAML",
        help="flags from a YAML file (vLLM's: long flag names as keys, e.g. `port: 8001`); "
        "a flag on the command line wins over the file's",
    )  # fmt: skip


def _add_stream_args(s: argparse.ArgumentParser) -> None:
    """Request size, logging, slow readers and shutdown."""
    s.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                   help="no per-request log")  # fmt: skip
    s.add_argument("--max-request-bytes", type=int, default=4 << 20)
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="parse tool calls out of the text for tool_choice 'auto'")  # fmt: skip
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a reasoning model's <think> text into `reasoning`")  # fmt: skip
    s.add_argument(
        "--generation-config", default="auto", metavar="auto|vllm|DIR",
        help="sampling defaults for fields a request leaves out: the model's "
        "generation_config.json (auto), the API's own (vllm), or DIR's",
    )  # fmt: skip
    s.add_argument(
        "--override-generation-config", type=_json_object, default=None, metavar="JSON",
        help='sampling defaults set over --generation-config\'s, e.g. \'{"temperature": 0.5}\'',
    )  # fmt: skip
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight streams")  # fmt: skip
    s.add_argument(
        "--max-buffered-bytes", type=int, default=4 << 20,
        help="bytes the server may hold for one slow-reading stream (WebSocket outbox plus "
        "socket buffer); past it a WebSocket's generations are aborted and it is closed "
        "with 1008, and an SSE write waits (up to --send-timeout) for the client to drain",
    )  # fmt: skip
    s.add_argument(
        "--send-timeout", type=float, default=30.0, metavar="SECONDS",
        help="longest one WebSocket frame or SSE chunk may wait for the client to read it "
        "before the stream is aborted",
    )  # fmt: skip
    s.add_argument(
        "--resume-grace", type=float, default=5.0, metavar="SECONDS",
        help="a stream whose client disconnects runs on this long for the client to resume "
        "it (SSE: GET /v1/streams/{id} with Last-Event-ID; WebSocket: a resume frame); "
        "then it is aborted; 0 aborts at once",
    )  # fmt: skip
    s.add_argument(
        "--resume-buffer-bytes", type=int, default=1 << 20, metavar="BYTES",
        help="newest event bytes kept per stream for a resume; a stream that makes more "
        "while no connection holds it is aborted",
    )  # fmt: skip
    s.add_argument(
        "--resume-buffer-total-bytes", type=int, default=64 << 20, metavar="BYTES",
        help="event bytes all detached streams (no connection holds them) may buffer "
        "together; past it the streams detached longest are aborted, their KV freed",
    )  # fmt: skip
    s.add_argument(
        "--socket-send-buffer", type=int, default=None, metavar="BYTES",
        help="kernel send buffer of each streaming connection (default: the OS's "
        "autotuning, up to 4 MiB); smaller makes back-pressure act sooner",
    )  # fmt: skip
    s.add_argument(
        "--max-stored-responses", type=int, default=1024, metavar="N",
        help="/v1/responses kept (per API key) for GET /v1/responses/{id} and "
        "previous_response_id; past it the key holding the most loses its least recently "
        "used; 0: store nothing",
    )  # fmt: skip
    s.add_argument(
        "--response-store", choices=("auto", "memory", "redis"), default="auto",
        help="where stored responses live: this replica's memory, or Redis at --redis-url "
        "(shared by the fleet: any replica continues a chain, and chains outlive "
        "restarts); auto: Redis when --redis-url is a Redis URL",
    )  # fmt: skip
    s.add_argument(
        "--max-stored-response-bytes", type=int, default=64 << 20, metavar="BYTES",
        help="bytes all stored responses and their conversations may take together",
    )  # fmt: skip
    s.add_argument(
        "--onednn-cache-capacity", type=int, default=64,
        help="compiled CPU GEMMs kept (oneDNN/ideep primitive caches; each step size "
        "compiles its own); bounds their memory",
    )  # fmt: skip
    s.add_argument(
        "--enable-debug-routes", action="store_true",
        help="serve GET /debug/state (queues, KV blocks, RSS, tasks; behind the API key)",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These two own their argument parsing.
    if argv[:1] == ["make-model"]:
        from modelkit.make_model import main as make_model_main

        return make_model_main(argv[1:])
    if argv[:1] == ["train-pair"]:
        from modelkit.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["train-medusa"]:
        from modelkit.medusa_train import main as medusa_main

        return medusa_main(argv[1:])
    if argv[:1] == ["bench"]:
        # bench/ sits above the service (it drives servers), so the service does not
        # import it: like git's external commands, this process becomes `python -m bench`.
        os.execv(sys.executable, [sys.executable, "-m", "bench", *argv[1:]])
    ap = build_parser()
    if argv[:1] == ["serve"]:
        try:
            argv = ["serve", *expand_config_file(argv[1:], _subparser(ap, "serve"))]
        except ValueError as e:
            ap.error(str(e))
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if a.func is None:
        ap.error(f"usage: pagestream {a.command} ... (see pagestream {a.command} --help)")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
