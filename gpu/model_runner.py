"""The model runner: one SchedulerOutput in, one ModelOutput out.

It owns the weights, the paged KV cache and per-request sampling state (sent once by the
scheduler, dropped when the request finishes).  No asyncio here: the executor actor calls
`execute_model` from a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu import cpu_kernels
from gpu.attention import create_attention_backend
from gpu.attention.base import AttentionMetadata
from gpu.config import ModelConfig, ModelLoadError, read_eos_token_ids, resolve_dtype
from gpu.cuda_graphs import DEFAULT_SIZES, DecodeGraphs
from gpu.loader import load_model
from gpu.sampler import RequestSamplingState, Sampler
from gpu.spec_decode import SpecRunner
from scheduler.contract import KVBlockPayload, ModelOutput, ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30  # 2 GiB of KV cache on CPU unless told otherwise
DEFAULT_GPU_MEMORY_FRACTION = 0.85  # of the memory left free after the weights


@dataclass
class SampleRows:
    """Where each sampled request reads its logits, and its sampling state."""

    rows: torch.Tensor  # [R] index into the step's hidden states
    states: list[RequestSamplingState]
    ids: list[str]


@dataclass
class StepInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    samples: SampleRows
    # Verify chunks: each request with draft tokens, and the row of its last known token.
    verify: list[tuple[ScheduledRequest, int]]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    query_start: list[int]  # first row of each sequence


def layout_batch(
    seqs: Sequence[tuple[list[int], int, list[int]]],  # (token ids, start position, blocks)
    block_size: int,
    device: torch.device,
) -> Batch:
    """Flatten sequences (decodes, i.e. one-token queries, must come first) into one step's
    tensors and attention metadata.  The target and the draft model share it."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    max_blocks = max(len(bt) for _, _, bt in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    num_decodes = 0
    for i, (ids, s, bt) in enumerate(seqs):
        n = len(ids)
        input_ids += ids
        if n == 1:
            num_decodes += 1
            positions.append(s)
            slots.append(bt[s // bs] * bs + s % bs)
        else:
            positions += range(s, s + n)
            slots += [bt[p // bs] * bs + p % bs for p in range(s, s + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(s + n)
        tables[i, : len(bt)] = bt
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(seqs))]

    def t(x: list[int], dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=device)

    meta = AttentionMetadata(
        num_tokens=len(input_ids),
        num_seqs=len(seqs),
        num_decodes=num_decodes,
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=t(slots, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=bs,
    )
    return Batch(t(input_ids, torch.int64), t(positions, torch.int64), meta, qsl[:-1])


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: Sequence[int] | None = None,
        max_num_seqs: int = 256,
        speculative_model: str | Path | None = None,
        speculation: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config = ModelConfig.from_dir(self.model_dir)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.config)
        self.dtype = resolve_dtype(dtype, self.device)
        if block_size <= 0 or block_size & (block_size - 1):
            raise ModelLoadError(f"block_size must be a positive power of two, got {block_size}")
        self.block_size = block_size
        limit = self.config.max_context
        if max_model_len is not None and max_model_len > limit:
            raise ModelLoadError(
                f"max_model_len {max_model_len} exceeds what the model supports ({limit})"
            )
        self.max_model_len = max_model_len or limit
        cfg = self.config
        self.attn_backend = create_attention_backend(
            attention_backend,
            self.device,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
            self.dtype,
            block_size,
        )
        self.model = load_model(
            self.model_dir, cfg, self.attn_backend, self.dtype, self.device, self.max_model_len
        )
        if self.device.type == "cpu":
            cpu_kernels.load()  # compile (once per machine) at start-up, not on a request
            packed = self.model.pack_for_cpu()
            log.info("CPU: %d projections use pre-packed oneDNN weights", packed)
        self.num_kv_blocks = num_kv_blocks or self._auto_num_blocks(kv_cache_bytes)
        shape = (self.num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not empty: the torch decode path reads padded slots (masked to weight 0),
        # and 0 * NaN garbage would still poison the sum.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler(cfg.vocab_size, self.eos_token_ids, self.device, seed=seed)
        self.requests: dict[str, RequestSamplingState] = {}
        self.last_step_seconds = 0.0
        self.graphs = self._setup_graphs(cuda_graphs, graph_batch_sizes, max_num_seqs)
        # Speculative decoding: verification, and the draft model when there is one.
        self.spec: SpecRunner | None = None
        if speculation or speculative_model is not None:
            self.spec = SpecRunner(self, speculative_model, attention_backend)

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
        capture = self.device.type == "cuda"
        # Pin the split-context choice: the heuristic reads max_seq_len on the host, and a
        # captured launch must not depend on it.
        self.attn_backend.num_splits = 1  # type: ignore[attr-defined]
        graphs = DecodeGraphs(self, sizes, capture=capture)
        graphs.capture_all()
        self.attn_backend.num_splits = None  # type: ignore[attr-defined]
        return graphs

    # ------------------------------------------------------------------ sizing
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem

    def _auto_num_blocks(self, kv_cache_bytes: int | None) -> int:
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * DEFAULT_GPU_MEMORY_FRACTION)
            else:
                kv_cache_bytes = DEFAULT_CPU_KV_BYTES
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
        t0 = time.perf_counter()
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            if self.spec is not None:
                self.spec.drop(rid)
        for new in so.new_requests:
            self.requests[new.req_id] = RequestSamplingState.create(new, self.device)
        if so.copy_blocks:
            self._copy_blocks(so.copy_blocks)
        if so.load_kv:
            self._load_kv(so.load_kv)
        out = ModelOutput(req_ids=[], sampled_token_ids=[])
        if so.scheduled:
            graphs = self.graphs
            verify: list[tuple[ScheduledRequest, int]] = []
            if self.spec is not None:
                self.spec.before_step(self, so)
            if (
                graphs is not None
                and all(len(r.input_ids) == 1 and not r.num_draft for r in so.scheduled)
                and graphs.bucket(len(so.scheduled)) is not None
            ):
                # The graph's hidden row i is scheduled request i.
                samples = self._sample_rows(so.scheduled, range(len(so.scheduled)))
                hidden = graphs.run(so.scheduled)
            else:
                inputs = self._prepare(so.scheduled)
                samples, verify = inputs.samples, inputs.verify
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            if samples.states:
                logits = self.model.compute_logits(hidden.index_select(0, samples.rows))
                result = self.sampler(logits, samples.states)
                for state, tok in zip(samples.states, result.token_ids, strict=True):
                    state.append(tok)
                out.req_ids = samples.ids
                out.sampled_token_ids = result.token_ids
                out.logprobs = result.logprobs
            if verify:
                assert self.spec is not None, "draft tokens sent to a runner without speculation"
                self.spec.verify(self, hidden, verify, out)
        if so.save_kv_blocks:
            out.saved_kv = self.read_kv_blocks(so.save_kv_blocks)
        self.last_step_seconds = time.perf_counter() - t0
        return out

    def _sample_rows(self, reqs: list[ScheduledRequest], last_rows: Sequence[int]) -> SampleRows:
        """Which hidden rows feed the sampler: each sampling request's last fed token, once
        for it and once for each request forked from it (n > 1)."""
        rows: list[int] = []
        states: list[RequestSamplingState] = []
        ids: list[str] = []
        for r, row in zip(reqs, last_rows, strict=True):
            if r.sample and not r.num_draft:  # verify chunks sample in spec_decode
                for rid in (r.req_id, *r.fork_ids):
                    rows.append(row)
                    states.append(self.requests[rid])
                    ids.append(rid)
        return SampleRows(torch.tensor(rows, dtype=torch.int64, device=self.device), states, ids)

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        # Decodes first: backends batch the one-token queries together.  A verify chunk
        # (a decode plus its draft tokens) is a short prefill chunk.
        ordered = [r for r in scheduled if len(r.input_ids) + r.num_draft == 1]
        ordered += [r for r in scheduled if len(r.input_ids) + r.num_draft != 1]
        batch = layout_batch(
            [(r.input_ids + r.draft_ids, r.start_pos, r.block_table) for r in ordered],
            self.block_size,
            self.device,
        )
        # Each request samples from its last known token's row; a verify chunk's draft
        # rows follow it.
        last_rows = [batch.query_start[i] + len(r.input_ids) - 1 for i, r in enumerate(ordered)]
        return StepInputs(
            input_ids=batch.input_ids,
            positions=batch.positions,
            meta=batch.meta,
            samples=self._sample_rows(ordered, last_rows),
            verify=[(r, row) for r, row in zip(ordered, last_rows, strict=True) if r.num_draft],
        )

    # ------------------------------------------------------------------ KV blocks
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def read_kv_blocks(self, block_ids: list[int]) -> list[KVBlockPayload]:
        """Each block's K and V of every layer: [layers, 2, block_size, kv_heads, head_dim]."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        stacked = torch.stack(
            [
                torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
                for k, v in self.kv_caches
            ]
        )  # [layers, 2, n, block_size, kv_heads, head_dim]
        per_block = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        return [
            KVBlockPayload(block_id=b, data=per_block[i].view(torch.uint8).numpy().tobytes())
            for i, b in enumerate(block_ids)
        ]

    def _load_kv(self, payloads: list[KVBlockPayload]) -> None:
        c = self.config
        shape = (c.num_layers, 2, self.block_size, c.num_kv_heads, c.head_dim)
        for p in payloads:
            # The prefix-index actor checks checksums and sizes before a payload gets here.
            assert len(p.data) == self.kv_bytes_per_block, "KV payload of the wrong size"
            block = (
                torch.frombuffer(bytearray(p.data), dtype=torch.uint8)
                .view(self.dtype)
                .view(shape)
                .to(self.device)
            )
            for layer, (k, v) in enumerate(self.kv_caches):
                k[p.block_id].copy_(block[layer, 0])
                v[p.block_id].copy_(block[layer, 1])
