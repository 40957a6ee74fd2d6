"""Per-request block tables on top of the block pool: prefix hits, slot allocation,
copy-on-write and forks."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.block_pool import Block, BlockEvent, BlockPool, hash_block
from scheduler.contract import DecodeColumns
from scheduler.pins import ConversationPins
from scheduler.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        on_event: Callable[[BlockEvent], None] | None = None,
        max_pinned_blocks: int = 0,
        session_ttl: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, on_event)
        # Pins mean nothing without the prefix cache: a next turn could not hit them.
        self.pins = ConversationPins(
            self.pool, max_pinned_blocks if enable_prefix_caching else 0, session_ttl
        )
        self.req_blocks: dict[str, list[Block]] = {}
        # The same tables as plain ids, kept in step so a step copies them with list().
        self.req_block_ids: dict[str, list[int]] = {}
        # How many leading entries of each request's table the runner already holds as
        # they are now (sent in an earlier step): a step sends only the entries after them.
        self.num_synced_blocks: dict[str, int] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ---------------------------------------------------------------- look-up
    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Longest chain of locally cached full blocks for a request with nothing computed.

        At least the last token is always left to compute: its logits are what we sample.
        """
        assert req.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        req.update_block_hashes(bs)
        hits: list[Block] = []
        for h in req.block_hashes[: (req.num_tokens - 1) // bs]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def blocks_of(self, req_id: str) -> list[Block]:
        return self.req_blocks.get(req_id, [])

    def block_ids(self, req_id: str) -> list[int]:
        return self.req_block_ids.get(req_id, [])

    def take_table_delta(self, req_id: str) -> tuple[int, list[int]]:
        """(entries the runner keeps, entries to send after them) of a request's table,
        for the step being built; from then on the runner holds the whole table."""
        ids = self.req_block_ids[req_id]
        kept = self.num_synced_blocks.get(req_id, 0)
        self.num_synced_blocks[req_id] = len(ids)
        return kept, ids[kept:]

    def _unsync(self, req_id: str, index: int) -> None:
        """Entry `index` of a request's table changed or went: resend from there on."""
        synced = self.num_synced_blocks.get(req_id, 0)
        if index < synced:
            self.num_synced_blocks[req_id] = index

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        copies: list[tuple[int, int]],
        new_computed_blocks: list[Block] | None = None,
        num_external_tokens: int = 0,
    ) -> list[Block] | None:
        """Give `req` slots for `num_new_tokens` tokens after its computed ones.

        `new_computed_blocks` are local prefix hits taken on admission;
        `num_external_tokens` (whole blocks) follow them and are filled by loading KV from
        the shared tier, so they need fresh blocks but no compute.  On success returns the newly allocated blocks and appends to `copies` the
        (src, dst) KV copy a copy-on-write needs; on a short pool returns None and
        changes nothing.
        """
        bs = self.block_size
        blocks = self.req_blocks.get(req.req_id)
        if blocks and new_computed_blocks is None and not num_external_tokens:
            # Every running request, every step (mostly a decode inside its last block):
            # no new block and nothing shared to copy is answered without the general path.
            start = req.num_computed_tokens
            total = start + num_new_tokens
            if (
                num_new_tokens > 0
                and total <= len(blocks) * bs
                and blocks[start // bs].ref_cnt == 1
            ):
                full = min(total, len(req.token_ids)) // bs
                if full > self.num_cached_blocks.get(req.req_id, 0):
                    self._cache_full_blocks(req, blocks, total)
                return []
        hits = new_computed_blocks or []
        if blocks is None:
            blocks = []
        num_computed = req.num_computed_tokens + len(hits) * bs + num_external_tokens
        total = num_computed + num_new_tokens
        need = -(-total // bs) - len(blocks) - len(hits)
        # A fork shares its parent's partial last block; whoever writes it first while
        # it is shared gets a private copy.
        first = num_computed // bs
        cow = num_new_tokens > 0 and first < len(blocks) and blocks[first].ref_cnt > 1
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        if max(need, 0) + cow + revived > self.pool.num_free:
            return None
        ids = self.req_block_ids.setdefault(req.req_id, [])
        self.pool.touch(hits)
        fresh = self.pool.allocate(need) if need > 0 else []
        assert fresh is not None
        for b in (*hits, *fresh):
            blocks.append(b)
            ids.append(b.block_id)
        if cow:  # rare (forks only): out of line costs the common paths nothing
            self._copy_on_write(req.req_id, blocks, ids, first, copies)
        self.req_blocks[req.req_id] = blocks
        self._cache_full_blocks(req, blocks, total)
        return fresh

    def grow_decode_edges(
        self, reqs: list[Request], positions: list[int], edge: list[int], cols: DecodeColumns
    ) -> bool:
        """The block-edge work of a step's columnar decodes (scheduler/columnar.py), in
        bulk: a block for each row whose position `p` starts one it lacks (all or none:
        False, and nothing changed, when the pool is short) with its table delta in
        `cols`, and the prefix-cache entry of each block a row fills.  At a thousand long
        decodes this is an eighth of the rows every step, so it is one allocation and
        one pass rather than a call per row."""
        bs = self.block_size
        tables, id_tables = self.req_blocks, self.req_block_ids
        starts = [i for i in edge if positions[i] % bs == 0]
        need = [i for i in starts if len(tables[reqs[i].req_id]) * bs <= positions[i]]
        if need:
            fresh = self.pool.allocate(len(need))
            if fresh is None:
                return False
            for i, b in zip(need, fresh, strict=True):
                rid = reqs[i].req_id
                tables[rid].append(b)
                id_tables[rid].append(b.block_id)
                kept, new = self.take_table_delta(rid)
                cols.delta_rows.append(i)
                cols.delta_kept.append(kept)
                cols.delta_blocks.append(new)
        fills = [i for i in edge if (positions[i] + 1) % bs == 0]
        if fills and self.enable_prefix_caching:
            cached, pool = self.num_cached_blocks, self.pool
            for i in fills:
                pos, req = positions[i], reqs[i]
                blk, rid, hashes = pos // bs, req.req_id, req.block_hashes
                if cached.get(rid, 0) == blk == len(hashes):
                    # The usual case, one block filled after a chain kept up to date:
                    # hashed and cached here without the general loop.
                    parent = hashes[-1] if blk else None
                    h = hash_block(parent, req.token_ids[blk * bs : pos + 1], req.cache_salt)
                    hashes.append(h)
                    pool.cache(tables[rid][blk], h, parent)
                    cached[rid] = blk + 1
                else:
                    self._cache_full_blocks(req, tables[rid], pos + 1)
        return True

    def _copy_on_write(
        self,
        req_id: str,
        blocks: list[Block],
        ids: list[int],
        index: int,
        copies: list[tuple[int, int]],
    ) -> None:
        """Give the request a private copy of its shared block `index` (its free block was
        counted by the caller) and queue the KV copy."""
        (copy,) = self.pool.allocate(1) or ()
        old = blocks[index]
        copies.append((old.block_id, copy.block_id))
        self.pool.free([old])
        blocks[index] = copy
        ids[index] = copy.block_id
        self._unsync(req_id, index)

    def _cache_full_blocks(self, req: Request, blocks: list[Block], num_tokens: int) -> None:
        """Register the blocks that are full once this step has run.

        Registering before the forward pass is safe: every backend writes a step's K/V
        before any attention reads, so a request that hits these blocks in the same
        step reads finished values.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_tokens, req.num_tokens) // bs
        start = self.num_cached_blocks.get(req.req_id, 0)
        if full <= start:
            return
        req.update_block_hashes(bs)
        hashes = req.block_hashes
        for i in range(start, full):
            self.pool.cache(blocks[i], hashes[i], hashes[i - 1] if i else None)
        self.num_cached_blocks[req.req_id] = full

    # ---------------------------------------------------------------- release
    def trim(self, req: Request, num_computed: int) -> None:
        """Free the tail blocks past the ones holding computed tokens (rejected drafts'
        slots).  They were never hashed: only blocks full of known tokens are."""
        blocks = self.req_blocks.get(req.req_id)
        if not blocks:
            return
        keep = -(-num_computed // self.block_size)
        if len(blocks) <= keep:
            return
        assert self.num_cached_blocks.get(req.req_id, 0) <= keep
        surplus = blocks[keep:]
        del blocks[keep:]
        del self.req_block_ids[req.req_id][keep:]
        self._unsync(req.req_id, keep)
        self.pool.free(reversed(surplus))

    def free(self, req: Request, *, drop_private: bool = False) -> None:
        """Release a request's blocks, tail first (its tail is evicted before its prefix).

        `drop_private`: the request failed, so the blocks only it held may never have
        been written; take them out of the prefix cache rather than offer them to others."""
        blocks = self.req_blocks.pop(req.req_id, None)
        if blocks and drop_private:
            for b in blocks:
                if b.ref_cnt == 1:
                    self.pool.uncache(b)
        self.req_block_ids.pop(req.req_id, None)
        self.num_synced_blocks.pop(req.req_id, None)
        self.num_cached_blocks.pop(req.req_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def fork(self, parent: Request, child: Request) -> None:
        """Share all of the parent's blocks with a child (read-only until copy-on-write)."""
        blocks = list(self.req_blocks[parent.req_id])
        self.pool.touch(blocks)
        self.req_blocks[child.req_id] = blocks
        self.req_block_ids[child.req_id] = [b.block_id for b in blocks]
        self.num_cached_blocks[child.req_id] = self.num_cached_blocks.get(parent.req_id, 0)
        child.block_hashes = list(parent.block_hashes)

    @property
    def usage(self) -> float:
        return self.pool.usage()
