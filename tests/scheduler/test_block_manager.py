"""Property tests of the block pool and KV cache manager (hypothesis state machine).

Besides the bookkeeping invariants, the machine simulates what the GPU would hold: each
slot stores the token written to it.  Every write must land in a block owned by the
writer alone (copy-on-write happened), and every live request must read back its own
tokens through its block table.
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.block_pool import BlockEvent, BlockPool, BlockRemoved, BlockStored, hash_block
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]


class KVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 40), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.parents: dict[bytes, bytes | None] = {}
        self.kv = KVCacheManager(
            num_blocks, BS, enable_prefix_caching=caching, on_event=self._on_event
        )
        self.slots: list[int | None] = [None] * (num_blocks * BS)
        self.live: dict[str, Request] = {}
        self.ids = itertools.count()

    # ------------------------------------------------------------ helpers
    def _on_event(self, ev: BlockEvent) -> None:
        if isinstance(ev, BlockStored):
            self.parents[ev.block_hash] = ev.parent_hash
        else:
            assert ev.block_hash in self.parents
            assert isinstance(ev, BlockRemoved)

    def _write(self, req: Request, start: int, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.slots[dst * BS : (dst + 1) * BS] = self.slots[src * BS : (src + 1) * BS]
        blocks = self.kv.blocks_of(req.req_id)
        for p in range(start, req.num_tokens):
            b = blocks[p // BS]
            assert b.ref_cnt == 1, f"write into shared {b} at pos {p} of {req.req_id}"
            self.slots[b.block_id * BS + p % BS] = req.token_ids[p]
        req.num_computed_tokens = req.num_tokens

    def _new(self, tokens: list[int]) -> Request:
        return Request(f"r{next(self.ids)}", tokens, SamplingParams(), max_tokens=100)

    # ------------------------------------------------------------ rules
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=9))
    def add(self, prefix: list[int], tail: list[int]) -> None:
        req = self._new(prefix + tail)
        hits = self.kv.get_computed_blocks(req)
        copies: list[tuple[int, int]] = []
        start = len(hits) * BS
        if self.kv.allocate_slots(req, req.num_tokens - start, copies, hits) is None:
            assert req.req_id not in self.kv.req_blocks
            return
        req.num_computed_tokens = start
        self._write(req, start, copies)
        self.live[req.req_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data: st.DataObject, k: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        start = req.num_tokens
        req.token_ids += data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
        copies: list[tuple[int, int]] = []
        if self.kv.allocate_slots(req, k, copies) is None:
            # Out of blocks: preempt it, as the scheduler would.
            self.kv.free(req)
            del self.live[req.req_id]
            return
        self._write(req, start, copies)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._new(list(parent.token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.req_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)

    @rule(n=st.integers(1, 10))
    def evict(self, n: int) -> None:
        """Allocate and return blocks straight away: cached free blocks get evicted."""
        got = self.kv.pool.allocate(min(n, self.kv.pool.num_free))
        assert got is not None
        for b in got:
            assert b.block_hash is None and b.ref_cnt == 1
            self.slots[b.block_id * BS : (b.block_id + 1) * BS] = [None] * BS
        self.kv.pool.free(got)

    # ------------------------------------------------------------ invariants
    @invariant()
    def ref_counts_match_owners(self) -> None:
        pool: BlockPool = self.kv.pool
        owners: dict[int, int] = {}
        for rid, blocks in self.kv.req_blocks.items():
            assert rid in self.live
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == owners.get(b.block_id, 0)
        assert pool.num_free + len(owners) == pool.num_blocks
        assert pool.num_free == sum(1 for _ in pool.free_queue)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for req in self.live.values():
            blocks = self.kv.blocks_of(req.req_id)
            assert len(blocks) == -(-req.num_tokens // BS)
            got = [
                self.slots[blocks[p // BS].block_id * BS + p % BS] for p in range(req.num_tokens)
            ]
            assert got == req.token_ids, req.req_id

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        """A hit must return exactly the tokens hashed (parents checked by chain)."""
        for h, b in self.kv.pool.cached.items():
            assert b.block_hash == h
            content = self.slots[b.block_id * BS : (b.block_id + 1) * BS]
            assert None not in content
            # The stored event named the parent; the block's content must hash to h under it.
            assert hash_block(self.parents[h], content, None) == h

    @invariant()
    def shared_blocks_are_full_or_forked(self) -> None:
        for b in self.kv.pool.blocks:
            if b.ref_cnt > 1:
                owners = [r for r, bl in self.kv.req_blocks.items() if b in bl]
                assert len(owners) == b.ref_cnt


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase


def test_hash_is_chained_and_salted() -> None:
    a = hash_block(None, [1, 2, 3, 4], None)
    assert hash_block(None, [1, 2, 3, 4], None) == a
    assert hash_block(a, [1, 2, 3, 4], None) != a
    assert hash_block(None, [1, 2, 3, 4], "salt") != a
    assert len(a) == 16


def test_free_queue_is_lru_and_tail_first() -> None:
    kv = KVCacheManager(8, BS)
    req = Request("a", list(range(16)), SamplingParams(), max_tokens=4)
    assert kv.allocate_slots(req, 16, []) is not None
    ids = kv.block_ids("a")
    kv.free(req)
    # Freed tail-first: the last block is evicted first, the first block last.
    order = [b.block_id for b in kv.pool.free_queue]
    assert order[-4:] == list(reversed(ids))
