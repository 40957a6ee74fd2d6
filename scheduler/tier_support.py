"""What the scheduler does for the shared (Redis) prefix tier: which prompt blocks to ask
it for, parking a request while it answers, and which blocks to read out for it to
publish.  A part of `Scheduler` (scheduler/scheduler.py), kept apart as one concern."""

from __future__ import annotations

from typing import Any, Protocol

from scheduler.block_pool import BlockHash
from scheduler.contract import ModelOutput, SchedulerOutput
from scheduler.fair_queue import FairQueue
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus


class PublishPolicy(Protocol):
    """What the scheduler asks of the shared prefix tier (see scheduler.prefix_tier)."""

    cfg: Any  # .hit_threshold

    def should_publish(self, h: BlockHash) -> bool: ...


class PrefixTierSupport:
    """Mixed into Scheduler, whose state (config, kv, waiting, step_id) it reads."""

    config: Any  # SchedulerConfig
    block_size: int
    kv: KVCacheManager
    waiting: FairQueue
    step_id: int

    def _init_tier(self, tier: PublishPolicy | None) -> None:
        # Requests parked while the tier is asked for their prompt's KV, blocks to read
        # out for publication (with the tenant whose share each counts against), and what
        # each step's read-outs were.
        self.tier = tier
        self.remote_pending: dict[str, Request] = {}
        self.prefix_hits_remote = 0
        self._to_save: dict[BlockHash, str | None] = {}
        self._saving: dict[int, dict[int, tuple[BlockHash, str | None]]] = {}

    def remote_lookup_plan(self, req: Request) -> tuple[int, list[BlockHash]] | None:
        """(first block index, hashes) of the prompt blocks worth asking the shared tier
        for: those past the local hits, leaving the last token to compute."""
        if (
            not self.config.enable_prefix_caching
            or req.num_computed_tokens
            or req.params.reads_every_position
        ):
            return None
        bs = self.block_size
        req.update_block_hashes(bs)
        max_blocks = (req.num_tokens - 1) // bs
        local = len(self.kv.get_computed_blocks(req))
        if local >= max_blocks:
            return None
        return local, req.block_hashes[local:max_blocks]

    def park_for_remote(self, req: Request) -> None:
        """Hold a queued request out of admission while the tier is asked."""
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE
        self.remote_pending[req.req_id] = req

    def remote_lookup_done(self, req_id: str, start: int, payloads: list[bytes]) -> None:
        req = self.remote_pending.pop(req_id, None)
        if req is None:
            return  # aborted meanwhile
        req.remote_start, req.remote_payloads = start, payloads
        req.status = RequestStatus.WAITING
        self.waiting.append(req)  # its tenant's line keeps arrival order

    def _note_hits(self, req: Request, hits: list) -> None:
        tier = self.tier
        if tier is None:
            return
        threshold = tier.cfg.hit_threshold
        for b in hits:
            b.hits += 1
            if (b.hits >= threshold or req.publish_prefix) and tier.should_publish(b.block_hash):
                self._to_save.setdefault(b.block_hash, req.tenant)

    def _note_registration(self, req: Request, end: int) -> None:
        """A registered prefix: publish every prompt block full once this step has run."""
        bs = self.block_size
        req.update_block_hashes(bs)
        tier = self.tier
        for h in req.block_hashes[: min(end, req.prompt_len) // bs]:
            if tier is not None and tier.should_publish(h):
                self._to_save.setdefault(h, req.tenant)

    def take_saved(
        self, so: SchedulerOutput, mo: ModelOutput
    ) -> list[tuple[BlockHash, bytes, str | None]]:
        """(block hash, payload, tenant) read out in a step, for the tier to publish."""
        mapping = self._saving.pop(so.step, {})
        out = []
        for p in mo.saved_kv:
            entry = mapping.get(p.block_id)
            if entry is not None:
                out.append((entry[0], p.data, entry[1]))
        return out

    def _blocks_to_save(self) -> list[int]:
        """The blocks this step reads out for publication (the step's id is set)."""
        if not self._to_save:
            return []
        save: dict[int, tuple[BlockHash, str | None]] = {}
        # Looked up now, after every allocation of this step: a block still cached under
        # its hash holds exactly that prefix's KV once the forward has run.
        for h, tenant in self._to_save.items():
            b = self.kv.pool.lookup(h)
            if b is not None:
                save[b.block_id] = (h, tenant)
        self._to_save.clear()
        self._saving[self.step_id] = save
        return list(save)
