"""Conversation KV pinning: the blocks of a conversation's last turn are kept in preference
to other cached blocks, so its next turn (seconds later, prompt = this turn's prompt and
answer + a new message) hits them even after a burst of other traffic went through.

A pin is keyed by conversation (the service makes the key from the API key's tenant and
the client's `conversation_id` / `session_id`, or a WebSocket's session, so one key can
neither pin nor release another's).  Pinned blocks that are free wait in the pool's
pinned queue (scheduler/block_pool.py): evicted only once no unpinned free block is left.
A pin ends when the next turn of the same conversation ends (it is replaced), after
`ttl` seconds, when released (a WebSocket closed), or when the cap needs room: at most
`max_blocks` distinct blocks are pinned, and a new pin pushes out the oldest ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler.block_pool import Block, BlockHash, BlockPool
from scheduler.request import Request, RequestStatus

# Conversation keys remembered to tell a follow-up turn from a first one (for the
# turn-2 hit-rate metrics); bounded, oldest forgotten.
_SEEN = 65536


@dataclass
class PinStats:
    pinned_blocks: int = 0
    conversations: int = 0
    # Turns of a conversation seen before, their prompt tokens and how many were cached.
    followup_turns: int = 0
    followup_hit_turns: int = 0
    followup_prompt_tokens: int = 0
    followup_cached_tokens: int = 0
    evicted_blocks: int = 0  # pinned blocks evicted anyway (no unpinned block was left)
    expired: int = 0  # pins that reached the session TTL


@dataclass
class _Pin:
    blocks: list[Block]
    expires: float


@dataclass
class ConversationPins:
    pool: BlockPool
    max_blocks: int
    ttl: float
    clock: Callable[[], float] = time.monotonic
    convs: OrderedDict[str, _Pin] = field(default_factory=OrderedDict)  # oldest first
    owners: dict[int, list[str]] = field(default_factory=dict)  # block id -> keys
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    stats: PinStats = field(default_factory=PinStats)

    def __post_init__(self) -> None:
        self.pool.on_pinned_evict = self._evicted

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0 and self.ttl > 0

    def pin(self, key: str, blocks: list[Block]) -> list[Block]:
        """Pin a turn's leading `blocks` (computed and cached) for conversation `key`,
        replacing its previous pin; returns what was pinned (a leading run: a prefix hit
        needs the chain from the start, so past the cap the tail is left out)."""
        self.unpin(key)
        if not self.enabled:
            return []
        pool = self.pool
        taken: list[Block] = []
        for b in blocks:
            if not b.pins:
                while pool.num_pinned >= self.max_blocks and self.convs:
                    self.unpin(next(iter(self.convs)))
                if pool.num_pinned >= self.max_blocks:
                    break
            pool.pin(b)
            taken.append(b)
            self.owners.setdefault(b.block_id, []).append(key)
        if taken:
            self.convs[key] = _Pin(taken, self.clock() + self.ttl)
        return taken

    def unpin(self, key: str) -> None:
        pin = self.convs.pop(key, None)
        if pin is None:
            return
        for b in pin.blocks:
            self._disown(b, key)
            self.pool.unpin(b)

    def _disown(self, b: Block, key: str) -> None:
        keys = self.owners[b.block_id]
        keys.remove(key)
        if not keys:
            del self.owners[b.block_id]

    def expire(self) -> None:
        """Drop the pins past their TTL (pinned in order, one TTL: the oldest first)."""
        if not self.convs:
            return
        now = self.clock()
        while self.convs:
            key, pin = next(iter(self.convs.items()))
            if pin.expires > now:
                return
            self.stats.expired += 1
            self.unpin(key)

    def _evicted(self, b: Block) -> None:
        """The pool handed a pinned block out (its pins are already dropped): each
        conversation that held it keeps only the blocks before it, the rest of its chain
        being unreachable by a prefix hit."""
        self.stats.evicted_blocks += 1
        for key in self.owners.pop(b.block_id, []):
            pin = self.convs[key]
            i = pin.blocks.index(b)
            rest = pin.blocks[i + 1 :]
            del pin.blocks[i:]
            for other in rest:
                self._disown(other, key)
                self.pool.unpin(other)
            if not pin.blocks:
                del self.convs[key]

    def note_turn(self, key: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a finished turn: a follow-up when its conversation was seen before."""
        st = self.stats
        if key in self.seen:
            self.seen.move_to_end(key)
            st.followup_turns += 1
            st.followup_hit_turns += cached_tokens > 0
            st.followup_prompt_tokens += prompt_tokens
            st.followup_cached_tokens += cached_tokens
            return
        self.seen[key] = None
        if len(self.seen) > _SEEN:
            self.seen.popitem(last=False)

    def snapshot(self) -> PinStats:
        self.expire()
        self.stats.pinned_blocks = self.pool.num_pinned
        self.stats.conversations = len(self.convs)
        return PinStats(**vars(self.stats))


class ConversationSupport:
    """Mixed into Scheduler: a conversation's turn, as it ends, pins its blocks (and,
    with the shared tier on, queues them for publication so the next turn hits on any
    replica)."""

    kv: Any  # KVCacheManager
    tier: Any  # PublishPolicy | None
    _to_save: dict[BlockHash, str | None]

    def _end_turn(self, req: Request, status: RequestStatus) -> None:
        """Before `req` frees its blocks: pin them for its conversation.  A failed turn's
        KV may never have been written, so it pins nothing (its old pin stays); one
        sample of n stands for the turn, as the conversation goes on with one answer."""
        key = req.conversation
        if key is None or req.sample_index or status == RequestStatus.FINISHED_ERROR:
            return
        pins: ConversationPins = self.kv.pins
        pins.note_turn(key, req.prompt_len, req.num_cached_tokens)
        blocks = self.kv.blocks_of(req.req_id)[: self.kv.num_cached_blocks.get(req.req_id, 0)]
        pinned = pins.pin(key, blocks)
        tier = self.tier
        if tier is None:
            return
        for b in pinned:
            h = b.block_hash
            if h is not None and tier.should_publish(h):
                self._to_save.setdefault(h, req.tenant)
