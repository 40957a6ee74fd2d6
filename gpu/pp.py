"""Pipeline parallelism: which layers a stage holds, and one step run as micro-batches
through the stages.

Ranks are laid out stage-major: global rank = stage * T + tp_rank (T = tensor-parallel
size), so a stage's T ranks form one tensor-parallel group and rank t of stage s sends
its activations to rank t of stage s + 1 (after each layer's all-reduce every rank of a
stage holds the same residual stream, so each sends its own copy: no scatter/gather).

Every rank receives the same SchedulerOutput (over the executor's pipes), so each one
lays out the same micro-batches and knows the shape of what it will receive without
being told.  Stage 0 embeds, the last stage applies the final norm, computes logits and
samples, then sends the step's ModelOutput (msgspec bytes) to global rank 0, the one in
the server process.  A step's rows are split into contiguous micro-batches in the order
the scheduler wrote them (decode columns, then the other rows as scheduled): a request
that hits a prefix block another request of the same step is writing was scheduled after
it (the writer's allocation registered the block), so the writer's micro-batch has gone
through each stage's layers first.  (Not the order one forward lays rows out in, one-token
rows first: a one-token row can be a new request whose prefix another row of the step is
writing.  Each micro-batch is laid out that way inside.)  While the next stage
runs micro-batch k, this stage runs k + 1: the sends are asynchronous (isend).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from gpu.config import ModelConfig, ModelLoadError
from gpu.step_rows import SampleRows
from scheduler.contract import DecodeColumns, KVBlockPayload, ModelOutput, ScheduledRequest

# Micro-batches per step (at most one per row).  Two already let a two-stage pipeline
# overlap; more shrink the bubble at the price of smaller products.
DEFAULT_MICRO_BATCHES = 2


def layer_split(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, one per stage, sizes differing by at most
    one (the first stages take the remainder: the last also holds the lm_head)."""
    per, extra = divmod(num_layers, size)
    out, at = [], 0
    for s in range(size):
        n = per + (1 if s < extra else 0)
        out.append((at, at + n))
        at += n
    return out


def check_pp_config(cfg: ModelConfig, size: int, quantization: str | None = None) -> None:
    """Refuse, before any process starts, what pipeline parallelism cannot run."""
    if size < 1:
        raise ModelLoadError(f"pipeline_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    problems = []
    if cfg.num_layers < size:
        problems.append(f"num_hidden_layers {cfg.num_layers} (fewer layers than stages)")
    if cfg.awq_group_size:
        problems.append("INT4 (AWQ / GPTQ) checkpoints (not supported with pipeline parallelism)")
    if cfg.fp8_format:
        problems.append("FP8 checkpoints (not supported with pipeline parallelism)")
    if quantization:
        problems.append(f"--quantization {quantization} (not supported with pipeline parallelism)")
    if problems:
        raise ModelLoadError(
            f"pipeline_parallel_size {size} cannot split this model: " + "; ".join(problems)
        )


@dataclass(frozen=True)
class PPStage:
    """This rank's place in the pipeline."""

    stage: int
    size: int  # number of stages
    start: int  # first layer held (global index)
    stop: int
    tp_size: int = 1
    tp_rank: int = 0
    micro_batches: int = DEFAULT_MICRO_BATCHES
    device: str = "cpu"  # where control tensors live (NCCL takes CUDA tensors only)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def prev_rank(self) -> int:
        return (self.stage - 1) * self.tp_size + self.tp_rank

    @property
    def next_rank(self) -> int:
        return (self.stage + 1) * self.tp_size + self.tp_rank

    @property
    def sends_output(self) -> bool:
        """The rank that hands the step's ModelOutput to global rank 0."""
        return self.last and self.tp_rank == 0

    @property
    def needs_embedding(self) -> bool:
        return self.first

    def holds(self, name: str, tied: bool) -> bool:
        """Whether this stage reads checkpoint tensor `name`."""
        if name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            return self.start <= i < self.stop
        if name == "model.embed_tokens.weight":
            return self.first or (self.last and tied)
        if name == "lm_head.weight":
            return self.last
        return True  # the final norm: a few bytes, kept everywhere

    def min_int(self, n: int) -> int:
        """The smallest n over every rank of every stage (one block table for all)."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def make_stage(
    cfg: ModelConfig, rank: int, pp_size: int, tp_size: int, micro_batches: int, device: str
) -> PPStage:
    stage, tp_rank = divmod(rank, tp_size)
    start, stop = layer_split(cfg.num_layers, pp_size)[stage]
    return PPStage(stage, pp_size, start, stop, tp_size, tp_rank, micro_batches, device)


def split_rows(
    dec: DecodeColumns, scheduled: list[ScheduledRequest], parts: int
) -> list[tuple[DecodeColumns, list[ScheduledRequest]]]:
    """Contiguous micro-batches of about equal token counts over the step's rows in
    scheduling order (the decode columns, then `scheduled` as it comes)."""
    ordered = scheduled
    nd = len(dec.req_ids)
    weights = [1] * nd + [len(r.input_ids) for r in ordered]
    parts = max(1, min(parts, len(weights)))
    total = sum(weights)
    bounds, acc = [0], 0
    for i, w in enumerate(weights):
        cuts_left = parts - len(bounds)
        if cuts_left > 0 and i > bounds[-1]:
            # Cut before row i where that lands nearer the next share than after it, or
            # where every row left must open a part of its own.
            target = total * len(bounds) / parts
            nearer = acc + w > target and target - acc <= acc + w - target
            if nearer or len(weights) - i <= cuts_left:
                bounds.append(i)
        acc += w
    bounds.append(len(weights))
    out = []
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        d = dec.select(list(range(a, min(b, nd)))) if a < nd else dec.select([])
        s = ordered[max(a, nd) - nd : max(b, nd) - nd]
        out.append((d, s))
    return out


def run_pipeline(
    runner: Any,  # gpu.model_runner.ModelRunner (which imports this module)
    pp: PPStage,
    dec: DecodeColumns,
    scheduled: list[ScheduledRequest],
    errors: dict[str, str],
    grammar_bitmasks: dict[str, bytes] | None,
    save_kv_blocks: list[int],
    out: ModelOutput,
) -> ModelOutput:
    """This stage's part of one step (every step, even one without rows: rank 0 always
    waits for the last stage's output).  Returns the step's ModelOutput on the last stage
    and on global rank 0 (received from the last stage); other ranks return `out`."""
    model = runner.model
    hidden_size = runner.config.hidden_size
    sends: list[Any] = []
    sampled: list[torch.Tensor] = []
    states, ids = [], []
    # The last stage's verify chunks (n-gram drafts): their rows' hidden states, and each
    # chunk with its first row's place among them.
    verify_h: list[torch.Tensor] = []
    verify: list[tuple[ScheduledRequest, int]] = []
    at = 0
    for d, s in split_rows(dec, scheduled, pp.micro_batches):
        inputs = runner._prepare(s, errors, d)
        t = inputs.meta.num_tokens
        if pp.first:
            x = model.embed_input(inputs.input_ids)
        else:
            x = torch.empty(t, hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(x, src=pp.prev_rank)
        keep = inputs.keep if pp.last else None
        if runner.lora is not None and runner._lora_rows(d, inputs.ordered):
            keep = None  # the last layer's cut assumes one weight for every row
        h = model.forward_layers(x, inputs.positions, runner.kv_caches, inputs.meta, keep)
        if runner.lora is not None:
            runner.lora.clear()
        if not pp.last:
            h = h.contiguous()
            sends.append((dist.isend(h, dst=pp.next_rank), h))
            continue
        samples = inputs.samples
        if keep is not None and h.shape[0] != t:
            samples = samples.among(keep)
        for pr in inputs.prompt_rows:
            out.prompt_logprobs[pr.req_id] = runner._prompt_logprobs(h, pr)
        runner._feed_pools(h, inputs.pool_rows)
        if samples.states:
            sampled.append(samples.hidden(h))
            states += samples.states
            ids += samples.ids
        for sr, row in inputs.verify:
            verify_h.append(h[row : row + sr.num_draft + 1])
            verify.append((sr, at))
            at += sr.num_draft + 1
    for handle, _tensor in sends:
        handle.wait()
    if save_kv_blocks:
        _save_kv(runner, pp, save_kv_blocks, out)
    if pp.last:
        if states:
            rows = SampleRows.of(list(range(len(states))), states, ids, runner.device)
            argmax_only = not grammar_bitmasks and all(st.plain_greedy for st in states)
            hidden = torch.cat(sampled)
            logits = model.compute_logits(hidden, float32=not argmax_only)
            if grammar_bitmasks:
                runner._apply_grammar(logits, ids, grammar_bitmasks)
            runner._sample(logits, rows, out)
            runner._pool(hidden, ids, out)
        if verify:
            assert runner.spec is not None, "draft tokens sent to a runner without speculation"
            runner.spec.verify(runner, torch.cat(verify_h), verify, out, grammar_bitmasks)
        if pp.sends_output:
            send_output(out, pp.device)
        return out
    if pp.first and pp.tp_rank == 0:
        return recv_output((pp.size - 1) * pp.tp_size, pp.device)
    return out


def _save_kv(runner: Any, pp: PPStage, blocks: list[int], out: ModelOutput) -> None:
    """Prefix-tier payloads keep the PP=1 layout (every layer, in order), so replicas of
    any pipeline size share one namespace: each stage reads its layers' bytes (with every
    tensor rank's heads) and the last stage puts the stages' parts together."""
    part = runner.read_kv_bytes(blocks)  # [n, this stage's layers' bytes]; all TP ranks
    if pp.tp_rank != 0:
        return
    last = (pp.size - 1) * pp.tp_size
    if not pp.last:
        dist.send(part.to(pp.device), dst=last)
        return
    per_layer = runner.kv_payload_bytes // runner.config.num_layers
    parts = []
    for stage, (lo, hi) in enumerate(layer_split(runner.config.num_layers, pp.size)[:-1]):
        buf = torch.empty(len(blocks), per_layer * (hi - lo), dtype=torch.uint8, device=pp.device)
        dist.recv(buf, src=stage * pp.tp_size)
        parts.append(buf.cpu())
    out.saved_kv = kv_payloads(blocks, torch.cat([*parts, part], dim=1))


def kv_payloads(blocks: list[int], data: torch.Tensor) -> list[KVBlockPayload]:
    """[n, payload bytes] uint8 on the host -> one payload per block."""
    return [
        KVBlockPayload(block_id=b, data=data[i].numpy().tobytes()) for i, b in enumerate(blocks)
    ]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ModelOutput).decode


def send_output(out: ModelOutput, device: str) -> None:
    """The step's result to global rank 0 (its length first: the receiver sizes its
    buffer from it)."""
    data = torch.frombuffer(bytearray(_encode(out)), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst=0)
    dist.send(data, dst=0)


def recv_output(src: int, device: str) -> ModelOutput:
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src=src)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    return _decode(data.cpu().numpy().tobytes())
