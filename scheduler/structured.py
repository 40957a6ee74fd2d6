"""What the scheduler asks of a grammar matcher (constrained decoding).

The scheduler owns each constrained request's matcher, as it owns the request's tokens:
it asks for the next token bitmask when it schedules a sampling step, ships the mask in
the step (the runner applies it to that row's logits), and advances the matcher with the
token it accepts in `update_from_output`.  The grammar library itself stays behind this
protocol (service/structured.py adapts llguidance), so scheduler/ imports neither it nor
torch.

Preemption here is recompute: the request keeps every output token, so its matcher stays
where it is.  Anything that drops accepted tokens (rejected draft tokens) calls
`rollback` with how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class GrammarMatcher(Protocol):
    def bitmask(self) -> bytes | None:
        """The allowed next tokens: bit t of little-endian int32 word t // 32 is token t.
        None: no mask this step (the matcher is in an error state, which `error` says, or
        its grammar has not started: `AfterToken`)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        ...

    @property
    def terminated(self) -> bool:
        """The grammar is complete and admits no further token (other than end-of-text)."""
        ...

    def error(self) -> str | None:
        """Why the matcher cannot go on (a dead end, a resource limit), or None."""
        ...


def bitmasks(matchers: Sequence[GrammarMatcher]) -> list[bytes | None]:
    """Every matcher's next mask.  A library that can fill many masks at once (in
    parallel, off the GIL) offers a `batch_bitmasks` class method; matchers of one class
    go to it together, the rest are asked one by one."""
    out: list[bytes | None] = [None] * len(matchers)
    by_type: dict[type, list[int]] = {}
    for i, m in enumerate(matchers):
        by_type.setdefault(type(m), []).append(i)
    for cls, idx in by_type.items():
        batch = getattr(cls, "batch_bitmasks", None)
        if batch is not None and len(idx) > 1:
            for i, mask in zip(idx, batch([matchers[i] for i in idx]), strict=True):
                out[i] = mask
        else:
            for i in idx:
                out[i] = matchers[i].bitmask()
    return out


class AfterReasoning:
    """A reasoning model's thinking and answer under one matcher (service/reasoning.py).

    The grammar (`inner`; None: no grammar) holds the answer, not the thinking: no mask
    and every token accepted until the closing token (`end`), the grammar from the token
    after it.  With `start`, the output is not in its thinking yet: its first token may be
    `start` (it opens its thinking) or else the grammar holds from that first token on.
    With `budget`, the thinking ends after that many tokens inside it: the next mask
    allows `end` alone (`mask_bytes` long), as vLLM's `thinking_token_budget` and
    Anthropic's `budget_tokens` bound it."""

    __slots__ = (
        "budget", "end", "inner", "mask_bytes", "opened", "start", "state", "taken", "thought",
    )  # fmt: skip

    def __init__(
        self,
        inner: GrammarMatcher | None,
        end: int,
        start: int | None = None,
        budget: int | None = None,
        mask_bytes: int = 0,
    ) -> None:
        self.inner = inner
        self.start, self.end = start, end
        self.budget, self.mask_bytes = budget, mask_bytes
        self.state = _MAY_OPEN if start is not None else _THINKING
        self.taken = 0  # tokens the grammar accepted
        self.thought = 0  # tokens accepted while thinking (the tags included)
        self.opened = False  # the output opened its thinking with `start`

    @property
    def drafts(self) -> bool:
        """Speculative drafts can be verified under it (Scheduler.fill_masks): its rows
        are free while thinking, the grammar's masks after."""
        return self.inner is None or bool(getattr(self.inner, "drafts", False))

    def _over_budget(self) -> bool:
        inside = self.thought - (1 if self.opened else 0)
        return self.budget is not None and inside >= self.budget

    def _end_only(self) -> bytes:
        out = bytearray(self.mask_bytes)
        out[self.end // 8] = 1 << (self.end % 8)
        return bytes(out)

    def bitmask(self) -> bytes | None:
        if self.state == _THINKING:
            return self._end_only() if self._over_budget() else None
        if self.inner is None:
            return None
        mask = self.inner.bitmask()
        if self.state == _MAY_OPEN and mask is not None:
            return _with_token(mask, self.start)  # type: ignore[arg-type]
        return mask

    def accept(self, token_id: int) -> bool:
        if self.state == _MAY_OPEN and token_id == self.start:
            self.state, self.thought, self.opened = _THINKING, 1, True
            return True
        if self.state == _THINKING:
            if self._over_budget() and token_id != self.end:
                return False
            self.thought += 1
            if token_id == self.end:
                self.state = _ANSWERING
            return True
        self.state = _ANSWERING
        if self.inner is None:
            return True
        if not self.inner.accept(token_id):
            return False
        self.taken += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        undo = min(num_tokens, self.taken)
        if undo:
            self.inner.rollback(undo)  # type: ignore[union-attr]  # (taken > 0: a grammar)
            self.taken -= undo
        left = num_tokens - undo
        if left <= 0:
            if self.taken == 0 and self.thought == 0 and self.start is not None:
                self.state = _MAY_OPEN
            return
        self.thought = max(0, self.thought - left)
        if self.thought == 0 and self.start is not None:
            self.state, self.opened = _MAY_OPEN, False
        else:
            self.state = _THINKING

    @property
    def terminated(self) -> bool:
        return self.state == _ANSWERING and self.inner is not None and self.inner.terminated

    def error(self) -> str | None:
        if self.state == _THINKING or self.inner is None:
            return None
        return self.inner.error()

    @classmethod
    def batch_bitmasks(cls, matchers: Sequence[AfterReasoning]) -> list[bytes | None]:
        live = [m for m in matchers if m.state != _THINKING and m.inner is not None]
        masks = iter(bitmasks([m.inner for m in live]))  # type: ignore[misc]
        out: list[bytes | None] = []
        for m in matchers:
            if m.state == _THINKING:
                out.append(m._end_only() if m._over_budget() else None)
                continue
            mask = next(masks) if m.inner is not None else None
            if mask is not None and m.state == _MAY_OPEN:
                mask = _with_token(mask, m.start)  # type: ignore[arg-type]
            out.append(mask)
        return out


_MAY_OPEN, _THINKING, _ANSWERING = 0, 1, 2


def _with_token(mask: bytes, token: int) -> bytes:
    """`mask` with `token` allowed too."""
    out = bytearray(mask)
    out[token // 8] |= 1 << (token % 8)  # little-endian int32 words: bit t is byte t // 8
    return bytes(out)
