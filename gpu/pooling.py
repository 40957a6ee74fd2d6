"""Pooling an embedding request's prompt over its positions (SamplingParams.pooling other
than the last token's), fed one prefill chunk at a time.

A chunked prompt's hidden states never exist together, so each mode keeps a running
value that the chunks fold into: a sum for the means, a running maximum, the first row
for CLS.  The scheduler computes every position of such a prompt (no prefix hits,
`SamplingParams.reads_every_position`), so the chunks cover positions 0.. in order; one
that starts at 0 again (a preempted prompt recomputed) starts the pools over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolRows:
    """One pooling request's rows in this step's hidden states and where they start."""

    req_id: str
    row: int  # its first row: `count` consecutive rows hold positions start, start + 1, ...
    count: int
    start: int


class RunningPool:
    """A request's pools so far, in float32 (sentence-transformers' modes): only what its
    modes read is kept."""

    def __init__(self, modes: tuple[str, ...]) -> None:
        self.modes = modes
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None  # sum of rows
        self.weighted: torch.Tensor | None = None  # sum of (position + 1) * row
        self.weights = 0.0
        self.peak: torch.Tensor | None = None
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    def feed(self, h: torch.Tensor, start: int) -> None:
        """Fold in the rows of positions start .. start + len(h) - 1."""
        if start == 0:
            self._reset()
        h = h.float()
        n = h.shape[0]
        modes = self.modes
        if start == 0 and "cls" in modes:
            self.first = h[0].clone()
        if "mean" in modes or "mean_sqrt_len" in modes:
            total = h.sum(0)
            self.total = total if self.total is None else self.total + total
        if "max" in modes:
            peak = h.amax(0)
            self.peak = peak if self.peak is None else torch.maximum(self.peak, peak)
        if "weightedmean" in modes:
            # sentence-transformers weighs position p by p + 1.
            w = torch.arange(start + 1, start + n + 1, device=h.device, dtype=h.dtype)
            part = (w.unsqueeze(1) * h).sum(0)
            self.weighted = part if self.weighted is None else self.weighted + part
            self.weights += float((start + 1 + start + n) * n / 2)
        if "last" in modes:
            self.last = h[-1].clone()
        self.count = start + n

    def vector(self) -> torch.Tensor:
        """[H * len(modes)]: each mode's vector, concatenated in `modes` order."""
        assert self.count > 0, "pooled before any row was fed"
        parts = []
        for mode in self.modes:
            if mode == "cls":
                parts.append(self.first)
            elif mode == "max":
                parts.append(self.peak)
            elif mode == "mean":
                parts.append(self.total / self.count)
            elif mode == "mean_sqrt_len":
                parts.append(self.total / self.count**0.5)
            elif mode == "weightedmean":
                parts.append(self.weighted / self.weights)
            else:
                parts.append(self.last)
        return torch.cat(parts)  # type: ignore[arg-type]
