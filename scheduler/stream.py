"""Per-request output channel between the engine actor and one consumer.

The engine only appends and sets an event, so a slow consumer never blocks a step; what
piles up between two reads is merged into one delta per sequence.
"""

from __future__ import annotations

import asyncio

from scheduler.scheduler import RequestUpdate

# A decode token without an update object: (req_id, token).  The stream fills in the rest
# from the last full update of that sequence, which always comes first (a sequence's
# first token is never a columnar decode).
TokenOnly = tuple[str, int]


def merge_updates(
    updates: list[RequestUpdate | TokenOnly], last: dict[str, RequestUpdate] | None = None
) -> list[RequestUpdate]:
    """Fold several updates of the same sequence into one, keeping sequence order.
    `last`: each sequence's latest full update, for the token-only entries."""
    merged: dict[str, RequestUpdate] = {}
    for u in updates:
        if type(u) is tuple:
            rid, tok = u
            m = merged.get(rid)
            if m is not None:
                m.new_token_ids.append(tok)
                continue
            assert last is not None, "a token-only update needs its sequence's last update"
            b = last[rid]
            merged[rid] = RequestUpdate(
                req_id=rid,
                group_id=b.group_id,
                sample_index=b.sample_index,
                new_token_ids=[tok],
                num_prompt_tokens=b.num_prompt_tokens,
                num_cached_tokens=b.num_cached_tokens,
                first_scheduled_time=b.first_scheduled_time,
            )
            continue
        assert isinstance(u, RequestUpdate)
        m = merged.get(u.req_id)
        if m is None:
            merged[u.req_id] = RequestUpdate(
                req_id=u.req_id,
                group_id=u.group_id,
                sample_index=u.sample_index,
                new_token_ids=list(u.new_token_ids),
                logprobs=list(u.logprobs) if u.logprobs is not None else None,
                finish_reason=u.finish_reason,
                stop_token_id=u.stop_token_id,
                num_prompt_tokens=u.num_prompt_tokens,
                num_cached_tokens=u.num_cached_tokens,
                error=u.error,
                client_error=u.client_error,
                first_scheduled_time=u.first_scheduled_time,
                prompt_logprobs=u.prompt_logprobs,
                embedding=u.embedding,
                prediction_tokens=u.prediction_tokens,
            )
            continue
        m.new_token_ids += u.new_token_ids
        if u.logprobs is not None:
            m.logprobs = (m.logprobs or []) + list(u.logprobs)
        m.finish_reason = u.finish_reason or m.finish_reason
        m.stop_token_id = u.stop_token_id if u.stop_token_id is not None else m.stop_token_id
        m.error = u.error or m.error
        m.client_error = m.client_error or u.client_error
        m.prompt_logprobs = m.prompt_logprobs or u.prompt_logprobs
        m.embedding = m.embedding or u.embedding
        m.prediction_tokens = u.prediction_tokens or m.prediction_tokens
    return list(merged.values())


class RequestStream:
    def __init__(self, group_id: str, n: int = 1, wake_on_tokens: bool = True) -> None:
        self.group_id = group_id
        self.n = n
        # False: a decode token does not wake the consumer, only full updates (first
        # token, finish, logprobs) and failures do; the tokens wait in _pending.  For
        # consumers that want the final output only (LLM.generate): waking every consumer
        # every step kept the loop thread busy while the next step waited.
        self.wake_on_tokens = wake_on_tokens
        self._pending: list[RequestUpdate | TokenOnly] = []
        self._last: dict[str, RequestUpdate] = {}  # each sequence's latest full update
        # The consumer's wake-up: a bare future made only while it waits (an Event costs a
        # coroutine, a future and its waiter list per wait, and this is one per stream
        # per step).
        self._waiter: asyncio.Future[None] | None = None
        self._live = n  # sequences not finished yet (as the consumer has been told)
        # Sequences not finished yet as the engine counts them: with the engine on its own
        # thread (EngineCore own_thread) the consumer's side learns of a finish a moment
        # later; the engine never reads _live.
        self.engine_live = n
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._live == 0 or self.error is not None

    def put(self, updates: list[RequestUpdate]) -> None:
        """Engine side: never blocks."""
        self._pending.extend(updates)
        for u in updates:
            self._last[u.req_id] = u
            if u.finish_reason is not None:
                self._live -= 1
        self._wake()

    def put_token(self, req_id: str, tok: int) -> None:
        """Engine side: one decode token of a sequence that goes on."""
        self._pending.append((req_id, tok))
        if self.wake_on_tokens:
            self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Consumer side: until something is pending.  Raises the engine's error if the
        engine died."""
        while not self._pending:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self) -> list[RequestUpdate]:
        """Consumer side: everything since the last call, one merged update per sequence.
        Raises the engine's error if the engine died."""
        if not self._pending:
            await self.wait()
        return self.take()

    def take(self) -> list[RequestUpdate]:
        """What `get` returns, once something is pending."""
        pending, self._pending = self._pending, []
        return merge_updates(pending, self._last)

    def take_tokens(self) -> list[int] | None:
        """Consumer side, a stream of one sequence: the pending decode tokens when that is
        all that is pending (most steps), taken without an update object; None (nothing
        taken) when a full update is among them."""
        toks = []
        for u in self._pending:
            if type(u) is not tuple:
                return None
            toks.append(u[1])
        self._pending = []
        return toks
