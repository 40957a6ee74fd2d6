"""The model runner: one SchedulerOutput in, one ModelOutput out.

It owns the weights, the paged KV cache and per-request sampling state (sent once by the
scheduler, dropped when the request finishes).  No asyncio here: the executor actor calls
`execute_model` from a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu import lora
from gpu.attention import create_attention_backend
from gpu.batch_layout import layout_batch
from gpu.config import ModelConfig, ModelLoadError, read_eos_token_ids, resolve_dtype
from gpu.cpu import features as cpu_features
from gpu.cpu import kernels as cpu_kernels
from gpu.cpu.linear import warm_onednn
from gpu.cpu.threads import ThreadGovernor
from gpu.cuda_graphs import DEFAULT_SIZES, DEFAULT_TOKEN_SIZES, DecodeGraphs, PiecewiseGraphs
from gpu.kv_quant import SCALE_DTYPE, bytes_per_token, check_kv_cache_dtype, storage_dtype
from gpu.loader import load_model
from gpu.lora import LoRAManager
from gpu.medusa import MedusaProposer
from gpu.pooling import PoolRows, RunningPool
from gpu.pp import PPStage, kv_payloads, run_pipeline
from gpu.sampler import RequestSamplingState, Sampler, apply_token_bitmask_
from gpu.spec_decode import SpecRunner
from gpu.step_rows import PromptRows, SampleRows, StepInputs
from gpu.tp import TPGroup, check_tp_config, gather_kv_heads, kv_heads, local_config
from scheduler import envs
from scheduler.config import EngineConfig
from scheduler.contract import (
    DecodeColumns,
    KVBlockPayload,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
    apply_block_delta,
    apply_decode_deltas,
)
from scheduler.faults import FaultPlan

log = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_FRACTION = 0.85  # of the memory left free after the weights


def kv_budget(free: int, total: int, own: int, utilization: float | None) -> int:
    """KV cache bytes on a GPU, once the weights are loaded: 85% of what is free (the rest
    for activations, graphs and the allocator's slack), or with --gpu-memory-utilization U,
    85% of what this engine's share U x total leaves after its own memory so far (`own`:
    the weights), as vLLM reads U (a per-engine share: two engines at 0.45 share a GPU),
    and never more than 85% of what is free.  Nothing left is a start-up error (the runner
    refuses fewer than two blocks)."""
    cap = int(free * DEFAULT_GPU_MEMORY_FRACTION)
    if utilization is None:
        return cap
    return max(0, min(cap, int((utilization * total - own) * DEFAULT_GPU_MEMORY_FRACTION)))


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        faults: FaultPlan | None = None,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
        cpu_threads: int | str | None = None,
        graph_batch_sizes: Sequence[int] | None = None,
        piecewise_graphs: bool | None = None,
        **settings: Any,
    ) -> None:
        """config: the engine's whole config (scheduler/config.py); the runner reads its
        model, cache, device and speculative groups.  Without one, `settings` are its flat
        fields (`dtype="float32", num_kv_blocks=16`), validated the same way, for tests and
        tools that build a bare runner.  cpu_threads (CPU only): a count fixes torch's
        threads; "auto" lets gpu/cpu/threads.py size the team before each step from the
        CPUs this process may use and what other processes take of them; None leaves
        torch's setting alone."""
        if config is None:
            config = EngineConfig.from_kwargs(**settings)
        elif settings:
            raise TypeError(f"ModelRunner: settings go in config, not keywords: {sorted(settings)}")
        self.engine_config = config
        self.faults = faults  # fault injection (tests and drills); None in normal serving
        self.model_dir = Path(model_dir)
        self._set_device(config, cpu_threads)
        self._set_lengths(config.cache.block_size, config.model.max_model_len)
        cuda_graphs = config.device.cuda_graphs
        # Tensor parallelism: this rank's share of the heads (and so of every KV block);
        # pipeline parallelism: this stage's layers (and their KV), gpu/pp.py.  Neither
        # captures graphs (collectives, and a step of several forwards with sends between).
        self.tp, self.pp = tp, pp
        if tp is not None:
            check_tp_config(self.config, tp.size)
        if tp is not None or pp is not None:
            spec = config.speculative
            if spec is not None and pp is not None and spec.method != "ngram":
                raise ModelLoadError(
                    "under pipeline parallelism speculative decoding runs with n-gram drafts only"
                )
            cuda_graphs = False
        self.local_config = local_config(self.config, tp, pp)
        self._load_weights(config.device.attention_backend, config.model.quantization, tp)
        self.lora: LoRAManager | None = None
        if config.model.lora:
            self.lora = self._attach_lora(config)
            # Graphs are captured for the base weights and every row; adapters' rows
            # change per step.
            cuda_graphs, piecewise_graphs = False, False
        self._make_kv_cache(config.cache.num_kv_blocks, config.cache.kv_cache_bytes, tp)
        self.sampler = Sampler(
            self.config.vocab_size, self.eos_token_ids, self.device, seed=config.model.seed
        )
        self.requests: dict[str, RequestSamplingState] = {}
        # Registered embedding requests (SamplingParams.embed): a step without any pools
        # nothing and looks at no row for it.
        self.embed_ids: set[str] = set()
        # Those that pool over every prompt position: their pools so far (gpu/pooling.py).
        self.pools: dict[str, RunningPool] = {}
        # Each running request's block table, kept across steps: a step sends only the
        # entries that changed (scheduler/contract.py, ScheduledRequest).
        self.block_tables: dict[str, list[int]] = {}
        self.last_step_seconds = 0.0
        max_seqs = config.scheduler.max_num_seqs
        self.graphs = self._setup_graphs(cuda_graphs, graph_batch_sizes, max_seqs)
        self.piecewise = self._setup_piecewise(piecewise_graphs)
        self.spec = self._setup_spec(config)

    def _set_device(self, config: EngineConfig, cpu_threads: int | str | None) -> None:
        """Device, the checkpoint's config and dtype, and the CPU thread team."""
        dtype = config.model.dtype
        self.kv_cache_dtype = check_kv_cache_dtype(config.cache.kv_cache_dtype)
        device = config.device.device
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config = ModelConfig.from_dir(self.model_dir)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.config)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":
            log.info(
                "CPU %s: dtype %s%s", cpu_features.detect().describe(),
                str(self.dtype).removeprefix("torch."),
                " (auto: the CPU's native dtype)" if dtype == "auto" else "",
            )  # fmt: skip
        self.threads: ThreadGovernor | None = None
        if self.device.type == "cpu" and cpu_threads == "auto":
            self.threads = ThreadGovernor()
        elif self.device.type == "cpu" and isinstance(cpu_threads, int):
            torch.set_num_threads(cpu_threads)

    def _setup_spec(self, config: EngineConfig) -> SpecRunner | None:
        """Speculative decoding: verification, and the draft model or Medusa heads when
        the method has one (n-gram lookup needs neither)."""
        spec = config.speculative
        if spec is None:
            return None
        draft = spec.model if spec.method == "draft" else None
        medusa = MedusaProposer(spec.model, self) if spec.method == "medusa" else None
        return SpecRunner(self, draft, config.device.attention_backend, medusa)

    def release(self) -> None:
        """Frees the KV caches and captured graphs once the engine has stopped.  On a GPU
        the cache takes most of the free memory, so a process that builds engines one
        after another (a notebook, a test suite) would run out while a stopped engine's
        Python objects linger until the garbage collector finds their cycles.  The
        runner cannot step afterwards."""
        self.kv_caches = []
        self.graphs = None
        self.piecewise = None
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.kv_caches = []
            self.spec.draft.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """Builds the CPU GEMM kernels a step of up to this many tokens can meet before the
        first request needs them (cpu_linear.warm_onednn); nothing on a GPU."""
        if self.device.type != "cpu":
            return
        t = time.perf_counter()
        runs = warm_onednn(self.model, max_num_batched_tokens, max_num_seqs)
        if runs:
            log.info("oneDNN kernels for %d product shapes built in %.1f s", runs,
                     time.perf_counter() - t)  # fmt: skip

    def _set_lengths(self, block_size: int, max_model_len: int | None) -> None:
        """The block size (its range checked with the config) and the longest sequence,
        which only the checkpoint bounds."""
        self.block_size = block_size
        limit = self.config.max_context
        if max_model_len is not None and max_model_len > limit:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds what the model supports ({limit})"
            )
        self.max_model_len = max_model_len or limit

    def _load_weights(
        self, attention_backend: str, quantization: str | None, tp: TPGroup | None
    ) -> None:
        """The attention backend, then the weights (this rank's shard under TP), packed and
        fused for the CPU kernels when on CPU."""
        cfg = self.config
        self.attn_backend = create_attention_backend(
            attention_backend,
            self.device,
            self.local_config.num_heads,
            self.local_config.num_kv_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
            self.dtype,
            self.block_size,
        )
        self.model = load_model(
            self.model_dir, cfg, self.attn_backend, self.dtype, self.device, self.max_model_len,
            quantization, tp, self.pp, self.engine_config.model.tokenizer,
        )  # fmt: skip
        # Bytes of weights this process holds (1/N of the sharded ones under TP).
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Weight quantization in effect: int8 / fp8 (at load), awq / fp8 (the checkpoint's),
        # or None.
        self.quantization = (
            (cfg.int4_format or "awq").removesuffix("_v2")
            if cfg.awq_group_size
            else "fp8"
            if cfg.fp8_format
            else quantization
        )
        if self.device.type == "cpu":
            cpu_kernels.load()  # compile (once per machine) at start-up, not on a request
            packed = self.model.pack_for_cpu()
            log.info(
                "CPU: %d projections use weights packed at load; weight and K/V prefetches %s",
                packed, "into L1" if cpu_kernels.wide_l1() else "as tuned for a 32 KB L1",
            )  # fmt: skip
            if self.model.fuse_for_cpu():
                log.info("CPU: residual adds, RMSNorm, rotary and SiLU*up run fused")

    def _attach_lora(self, config: EngineConfig) -> LoRAManager:
        try:
            manager = lora.attach(
                self.model, self.config, config.model.lora_modules or {},
                config.model.max_lora_rank, self.dtype, self.device,
            )  # fmt: skip
        except lora.LoRAError as e:
            raise ModelLoadError(str(e)) from e
        for ad in manager.adapters.values():
            log.info(
                "LoRA adapter %s: rank %d, %d projections, %.1f MiB (%s)",
                ad.name, ad.rank, len(ad.deltas), ad.nbytes / (1 << 20), ad.path,
            )  # fmt: skip
        return manager

    @staticmethod
    def read_lora_files(name: str, path: str) -> lora.AdapterFiles:
        """An adapter's files, read on any thread (AsyncEngine.load_lora: not the step's)."""
        return lora.read_files(name, path)

    def add_lora(self, name: str, path: str, files: lora.AdapterFiles | None = None) -> None:
        """Serve an adapter from the next step on (ThreadExecutor.call_between_steps)."""
        assert self.lora is not None, "LoRA is off (--lora-modules, --allow-runtime-lora)"
        ad = self.lora.load(name, path, files)
        log.info("LoRA adapter %s loaded: rank %d, %.1f MiB (%s)", name, ad.rank,
                 ad.nbytes / (1 << 20), path)  # fmt: skip

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (ThreadExecutor.call_between_steps); LoRAInUse while a
        registered request runs it."""
        assert self.lora is not None, "LoRA is off (--lora-modules, --allow-runtime-lora)"
        if name not in self.lora.adapters:
            raise lora.LoRAError(f"no LoRA adapter named {name!r}")
        if any(st.params.lora == name for st in self.requests.values()):
            raise lora.LoRAInUse(name)
        self.lora.unload(name)
        log.info("LoRA adapter %s unloaded", name)

    def _lora_rows(self, dec: DecodeColumns, ordered: list[ScheduledRequest]) -> bool:
        """Tell the adapters which rows of this step are theirs (decode columns first,
        then each request's query rows, as _prepare lays them out); False: none is."""
        assert self.lora is not None
        reqs = self.requests

        def lora_of(rid: str) -> str | None:  # (one that failed to register runs as the base)
            st = reqs.get(rid)
            return None if st is None else st.params.lora

        spans = [(lora_of(rid), 1) for rid in dec.req_ids]
        spans += [(lora_of(r.req_id), len(r.input_ids) + r.num_draft) for r in ordered]
        return self.lora.set_rows(spans, self.device)

    def _make_kv_cache(
        self, num_kv_blocks: int | None, kv_cache_bytes: int | None, tp: TPGroup | None
    ) -> None:
        block_size = self.block_size
        self.num_kv_blocks = num_kv_blocks or self._auto_num_blocks(kv_cache_bytes)
        if tp is not None:  # one block table for all ranks: the smallest cache sets it
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        if self.pp is not None:  # and over every stage (each holds its own layers' share)
            self.num_kv_blocks = self.pp.min_int(self.num_kv_blocks)
        self.kv_caches = self._allocate_kv()
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%d bytes per token over all layers), %.2f GiB",
            self.num_kv_blocks, block_size, self.kv_cache_dtype,
            self.kv_bytes_per_block // block_size,
            self.num_kv_blocks * self.kv_bytes_per_block / (1 << 30),
        )  # fmt: skip

    def _setup_graphs(
        self, enabled: bool | None, sizes: Sequence[int] | None, max_num_seqs: int
    ) -> DecodeGraphs | None:
        """Decode-step CUDA graphs: on by default on CUDA with the Triton backend (the
        torch path syncs with the host, so it cannot be captured)."""
        graph_safe = self.attn_backend.name == "triton"
        if enabled is None:
            enabled = self.device.type == "cuda" and graph_safe
        if not enabled:
            return None
        if not graph_safe:
            raise ModelLoadError("CUDA graphs need the triton attention backend")
        sizes = [b for b in (sizes or DEFAULT_SIZES) if b <= max_num_seqs] or [1]
        graphs = DecodeGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
            device=self.device,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            sizes=sizes,
            capture=self.device.type == "cuda",
        )
        graphs.capture_all()
        return graphs

    def _setup_piecewise(self, enabled: bool | None) -> PiecewiseGraphs | None:
        """The other steps' graphs (prefill and mixed): by default wherever the decode
        graphs run (cuda_graphs / --enforce-eager switch both).  A model whose layers
        cannot be captured keeps eager steps, with a warning, rather than failing."""
        if enabled is None:
            enabled = self.graphs is not None
        if not enabled:
            return None
        if self.attn_backend.name != "triton" or self.tp is not None or self.pp is not None:
            raise ModelLoadError("piecewise CUDA graphs need the triton backend, without TP")
        pw = PiecewiseGraphs(
            self.model,
            self.kv_caches,
            device=self.device,
            sizes=DEFAULT_TOKEN_SIZES,
            capture=self.device.type == "cuda",
        )
        try:
            pw.capture_all()
        except RuntimeError as e:
            log.warning("piecewise CUDA graphs not captured, prefill steps run eagerly: %s", e)
            return None
        return pw

    # ------------------------------------------------------------------ sizing
    @property
    def kv_bytes_per_block(self) -> int:
        """K/V bytes of one block over all layers, scales included (= a payload's size).
        Under TP: this rank's heads only."""
        c = self.local_config
        per_token = bytes_per_token(self.kv_cache_dtype, self.dtype, c.num_kv_heads, c.head_dim)
        return c.num_layers * self.block_size * per_token

    @property
    def kv_payload_bytes(self) -> int:
        """Bytes of one block's prefix-tier payload: every KV head, as a TP=1 cache holds
        them, whatever this rank holds (see read_kv_blocks)."""
        c = self.config
        per_token = bytes_per_token(self.kv_cache_dtype, self.dtype, c.num_kv_heads, c.head_dim)
        return c.num_layers * self.block_size * per_token

    def _allocate_kv(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (k, v), or (k, v, k_scale, v_scale) for a quantized cache."""
        c = self.local_config
        shape = (self.num_kv_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        vdt = storage_dtype(self.kv_cache_dtype, self.dtype)

        # Zeroed, not empty: the torch decode path reads padded slots (masked to weight 0),
        # and 0 * NaN garbage would still poison the sum.
        def zeros(shp: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            if self.device.type == "cpu":
                return cpu_kernels.huge_zeros(shp, dt)
            return torch.zeros(shp, dtype=dt, device=self.device)

        if self.kv_cache_dtype == "auto":
            return [(zeros(shape, vdt), zeros(shape, vdt)) for _ in range(c.num_layers)]
        return [
            (zeros(shape, vdt), zeros(shape, vdt), zeros(shape[:3], SCALE_DTYPE),
             zeros(shape[:3], SCALE_DTYPE))
            for _ in range(c.num_layers)
        ]  # fmt: skip

    def _auto_num_blocks(self, kv_cache_bytes: int | None) -> int:
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = kv_budget(
                    free, total, torch.cuda.memory_reserved(self.device),
                    self.engine_config.cache.gpu_memory_utilization,
                )  # fmt: skip
            else:
                if self.engine_config.cache.gpu_memory_utilization is not None:
                    log.info("--gpu-memory-utilization applies on CUDA; on a CPU the KV cache "
                             "is --kv-cache-memory or PAGESTREAM_CPU_KVCACHE_SPACE")  # fmt: skip
                kv_cache_bytes = envs.PAGESTREAM_CPU_KVCACHE_SPACE
        n = kv_cache_bytes // self.kv_bytes_per_block
        if n < 2:
            raise ModelLoadError(
                f"KV cache budget of {kv_cache_bytes} bytes holds fewer than 2 blocks "
                f"({self.kv_bytes_per_block} bytes each)"
            )
        return int(n)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        """One step.  A failure that belongs to one request (its sampling state cannot be
        built, its inputs are out of range, its row fails to sample) is reported in
        `ModelOutput.errors` and the others go on; anything else raises (engine failure)."""
        t0 = time.perf_counter()
        if self.threads is not None:
            self.threads.tick()
        errors = self._apply_request_changes(so)
        if so.copy_blocks:
            self._copy_blocks(so.copy_blocks)
        if so.load_kv:
            self._load_kv(so.load_kv)
        out = ModelOutput(req_ids=[], sampled_token_ids=[], errors=errors)
        dec = self._valid_decodes(so.decodes, errors)
        scheduled = self._valid_inputs(so.scheduled, errors)
        if self.faults is not None:
            rids = [*dec.req_ids, *(r.req_id for r in scheduled)]
            self.faults.check_forward(so.step, [self._prompt_of(rid) for rid in rids])
        if self.pp is not None:  # every step: the last stage's output is the step's
            out = run_pipeline(
                self, self.pp, dec, scheduled, errors, so.grammar_bitmasks, so.save_kv_blocks, out
            )
            self.last_step_seconds = time.perf_counter() - t0
            return out
        if scheduled or dec.req_ids:
            graphs = self.graphs
            verify: list[tuple[ScheduledRequest, int]] = []
            if self.spec is not None:
                self.spec.before_step(self, scheduled, so.copy_blocks, so.grammar_bitmasks)
            if graphs is not None and self._graph_fits(graphs, dec, scheduled):
                # The graph's hidden row i is decode row i, then scheduled request i - nd.
                n = len(dec.req_ids) + len(scheduled)
                samples = self._sample_rows(scheduled, range(len(dec), n), errors, dec)
                tables = self.block_tables
                hidden = graphs.run(
                    [*dec.token_ids, *(r.input_ids[0] for r in scheduled)],
                    [*dec.positions, *(r.start_pos for r in scheduled)],
                    [tables[rid] for rid in (*dec.req_ids, *(r.req_id for r in scheduled))],
                )
            else:
                inputs = self._prepare(scheduled, errors, dec)
                samples, verify = inputs.samples, inputs.verify
                keep = inputs.keep
                if self.lora is not None and self._lora_rows(dec, inputs.ordered):
                    keep = None  # the last layer's cut assumes one weight for every row
                pw = self.piecewise
                if (
                    pw is not None
                    and inputs.meta.tree_bits is None  # (graphs captured without a tree)
                    and pw.bucket(inputs.meta.num_tokens) is not None
                ):
                    # Every row comes back: the eager forward's cut of the last layer to
                    # `keep` is a host-side choice a graph cannot make per step.
                    hidden = pw.run(inputs.input_ids, inputs.positions, inputs.meta)
                else:
                    hidden = self.model(
                        inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, keep
                    )
                if keep is not None and hidden.shape[0] != inputs.meta.num_tokens:
                    samples = samples.among(keep)  # the forward returned only `keep`'s rows
                if self.lora is not None:
                    self.lora.clear()
                for pr in inputs.prompt_rows:
                    out.prompt_logprobs[pr.req_id] = self._prompt_logprobs(hidden, pr)
                self._feed_pools(hidden, inputs.pool_rows)
            if samples.states:
                argmax_only = not so.grammar_bitmasks and all(
                    st.plain_greedy for st in samples.states
                )
                rows = samples.hidden(hidden)
                logits = self.model.compute_logits(rows, float32=not argmax_only)
                if so.grammar_bitmasks:
                    self._apply_grammar(logits, samples.ids, so.grammar_bitmasks)
                self._sample(logits, samples, out)
                self._pool(rows, samples.ids, out)
                if self.spec is not None and self.spec.medusa is not None:
                    # Medusa's heads read the hidden state that sampled each last token.
                    self.spec.medusa.remember(samples.ids, rows)
            if verify:
                assert self.spec is not None, "draft tokens sent to a runner without speculation"
                self.spec.verify(self, hidden, verify, out, so.grammar_bitmasks)
        if so.save_kv_blocks:
            out.saved_kv = self.read_kv_blocks(so.save_kv_blocks)
        self.last_step_seconds = time.perf_counter() - t0
        return out

    def _graph_fits(
        self, graphs: DecodeGraphs, dec: DecodeColumns, scheduled: list[ScheduledRequest]
    ) -> bool:
        """A step the decode graphs can run: one-token queries only, none that reads
        every prompt row (prompt logprobs, pooling; decode columns never do), a captured
        size."""
        return (
            all(len(r.input_ids) == 1 and not r.num_draft for r in scheduled)
            and not any(self.requests[r.req_id].params.reads_every_position for r in scheduled)
            and graphs.bucket(len(dec.req_ids) + len(scheduled)) is not None
        )

    def _apply_request_changes(self, so: SchedulerOutput) -> dict[str, str]:
        """Drop finished requests' state and register new ones; a new request that cannot
        be registered gets an error entry (it alone fails)."""
        errors: dict[str, str] = {}
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.block_tables.pop(rid, None)
            self.embed_ids.discard(rid)
            self.pools.pop(rid, None)
            if self.spec is not None:
                self.spec.drop(rid)
        for new in so.new_requests:
            try:
                if self.faults is not None:
                    self.faults.check_register(new.req_id, new.token_ids[: new.prompt_len])
                lora_name = new.sampling.lora
                if lora_name is not None and (
                    self.lora is None or lora_name not in self.lora.adapters
                ):
                    raise ValueError(f"no LoRA adapter named {lora_name!r}")
                self.requests[new.req_id] = RequestSamplingState.create(new, self.device)
                if new.sampling.embed:
                    self.embed_ids.add(new.req_id)
                    if new.sampling.pooling != ("last",):
                        self.pools[new.req_id] = RunningPool(new.sampling.pooling)
            except Exception as e:
                log.warning("request %s: could not register: %r", new.req_id, e)
                errors[new.req_id] = f"could not start the request: {e}"
        return errors

    def _prompt_of(self, req_id: str) -> list[int]:
        st = self.requests.get(req_id)
        return st.token_ids[: st.prompt_len] if st is not None else []

    def _valid_decodes(self, d: DecodeColumns, errors: dict[str, str]) -> DecodeColumns:
        """`_valid_inputs` for the decode columns: the tables brought up to this step, and
        the rows that would poison the batch dropped (and reported), in bulk."""
        if not d.req_ids:
            return d
        bad = apply_decode_deltas(self.block_tables, d, self.block_size)
        vocab = self.config.vocab_size
        if min(d.token_ids) < 0 or max(d.token_ids) >= vocab:
            bad = sorted({*bad, *(i for i, t in enumerate(d.token_ids) if not 0 <= t < vocab)})
        for rid in (d.req_ids[i] for i in bad):
            log.warning("request %s dropped from step: a bad decode row", rid)
            errors[rid] = "bad step input: its block table or token id does not fit the runner"
        if not bad:
            return d  # (its deltas stay: applying one again leaves the table as it is)
        skip = set(bad)
        return d.select([i for i in range(len(d.req_ids)) if i not in skip])

    def _valid_inputs(
        self, scheduled: list[ScheduledRequest], errors: dict[str, str]
    ) -> list[ScheduledRequest]:
        """Bring the block tables up to this step, then drop (and report) requests whose
        inputs would poison the whole batch: token ids outside the embedding table, or a
        block table too short for their positions."""
        vocab, bs = self.config.vocab_size, self.block_size
        tables = self.block_tables
        bad = None
        for r in scheduled:
            ids = r.input_ids
            table = apply_block_delta(tables, r)
            why = None
            if table is None:
                why = "its block table delta does not follow the table this runner holds"
            elif not ids:
                why = "no input tokens"
            elif min(ids) < 0 or max(ids) >= vocab:
                why = f"a token id is outside the vocabulary (0..{vocab - 1})"
            elif len(table) * bs < r.start_pos + len(ids):
                why = "its block table does not cover its positions"
            if why is not None:
                log.warning("request %s dropped from step: %s", r.req_id, why)
                errors[r.req_id] = f"bad step input: {why}"
                bad = bad or set()
                bad.add(r.req_id)
        if bad is None:
            return scheduled
        return [r for r in scheduled if r.req_id not in bad]

    def _sample(self, logits: torch.Tensor, samples: SampleRows, out: ModelOutput) -> None:
        """Sample every row at once; if that fails, row by row, so that only the rows that
        fail on their own are reported as errors.  A greedy or seeded row draws the same
        token either way (its draw depends on its own logits and generator only)."""
        faults = self.faults
        try:
            if faults is not None:
                for rid, st in zip(samples.ids, samples.states, strict=True):
                    faults.check_sample(rid, st.token_ids[: st.prompt_len], st.num_output_tokens)
            result = self.sampler(logits, samples.states)
            ids, toks, lps = samples.ids, result.token_ids, result.logprobs
        except Exception as e:
            log.warning("sampling a batch of %d rows failed (%r); row by row", len(samples.ids), e)
            ids, toks = [], []
            row_lps: list[TokenLogprobs | None] = []
            for i, (rid, st) in enumerate(zip(samples.ids, samples.states, strict=True)):
                try:
                    if faults is not None:
                        prompt = st.token_ids[: st.prompt_len]
                        faults.check_sample(rid, prompt, st.num_output_tokens)
                    r = self.sampler(logits[i : i + 1], [st])
                except Exception as row_e:
                    log.warning("request %s: sampling failed: %r", rid, row_e)
                    out.errors[rid] = f"sampling failed: {row_e}"
                    continue
                ids.append(rid)
                toks += r.token_ids
                row_lps.append(r.logprobs[0] if r.logprobs else None)
            lps = row_lps if any(lp is not None for lp in row_lps) else None
        by_id = dict(zip(samples.ids, samples.states, strict=True))
        for rid, tok in zip(ids, toks, strict=True):
            by_id[rid].append(tok)
        out.req_ids = list(ids)
        out.sampled_token_ids = list(toks)
        out.logprobs = lps

    def _pool(self, rows: torch.Tensor, ids: list[str], out: ModelOutput) -> None:
        """Embedding requests' pooled vectors: the hidden state that sampled their first
        token is the final (normed) state of the prompt's last position, which is what
        last-token pooling reads (HF's last_hidden_state[-1]); other poolings come from
        the request's running pools, whose last chunk this step fed.  A classifier's
        label logits are its score head applied to that state."""
        embed = self.embed_ids
        if not embed:
            return
        want = [i for i, rid in enumerate(ids) if rid in embed]
        if not want:
            return
        pools = self.pools
        if pools and any(ids[i] in pools for i in want):
            pooled = [p.vector() if (p := pools.get(ids[i])) is not None else None for i in want]
            for i, vec in zip(want, pooled, strict=True):
                if vec is not None:
                    out.embeddings[ids[i]] = vec.cpu().tolist()
            want = [i for i in want if ids[i] not in pools]
            if not want:
                return
        vecs = rows.index_select(0, torch.tensor(want, device=rows.device))
        score = self.model.score_weight
        if score is not None:
            # A sequence classifier: its label logits (transformers' score(last state)).
            vecs = vecs @ score.T
        vecs = vecs.float().cpu()
        for i, vec in zip(want, vecs.tolist(), strict=True):
            out.embeddings[ids[i]] = vec

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, ids: list[str], masks: dict[str, bytes]) -> None:
        """Mask the constrained rows' logits in place; other rows are not touched."""
        rows = [i for i, rid in enumerate(ids) if rid in masks]
        if rows:
            apply_token_bitmask_(logits, rows, [masks[ids[i]] for i in rows])

    def _sample_rows(
        self,
        reqs: list[ScheduledRequest],
        last_rows: Sequence[int],
        errors: dict[str, str] | None = None,
        dec: DecodeColumns | None = None,
    ) -> SampleRows:
        """Which hidden rows feed the sampler: the decode rows (hidden rows 0..), then
        each sampling request's last fed token, once for it and once for each request
        forked from it (n > 1).  Requests that already failed this step (see `errors`)
        take no row."""
        ids: list[str] = list(dec.req_ids) if dec is not None else []
        rows: list[int] = list(range(len(ids)))
        states: list[RequestSamplingState] = [self.requests[rid] for rid in ids]
        for r, row in zip(reqs, last_rows, strict=True):
            if r.sample and not r.num_draft:  # verify chunks sample in spec_decode
                for rid in (r.req_id, *r.fork_ids):
                    if errors and rid in errors:
                        continue
                    rows.append(row)
                    states.append(self.requests[rid])
                    ids.append(rid)
        return SampleRows.of(rows, states, ids, self.device)

    def _prepare(
        self,
        scheduled: list[ScheduledRequest],
        errors: dict[str, str] | None = None,
        dec: DecodeColumns | None = None,
    ) -> StepInputs:
        # Decodes first (the columns, then the others): backends batch the one-token
        # queries together.  A verify chunk (a decode plus its drafts) is a short prefill.
        ordered = [r for r in scheduled if len(r.input_ids) + r.num_draft == 1]
        ordered += [r for r in scheduled if len(r.input_ids) + r.num_draft != 1]
        tables = self.block_tables
        batch = layout_batch(
            [(r.input_ids + r.draft_ids, r.start_pos, tables[r.req_id]) for r in ordered],
            self.block_size,
            self.device,
            None
            if dec is None or not dec.req_ids
            else (dec.token_ids, dec.positions, [tables[rid] for rid in dec.req_ids]),
            None
            if self.spec is None or self.spec.medusa is None
            else [self.spec.tree_layout(r.req_id) if r.num_draft else None for r in ordered],
        )
        # Each request samples from its last known token's row; a verify chunk's draft
        # rows follow it.
        nd = len(dec.req_ids) if dec is not None else 0
        qs = batch.query_start[nd:]
        last_rows = [qs[i] + len(r.input_ids) - 1 for i, r in enumerate(ordered)]
        samples = self._sample_rows(ordered, last_rows, errors, dec)
        prompt_rows = self._prompt_rows(ordered, qs)
        pool_rows = self._pool_rows(ordered, qs)
        verify = [(r, row) for r, row in zip(ordered, last_rows, strict=True) if r.num_draft]
        meta = batch.meta
        # Prompt logprobs, pooling and speculative verification read other rows' hidden
        # states.
        keep = None
        if not prompt_rows and not pool_rows and not verify:
            keep = samples.kept_rows(meta.num_tokens, meta.num_decodes)
        return StepInputs(
            ordered=ordered,
            input_ids=batch.input_ids,
            positions=batch.positions,
            meta=meta,
            samples=samples,
            prompt_rows=prompt_rows,
            verify=verify,
            keep=keep,
            pool_rows=pool_rows,
        )

    def _pool_rows(self, ordered: list[ScheduledRequest], query_start: list[int]) -> list[PoolRows]:
        """Every fed row of the requests that pool over their prompt's positions."""
        pools = self.pools
        if not pools:
            return []
        return [
            PoolRows(r.req_id, query_start[i], len(r.input_ids), r.start_pos)
            for i, r in enumerate(ordered)
            if r.req_id in pools
        ]

    def _feed_pools(self, hidden: torch.Tensor, pool_rows: list[PoolRows]) -> None:
        for pr in pool_rows:
            self.pools[pr.req_id].feed(hidden[pr.row : pr.row + pr.count], pr.start)

    def _prompt_rows(
        self, ordered: list[ScheduledRequest], query_start: list[int]
    ) -> list[PromptRows]:
        """Hidden rows whose logits score the next prompt token, for requests that asked
        for prompt logprobs."""
        prompt_rows = []
        for i, r in enumerate(ordered):
            state = self.requests.get(r.req_id)
            if state is None or (top_n := state.params.prompt_logprobs) is None:
                continue
            end = min(r.start_pos + len(r.input_ids), state.prompt_len - 1)
            if r.start_pos < end:
                span = range(r.start_pos, end)
                rows = [query_start[i] + p - r.start_pos for p in span]
                targets = [state.token_ids[p + 1] for p in span]
                prompt_rows.append(PromptRows(r.req_id, rows, targets, top_n))
        return prompt_rows

    def _prompt_logprobs(self, hidden: torch.Tensor, pr: PromptRows) -> list[TokenLogprobs]:
        """Logprob of each prompt token given the ones before it (raw model distribution),
        in slices so a long chunk never holds [chunk, vocab] logits at once."""
        out: list[TokenLogprobs] = []
        vocab = self.sampler.vocab_size
        for a in range(0, len(pr.rows), 128):
            rows = torch.tensor(pr.rows[a : a + 128], dtype=torch.int64, device=self.device)
            tgt = torch.tensor(pr.targets[a : a + 128], dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))[:, :vocab]
            lp = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
            tok = lp.gather(1, tgt.unsqueeze(1))  # [P, 1]
            # vLLM's rank: how many tokens are at least as likely as this one.
            ranks = (lp >= tok).sum(-1).tolist()
            tok_lp = tok.squeeze(1).tolist()
            if pr.top_n:
                top_v, top_i = lp.topk(pr.top_n, dim=-1)
                vals, ids = top_v.tolist(), top_i.tolist()
            else:
                vals = ids = [[] for _ in tok_lp]
            out += [
                TokenLogprobs(t, v, i, tv, r)
                for t, v, i, tv, r in zip(
                    pr.targets[a : a + 128], tok_lp, ids, vals, ranks, strict=True
                )
            ]
        return out

    # ------------------------------------------------------------------ KV blocks
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for layer in self.kv_caches:  # values, and scales beside them when quantized
            for t in layer:
                t.index_copy_(0, dst, t.index_select(0, src))

    def read_kv_blocks(self, block_ids: list[int]) -> list[KVBlockPayload]:
        """Each block's bytes: per layer K then V values ([block_size, kv_heads, head_dim]),
        then, for a quantized cache, K then V scales ([block_size, kv_heads] bfloat16)."""
        return kv_payloads(block_ids, self.read_kv_bytes(block_ids))

    def read_kv_bytes(self, block_ids: list[int]) -> torch.Tensor:
        """read_kv_blocks' bytes as one [blocks, bytes] uint8 tensor on the host; a pipeline
        stage's hold its own layers only (gpu.pp gathers the stages')."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        n = len(block_ids)
        parts = []
        for layer in self.kv_caches:
            for t in layer:
                x = t.index_select(0, idx)
                if self.tp is not None:  # every rank's heads, in a TP=1 layout
                    # Bytes per element on a trailing dim, so dim 2 stays the heads.
                    x = gather_kv_heads(x.unsqueeze(-1).view(torch.uint8), self.config, self.tp)
                parts.append(x.reshape(n, -1).view(torch.uint8))
        return torch.cat(parts, dim=1).cpu()  # [n, kv_payload_bytes]

    def _load_kv(self, payloads: list[KVBlockPayload]) -> None:
        # Payloads hold every KV head (TP=1 layout); a TP rank copies its own heads.
        c = self.config
        heads = (0, c.num_kv_heads) if self.tp is None else kv_heads(c, self.tp)
        for p in payloads:
            # The prefix-index actor checks checksums and sizes before a payload gets here.
            assert len(p.data) == self.kv_payload_bytes, "KV payload of the wrong size"
            raw = torch.frombuffer(bytearray(p.data), dtype=torch.uint8).to(self.device)
            # Layer after layer: a pipeline stage's layers start past the earlier stages'.
            at = 0 if self.pp is None else self.pp.start * (len(p.data) // c.num_layers)
            for layer in self.kv_caches:
                for t in layer:
                    dst = t[p.block_id]  # [block_size, local heads, ...]
                    shape = (dst.shape[0], c.num_kv_heads, *dst.shape[2:])
                    nbytes = dst.element_size() * dst[:, :1].numel() * shape[1]
                    src = raw[at : at + nbytes].view(t.dtype).view(shape)
                    dst.copy_(src[:, heads[0] : heads[1]])
                    at += nbytes
