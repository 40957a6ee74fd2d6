"""The rows of one step the runner passes between its phases: which hidden rows sample
(and with what state), which score prompt tokens, and the step's device tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu.attention.base import AttentionMetadata
from gpu.pooling import PoolRows
from gpu.sampler import RequestSamplingState
from scheduler.contract import ScheduledRequest


@dataclass
class SampleRows:
    """Where each sampled request reads its logits, and its sampling state."""

    rows: torch.Tensor  # [R] index into the step's hidden states
    states: list[RequestSamplingState]
    ids: list[str]
    host: list[int]  # rows on the host (the step's planning reads them without a sync)
    # rows are 0 .. R-1 (every row samples, once, in order: e.g. an all-decode step), so
    # the first R hidden rows are the sampled ones as they lie, without a gather.
    leading: bool

    @classmethod
    def of(
        cls,
        rows: list[int],
        states: list[RequestSamplingState],
        ids: list[str],
        device: torch.device,
    ) -> SampleRows:
        idx = torch.tensor(rows, dtype=torch.int64, device=device)
        return cls(idx, states, ids, rows, rows == list(range(len(rows))))

    def hidden(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [R, H]
        n = self.rows.shape[0]
        return hidden[:n] if self.leading else hidden.index_select(0, self.rows)

    def kept_rows(self, num_tokens: int, num_decodes: int) -> list[int] | None:
        """The step's rows a forward must carry to the end for these samples (ascending;
        every decode row, then the sampled rows after them), or None where that is every
        row.  See CausalLM.forward's `keep`."""
        if num_decodes >= num_tokens:  # every row is a decode (the common step): no work
            return None
        rows = sorted(set(range(num_decodes)).union(self.host))
        return rows if len(rows) < num_tokens else None

    def among(self, keep: list[int]) -> SampleRows:
        """The same samples read from a forward that returned only `keep`'s rows."""
        at = {row: i for i, row in enumerate(keep)}
        return SampleRows.of([at[r] for r in self.host], self.states, self.ids, self.rows.device)


@dataclass
class PromptRows:
    """Hidden rows whose next token is a known prompt token (prompt_logprobs)."""

    req_id: str
    rows: list[int]  # index into the step's hidden states
    targets: list[int]  # the prompt token each row predicts
    top_n: int


@dataclass
class StepInputs:
    """Device tensors of one step."""

    ordered: list[ScheduledRequest]  # the scheduled requests in row order (decodes first)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    samples: SampleRows
    prompt_rows: list[PromptRows]
    # Verify chunks: each request with draft tokens, and the row of its last known token.
    verify: list[tuple[ScheduledRequest, int]]
    # The rows the forward may stop carrying all others at (CausalLM.forward), or None.
    keep: list[int] | None = None
    # Requests pooling over their prompt's positions: their rows (gpu/pooling.py).
    pool_rows: list[PoolRows] = field(default_factory=list)
