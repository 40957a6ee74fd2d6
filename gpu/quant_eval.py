"""How far a quantized runner drifts from the unquantized one: teacher-forced logits over
a fixed token sequence (so every step reads the same context, through the paged cache),
and greedy agreement (share of identical sequences, first-divergence positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.model_runner import ModelRunner
from scheduler.contract import ScheduledRequest, apply_block_delta


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
            new_block_ids=table[: -(-(pos + n) // bs)],
            sample=False,  # rows are picked here, not by the sampler
        )
        apply_block_delta(runner.block_tables, req)
        inputs = runner._prepare([req])
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        rows.append(runner.model.compute_logits(hidden[-1:]))
        pos += n
    runner.block_tables.pop("eval", None)
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


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the decoder layers' projection weights as the kernels read them, bytes of
    the rest: embedding, lm_head (a packed copy counts once more), norms)."""
    from gpu.cpu.linear import PackedLinear
    from gpu.quant_linear import AWQLinear, Int8Linear

    def elem(dt: torch.dtype) -> int:
        return torch.empty((), dtype=dt).element_size()

    proj = 0
    head = getattr(model, "lm_head_int8", None)
    packed_head = getattr(model, "lm_head_packed", None)
    for m in model.modules():
        if m is head or m is packed_head:
            continue
        if isinstance(m, Int8Linear):
            proj += m.qweight.nbytes + m.scale.nbytes
        elif isinstance(m, AWQLinear):
            if m.packed is not None:  # 4-bit values + a (scale, zero) pair per group
                proj += m.in_features * m.out_features // 2 + m.sz.nbytes
            else:
                proj += m.weight.nbytes
        elif isinstance(m, PackedLinear):
            proj += m.in_features * m.out_features * elem(m.dtype)  # layouts keep its dtype
        elif isinstance(m, torch.nn.Linear):
            proj += m.weight.nbytes
    other = sum(p.nbytes for n, p in model.named_parameters() if "proj" not in n)
    if head is not None:  # the int8 lm_head copy (the tied embedding is counted above)
        other += head.qweight.nbytes + head.scale.nbytes
    if packed_head is not None:
        cfg = model.config  # type: ignore[attr-defined]
        other += cfg.vocab_size * cfg.hidden_size * elem(packed_head.dtype)
    return proj, other


@torch.inference_mode()
def decode_tokens_per_second(runner: ModelRunner, context: int = 64, steps: int = 64) -> float:
    """Batch-1 decode speed: one request's forward + logits per token, after a prefill of
    `context` tokens (sampling excluded: the same for every configuration)."""
    import time

    toks = [(7 * i + 3) % runner.config.vocab_size for i in range(context + steps)]
    teacher_forced_logits(runner, toks[: context + 4], context)  # warm-up
    t = time.perf_counter()
    teacher_forced_logits(runner, toks, context)
    total = time.perf_counter() - t
    t = time.perf_counter()
    teacher_forced_logits(runner, toks[: context + 1], context)  # the prefill alone
    prefill = time.perf_counter() - t
    return steps / max(1e-9, total - prefill)
