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
        None when the matcher is in an error state (see `error`)."""
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
