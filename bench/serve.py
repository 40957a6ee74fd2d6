"""`pagestream bench serve`: a load generator against a running server.

It sends `--num-prompts` requests with Poisson (or gamma, `--burstiness`) arrivals at
`--request-rate`, at most `--max-concurrency` in flight, over SSE (`/v1/completions` or
`/v1/chat/completions` with `stream: true`) or the WebSocket (`/v1/ws`), and reports
throughput plus TTFT, TPOT, ITL and end-to-end latency, the way vLLM's
`benchmarks/serve.py` does, so numbers from the two are comparable.

Prompts of the `random` dataset are random token ids, sent as a token-id prompt so the
input length is exact; `ignore_eos` makes the output length exact too.  The chat endpoint
takes text, so there the prompt is random words and the server's usage report gives the
real prompt length.

Definitions (per successful request; times from just before the request is sent):
  TTFT   the first delta that carries a token (or text)
  ITL    every gap between consecutive deltas; a delta holding k tokens is one gap
  TPOT   (E2E - TTFT) / (output tokens - 1), for requests with more than one token
  E2E    the end of the stream ([DONE] / the `done` frame)

WebSocket pooling: one socket per concurrency slot (`--max-concurrency`, else one per
prompt), at most `--ws-connections` (default 256) sockets; beyond that, generations are
multiplexed on the least-loaded socket, as the protocol allows (the server takes up to 64
per socket).  A generation waiting for a socket slot waits like one at the semaphore:
its clock starts when its frame is sent.

This is a client: it imports nothing that pulls in torch or the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.serve_stats import METRIC_TITLES, METRICS, format_report, summarize
from bench.serve_stream import (
    MAX_SSE_LINE_BYTES,
    WS_MAX_PER_SOCKET,
    SSEParser,
    StreamEvent,
    WSPool,
    _auth_headers,
    _error_text,
    _Recorder,
    _ws_url,
    parse_sse_payload,
    sse_request,
    ws_request,
)
from bench.serve_workload import (
    BenchConfig,
    RequestResult,
    SampleRequest,
    arrival_offsets,
    random_requests,
)

# The pieces live in serve_workload / serve_stream / serve_stats; this module runs them and
# keeps the names importers (tests, bench/serve_sweep.py) use.
__all__ = [
    "MAX_SSE_LINE_BYTES",
    "METRICS",
    "METRIC_TITLES",
    "WS_MAX_PER_SOCKET",
    "BenchConfig",
    "RequestResult",
    "SSEParser",
    "SampleRequest",
    "StreamEvent",
    "WSPool",
    "_Recorder",
    "arrival_offsets",
    "build_parser",
    "config_from_args",
    "format_report",
    "main",
    "parse_sse_payload",
    "random_requests",
    "run_benchmark",
    "sse_request",
    "summarize",
    "ws_request",
]


# ----------------------------------------------------------------------------- the run
async def _model_info(
    session: aiohttp.ClientSession, cfg: BenchConfig
) -> tuple[str, dict[str, Any]]:
    url = cfg.base_url.rstrip("/") + "/v1/models"
    async with session.get(url, headers=_auth_headers(cfg.api_key)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url} failed: {await _error_text(resp)}")
        data = (await resp.json())["data"]
    if cfg.model is None:
        if not data:
            raise RuntimeError(f"GET {url} lists no model")
        return data[0]["id"], data[0]
    entry = next((m for m in data if m.get("id") == cfg.model), {})
    return cfg.model, entry


async def _vocab_size(
    session: aiohttp.ClientSession, cfg: BenchConfig, model: str, entry: dict[str, Any]
) -> int:
    """--vocab-size, else what the server says, else the checkpoint's config.json when it
    is on this machine, else the range in the server's out-of-vocabulary error."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    if isinstance(entry.get("vocab_size"), int):
        return entry["vocab_size"]
    root = entry.get("root")
    if isinstance(root, str):
        with contextlib.suppress(OSError, ValueError, TypeError):
            conf = json.loads((Path(root) / "config.json").read_text())
            v = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
            if isinstance(v, int):
                return v
    url = cfg.base_url.rstrip("/") + "/v1/completions"
    body = {"model": model, "prompt": [2**31 - 1], "max_tokens": 1}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.post(url, json=body, headers=_auth_headers(cfg.api_key)) as resp:
            m = re.search(r"\(0\.\.(\d+)\)", await resp.text())
            if resp.status == 400 and m:
                return int(m.group(1)) + 1
    raise RuntimeError("could not learn the model's vocabulary size; pass --vocab-size")


def _check_lengths(cfg: BenchConfig, entry: dict[str, Any]) -> None:
    max_len = entry.get("max_model_len")
    if not isinstance(max_len, int):
        return
    longest = (
        cfg.prefix_len
        + int(cfg.input_len * (1 + cfg.range_ratio))
        + int(cfg.output_len * (1 + cfg.range_ratio))
    )
    if longest > max_len:
        raise ValueError(
            f"prompt + output may reach {longest} tokens, but the server's max_model_len is "
            f"{max_len}; lower --input-len/--output-len/--range-ratio"
        )


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run one benchmark against a running server and return its metrics, the config and
    the per-request data (and write it to config.result_json when set)."""
    cfg = config
    cfg.validate()
    concurrency = cfg.max_concurrency or cfg.num_prompts
    text = cfg.endpoint == "chat"
    connector = aiohttp.TCPConnector(limit=max(concurrency, cfg.warmup, 1) + 1)
    # Per-request timeouts are set on each call; this one bounds the set-up calls.
    timeout = aiohttp.ClientTimeout(total=max(60.0, cfg.request_timeout))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model, entry = await _model_info(session, cfg)
        vocab = None
        if not text:
            _check_lengths(cfg, entry)
            vocab = await _vocab_size(session, cfg, model, entry)
        # Warm-up prompts come after the measured ones, from the same stream, so they never
        # prefix-cache-hit the measured ones any more than two measured prompts do.
        reqs = random_requests(
            cfg.num_prompts + cfg.warmup,
            cfg.input_len,
            cfg.output_len,
            cfg.range_ratio,
            vocab,
            cfg.prefix_len,
            cfg.seed,
            text=text,
        )
        measured, warm = reqs[: cfg.num_prompts], reqs[cfg.num_prompts :]

        pool: WSPool | None = None
        if cfg.transport == "ws":
            pool = WSPool(session, _ws_url(cfg.base_url), cfg.api_key)
            await pool.open(min(concurrency, cfg.ws_connections))

        async def one(req: SampleRequest, t0: float) -> RequestResult:
            if pool is not None:
                return await ws_request(pool, cfg, req, t0)
            return await sse_request(session, cfg, model, req, t0)

        try:
            if warm:
                await _warm_up(warm, concurrency, one)
            results, duration, peak = await _timed_run(cfg, measured, concurrency, one)
        finally:
            if pool is not None:
                await pool.close()

    out = _result_record(cfg, model, results, duration, peak)
    if cfg.result_json:
        Path(cfg.result_json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return out


async def _warm_up(
    warm: list[SampleRequest],
    concurrency: int,
    one: Callable[[SampleRequest, float], Awaitable[RequestResult]],
) -> None:
    """Send the warm-up requests, `concurrency` at a time; any failure stops the run."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrency)

    async def warm_one(req: SampleRequest) -> RequestResult:
        async with sem:
            return await one(req, t0)

    wres = await asyncio.gather(*(warm_one(r) for r in warm))
    bad = next((r for r in wres if not r.success), None)
    if bad is not None:
        raise RuntimeError(f"a warm-up request failed: {bad.error}")


def _result_record(
    cfg: BenchConfig, model: str, results: list[RequestResult], duration: float, peak: int
) -> dict[str, Any]:
    """The run's JSON record: what was asked, the summary, and per-request data."""
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": f"pagestream-{cfg.transport}",
        "model_id": model,
        "base_url": cfg.base_url,
        "transport": cfg.transport,
        "endpoint": cfg.endpoint,
        "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "percentiles": list(cfg.percentiles),
        "max_concurrent_requests": peak,
        "config": {
            k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
            for k, v in asdict(cfg).items()
            if k != "api_key"
        },
        **summarize(results, duration, cfg.percentiles),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2e for r in results],
        "start_times": [r.start for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "errors": [r.error for r in results],
    }
    return out


async def _timed_run(
    cfg: BenchConfig,
    reqs: list[SampleRequest],
    concurrency: int,
    one: Callable[[SampleRequest, float], Awaitable[RequestResult]],
) -> tuple[list[RequestResult], float, int]:
    """Send reqs on the arrival schedule; a request that arrives while `concurrency` are in
    flight waits at the semaphore (its clock starts when it is sent, as in vLLM)."""
    offsets = arrival_offsets(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
    sem = asyncio.Semaphore(concurrency)
    inflight = peak = 0
    t0 = time.perf_counter()
    ends: list[float] = []

    async def run(req: SampleRequest) -> RequestResult:
        nonlocal inflight, peak
        async with sem:
            inflight += 1
            peak = max(peak, inflight)
            try:
                return await one(req, t0)
            finally:
                inflight -= 1
                ends.append(time.perf_counter())

    tasks: list[asyncio.Task[RequestResult]] = []
    try:
        for req, at in zip(reqs, offsets):  # bounded by the prompt count
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run(req)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
    duration = (max(ends) if ends else time.perf_counter()) - t0
    return results, duration, peak


# ----------------------------------------------------------------------------- CLI
def _percentiles(s: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}") from e


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pagestream bench serve",
        description="load-test a running pagestream (or OpenAI-compatible) server: "
        "throughput, TTFT, TPOT, ITL and end-to-end latency",
    )
    d = BenchConfig()
    ap.add_argument("--base-url", default=d.base_url)
    ap.add_argument("--transport", choices=["sse", "ws"], default=d.transport,
                    help="SSE (OpenAI streaming) or the /v1/ws WebSocket")  # fmt: skip
    ap.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint,
                    help="completions: token-id prompts (exact lengths); chat: text prompts")  # fmt: skip
    ap.add_argument("--api-key", default=os.environ.get("PAGESTREAM_API_KEY") or None,
                    help="bearer token (default: $PAGESTREAM_API_KEY)")  # fmt: skip
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--dataset", choices=["random"], default=d.dataset)
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    ap.add_argument("--input-len", type=int, default=d.input_len)
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--range-ratio", type=float, default=d.range_ratio,
                    help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    ap.add_argument("--prefix-len", type=int, default=d.prefix_len,
                    help="random tokens shared by every prompt, before --input-len")  # fmt: skip
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="token ids are drawn from [0, V) (default: learned from the server)")  # fmt: skip
    ap.add_argument("--request-rate", type=float, default=d.request_rate,
                    help="requests per second; inf sends all at once")  # fmt: skip
    ap.add_argument("--burstiness", type=float, default=d.burstiness,
                    help="gamma shape of the arrival gaps; 1 = Poisson")  # fmt: skip
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--percentiles", type=_percentiles, default=d.percentiles,
                    help="comma-separated, e.g. 50,90,99")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=d.warmup,
                    help="requests sent (and checked) before the timed run")  # fmt: skip
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout,
                    help="seconds one request may take")  # fmt: skip
    ap.add_argument("--ws-connections", type=int, default=d.ws_connections,
                    help="most WebSockets to open; beyond, generations share sockets")  # fmt: skip
    ap.add_argument("--result-json", default=None, help="write metrics + per-request data here")
    return ap


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=a.base_url,
        transport=a.transport,
        endpoint=a.endpoint,
        api_key=a.api_key,
        model=a.model,
        dataset=a.dataset,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        prefix_len=a.prefix_len,
        vocab_size=a.vocab_size,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        seed=a.seed,
        temperature=a.temperature,
        percentiles=a.percentiles,
        warmup=a.warmup,
        request_timeout=a.request_timeout,
        ws_connections=a.ws_connections,
        result_json=a.result_json,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table; exit 1 when any request failed (the numbers are then not a
    clean measurement), 2 on bad arguments or an unreachable server."""
    ap = build_parser()
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from_args(a)
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (RuntimeError, ValueError, aiohttp.ClientError, OSError) as e:
        print(f"pagestream bench serve: {e}", file=sys.stderr)
        return 2
    print(format_report(result), flush=True)
    return 1 if result["failed"] else 0
