"""How far a quantized runner drifts from the unquantized one: teacher-forced logits over
a fixed token sequence (so every step reads the same context, through the paged cache),
and greedy agreement (share of identical sequences, first-divergence positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.model_runner import ModelRunner
from scheduler.contract import ScheduledRequest


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Logits [len(tokens) - prompt_len + 1, V] predicting tokens[prompt_len:] and one more:
    the prompt as one prefill chunk, then one decode step per further token (so decode
    attention reads what earlier steps wrote into the cache).  Uses blocks 0.. of the
    runner's cache; the runner must hold len(tokens) slots."""
    bs = runner.block_size
    table = list(range(-(-len(tokens) // bs)))
    assert len(table) <= runner.num_kv_blocks
    rows: list[torch.Tensor] = []
    pos = 0
    while pos < len(tokens):
        n = prompt_len if pos == 0 else 1
        req = ScheduledRequest(
            req_id="eval",
            input_ids=tokens[pos : pos + n],
            start_pos=pos,
            block_table=table[: -(-(pos + n) // bs)],
            sample=False,  # rows are picked here, not by the sampler
        )
        inputs = runner._prepare([req])
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        rows.append(runner.model.compute_logits(hidden[-1:]))
        pos += n
    return torch.cat(rows).float()


@dataclass
class LogitDrift:
    max_abs: float  # largest |logit difference|
    rel_max: float  # max_abs over the reference logits' standard deviation
    argmax_agree: float  # share of positions with the same top token
    mean_kl: float  # KL(ref || quantized) per position, nats


def logit_drift(ref: torch.Tensor, got: torch.Tensor) -> LogitDrift:
    diff = (got - ref).abs()
    lp_ref = ref.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - got.log_softmax(-1))).sum(-1)
    return LogitDrift(
        max_abs=diff.max().item(),
        rel_max=diff.max().item() / ref.std().item(),
        argmax_agree=(ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
        mean_kl=kl.mean().item(),
    )


@dataclass
class GreedyAgreement:
    identical: float  # share of sequences identical to the reference
    first_divergence: list[int | None]  # per sequence: first differing position, or None
    mean_matched_prefix: float  # mean share of each sequence matched before it diverges


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> GreedyAgreement:
    firsts: list[int | None] = []
    prefix = 0.0
    for a, b in zip(ref, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        firsts.append(first)
        prefix += (len(a) if first is None else first) / max(1, len(a))
    same = sum(f is None for f in firsts)
    return GreedyAgreement(same / len(ref), firsts, prefix / len(ref))
