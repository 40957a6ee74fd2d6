"""Tensor parallelism: which slice of each checkpoint tensor a rank holds, and the
collectives the sharded model needs.

Megatron-style split: q/k/v and gate/up are column-parallel (each rank computes its own
heads / its own slice of the intermediate features), o_proj and down_proj row-parallel
(each rank multiplies its slice of the input features, one all-reduce sums the partial
outputs), the embedding and lm_head vocab-parallel (each rank holds a contiguous range of
token rows).  When there are fewer KV heads than ranks, each KV head is replicated on the
ranks whose query heads read it.  Norms are replicated (Qwen3's q/k norms act per head
over head_dim, so every rank applies the same weights to its own heads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpu.config import ModelConfig, ModelLoadError


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (the default process group)."""

    rank: int
    size: int
    device: str = "cpu"  # where small control tensors live (NCCL takes CUDA tensors only)
    # The tensor-parallel subgroup under pipeline parallelism (one per stage); None is the
    # default group (every rank: tensor parallelism alone).
    group: Any = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[R, V/N] on every rank -> [R, V] on every rank (rank order = vocab order)."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_ints(self, values: list[int] | None, n: int) -> list[int]:
        """`values` (n ints, given on the group's first rank; None elsewhere) on every
        rank."""
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            assert values is not None and len(values) == n
            t.copy_(torch.tensor(values, dtype=torch.int64))
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(t, src=src, group=self.group)
        return [int(v) for v in t.tolist()]

    def broadcast_lists(self, lists: list[list[int]] | None, widths: list[int]) -> list[list[int]]:
        """`lists` (given on the group's first rank; None elsewhere) on every rank, list i
        at most widths[i] long: one broadcast, each list's length first."""
        flat = None
        if lists is not None:
            flat = []
            for values, width in zip(lists, widths, strict=True):
                flat += [len(values), *values, *[-1] * (width - len(values))]
        got = self.broadcast_ints(flat, sum(1 + w for w in widths))
        out, at = [], 0
        for width in widths:
            out.append(got[at + 1 : at + 1 + got[at]])
            at += 1 + width
        return out

    def min_int(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def init_group(
    rank: int,
    size: int,
    port: int,
    backend: str,
    timeout_s: float,
    *,
    addr: str = "127.0.0.1",
    local_rank: int | None = None,
    tp_size: int | None = None,
) -> TPGroup:
    """Join the group (rank 0 listens on addr:port, the others connect there); every
    collective after this times out after timeout_s (a dead or hung rank fails the step
    instead of hanging it).  `size` is the world: tp_size x pipeline stages; with fewer
    tensor-parallel ranks than that, each stage's tp_size ranks (stage-major) get a
    subgroup, and the TPGroup returned is this rank's."""
    device = "cpu"
    if backend == "nccl":
        local = rank if local_rank is None else local_rank
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    tp_size = size if tp_size is None else tp_size
    if tp_size == size:
        return TPGroup(rank, size, device)
    if tp_size == 1:  # pipeline stages of one rank each: no subgroup to make
        return TPGroup(0, 1, device)
    mine = None
    for stage in range(size // tp_size):  # every rank creates every group, in one order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        g = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            mine = g
    return TPGroup(rank % tp_size, tp_size, device, mine)


def check_tp_config(cfg: ModelConfig, size: int) -> None:
    """Refuse, before any process starts, a model that does not split evenly over size."""
    if size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"num_attention_heads {cfg.num_heads}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(
            f"num_key_value_heads {cfg.num_kv_heads} (needs a multiple or a divisor of the size)"
        )
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size {cfg.intermediate_size}")
    if cfg.vocab_size % size:
        problems.append(f"vocab_size {cfg.vocab_size}")
    if cfg.awq_group_size:
        problems.append("INT4 (AWQ / GPTQ) checkpoints (not supported with tensor parallelism)")
    if cfg.fp8_format:
        problems.append("FP8 checkpoints (not supported with tensor parallelism)")
    if problems:
        raise ModelLoadError(
            f"tensor_parallel_size {size} cannot split this model evenly: " + "; ".join(problems)
        )


def local_config(cfg: ModelConfig, tp: TPGroup | None, pp: Any = None) -> ModelConfig:
    """The shapes one rank's modules have: its heads, its intermediate and vocab slice,
    and under pipeline parallelism (`pp`, a gpu.pp.PPStage) its stage's layers."""
    if pp is not None:
        cfg = replace(cfg, num_layers=pp.stop - pp.start)
    if tp is None or tp.size == 1:
        return cfg
    n = tp.size
    return replace(
        cfg,
        num_heads=cfg.num_heads // n,
        num_kv_heads=max(cfg.num_kv_heads // n, 1),
        intermediate_size=cfg.intermediate_size // n,
        vocab_size=cfg.vocab_size // n,
    )


def kv_heads(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int]:
    """The KV heads [lo, hi) rank `tp.rank` holds.  Fewer KV heads than ranks: consecutive
    ranks share (replicate) one, matching the query heads each rank holds."""
    kv, n = cfg.num_kv_heads, tp.size
    if kv % n == 0:
        per = kv // n
        return tp.rank * per, (tp.rank + 1) * per
    head = tp.rank // (n // kv)
    return head, head + 1


def shard_range(name: str, cfg: ModelConfig, tp: TPGroup) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the slice of HF tensor `name` this rank reads; None = whole."""
    r, n, d = tp.rank, tp.size, cfg.head_dim
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        q = cfg.q_size // n
        return 0, r * q, (r + 1) * q
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        lo, hi = kv_heads(cfg, tp)
        return 0, lo * d, hi * d
    if name.endswith("self_attn.o_proj.weight"):
        q = cfg.q_size // n
        return 1, r * q, (r + 1) * q
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        i = cfg.intermediate_size // n
        return 0, r * i, (r + 1) * i
    if name.endswith("mlp.down_proj.weight"):
        i = cfg.intermediate_size // n
        return 1, r * i, (r + 1) * i
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        v = cfg.vocab_size // n
        return 0, r * v, (r + 1) * v
    return None


def gather_kv_heads(x: torch.Tensor, cfg: ModelConfig, tp: TPGroup) -> torch.Tensor:
    """[n, block_size, local KV heads, ...] on every rank -> every KV head once, in head
    order (a replicated head is taken from the first rank holding it).  The result is
    laid out as a TP=1 cache's, so prefix-tier payloads do not depend on the TP size."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    step = 1 if cfg.num_kv_heads % tp.size == 0 else tp.size // cfg.num_kv_heads
    return torch.cat(parts[::step], dim=2)


def vocab_parallel_embed(
    weight: torch.Tensor, input_ids: torch.Tensor, tp: TPGroup
) -> torch.Tensor:
    """Each rank embeds the ids in its vocabulary range (zeros elsewhere); the sum over
    ranks is the full lookup (exactly: every row has one non-zero term)."""
    per = weight.shape[0]
    local = input_ids - tp.rank * per
    outside = (local < 0) | (local >= per)
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    x.masked_fill_(outside[:, None], 0.0)
    return tp.all_reduce(x)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def core_sets(size: int) -> list[list[int]] | None:
    """Disjoint CPU core sets, one per rank, or None when there are fewer cores than
    ranks (then the ranks share all cores)."""
    import os

    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(cores) < size:
        return None
    per = len(cores) // size
    return [cores[i * per : (i + 1) * per] for i in range(size)]


def pin_thread(cores: list[int] | None, threads: int | None) -> None:
    """Pin the calling thread (which then starts torch's OpenMP team) to its cores."""
    import os

    if cores:
        os.sched_setaffinity(0, cores)  # 0 = the calling thread on Linux
    n = threads or (len(cores) if cores else None)
    if n:
        torch.set_num_threads(n)
