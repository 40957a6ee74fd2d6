"""The step contract: one SchedulerOutput to the model runner, one ModelOutput back.

Plain Python lists only (no tensors): the scheduler stays torch-free and these objects can
cross a thread or process boundary.  Only the scheduler writes request state; the runner
caches what `NewRequestData` tells it once and drops it when the id appears in
`finished_req_ids`.

Block tables travel as deltas: the runner keeps each request's table from step to step,
and a `ScheduledRequest` carries only what changed (`num_kept_blocks`, `new_block_ids`),
so a step's size grows with the blocks it touches, not with the contexts it holds.  The
runner must apply every step it is given, in order (the engine stops on a runner error).

Plain decodes (one known token in, one sampled token out, nothing else asked: no grammar,
logprobs, fork or draft) travel column-wise in `DecodeColumns`: three flat lists, and
table deltas only for the rows that crossed a block boundary.  At a thousand running
requests a step is then a few list comprehensions on both sides rather than a thousand
objects built, encoded, decoded and walked.
"""

from __future__ import annotations

import msgspec

from scheduler.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, gc=False, kw_only=True):
    """Sent once per request lifetime, the first step it is scheduled (or forked)."""

    req_id: str
    prompt_len: int
    # Every token known when the request is registered (prompt, then any output so far,
    # as for a child forked after its parent's first sample).  Penalties read it.
    token_ids: list[int]
    sampling: SamplingParams
    # Which of the n samples of its group this is: a seeded request draws from
    # seed + sample_index, so the n samples differ yet repeat run after run.
    sample_index: int = 0


class ScheduledRequest(msgspec.Struct, gc=False, kw_only=True, array_like=True):
    """One request's work in a step.  Encoded as an array (no field names): there is one
    per running request per step, and an executor in another process gets ~18 bytes for
    a decode instead of ~110."""

    req_id: str
    input_ids: list[int]  # tokens fed this step (decode: 1, prefill chunk: many)
    start_pos: int  # position of input_ids[0]; equals num_computed_tokens before the step
    # The request's block table after this step's allocations is the runner's copy cut to
    # its first `num_kept_blocks` entries, then `new_block_ids` appended; it covers
    # positions [0, start_pos + len(input_ids) + num_draft).  0 means "the whole table is
    # here" (a request's first step, a fork's, a recompute after preemption).  Entries
    # change below the end on copy-on-write and drop off it when drafts are rolled back.
    new_block_ids: list[int]
    num_kept_blocks: int = 0
    sample: bool  # the chunk ends at the last known token: sample the next one
    # n > 1: requests forked from this one at its first sample; each draws its own token
    # from this request's logits row (the prompt's KV was computed once, here).
    fork_ids: list[str] = msgspec.field(default_factory=list)
    # Speculative decoding: `num_draft` guessed tokens follow input_ids in this step's
    # query (a verify chunk).  `draft_ids` holds them when the scheduler proposed them
    # (n-gram); when it is empty the executor's draft model fills the slots.  The
    # tokens after start_pos + len(input_ids) are only guesses: the scheduler rolls back
    # the KV of the ones the runner rejects.
    draft_ids: list[int] = msgspec.field(default_factory=list)
    num_draft: int = 0


# `ScheduledRequest.num_kept_blocks` of a row whose table did not change this step (only
# `SchedulerOutput.all_scheduled` writes it: a decode column row without a delta).
KEEP_TABLE = -1

# `DecodeColumns.token_ids` of a row whose token the previous step is still sampling (see
# DecodeColumns.prev_rows); out of any vocabulary, so a runner that got one unresolved
# refuses the row rather than feeding a wrong token.
PLACEHOLDER = -1


class DecodeColumns(msgspec.Struct, gc=False, array_like=True):
    """A step's plain decodes, column-wise (row i of each list is one request).  Each row
    feeds `token_ids[i]` at `positions[i]` and samples one token; in ModelOutput these
    rows come first, in this order.  A row's block table is the runner's copy unchanged,
    except for the rows named in `delta_rows`, whose tables are cut to `delta_kept[k]`
    entries and extended by `delta_blocks[k]` as ScheduledRequest's delta rule says."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    positions: list[int] = msgspec.field(default_factory=list)
    delta_rows: list[int] = msgspec.field(default_factory=list)
    delta_kept: list[int] = msgspec.field(default_factory=list)
    delta_blocks: list[list[int]] = msgspec.field(default_factory=list)
    # Async scheduling (scheduler/ahead.py): set when this step was scheduled while the
    # step before it ran, so its input tokens were not known yet.  token_ids then holds
    # PLACEHOLDER and row i's token is the one the previous step sampled at its output
    # row prev_rows[i]; the executor fills them in before the runner sees the step.
    prev_rows: list[int] = msgspec.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)

    def as_requests(self) -> list[ScheduledRequest]:
        """The rows as ScheduledRequests (for paths that walk requests one by one); a
        row without a delta gets num_kept_blocks=KEEP_TABLE."""
        deltas = dict(zip(self.delta_rows, zip(self.delta_kept, self.delta_blocks)))
        out = []
        for i, (rid, tok, pos) in enumerate(zip(self.req_ids, self.token_ids, self.positions)):
            kept, new = deltas.get(i, (KEEP_TABLE, []))
            out.append(
                ScheduledRequest(
                    req_id=rid,
                    input_ids=[tok],
                    start_pos=pos,
                    new_block_ids=list(new),
                    num_kept_blocks=kept,
                    sample=True,
                )
            )
        return out

    def select(self, keep: list[int]) -> DecodeColumns:
        """The rows `keep` (indices, ascending), deltas dropped: for a runner that has
        already applied them."""
        return DecodeColumns(
            req_ids=[self.req_ids[i] for i in keep],
            token_ids=[self.token_ids[i] for i in keep],
            positions=[self.positions[i] for i in keep],
        )


class KVBlockPayload(msgspec.Struct, gc=False, kw_only=True):
    """The K and V of every layer for one block, as raw bytes (Redis prefix tier)."""

    block_id: int
    data: bytes


class SchedulerOutput(msgspec.Struct, gc=False, kw_only=True):
    step: int
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]  # everything that is not a plain decode
    finished_req_ids: list[str]
    decodes: DecodeColumns = msgspec.field(default_factory=DecodeColumns)
    # (src, dst): copy a block's KV before the forward (copy-on-write of a shared block).
    copy_blocks: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # KV to write into blocks before the forward (blocks loaded from the Redis tier).
    load_kv: list[KVBlockPayload] = msgspec.field(default_factory=list)
    # Blocks to read out after the forward (full blocks published to the Redis tier).
    save_kv_blocks: list[int] = msgspec.field(default_factory=list)
    # Constrained rows sampled this step: req_id -> allowed-token bitmask (packed
    # little-endian int32 words, bit t = token t); for a verify chunk, one mask per verify
    # row (num_draft + 1), joined.  Rows not named here are unconstrained.
    grammar_bitmasks: dict[str, bytes] = msgspec.field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decodes.req_ids) + sum(
            len(r.input_ids) + r.num_draft for r in self.scheduled
        )

    @property
    def num_scheduled_requests(self) -> int:
        return len(self.decodes.req_ids) + len(self.scheduled)

    def all_scheduled(self) -> list[ScheduledRequest]:
        """Every scheduled request as a ScheduledRequest, decode columns first: for
        consumers where a step's size does not matter (tests, logs)."""
        return self.decodes.as_requests() + self.scheduled

    @property
    def is_empty(self) -> bool:
        return (
            not self.scheduled
            and not self.decodes.req_ids
            and not self.copy_blocks
            and not self.load_kv
            and not self.save_kv_blocks
        )


class TokenLogprobs(msgspec.Struct, gc=False, array_like=True):
    """Logprob of the sampled token, and the top-n alternatives (model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    # The token's rank in the whole distribution (1 = most likely), as vLLM's
    # prompt_logprobs report it; set for prompt tokens only.
    rank: int | None = None


class ModelOutput(msgspec.Struct, gc=False, kw_only=True):
    # Requests that sampled this step, in order, with their token (forked children too).
    req_ids: list[str]
    sampled_token_ids: list[int]
    # Parallel to req_ids when any request asked for logprobs; None entries otherwise.
    logprobs: list[TokenLogprobs | None] | None = None
    # Payloads of save_kv_blocks, in the same order.
    saved_kv: list[KVBlockPayload] = msgspec.field(default_factory=list)
    # Speculative decoding, per verifying request: the draft tokens accepted, in order
    # (sampled_token_ids then holds the token drawn after them), and their logprobs.
    spec_accepted: dict[str, list[int]] = msgspec.field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs | None]] = msgspec.field(default_factory=dict)
    # Set when a request failed inside the runner (e.g. a bad payload): req_id -> reason.
    errors: dict[str, str] = msgspec.field(default_factory=dict)
    # Requests that asked for prompt_logprobs: the logprob of each prompt token this
    # step's chunk predicted (the token after each fed position), in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # Embedding requests (SamplingParams.embed) that sampled this step: the final
    # (normed) hidden state of the row that sampled, in float32.
    embeddings: dict[str, list[float]] = msgspec.field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        """Tokens this step sampled for its clients: each sampling row, its accepted
        drafts; not the token an embedding's pass samples and nobody reads."""
        accepted = sum(len(a) for a in self.spec_accepted.values())
        return len(self.req_ids) - len(self.embeddings) + accepted


def child_request_id(parent_id: str, index: int) -> str:
    """Id of the index-th sample (index >= 1) of an n > 1 request; sample 0 is the parent."""
    return f"{parent_id}#{index}"


def apply_block_delta(tables: dict[str, list[int]], sr: ScheduledRequest) -> list[int] | None:
    """Bring a runner's copy of `sr`'s block table up to this step (see ScheduledRequest)
    and return it; None when the runner holds fewer entries than the step keeps (it lost
    the request's table), so the request cannot run."""
    kept = sr.num_kept_blocks
    if kept == KEEP_TABLE:
        return tables.get(sr.req_id)
    if kept == 0:
        # A copy: the runner edits its tables in place, and the step stays as sent.
        table = tables[sr.req_id] = list(sr.new_block_ids)
        return table
    table = tables.get(sr.req_id)
    if table is None or len(table) < kept:
        return None
    del table[kept:]
    table += sr.new_block_ids
    return table


def apply_decode_deltas(
    tables: dict[str, list[int]], d: DecodeColumns, block_size: int
) -> list[int]:
    """Bring a runner's copies of the decode rows' tables up to this step; returns the
    rows (ascending) that cannot run: their table is missing or shorter than the kept
    entries, or does not reach their position."""
    bad: set[int] = set()
    rids = d.req_ids
    for row, kept, new in zip(d.delta_rows, d.delta_kept, d.delta_blocks, strict=True):
        rid = rids[row]
        if kept == 0:
            tables[rid] = list(new)
            continue
        table = tables.get(rid)
        if table is None or len(table) < kept:
            bad.add(row)
            continue
        del table[kept:]
        table += new
    get = tables.get
    # One pass over every row, but only a look-up and a length each.
    short = (
        i
        for i, (rid, pos) in enumerate(zip(rids, d.positions, strict=True))
        if (t := get(rid)) is None or len(t) <= pos // block_size
    )
    return sorted(bad.union(short))
