"""AsyncEngine: the composition of tokenizer, scheduler actor and model executor.

`generate()` is what every transport (SSE, WebSocket, the offline LLM class) consumes:
an async iterator of RequestOutputs carrying text deltas, with detokenization and stop
strings handled per sequence.  Closing the iterator early aborts the request in the
engine, which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from scheduler.config import LORA_NAME, EngineConfig, LoRAInUse, lora_fingerprint
from scheduler.engine_core import EngineCore, ExecutorFailed, StepInfo
from scheduler.executor import ThreadExecutor
from scheduler.faults import FaultPlan
from scheduler.prefix_tier import PrefixTier
from scheduler.request import Request, stop_set
from scheduler.sampling_params import ReasoningBudget, SamplingParams
from scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from scheduler.scheduler_types import SchedulerStats
from scheduler.spec import SpecDecoder
from scheduler.stream import RequestStream
from scheduler.structured import AfterReasoning
from service.bad_words import encode_words, nothing_allowed
from service.detokenizer import IncrementalDetokenizer, StopChecker
from service.engine_setup import build_prefix_tier, ensure_default_model, tp_executor
from service.outputs import CompletionOutput, RequestMetrics, RequestOutput, Submitted
from service.structured import GrammarCompiler, GrammarError
from service.tokenizer import Tokenizer

if TYPE_CHECKING:
    from service.data_parallel import DataParallelCore
    from service.engine_proc import ProcessCore, TierView

log = logging.getLogger(__name__)


def engine_thread_default(config: EngineConfig, runner: object) -> bool:
    """Whether the engine core runs on its own thread (EngineCore own_thread).  Auto: on
    a GPU yes, so scheduling, update and grammar work never hold up HTTP (and the reverse)
    while the device computes.  On a CPU no: there the model and the host share the same
    few cores, so the thread overlaps nothing the step does not already overlap inline
    (the step releases the GIL either way) and adds a loop hop and GIL hand-offs a step."""
    if config.device.engine_thread is not None:
        return config.device.engine_thread
    device = getattr(runner, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


def tokenizer_dir(config: EngineConfig, model_dir: Path) -> Path:
    """Where the served tokenizer's files are: --tokenizer, else the checkpoint's."""
    return Path(config.model.tokenizer) if config.model.tokenizer else model_dir


def default_builder(config: EngineConfig) -> AsyncEngine:
    """The engine process's builder (run in the child, pickled by name): the engine as
    it is built in one process."""
    return AsyncEngine.from_config(config)


def engine_process_default(config: EngineConfig) -> bool:
    """Whether `serve` runs the engine core in a child process (service/engine_proc.py).
    Auto: on CUDA yes, as vLLM v1 serves: the host bench, whose stand-in model releases
    the GIL for a step as a GPU step does, measured the process ahead of the engine
    thread (host time in series with an 8 ms step 4-18% against 7-28%, server CPU a
    token 5.8-6.7 against 6.1-8.4 µs; docs/HOST_PATH.md); the shared prefix tier and
    the tensor/pipeline-parallel executor (with its rank processes) live in the child.
    Not where the engine thread is set either way.  On a CPU no: served beside the
    model it measured level with inline, and it is one more process on the cores the
    model uses."""
    d = config.device
    if d.engine_process is not None:
        return d.engine_process
    if config.parallel.data_parallel_size > 1:
        return True  # every rank is an engine process
    if d.engine_thread is not None:
        return False
    if d.device is not None:
        return d.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


# What --switch-interval-ms defaults to where the engine's threads run Python at once (its
# own engine thread, or scheduling ahead beside the executor): with the interpreter's 5 ms a
# thread that wants it waits up to a step's worth, several times a step; the shorter one
# cut both the host's CPU a token and TPOT in the host bench (docs/PERFORMANCE.md).
THREADED_SWITCH_INTERVAL_MS = 0.5


def switch_interval(config: EngineConfig, threaded: bool = False) -> float:
    """Apply --switch-interval-ms (process-wide) and return the interval in force, in
    seconds.  The engine's threads (HTTP loop, engine core, executor) take turns on one
    interpreter: a thread that wants it while another runs Python waits up to this long,
    and a step's host work hands it over several times (docs/HOST_PATH.md).  Unset:
    THREADED_SWITCH_INTERVAL_MS where `threaded`, else the interpreter's own."""
    ms = config.device.switch_interval_ms
    if ms is None and threaded:
        ms = THREADED_SWITCH_INTERVAL_MS
    if ms is not None:
        sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()


def async_scheduling_default(config: EngineConfig, runner: object) -> bool:
    """Whether the engine schedules step N+1 while step N runs (scheduler/ahead.py).
    Auto: on a GPU yes, the host's step work then hides behind the device's.  On a CPU
    no: the model's threads and the host's share the same cores, so there is no idle
    device to hide behind (docs/HOST_PATH.md has the measurements)."""
    if config.device.async_scheduling is not None:
        return config.device.async_scheduling
    device = getattr(runner, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


def rss_bytes() -> int | None:
    """This process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class MaxTokensTooLarge(RequestRejected):
    """max_tokens does not fit beside the prompt in max_model_len (names that field)."""


class EmbeddingOnly(RequestRejected):
    """A generation request to a model without an LM head (names `model`)."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine or its output processing; the others go on.
    status: 400 when the request's own spec caused it (its grammar), else 500."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class _Sequence:
    """Service-side state of one sample: detokenizer, stop strings, accumulated output."""

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: list[int], p: SamplingParams):
        self.out = CompletionOutput(index=index, logprobs=[] if p.logprobs is not None else None)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, p.skip_special_tokens)
        self.stops = StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None
        self.params = p
        self.prompt_ids = prompt_ids
        self.done = False
        self.req_id = ""  # the engine's id of this sample, from its first update

    def clear_delta(self) -> None:
        """Before each batch of updates: the deltas hold only what that batch adds."""
        o = self.out
        o.delta_text, o.delta_token_ids = "", []
        o.delta_logprobs = [] if o.logprobs is not None else None


async def _child_lora(query: Any) -> None:
    """An engine process's answer to a LoRA load or unload, its failure raised as the
    child raised it (a query's failure comes back as "<type>: <message>")."""
    try:
        await query
    except RuntimeError as e:
        kind, _, why = str(e).partition(": ")
        if kind == "LoRAInUse":
            raise LoRAInUse(why) from None
        if kind in ("ValueError", "LoRAError"):
            raise ValueError(why) from None
        raise


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: object,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        model_dir: Path,
        on_step: Callable[[StepInfo], None] | None = None,
        tier: PrefixTier | TierView | None = None,
        executor: ThreadExecutor | None = None,
        core: ProcessCore | DataParallelCore | None = None,
    ) -> None:
        """`core`: the engine in a child process (`in_process`); then there is no
        scheduler, executor or model here, and `runner` holds the child's facts."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.model_dir = model_dir
        self.model_name = config.model.model or "pagestream-default"
        # LoRA adapters by name, with what keys their requests' cached KV: the adapter's
        # weights' hash too, so replicas sharing the Redis tier never mix two adapters
        # served under one name.
        self.lora_paths = dict(config.model.lora_modules or {})
        self.lora_salts = {
            name: f"lora:{name}@{lora_fingerprint(path)}" for name, path in self.lora_paths.items()
        }
        self.executor = executor
        if executor is None and core is None:
            self.executor = ThreadExecutor(runner)  # type: ignore[arg-type]
        self._step_hooks: list[Callable[[StepInfo], None]] = [on_step] if on_step else []
        # Called once per request when it ends (finished, aborted or failed).
        self.request_hooks: list[Callable[[RequestOutput], None]] = []
        self.tier = tier
        self.core: EngineCore | ProcessCore
        if core is not None:
            self.core = core
            core.on_step = self._on_step
            switch_interval(config)
        else:
            self.core = EngineCore(
                scheduler,  # type: ignore[arg-type]
                self.executor,  # type: ignore[arg-type]
                on_step=self._on_step,
                tier=tier,
                max_waiting_requests=config.scheduler.max_waiting_requests,
                max_waiting_tokens=config.scheduler.max_waiting_tokens,
                max_waiting_per_tenant=config.scheduler.max_waiting_per_key,
                own_thread=engine_thread_default(config, runner),
                async_scheduling=async_scheduling_default(config, runner),
            )
            switch_interval(config, self.core.own_thread or self.core.async_scheduling)
        self._ids = itertools.count()
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*runner.eos_token_ids, *tokenizer.eos_token_ids])  # type: ignore[attr-defined]
        )
        if scheduler is not None:
            self.max_model_len = scheduler.config.max_model_len
            self.block_size = scheduler.block_size
        else:
            self.max_model_len = runner.max_model_len  # type: ignore[attr-defined]
            self.block_size = core.facts["block_size"]  # type: ignore[union-attr]
        self.faults: FaultPlan | None = None
        # Ids the model has embeddings for (a tokenizer may know more added tokens).
        self.vocab_size: int = runner.config.vocab_size  # type: ignore[attr-defined]
        # A base model without an LM head (gpu/config.py): embedding requests only.
        self.embedding_only = bool(getattr(runner.config, "embedding_only", False))
        self.grammars = GrammarCompiler(
            tokenizer_dir(config, model_dir) / "tokenizer.json", self.vocab_size,
            self.eos_token_ids,
        )  # fmt: skip

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and tokenizer and size the KV cache (blocking, seconds)."""
        if config.device.engine_process or config.parallel.data_parallel_size > 1:
            return cls.in_process(config)  # the HTTP process never imports torch
        from gpu.config import with_hf_overrides
        from gpu.model_runner import ModelRunner  # torch stays out of light imports

        source = Path(config.model.model) if config.model.model else ensure_default_model()
        model_dir = with_hf_overrides(source, config.model.hf_overrides)
        faults = FaultPlan.from_env(config.fault_injection)
        if faults is not None:
            log.warning("FAULT INJECTION is on: %s", faults)
        if config.parallel.enabled:
            executor: ThreadExecutor = tp_executor(config, source, faults)
            return cls._assemble(config, executor, model_dir, faults)

        def build() -> ModelRunner:
            threads = config.device.threads or "auto"
            return ModelRunner(model_dir, config, faults=faults, cpu_threads=threads)

        # Built on the thread that will run every step (see ThreadExecutor).
        return cls._assemble(config, ThreadExecutor(factory=build), model_dir, faults)

    @classmethod
    def in_process(
        cls,
        config: EngineConfig,
        builder: Callable[[EngineConfig], AsyncEngine] | None = None,
    ) -> AsyncEngine:
        """The engine in a child process (`serve --engine-process`,
        service/engine_proc.py), or one in each of --data-parallel-size children
        (service/data_parallel.py): `builder(config)` builds it there (default: from_config,
        inline); here only the tokenizer, grammar checks and the streams.  Blocks while
        the child loads the model."""
        from service.data_parallel import DataParallelCore
        from service.engine_proc import ProcessCore, remote_runner

        dp = config.parallel.data_parallel_size > 1
        spawn = DataParallelCore.spawn if dp else ProcessCore.spawn
        core = spawn(config, builder or default_builder)
        try:
            model_dir = Path(core.facts["model_dir"])
            engine = cls(
                config,
                runner=remote_runner(core.facts),
                tokenizer=Tokenizer.from_dir(tokenizer_dir(config, model_dir)),
                scheduler=None,
                model_dir=model_dir,
                tier=core.tier,
                core=core,
            )
        except BaseException:
            core.kill()
            raise
        engine.faults = FaultPlan.from_env(config.fault_injection)
        return engine

    @classmethod
    def _assemble(
        cls,
        config: EngineConfig,
        executor: ThreadExecutor,
        model_dir: Path,
        faults: FaultPlan | None,
    ) -> AsyncEngine:
        """The scheduler, tokenizer and prefix tier around a built executor."""
        runner: Any = executor.runner
        tokenizer = Tokenizer.from_dir(tokenizer_dir(config, model_dir))
        capacity = runner.num_kv_blocks * config.cache.block_size
        max_model_len = runner.max_model_len
        if config.model.max_model_len is None and capacity < max_model_len:
            log.warning(
                "KV cache holds %d tokens; lowering max_model_len from %d", capacity, max_model_len
            )
            max_model_len = capacity
        # CPU: 1,024.  Behind a smaller budget queued prompts wait more steps, each carrying
        # the whole decode batch (higher TTFT and TPOT, fewer tokens under load); a larger
        # one gained nothing and stalls decodes longer (paired runs: docs/PERFORMANCE.md).
        budget = config.scheduler.max_num_batched_tokens or (
            2048 if runner.device.type == "cuda" else 1024
        )
        if callable(getattr(type(runner), "warm_up", None)):  # a ModelRunner (not TP's)
            # On the step thread, before the first request: the CPU GEMMs' kernels for
            # every step size this budget allows (ModelRunner.warm_up).
            seqs = config.scheduler.max_num_seqs
            executor.call(lambda: runner.warm_up(budget, seqs))
        tier = None
        if config.prefix_tier.redis_url and config.cache.enable_prefix_caching:
            tier = build_prefix_tier(config, runner, model_dir)
        spec = config.speculative
        sched = Scheduler(
            SchedulerConfig.from_engine(config, runner.num_kv_blocks, max_model_len, budget),
            tier=tier,
            spec=SpecDecoder(spec) if spec is not None else None,
        )
        spec_runner = getattr(runner, "spec", None)
        if spec_runner is not None and hasattr(spec_runner, "grammar_walk"):
            # The draft model runs in this process (on rank 0 under tensor parallelism):
            # it drafts a constrained request's tokens under its grammar, so such a
            # request drafts too.
            spec_runner.grammar_walk = sched.draft_walk
            spec_runner.grammar_tree = sched.draft_tree
            sched.executor_masks = True
        engine = cls(
            config,
            runner=runner,
            tokenizer=tokenizer,
            scheduler=sched,
            model_dir=model_dir,
            tier=tier,
            executor=executor,
        )
        engine.faults = faults
        return engine

    def add_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        self._step_hooks.append(hook)

    def _on_step(self, info: StepInfo) -> None:
        for hook in self._step_hooks:
            self.core.run_guarded(f"step hook {getattr(hook, '__qualname__', hook)}", hook, info)

    async def start(self) -> None:
        self.core.start()
        connect = getattr(self.core, "connect", None)
        if connect is not None:  # the engine's process: its socket, on this loop
            await connect()
        # Its tasks and connections live on the engine's loop (in an engine process, the
        # child starts and closes it: here is only its view).
        if self.tier is not None and not self.in_child:
            await self.core.call_in_loop(self.tier.start)
        watch = getattr(self.executor, "watch", None)
        if watch is not None:  # tensor parallel: a rank exiting fails the engine at once

            def failed(error: BaseException) -> None:
                self.core.post(ExecutorFailed(error))

            watch(failed)

    async def shutdown(self) -> None:
        tier = self.tier if not self.in_child else None
        await self.core.stop(finally_in_loop=tier.close if tier is not None else None)
        self.grammars.shutdown()
        if self.executor is not None:
            self.executor.shutdown(wait=self.dead is None)

    async def load_lora(self, name: str, path: str) -> None:
        """Serve another LoRA adapter from now on (--allow-runtime-lora).  ValueError: the
        name is taken or the adapter cannot be served (LoRAError says why)."""
        if not self.config.model.allow_runtime_lora:
            raise ValueError("adapters are loaded at start only (--allow-runtime-lora)")
        if name in self.lora_salts:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if not LORA_NAME.fullmatch(name):
            raise ValueError(f"LoRA adapter names must match {LORA_NAME.pattern}")
        if self.scheduler is None:  # the engine process loads it; then this one knows it
            await _child_lora(self.core.query("load_lora", name, path))  # type: ignore[union-attr]
        else:
            runner, executor = self.runner, self.executor
            assert executor is not None
            # The files are read off the step thread (a step waits only for the checks
            # and conversions), and off this loop.
            files = await asyncio.to_thread(runner.read_lora_files, name, path)  # type: ignore[attr-defined]
            await executor.call_between_steps(lambda: runner.add_lora(name, path, files))  # type: ignore[attr-defined]
        self.lora_paths[name] = path
        self.lora_salts[name] = f"lora:{name}@{lora_fingerprint(path)}"

    async def unload_lora(self, name: str, timeout: float = 30.0) -> None:
        """Stop serving an adapter: new requests for it are refused at once, and it goes
        once no request runs it (LoRAInUse if some still do after `timeout` seconds, and
        it stays).  KeyError: no adapter of that name."""
        if not self.config.model.allow_runtime_lora:
            raise ValueError("adapters are unloaded at stop only (--allow-runtime-lora)")
        salt = self.lora_salts.pop(name)
        try:
            if self.scheduler is None:
                await _child_lora(self.core.query("unload_lora", name, timeout))  # type: ignore[union-attr]
            else:
                runner, executor = self.runner, self.executor
                assert executor is not None
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        await executor.call_between_steps(lambda: runner.remove_lora(name))  # type: ignore[attr-defined]
                        break
                    except LoRAInUse:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)
        except BaseException:
            self.lora_salts[name] = salt  # still served: requests may name it again
            raise
        del self.lora_paths[name]

    @property
    def in_child(self) -> bool:
        """The engine runs in a child process (service/engine_proc.py)."""
        return self.scheduler is None

    async def scheduler_stats(self) -> tuple[SchedulerStats, int]:
        """(scheduler stats, KV blocks in use), read on the engine's loop: with the engine
        on its own thread, reading them elsewhere would race it (stats() expires pins)."""
        if self.scheduler is None:
            stats, used, hooks = await self.core.query("stats_for_server")  # type: ignore[union-attr]
            self.core.child_hook_errors = hooks  # type: ignore[union-attr]
            return stats, used
        sched = self.scheduler
        return await self.core.call_in_loop(lambda: (sched.stats(), sched.kv.pool.num_used))

    async def stats_for_server(self) -> tuple[SchedulerStats, int, dict[str, int]]:
        """What the server's process asks an engine process for at a /metrics scrape."""
        stats, used = await self.scheduler_stats()
        return stats, used, dict(self.core.hook_errors)

    @property
    def hook_errors(self) -> dict[str, int]:
        """Failures of guarded hooks by hook, the engine process's (as of the last
        scrape) with this one's."""
        mine = self.core.hook_errors
        theirs: dict[str, int] = getattr(self.core, "child_hook_errors", {})
        return {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}}

    async def debug_counts(self) -> dict[str, object]:
        """The engine's part of /debug/state: what runs, waits and is held."""
        if self.scheduler is None:
            return await self.core.query("debug_counts")  # type: ignore[union-attr]
        sched = self.scheduler
        pool = sched.kv.pool
        return {
            "engine_dead": str(self.dead) if self.dead else None,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "remote_pending": len(sched.remote_pending),
            "requests": len(sched.requests),
            "groups": len(sched.groups),
            "streams": len(self.core.streams),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            # Free counts pinned free blocks (a conversation's cached turn): the KV-leak
            # checks compare it with the total.
            "kv_blocks_free": pool.num_free,
            "kv_blocks_cached": len(pool.cached),
            "kv_blocks_pinned": pool.num_pinned,
            "conversation_pins": len(sched.kv.pins.convs),
            "runner_requests": len(getattr(self.runner, "requests", ())),
            "num_preemptions": sched.num_preemptions,
            "hook_errors": self.core.hook_errors,
            # The engine's process (/debug/state shows it apart where that is a child).
            "process_rss_bytes": rss_bytes(),
        }

    @property
    def dead(self) -> BaseException | None:
        return self.core.dead

    # ---------------------------------------------------------------- requests
    def check_token_ids(self, ids: list[int], what: str = "prompt") -> list[int]:
        """Refuse ids the model cannot embed: a client's token-id prompt, or a text whose
        tokenizer produced added tokens past the model's vocabulary."""
        vocab = self.vocab_size
        if ids and min(ids) >= 0 and max(ids) < vocab:  # C speed: a prompt may be 1M ids
            return ids
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"{what} token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        return ids

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.check_token_ids(self.tokenizer.encode(prompt))
        return self.check_token_ids(list(prompt))

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: object
    ) -> list[int]:
        """Chat messages -> prompt ids through the checkpoint's template."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.check_token_ids(self.tokenizer.encode(text, add_special_tokens=False))

    def resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if params.embed and room == 0:
            return 1  # the one token an embedding samples is never fed back (check_group)
        if room < 1:
            raise RequestRejected(
                f"the prompt has {prompt_len} tokens, but max_model_len is {self.max_model_len}"
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise MaxTokensTooLarge(
                f"max_tokens is {params.max_tokens} but the prompt has {prompt_len} tokens and "
                f"max_model_len is {self.max_model_len} (at most {room} tokens can be generated)"
            )
        return params.max_tokens

    def _budgeted(self, grammar: Any, rb: ReasoningBudget) -> AfterReasoning:
        """A sample's matcher with its thinking bounded: its grammar's reasoning wrapper
        (the spec placed the grammar after the thinking), or one holding no grammar."""
        if isinstance(grammar, AfterReasoning):
            grammar.budget = rb.budget
            grammar.mask_bytes = 4 * ((self.vocab_size + 31) // 32)
            return grammar
        assert grammar is None, "a grammar on a reasoning budget is placed after the thinking"
        words = (self.vocab_size + 31) // 32
        return AfterReasoning(None, rb.end, rb.start, rb.budget, 4 * words)

    def build_group(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        publish_prefix: bool = False,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        priority: int = 0,
        grammar_share: int = 1,
    ) -> list[Request]:
        """The request's n samples.  tenant: whose share of the shared prefix tier the
        blocks it publishes count against (see scheduler.prefix_tier; None: no share),
        and of the waiting queue (scheduler.fair_queue); conversation: the key its KV is
        pinned under when it ends (scheduler.pins); priority: its place in its tenant's
        line, lower first; grammar_share: the prompts of the API request it is one of
        (their samples split the grammar's per-token budget)."""
        if self.embedding_only and not params.embed:
            raise EmbeddingOnly(
                "this model has no LM head (an embedding model or a sequence classifier): "
                "it serves /v1/embeddings or /classify, /score and /rerank, not generation"
            )
        max_tokens = self.resolve_max_tokens(len(prompt_ids), params)
        if params.lora is not None:
            lora = self.lora_salts.get(params.lora)
            if lora is None:
                raise RequestRejected(f"model: no LoRA adapter named {params.lora!r}")
            cache_salt = f"{lora}/{cache_salt}" if cache_salt else lora
        elif cache_salt is not None and cache_salt.startswith(("lora:", "base:")):
            # A base request's salt never reads as an adapter's: a client's cache_salt of
            # "lora:<name>@<hash>" would otherwise put base KV where the adapter's
            # requests look.  (Escaping every "base:" too keeps distinct salts distinct.)
            cache_salt = "base:" + cache_salt
        if params.bad_words and params.bad_words_token_ids is None:
            # The offline engine's callers pass words; the server tokenizes them off its
            # event loop first (service/prep.py), so this never runs on it.
            try:
                seqs = encode_words(
                    params.bad_words,
                    lambda texts: [
                        self.tokenizer.encode(t, add_special_tokens=False) for t in texts
                    ],
                )
            except ValueError as e:
                raise RequestRejected(str(e)) from e
            params = msgspec.structs.replace(params, bad_words_token_ids=seqs)
        if (why := nothing_allowed(params, self.eos_token_ids)) is not None:
            raise RequestRejected(why)
        for field, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"{field}: token id {bad} is outside the vocabulary")
        grammars: list = [None] * params.n
        # In an engine process the child makes the matchers (the spec is checked here).
        if params.structured_outputs is not None and not self.in_child:
            try:
                grammars = self.grammars.matchers(
                    params.structured_outputs, params.n, grammar_share
                )
            except GrammarError as e:
                raise RequestRejected(f"structured_outputs: {e}") from e
        if params.reasoning_budget is not None and not self.in_child:
            grammars = [self._budgeted(g, params.reasoning_budget) for g in grammars]
        now = time.monotonic()
        stop_ids = stop_set(params, self.eos_token_ids)
        return [
            Request(
                request_id if i == 0 else f"{request_id}#{i}",
                prompt_ids,
                params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                cache_salt=cache_salt,
                sample_index=i,
                group_id=request_id,
                arrival_time=now,
                publish_prefix=publish_prefix,
                grammar=grammars[i],
                tenant=tenant,
                conversation=conversation,
                priority=priority,
                stop_ids=stop_ids,
                grammar_share=grammar_share,  # (an engine process makes its matchers alike)
            )
            for i in range(params.n)
        ]

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        publish_prefix: bool = False,
        final_only: bool = False,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        priority: int = 0,
    ) -> Submitted:
        """Validate and queue a request now (synchronously, so a transport can answer 400
        or 429 before it starts a response).  Pass the result to `generate`; if it is
        never consumed, `release` it.  final_only: see `generate`; tenant: see
        `build_group` (also conversation, priority).  An id a live request holds raises
        DuplicateRequestId."""
        group = self.build_group(
            request_id, prompt_token_ids, params, cache_salt, publish_prefix,
            tenant=tenant, conversation=conversation, priority=priority,
        )  # fmt: skip
        # Stop strings are matched here, on the consumer's side, as tokens arrive: such a
        # request's tokens must wake it or it would run on past its stop string.
        stream = self.core.add(group, wake_on_tokens=not final_only or bool(params.stop))
        return Submitted(request_id, prompt_token_ids, params, stream, group[0].arrival_time)

    def submit_many(
        self,
        prompts: list[tuple[str, list[int]]],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        tenant: str | None = None,
        conversation: str | None = None,
        priority: int = 0,
    ) -> list[Submitted]:
        """Several (request id, prompt ids) as one: all validated and admitted against the
        waiting bound before any is queued (tenant, conversation, priority: `build_group`)."""
        kw = {"tenant": tenant, "conversation": conversation, "priority": priority,
              "grammar_share": len(prompts)}  # fmt: skip
        groups = [self.build_group(rid, ids, params, cache_salt, **kw) for rid, ids in prompts]
        for g in groups:
            self.core.validate(g)
        self.core.admit(groups)
        return [
            Submitted(rid, ids, params, self.core.add(g), g[0].arrival_time)
            for (rid, ids), g in zip(prompts, groups, strict=True)
        ]

    def release(self, sub: Submitted) -> None:
        """Abort a submitted request whose outputs will never be read."""
        if not sub.consumed:
            sub.consumed = True
            self.core.abort(sub.request_id, sub.stream)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured-output spec off the event loop (cached by spec);
        raises GrammarError when the engine cannot enforce it."""
        if params.structured_outputs is not None:
            await self.grammars.compile(params.structured_outputs)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        publish_prefix: bool = False,
        submitted: Submitted | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs.  Raises RequestRejected (bad input) or
        EngineOverloaded before the first yield; closing the iterator early aborts the
        request.  With `submitted`, stream that already-queued request (its grammar, if
        any, already compiled by the caller).  final_only (vLLM's FINAL_ONLY output kind,
        as its LLM.generate uses): yield the finished output alone, and let decode tokens
        pile up in the stream instead of waking this consumer every step."""
        if submitted is None:
            submitted = await self._submit_new(
                prompt, params, request_id, prompt_token_ids, cache_salt, publish_prefix,
                final_only,
            )  # fmt: skip
        submitted.consumed = True
        stream, ids, params, rid = (
            submitted.stream, submitted.prompt_token_ids, submitted.params, submitted.request_id
        )  # fmt: skip
        metrics = RequestMetrics(arrival_time=submitted.arrival_time)
        seqs = [_Sequence(i, self.tokenizer, ids, params) for i in range(params.n)]
        out = RequestOutput(
            request_id=rid,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            outputs=[s.out for s in seqs],
            metrics=metrics,
            lora=params.lora,
        )
        live = params.n
        # One sample without stop strings or logprobs: a step's decode tokens go straight
        # to the detokenizer, without an update object (every stream, every step).
        plain = params.n == 1 and seqs[0].stops is None and params.logprobs is None
        try:
            while live:
                if plain and metrics.first_token_time is not None:
                    if not stream._pending:
                        await stream.wait()
                    toks = stream.take_tokens()
                    if toks is not None:
                        self._take_tokens(seqs[0], metrics, toks)
                        if not final_only:
                            yield out
                        continue
                updates = await stream.get()
                now = time.monotonic()
                for s in seqs:
                    s.clear_delta()
                for u in updates:
                    seq = seqs[u.sample_index]
                    if seq.done:
                        continue
                    if u.error is not None and u.new_token_ids and not final_only:
                        # A slow consumer's merged update may hold tokens sampled before
                        # the failure: the client sees them, then hears of the failure.
                        tokens = msgspec.structs.replace(u, error=None, finish_reason=None)
                        self._take_update(seq, out, metrics, tokens, now)
                        yield out
                        for s in seqs:
                            s.clear_delta()
                        u = msgspec.structs.replace(u, new_token_ids=[], logprobs=None)
                    self._take_update(seq, out, metrics, u, now)
                    if seq.done:
                        live -= 1
                    if u.error is not None:
                        # One sample failed: the request fails (its other samples are
                        # aborted on the way out), and the client is told why.
                        raise RequestFailed(
                            f"request {rid} failed: {u.error}",
                            status=400 if u.client_error else 500,
                        )
                if live == 0:
                    metrics.finished_time = now
                    out.finished = True
                elif final_only:
                    continue
                yield out
        finally:
            self._end_request(rid, seqs, out, unfinished=live > 0, stream=stream)

    def _end_request(
        self,
        rid: str,
        seqs: list[_Sequence],
        out: RequestOutput,
        unfinished: bool,
        stream: RequestStream | None = None,
    ) -> None:
        """Abort what still runs (the consumer left, or a sample failed), then tell the
        request hooks.  The abort names this request's own stream: a request that was
        refused (its id in use) never aborts the live one under that id."""
        if unfinished:
            self.core.abort(rid, stream)
            for s in seqs:
                if s.out.finish_reason is None:
                    s.out.finish_reason = "abort"
        for hook in self.request_hooks:
            self.core.run_guarded(f"request hook {getattr(hook, '__qualname__', hook)}", hook, out)

    async def _submit_new(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        prompt_token_ids: list[int] | None,
        cache_salt: str | None,
        publish_prefix: bool,
        final_only: bool = False,
    ) -> Submitted:
        """`generate` called without `submitted`: encode, compile the grammar, queue."""
        params = params or SamplingParams()
        ids = prompt_token_ids if prompt_token_ids is not None else self.encode_prompt(prompt)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        try:
            await self.compile_grammar(params)
        except GrammarError as e:
            raise RequestRejected(f"structured_outputs: {e}") from e
        return self.submit(ids, params, rid, cache_salt, publish_prefix, final_only)

    def _take_update(
        self, seq: _Sequence, out: RequestOutput, metrics: RequestMetrics, u, now: float
    ) -> None:  # u: RequestUpdate
        """One sample's update: timings, cached tokens, prompt logprobs, then its text."""
        seq.req_id = u.req_id
        if u.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.token_times.append(now)
        out.num_cached_tokens = u.num_cached_tokens
        if u.prompt_logprobs and out.prompt_logprobs is None:
            out.prompt_logprobs = [None, *u.prompt_logprobs]
        if u.embedding is not None:
            out.embedding = u.embedding
        if (pt := u.prediction_tokens) is not None:
            a, r = out.prediction_tokens or (0, 0)
            out.prediction_tokens = (a + pt[0], r + pt[1])
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = u.first_scheduled_time
        self._apply_guarded(seq, u)

    async def register_prefix(
        self,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        *,
        tenant: str | None = None,
    ) -> dict[str, int]:
        """Compute a prefix (e.g. a system prompt) and publish the KV of all its full
        blocks to the shared tier now, rather than after it proves hot (counted against
        `tenant`'s share of the tier)."""
        bs = self.block_size
        # (embed: it samples one unread token either way, and an embedding model takes it)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, embed=True)
        rid = f"prefix-{uuid.uuid4().hex[:16]}"
        sub = self.submit(
            prompt_token_ids, params, rid, cache_salt, publish_prefix=True, tenant=tenant
        )
        last = None
        async for out in self.generate("", submitted=sub):
            last = out
        assert last is not None
        return {
            "prompt_tokens": len(prompt_token_ids),
            "blocks": len(prompt_token_ids) // bs,
            "cached_tokens": last.num_cached_tokens,
        }

    def _take_tokens(self, seq: _Sequence, metrics: RequestMetrics, toks: list[int]) -> None:
        """`_take_update` for decode tokens alone of a sample without stop strings or
        logprobs: what that does with such an update, without the update."""
        now = time.monotonic()
        metrics.last_token_time = now
        metrics.token_times.append(now)
        o = seq.out
        try:
            if self.faults is not None:
                self.faults.check_detok(seq.req_id, seq.prompt_ids, len(o.token_ids))
            delta = seq.detok.push(toks)
        except Exception as e:
            raise _output_failed(seq, seq.req_id, e) from e
        o.token_ids += toks
        o.delta_token_ids = toks
        o.delta_text = delta
        o.add_text(delta)

    def _apply_guarded(self, seq: _Sequence, u) -> None:  # u: RequestUpdate
        """Detokenize and match stop strings; a failure there belongs to this request."""
        try:
            if self.faults is not None and u.new_token_ids:
                self.faults.check_detok(u.req_id, seq.prompt_ids, len(seq.out.token_ids))
            self._apply(seq, u)
        except Exception as e:
            raise _output_failed(seq, u.req_id, e) from e

    def _apply(self, seq: _Sequence, u) -> None:  # u: RequestUpdate
        o = seq.out
        toks = u.new_token_ids
        lps = u.logprobs or []
        text_ids = toks
        hide_stop_token = u.stop_token_id is not None and not seq.params.include_stop_str_in_output
        if seq.stops is None:
            if hide_stop_token and toks:
                text_ids = toks[:-1]
            delta = seq.detok.push(text_ids)
            o.token_ids += toks
            o.delta_token_ids += toks
            if o.logprobs is not None:
                o.logprobs += lps
                o.delta_logprobs += lps  # type: ignore[operator]
        else:
            # Token by token, so the token that completes a stop string is known exactly.
            delta = ""
            for j, t in enumerate(toks):
                is_stop_tok = hide_stop_token and j == len(toks) - 1
                piece = "" if is_stop_tok else seq.detok.push([t])
                emit, stopped = seq.stops.push(piece)
                delta += emit
                o.token_ids.append(t)
                o.delta_token_ids.append(t)
                if o.logprobs is not None and j < len(lps):
                    o.logprobs.append(lps[j])
                    o.delta_logprobs.append(lps[j])  # type: ignore[union-attr]
                if stopped:
                    o.finish_reason, o.stop_reason = "stop", seq.stops.matched
                    seq.done = True
                    self.core.finish_sequence(u.req_id)
                    break
        if u.finish_reason is not None and not seq.done:
            seq.done = True
            tail = seq.detok.flush()
            if seq.stops is not None:
                emit, stopped = seq.stops.push(tail)
                delta += emit if stopped else emit + seq.stops.flush()
                if stopped:
                    o.finish_reason, o.stop_reason = "stop", seq.stops.matched
            else:
                delta += tail
            if o.finish_reason is None:
                o.finish_reason = u.finish_reason if u.error is None else "error"
                if u.stop_token_id is not None:
                    o.stop_reason = u.stop_token_id
                elif u.error is not None:
                    o.stop_reason = u.error  # e.g. a grammar's dead end: say why
        o.add_text(delta)
        o.delta_text += delta


def _output_failed(seq: _Sequence, req_id: str, e: Exception) -> RequestFailed:
    """A failure while turning a sample's tokens into output (called in the `except`):
    logged, the sample ended with finish_reason "error", the error its request raises."""
    log.exception("request %s: output processing failed", req_id)
    seq.done = True
    seq.out.finish_reason = "error"
    return RequestFailed(f"output processing failed: {e}")
