"""CUDA graphs: whole decode steps, and every other step in pieces around its attention.

DecodeGraphs: decode-only steps, captured at a few batch-size buckets.

A decode step of b sequences runs the graph of the smallest bucket B >= b: the step's
inputs are copied into static buffers and rows b..B-1 are padding (slot -1: nothing is
written to the cache; sequence length 0: attention returns zeros), so one graph serves
every batch up to its size and every context length.  Steps with prefill chunks, or
more sequences than the largest bucket, run eagerly.

Only the decode step is wrapped; logits and sampling stay eager.  With `capture=False`
the same padded static-buffer path runs without a graph, which lets CPU tests exercise
it through the Triton interpreter.

PiecewiseGraphs: the steps the decode graphs do not take (prefill chunks, mixed
prefill + decode, speculative verification), as vLLM's piecewise graphs do.  Their
attention depends on host values (sequence count, query lengths, split choice), so it
runs eagerly; everything between two attentions (o_proj, residual, norm, MLP, the next
layer's norm, qkv and rotary) is one graph per token-count bucket.  Eager, such a step
is mostly host time (hundreds of launches for little device work:
docs/PERFORMANCE.md, "NVIDIA H200"); in pieces a layer is one replay and its two
attention launches (writing straight into the next piece's input).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from gpu.model import CausalLM

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Token counts of the piecewise graphs' buckets: a step pads to the next one (at most a
# third more rows above 512); larger steps run eagerly, where the kernels' time already
# hides the launches'.
DEFAULT_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


def smallest_at_least(sizes: Sequence[int], n: int) -> int | None:
    """The bucket a step of n rows pads to (sizes ascending), or None: too large."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


# (input_ids [n], positions [n], meta) -> hidden [n, hidden]: the model's forward over
# the runner's KV caches, handed in so the graphs know nothing of the runner.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        *,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        sizes: Sequence[int],
        capture: bool = True,
    ) -> None:
        self.forward = forward
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        self.capture = capture
        dev = device
        maxb = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(maxb, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(maxb, dtype=torch.int64, device=dev)
        self.slots = torch.full((maxb,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(maxb, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(maxb + 1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(maxb, self.max_blocks, dtype=torch.int32, device=dev)
        # Host staging for one step's inputs, each shaped so its first b rows are one
        # contiguous range (a strided source would be copied through a pageable temporary).
        # Pinned on a GPU, so the copies are asynchronous (from pageable memory each is a
        # synchronous staged copy), and filled through numpy views: one slice assignment
        # a row instead of a tensor built per row (the block tables at batch 64 were 64
        # small torch.tensor calls a step).
        pin = dev.type == "cuda"
        self.host_rows = torch.zeros(3, maxb, dtype=torch.int64, pin_memory=pin)  # ids/pos/slots
        self.host_lens = torch.zeros(maxb, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(maxb, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._np_rows = self.host_rows.numpy()
        self._np_lens = self.host_lens.numpy()
        self._np_tables = self.host_tables.numpy()
        # Recorded after a step's copies: the next step waits on it before it overwrites
        # the staging rows a copy may still be reading.
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas = {b: self._meta(b) for b in self.sizes}
        self.replays = 0

    def _meta(self, b: int) -> AttentionMetadata:
        # max_seq_len is the bound the kernels are launched for; the real lengths are
        # read on the device, so the same launch stays right for any context.
        return AttentionMetadata(
            num_tokens=b,
            num_seqs=b,
            num_decodes=b,
            query_start_loc=self.qsl[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.tables[:b],
            slot_mapping=self.slots[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,
            block_size=self.block_size,
            num_splits=1,
        )

    def bucket(self, n: int) -> int | None:
        return smallest_at_least(self.sizes, n)

    def _forward(self, b: int) -> torch.Tensor:
        return self.forward(self.input_ids[:b], self.positions[:b], self.metas[b])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per bucket, largest first so smaller ones reuse its pool."""
        if not self.capture:
            return
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self._forward(b)  # warm-up: autotuning and lazy init outside the capture
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.outputs[b] = self._forward(b)
                pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(
        self, token_ids: list[int], positions: list[int], tables: list[list[int]]
    ) -> torch.Tensor:  # [n, hidden]
        """One decode step through the bucket's graph (or its eager equivalent): row i
        feeds token_ids[i] at positions[i] through block table tables[i]."""
        n = len(token_ids)
        b = self.bucket(n)
        assert b is not None
        bs = self.block_size
        if self._copied is not None:
            self._copied.synchronize()
        rows, lens, table = self._np_rows, self._np_lens, self._np_tables
        rows[:, n:b] = 0
        rows[2, n:b] = -1  # padded rows write nothing to the cache (slot -1)...
        lens[n:b] = 0  # ...and attend to nothing
        table[:b] = 0
        rows[0, :n] = token_ids
        rows[1, :n] = positions
        for i, (s, bt) in enumerate(zip(positions, tables, strict=True)):
            rows[2, i] = bt[s // bs] * bs + s % bs
            lens[i] = s + 1
            table[i, : len(bt)] = bt
        self.input_ids[:b].copy_(self.host_rows[0, :b], non_blocking=True)
        self.positions[:b].copy_(self.host_rows[1, :b], non_blocking=True)
        self.slots[:b].copy_(self.host_rows[2, :b], non_blocking=True)
        self.seq_lens[:b].copy_(self.host_lens[:b], non_blocking=True)
        self.tables[:b].copy_(self.host_tables[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.replays += 1
        if self.capture:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(b)[:n]


class PiecewiseGraphs:
    """One graph per (token bucket, piece): piece 0 embeds and runs layer 0 up to its
    attention, piece i finishes layer i-1 and runs layer i up to its attention, the last
    piece finishes the last layer and applies the final norm.  Pieces read and write
    static buffers (ids, positions, residual, q/k/v, the attention's output, the final
    hidden) allocated once at the largest bucket, so a step of n tokens in bucket T only
    copies its ids and positions in; each attention writes into the next piece's input.  Rows n..T-1 are
    padding: every op in a piece works row by row, the attention runs on the first n rows
    only, so padding never reaches a real row and writes nothing to the cache."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, ...]],
        *,
        device: torch.device,
        sizes: Sequence[int],
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = sorted(set(sizes))
        self.capture = capture
        attn = model.layers[0].self_attn
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        hidden = model.config.hidden_size
        dtype = model.embed_tokens.weight.dtype
        t = self.sizes[-1]

        def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        self.input_ids = zeros(t, dt=torch.int64)
        self.positions = zeros(t, dt=torch.int64)
        self.residual = zeros(t, hidden)
        self.q, self.k, self.v = zeros(t, heads, d), zeros(t, kv_heads, d), zeros(t, kv_heads, d)
        self.attn_out = zeros(t, heads * d)
        self.hidden = zeros(t, hidden)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        return smallest_at_least(self.sizes, n)

    def _piece(self, i: int, t: int) -> None:
        """Piece i over the first t rows of the static buffers (captured as one graph)."""
        model, layers = self.model, self.model.layers
        if i == 0:
            x = model.embed(self.input_ids[:t])
        else:
            x = layers[i - 1].after_attention(self.residual[:t], self.attn_out[:t])
        if i == len(layers):
            self.hidden[:t].copy_(model.norm(x))
            return
        self.residual[:t].copy_(x)
        q, k, v = layers[i].before_attention(x, model.rope(self.positions[:t], x.dtype))
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's pieces, largest bucket first, all in one memory pool:
        the pieces replay one at a time, so their temporaries can share it."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        pool = None
        pieces = len(self.model.layers) + 1
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t in reversed(self.sizes):
                for i in range(pieces):  # warm-up outside the capture (Triton compiles)
                    self._piece(i, t)
                graphs = []
                for i in range(pieces):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self._piece(i, t)
                    pool = g.pool()
                    graphs.append(g)
                self.graphs[t] = graphs
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured piecewise CUDA graphs (%d pieces) for token counts %s in %.1f s",
            pieces, self.sizes, time.perf_counter() - t0,
        )  # fmt: skip

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [n, hidden] after the final norm (valid until the next run)
        """The model's forward over a step's n = meta.num_tokens rows (every row back,
        as CausalLM.forward with keep=None)."""
        n = meta.num_tokens
        t = self.bucket(n)
        assert t is not None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        graphs = self.graphs.get(t)
        q, k, v = self.q[:n], self.k[:n], self.v[:n]
        out = self.attn_out[:n].view(q.shape)  # the attention writes the next piece's input
        for i, layer in enumerate(self.model.layers):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, t)
            kv = self.kv_caches[i]
            layer.self_attn.backend.forward(q, k, v, kv[0], kv[1], meta, *kv[2:], out=out)
        if graphs is not None:
            graphs[-1].replay()
        else:
            self._piece(len(self.model.layers), t)
        self.replays += 1
        return self.hidden[:n]
