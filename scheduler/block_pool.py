"""Fixed-size KV blocks: ref counts, a free queue in LRU order, and the prefix-hash map.

A freed block keeps its hash and stays findable until it is handed out again ("lazy
eviction"), so a prompt seen a while ago can still hit.  Allocation pops from the head of
the free queue (least recently freed first); the hot path raises no exceptions and
returns None when the pool is short.

Blocks a conversation pinned (scheduler/pins.py) wait in a second queue once free:
allocation takes from it only when the plain free queue is empty, so pinned KV is
evicted after every unpinned cached block, and still in LRU order among itself.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes

_ROOT = b"pagestream-root"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None
) -> BlockHash:
    """Hash of one full block, chained on its parent's hash.

    Stable across processes and machines (blake2b over packed ids, not Python's salted
    hash()), so the same function keys the local cache and the Redis index.
    """
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_key:
        h.update(b"\x00salt\x00" + extra_key.encode())
    return h.digest()


class Block:
    __slots__ = ("block_hash", "block_id", "hits", "next_free", "pins", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.hits = 0  # prefix-cache hits since it was cached (hot blocks get published)
        self.pins = 0  # conversations pinning it; free with pins > 0: in the pinned queue
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeQueue:
    """Doubly linked list of free blocks; O(1) pop-left, append and removal from the middle
    (a cache hit revives a free block wherever it sits)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.size += 1

    def remove(self, b: Block) -> None:
        assert b.prev_free is not None and b.next_free is not None, "block not in free queue"
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.size -= 1

    def popleft(self) -> Block:
        b = self.head.next_free
        assert b is not None and b is not self.tail, "free queue is empty"
        self.remove(b)
        return b

    def __iter__(self):
        b = self.head.next_free
        while b is not None and b is not self.tail:
            yield b
            b = b.next_free


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash
    block_id: int


BlockEvent = BlockStored | BlockRemoved


class BlockPool:
    """All KV blocks of one engine."""

    def __init__(self, num_blocks: int, on_event: Callable[[BlockEvent], None] | None = None):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.pinned_queue = FreeQueue(())
        self.cached: dict[BlockHash, Block] = {}
        self.on_event = on_event
        # Told when a pinned block is evicted after all (the pool ran out of unpinned
        # ones), so the pins forget it.
        self.on_pinned_evict: Callable[[Block], None] | None = None
        self.num_pinned = 0  # blocks with pins > 0, free or in use

    @property
    def num_free(self) -> int:
        return self.free_queue.size + self.pinned_queue.size

    @property
    def num_used(self) -> int:
        """Blocks held by live requests (cached-but-free blocks are free)."""
        return self.num_blocks - self.free_queue.size

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks (ref 1), evicting cached ones lazily; None if fewer are free."""
        free = self.free_queue
        if n > free.size:
            if n > free.size + self.pinned_queue.size:
                return None
            return self._allocate_into_pinned(n)
        out = []
        for _ in range(n):
            b = free.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _allocate_into_pinned(self, n: int) -> list[Block]:
        """n blocks when the plain free queue is short: all of it, then the least
        recently freed pinned blocks, whose pins are dropped."""
        out = []
        for _ in range(n):
            q = self.free_queue if self.free_queue.size else self.pinned_queue
            b = q.popleft()
            if b.pins:
                self._drop_pins(b)
                if self.on_pinned_evict is not None:
                    self.on_pinned_evict(b)
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _drop_pins(self, b: Block) -> None:
        b.pins = 0
        self.num_pinned -= 1

    def pin(self, b: Block) -> None:
        """One more conversation prefers to keep this block."""
        b.pins += 1
        if b.pins == 1:
            self.num_pinned += 1
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.pinned_queue.append(b)

    def unpin(self, b: Block) -> None:
        """One conversation less pins it; with none left, a free block goes back to the
        plain free queue (at its tail: it was used no longer ago than its pin)."""
        assert b.pins > 0, f"unpin of an unpinned {b}"
        b.pins -= 1
        if b.pins == 0:
            self.num_pinned -= 1
            if b.ref_cnt == 0:
                self.pinned_queue.remove(b)
                self.free_queue.append(b)

    def _evict(self, b: Block) -> None:
        h = b.block_hash
        assert h is not None
        if self.cached.get(h) is b:
            del self.cached[h]
            if self.on_event:
                self.on_event(BlockRemoved(h, b.block_id))
        b.block_hash = None
        b.hits = 0

    def lookup(self, h: BlockHash) -> Block | None:
        return self.cached.get(h)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on (cached) blocks, reviving free ones."""
        for b in blocks:
            if b.ref_cnt == 0:
                (self.pinned_queue if b.pins else self.free_queue).remove(b)
            b.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (callers pass a
        request's blocks tail-first, so its tail is evicted before its shared prefix)."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (self.pinned_queue if b.pins else self.free_queue).append(b)

    def uncache(self, b: Block) -> None:
        """Forget a block's hash (its KV cannot be trusted, e.g. its request failed)."""
        if b.block_hash is not None:
            self._evict(b)

    def cache(self, b: Block, h: BlockHash, parent: BlockHash | None) -> None:
        """Register a full, computed block under its hash (first one wins)."""
        if b.block_hash is not None:
            return
        if h in self.cached:
            return  # an identical block is already cached; this one stays private
        b.block_hash = h
        self.cached[h] = b
        if self.on_event:
            self.on_event(BlockStored(h, parent, b.block_id))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use)."""
        if self.num_used:
            return False
        for b in list(self.pinned_queue):
            self.pinned_queue.remove(b)
            self._drop_pins(b)
            if self.on_pinned_evict is not None:
                self.on_pinned_evict(b)
            self.free_queue.append(b)
        for b in list(self.cached.values()):
            self._evict(b)
        return True
