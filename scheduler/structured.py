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
