"""A model runner whose "KV cache" holds token ids, for testing the scheduler without torch.

Each step it writes the fed tokens into their slots, and a sampling request's next token
is a hash of the context it reads back *through its block table*.  A wrong block table,
slot, copy-on-write or prefix hit therefore changes the output, and the expected output
is simply the same hash applied to the true token sequence.
"""

from __future__ import annotations

import hashlib
import struct

from scheduler.contract import (
    ModelOutput,
    SchedulerOutput,
    apply_block_delta,
    apply_decode_deltas,
)


def next_token(context: list[int], sample_index: int, vocab: int) -> int:
    h = hashlib.blake2b(struct.pack(f"<{len(context)}q", *context), digest_size=8)
    h.update(bytes([sample_index]))
    return int.from_bytes(h.digest(), "little") % vocab


def reference_generate(
    prompt: list[int], max_tokens: int, vocab: int, eos: int | None, sample_index: int = 0
) -> list[int]:
    toks = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(toks, sample_index, vocab)
        toks.append(t)
        out.append(t)
        if t == eos:
            break
    return out


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 1000) -> None:
        self.bs = block_size
        self.vocab = vocab
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.known: dict[str, int] = {}  # req_id -> sample_index
        self.tables: dict[str, list[int]] = {}  # kept across steps, as the real runner does
        self.steps = 0
        self.tokens_computed = 0

    def execute_model(self, so: SchedulerOutput) -> ModelOutput:
        self.steps += 1
        for rid in so.finished_req_ids:
            self.known.pop(rid)
            self.tables.pop(rid, None)
        for new in so.new_requests:
            assert new.req_id not in self.known, f"{new.req_id} registered twice"
            self.known[new.req_id] = new.sample_index
        bs = self.bs
        for src, dst in so.copy_blocks:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        # Write every request's tokens first (as a real backend writes K/V before attention),
        # the decode columns' first.
        d = so.decodes
        assert not apply_decode_deltas(self.tables, d, bs), "a decode row cannot run"
        for rid, tok, p in zip(d.req_ids, d.token_ids, d.positions, strict=True):
            assert rid in self.known, f"{rid} decoded before registration"
            table = self.tables[rid]
            self.slots[table[p // bs] * bs + p % bs] = tok
            self.tokens_computed += 1
        for r in so.scheduled:
            assert r.req_id in self.known, f"{r.req_id} scheduled before registration"
            assert len(r.draft_ids) == r.num_draft  # the scheduler proposes (n-gram)
            table = apply_block_delta(self.tables, r)
            assert table is not None, f"{r.req_id}: delta on a table the runner lacks"
            assert len(table) * bs >= r.start_pos + len(r.input_ids) + r.num_draft
            for j, tok in enumerate(r.input_ids + r.draft_ids):
                p = r.start_pos + j
                self.slots[table[p // bs] * bs + p % bs] = tok
            self.tokens_computed += len(r.input_ids) + r.num_draft
        out = ModelOutput(req_ids=[], sampled_token_ids=[])
        for rid, p in zip(d.req_ids, d.positions, strict=True):
            out.req_ids.append(rid)
            out.sampled_token_ids.append(self._next(rid, p + 1))
        for r in so.scheduled:
            if not r.sample:
                continue
            end = r.start_pos + len(r.input_ids)
            table = self.tables[r.req_id]
            ctx = [self.slots[table[p // bs] * bs + p % bs] for p in range(end)]
            assert None not in ctx, f"{r.req_id} read an unwritten slot"
            if r.num_draft:
                # Verify: accept drafts while they equal the "model's" next token.
                accepted: list[int] = []
                nxt = next_token(ctx, self.known[r.req_id], self.vocab)
                for d in r.draft_ids:
                    if d != nxt:
                        break
                    accepted.append(d)
                    ctx.append(d)
                    nxt = next_token(ctx, self.known[r.req_id], self.vocab)
                out.spec_accepted[r.req_id] = accepted
                out.req_ids.append(r.req_id)
                out.sampled_token_ids.append(nxt)
                continue
            for rid in (r.req_id, *r.fork_ids):
                out.req_ids.append(rid)
                out.sampled_token_ids.append(next_token(ctx, self.known[rid], self.vocab))  # type: ignore[arg-type]
        return out

    def _next(self, rid: str, end: int) -> int:
        """The "model's" token after positions [0, end) of `rid`, read through its table."""
        bs, table = self.bs, self.tables[rid]
        ctx = [self.slots[table[p // bs] * bs + p % bs] for p in range(end)]
        assert None not in ctx, f"{rid} read an unwritten slot"
        return next_token(ctx, self.known[rid], self.vocab)  # type: ignore[arg-type]
