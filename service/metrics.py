"""Prometheus metrics with the names an operator of vLLM would recognise."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.engine_core import StepInfo
from scheduler.pins import PinStats
from scheduler.prefix_tier import TierStats
from scheduler.scheduler import SchedulerStats
from scheduler.spec import SpecStats
from service.outputs import RequestOutput

if TYPE_CHECKING:
    from service.resume import StreamRegistry

# The *_created series only add noise to every scrape.
disable_created_metrics()


def observe_many(hist: Histogram, values: list[float]) -> None:
    """`hist.observe` for each value, in one pass: a request's inter-token latencies
    are one per token, and observe() walks the buckets and takes a lock per call.
    Falls back to observe() where the child's layout is not the one this reads."""
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            hist.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:  # the first bucket whose bound is >= v, as observe() picks
        counts[bisect.bisect_left(bounds, v)] += 1
    total.inc(sum(values))
    for i, k in enumerate(counts):
        if k:
            buckets[i].inc(k)


_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # Families in the order they are exposed.
        self._add_latencies()
        self._add_scheduler_state()
        self._add_throughput()
        self._add_failures_and_load()
        self._add_conversations()
        self.extra_counters: dict[str, Counter] = {}
        self._last = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self._last_extra: dict[str, float] = {}
        self._pin_children: tuple[Any, Any, tuple[tuple[str, Any], ...]] | None = None
        # Label children resolved once: the step hook runs every step.
        self._c = {
            name: getattr(self, name).labels(model_name)
            for name in (
                "ttft", "itl", "e2e", "queue", "running", "waiting", "kv_usage",
                "prefix_queries", "preemptions", "prompt_tokens", "generation_tokens", "step_time",
            )
        }  # fmt: skip
        self._hits_local = self.prefix_hits.labels(model_name, "local")
        self._hits_redis = self.prefix_hits.labels(model_name, "redis")
        self._tier_up: Gauge | None = None

    def _add_latencies(self) -> None:
        """Per-request latency histograms, observed when a request finishes."""
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "pagestream_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "pagestream_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            m, buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pagestream_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "pagestream_request_queue_time_seconds",
            "Time a request waited before its first step.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def _add_scheduler_state(self) -> None:
        """The batch, the KV pool and the prefix cache, as the step hook sees them."""
        r, m = self.registry, ["model_name"]
        self.running = Gauge(
            "pagestream_num_requests_running", "Sequences in the running batch.", m, registry=r
        )
        self.waiting = Gauge(
            "pagestream_num_requests_waiting", "Requests waiting to be admitted.", m, registry=r
        )
        self.kv_usage = Gauge(
            "pagestream_kv_cache_usage_ratio",
            "KV blocks held by live requests over all blocks (cached-but-free blocks count as free).",
            m, registry=r,
        )  # fmt: skip
        self.prefix_queries = Counter(
            "pagestream_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m, registry=r,
        )  # fmt: skip
        self.prefix_hits = Counter(
            "pagestream_prefix_cache_hits",
            "Prompt tokens served from the prefix cache, by tier (local, redis).",
            [*m, "tier"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "pagestream_num_preemptions", "Requests preempted for KV space.", m, registry=r
        )

    def _add_throughput(self) -> None:
        """Tokens in and out, finished requests, and the step's wall time."""
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "pagestream_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        )
        self.generation_tokens = Counter(
            "pagestream_generation_tokens", "Tokens generated.", m, registry=r
        )
        self.requests = Counter(
            "pagestream_request_success",
            "Finished requests by finish reason.",
            [*m, "finished_reason"], registry=r,
        )  # fmt: skip
        self.lora_requests = Counter(
            "pagestream_lora_requests",
            "Finished requests that ran a LoRA adapter (--lora-modules), by adapter.",
            [*m, "adapter"], registry=r,
        )  # fmt: skip
        self.step_time = Histogram(
            "pagestream_engine_step_seconds",
            "Wall time of one engine step (model forward and sampling).",
            m, buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip

    def _add_failures_and_load(self) -> None:
        """What an operator alerts on: slow clients, failures, refusals, blocks in use."""
        r, m = self.registry, ["model_name"]
        self.slow_clients = Counter(
            "pagestream_slow_clients",
            "Streams closed because the client did not read fast enough, by transport.",
            [*m, "transport"], registry=r,
        )  # fmt: skip
        self.request_errors = Counter(
            "pagestream_request_errors",
            "Requests that failed inside the engine or their output processing.",
            m, registry=r,
        )  # fmt: skip
        self.hook_errors = Gauge(
            "pagestream_engine_hook_errors",
            "Failures of hooks beside the step loop (metrics, prefix tier), which go on.",
            [*m, "hook"], registry=r,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            "pagestream_kv_blocks_used", "KV blocks held by live requests.", m, registry=r
        )
        self.rejected = Counter(
            "pagestream_requests_rejected",
            "Requests refused for load (overloaded: the waiting queue is full; websockets: "
            "too many open sockets), answered 429.",
            [*m, "reason"], registry=r,
        )  # fmt: skip

    def _add_conversations(self) -> None:
        """Conversation KV pins (scheduler/pins.py) and whether follow-up turns hit."""
        r, m = self.registry, ["model_name"]
        self.pinned_blocks = Gauge(
            "pagestream_kv_pinned_blocks",
            "KV blocks pinned for conversations' next turns (in use or free).",
            m, registry=r,
        )  # fmt: skip
        self.pinned_conversations = Gauge(
            "pagestream_pinned_conversations", "Conversations holding a KV pin.", m, registry=r
        )
        self.followups = Counter(
            "pagestream_conversation_followup_turns",
            "Finished turns of conversations seen before (turn 2 and later).",
            m, registry=r,
        )  # fmt: skip
        self.followup_hits = Counter(
            "pagestream_conversation_followup_hit_turns",
            "Follow-up turns whose prompt hit the prefix cache (over followup_turns: the "
            "turn-2 hit rate).",
            m, registry=r,
        )  # fmt: skip
        self.followup_tokens = Counter(
            "pagestream_conversation_followup_prompt_tokens",
            "Prompt tokens of follow-up turns, and of them served from a prefix cache "
            "(kind=cached).",
            [*m, "kind"], registry=r,
        )  # fmt: skip
        self.pins_dropped = Counter(
            "pagestream_conversation_pins_dropped",
            "Pinned blocks evicted anyway (reason=evicted: no unpinned block was left) and "
            "pins that reached --session-ttl (reason=expired).",
            [*m, "reason"], registry=r,
        )  # fmt: skip

    def on_pins(self, st: PinStats) -> None:
        # Runs every step: the labelled children are looked up once (each `labels` call
        # builds and hashes its label tuple under a lock).
        children = self._pin_children
        if children is None:
            name = self.model_name
            children = self._pin_children = (
                self.pinned_blocks.labels(name),
                self.pinned_conversations.labels(name),
                (
                    ("followup_turns", self.followups.labels(name)),
                    ("followup_hit_turns", self.followup_hits.labels(name)),
                    ("followup_prompt_tokens", self.followup_tokens.labels(name, "prompt")),
                    ("followup_cached_tokens", self.followup_tokens.labels(name, "cached")),
                    ("evicted_blocks", self.pins_dropped.labels(name, "evicted")),
                    ("expired", self.pins_dropped.labels(name, "expired")),
                ),
            )
        blocks, conversations, counters = children
        blocks.set(st.pinned_blocks)
        conversations.set(st.conversations)
        for attr, counter in counters:
            value, key = getattr(st, attr), f"pins:{attr}"
            last = self._last_extra.get(key, 0)
            if value > last:
                counter.inc(value - last)
                self._last_extra[key] = value

    def on_truncated(self, messages: int) -> None:
        """A request under `truncation: "auto"` that left out its oldest messages."""
        self.counter(
            "pagestream_truncated_requests",
            'Requests under truncation "auto" whose conversation did not fit: its oldest '
            "turns were left out.",
        ).labels(self.model_name).inc()
        self.counter(
            "pagestream_truncated_messages", 'Messages left out by truncation "auto".'
        ).labels(self.model_name).inc(messages)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        """A further counter (e.g. the Redis tier's), registered once."""
        if name not in self.extra_counters:
            self.extra_counters[name] = Counter(
                name, doc, ["model_name", *labels], registry=self.registry
            )
        return self.extra_counters[name]

    def on_tier(self, tier_name: str, st: TierStats, up: bool) -> None:
        """Counters of the shared prefix tier (look-ups, blocks and bytes, errors)."""
        fields = {
            "lookups": ("pagestream_prefix_tier_lookups", "Look-ups sent to the shared tier."),
            "blocks_loaded": (
                "pagestream_prefix_tier_blocks_loaded", "KV blocks loaded from the shared tier."
            ),
            "bytes_loaded": (
                "pagestream_prefix_tier_bytes_loaded", "KV bytes loaded from the shared tier."
            ),
            "blocks_published": (
                "pagestream_prefix_tier_blocks_published", "KV blocks written to the shared tier."
            ),
            "bytes_published": (
                "pagestream_prefix_tier_bytes_published", "KV bytes written to the shared tier."
            ),
            "errors": (
                "pagestream_prefix_tier_errors",
                "Shared-tier operations that failed (it then serves locally and retries).",
            ),
            "bad_payloads": (
                "pagestream_prefix_tier_bad_payloads",
                "Payloads dropped for a failed checksum or size check.",
            ),
        }  # fmt: skip
        for attr, (name, doc) in fields.items():
            value = getattr(st, attr)
            key = f"{tier_name}:{attr}"
            last = self._last_extra.get(key, 0)
            if value > last:
                self.counter(name, doc, ("tier",)).labels(self.model_name, tier_name).inc(
                    value - last
                )
                self._last_extra[key] = value
        if self._tier_up is None:
            self._tier_up = Gauge(
                "pagestream_prefix_tier_up",
                "1 while the shared prefix tier answers, 0 while degraded to local caching.",
                ["model_name", "tier"],
                registry=self.registry,
            )
        self._tier_up.labels(self.model_name, tier_name).set(1 if up else 0)

    def set_kv_cache_info(self, runner: object) -> None:
        """KV cache capacity as allocated at start-up: blocks, and bytes per token (which
        the KV cache dtype sets), labelled with the KV dtype and weight quantization."""
        labels = ["model_name", "kv_cache_dtype", "quantization"]
        values = (
            self.model_name,
            str(getattr(runner, "kv_cache_dtype", "auto")),
            str(getattr(runner, "quantization", None) or "none"),
        )
        blocks = Gauge(
            "pagestream_kv_cache_num_blocks", "KV blocks allocated.", labels, registry=self.registry
        )
        per_token = Gauge(
            "pagestream_kv_cache_bytes_per_token",
            "KV cache bytes one token takes over all layers (values and scales).",
            labels, registry=self.registry,
        )  # fmt: skip
        bs = int(getattr(runner, "block_size", 1))
        blocks.labels(*values).set(int(getattr(runner, "num_kv_blocks", 0)))
        per_token.labels(*values).set(int(getattr(runner, "kv_bytes_per_block", 0)) // bs)

    def on_step(self, info: StepInfo, stats: SchedulerStats) -> None:
        c = self._c
        c["running"].set(stats.num_running)
        c["waiting"].set(stats.num_waiting)
        c["kv_usage"].set(stats.kv_usage)
        c["step_time"].observe(info.seconds)
        mo = info.mo
        c["generation_tokens"].inc(mo.generated_tokens)
        if stats.spec is not None:
            self._on_spec(stats.spec)
        if stats.pins is not None:
            self.on_pins(stats.pins)
        last = self._last
        if stats.prefix_queries > last.prefix_queries:
            c["prefix_queries"].inc(stats.prefix_queries - last.prefix_queries)
        if stats.prefix_hits > last.prefix_hits:
            self._hits_local.inc(stats.prefix_hits - last.prefix_hits)
        if stats.prefix_hits_remote > last.prefix_hits_remote:
            self._hits_redis.inc(stats.prefix_hits_remote - last.prefix_hits_remote)
        if stats.num_preemptions > last.num_preemptions:
            c["preemptions"].inc(stats.num_preemptions - last.num_preemptions)
        self._last = stats

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def _on_spec(self, st: SpecStats) -> None:
        """Speculative decoding counters, with vLLM's names under our prefix."""
        fields = {
            "num_drafts": ("pagestream_spec_decode_drafts", "Verify steps (per request)."),
            "num_draft_tokens": (
                "pagestream_spec_decode_draft_tokens", "Draft tokens proposed and verified."
            ),
            "num_accepted_tokens": (
                "pagestream_spec_decode_accepted_tokens", "Draft tokens accepted."
            ),
        }  # fmt: skip
        for attr, (name, doc) in fields.items():
            value = getattr(st, attr)
            last = self._last_extra.get(name, 0)
            if value > last:
                self.counter(name, doc).labels(self.model_name).inc(value - last)
                self._last_extra[name] = value
        per_pos = self.counter(
            "pagestream_spec_decode_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            ("position",),
        )
        for i, value in enumerate(st.accepted_by_position):
            key = f"spec_pos:{i}"
            last = self._last_extra.get(key, 0)
            if value > last:
                per_pos.labels(self.model_name, str(i)).inc(value - last)
                self._last_extra[key] = value

    def on_request_done(self, out: RequestOutput) -> None:
        m = out.metrics
        c = self._c
        c["prompt_tokens"].inc(len(out.prompt_token_ids))
        # A pooling request (embedding, classification, score) ends with its one pass:
        # "stop", as vLLM counts it, and no token latencies (none was streamed).
        pooled = out.embedding is not None
        for o in out.outputs:
            reason = "stop" if pooled and o.finish_reason == "length" else o.finish_reason
            self.requests.labels(self.model_name, reason or "abort").inc()
        if out.lora is not None:
            self.lora_requests.labels(self.model_name, out.lora).inc()
        if any(o.finish_reason == "error" for o in out.outputs):
            self.request_errors.labels(self.model_name).inc()
        if m is None:
            return
        if m.first_scheduled_time is not None:
            c["queue"].observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.last_token_time is not None:
            c["e2e"].observe(m.last_token_time - m.arrival_time)
        if pooled:
            return
        if m.first_token_time is not None:
            c["ttft"].observe(m.first_token_time - m.arrival_time)
        times = m.token_times
        observe_many(c["itl"], [b - a for a, b in itertools.pairwise(times)])

    def refresh(
        self, stats: SchedulerStats, kv_blocks_used: int, hook_errors: dict[str, int]
    ) -> None:
        """Gauges read at scrape time (the step hook does not run while the engine idles,
        so aborts between steps would otherwise leave them stale)."""
        c = self._c
        c["running"].set(stats.num_running)
        c["waiting"].set(stats.num_waiting)
        c["kv_usage"].set(stats.kv_usage)
        self.kv_blocks_used.labels(self.model_name).set(kv_blocks_used)
        if stats.pins is not None:
            self.on_pins(stats.pins)
        for hook, n in hook_errors.items():
            self.hook_errors.labels(self.model_name, hook).set(n)

    def watch_streams(self, streams: StreamRegistry) -> None:
        """Expose the resumable streams' state (service/resume.py), read at scrape time."""
        self.registry.register(_StreamsCollector(streams, self.model_name))

    def watch_responses(self, serving: Any) -> None:
        """Expose the Responses store's failures and the background turns running
        (service/openai_responses.py), read at scrape time."""
        self.registry.register(_ResponsesCollector(serving, self.model_name))

    def watch_ranks(self, core: Any) -> None:
        """Data parallelism (service/data_parallel.py): each rank's load, as of the scrape's
        stats query, and the requests routed to it."""
        self.registry.register(_RanksCollector(core, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RanksCollector(Collector):
    def __init__(self, core: Any, model_name: str) -> None:
        self.core = core
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m, core = [self.model_name], self.core
        per_rank = (
            ("pagestream_dp_rank_requests_running", "Sequences running on each rank.",
             lambda st: st.num_running),
            ("pagestream_dp_rank_requests_waiting", "Sequences waiting on each rank.",
             lambda st: st.num_waiting),
            ("pagestream_dp_rank_kv_cache_usage", "Each rank's KV cache in use (0-1).",
             lambda st: st.kv_usage),
        )  # fmt: skip
        for name, doc, read in per_rank:
            g = GaugeMetricFamily(name, doc, labels=["model_name", "rank"])
            for i, st in enumerate(core.rank_stats):
                g.add_metric([*m, str(i)], read(st))
            yield g
        c = CounterMetricFamily(
            "pagestream_dp_rank_routed_requests",
            "Requests the server sent to each data-parallel rank.",
            labels=["model_name", "rank"],
        )
        for i, n in enumerate(core.routed):
            c.add_metric([*m, str(i)], n)
        yield c


class _ResponsesCollector(Collector):
    def __init__(self, serving: Any, model_name: str) -> None:
        self.serving = serving
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m = [self.model_name]
        g = GaugeMetricFamily(
            "pagestream_background_responses_running",
            "Background /v1/responses turns this replica runs now.",
            labels=["model_name"],
        )
        g.add_metric(m, len(self.serving.background.tasks))
        yield g
        c = CounterMetricFamily(
            "pagestream_response_store_errors",
            "Response store (Redis) calls that failed or timed out, by operation: reads "
            "answered 503, responses answered but not stored.",
            labels=["model_name", "op"],
        )
        for op, n in self.serving.store.errors.items():
            c.add_metric([*m, op], n)
        yield c


class _StreamsCollector(Collector):
    """Resumable streams: detached now, the bytes they buffer, resumes and expiries."""

    def __init__(self, streams: StreamRegistry, model_name: str) -> None:
        self.streams = streams
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s, m = self.streams, [self.model_name]
        g = GaugeMetricFamily(
            "pagestream_resume_streams_detached",
            "Resumable streams no connection holds now (waiting for a resume or their "
            "grace period to end).",
            labels=["model_name"],
        )
        g.add_metric(m, len(s.detached))
        yield g
        g = GaugeMetricFamily(
            "pagestream_resume_buffered_bytes",
            "Event bytes the detached streams buffer (capped by --resume-buffer-total-bytes).",
            labels=["model_name"],
        )
        g.add_metric(m, s.detached_bytes)
        yield g
        c = CounterMetricFamily(
            "pagestream_resume_streams_resumed",
            "Streams a reconnecting client took over (SSE Last-Event-ID, WebSocket resume).",
            labels=["model_name"],
        )
        c.add_metric(m, s.resumed)
        yield c
        c = CounterMetricFamily(
            "pagestream_resume_streams_expired",
            "Streams given up with events their client never got: reason=grace (nobody "
            "resumed in --resume-grace), buffer (over --resume-buffer-bytes with no reader), "
            "memory (aborted, detached longest, over --resume-buffer-total-bytes).",
            labels=["model_name", "reason"],
        )
        for reason, n in s.expired.items():
            c.add_metric([*m, reason], n)
        yield c
