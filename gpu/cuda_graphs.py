"""CUDA graphs for decode-only steps, captured at a few batch-size buckets.

A decode step of b sequences runs the graph of the smallest bucket B >= b: the step's
inputs are copied into static buffers and rows b..B-1 are padding (slot -1: nothing is
written to the cache; sequence length 0: attention returns zeros), so one graph serves
every batch up to its size and every context length.  Steps with prefill chunks, or
more sequences than the largest bucket, run eagerly.

Only the decode step is wrapped; logits and sampling stay eager.  With `capture=False`
the same padded static-buffer path runs without a graph, which lets CPU tests exercise
it through the Triton interpreter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from gpu.attention.base import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


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
        for b in self.sizes:
            if b >= n:
                return b
        return None

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
