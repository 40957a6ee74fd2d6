"""OpenAI's predicted outputs (`prediction` on a chat completion) as speculative drafts.

A client that expects most of the answer (a file to rewrite with a few changes) sends it;
under n-gram or draft-model speculation the scheduler drafts from it first.
The model verifies every draft, so the output is what it would have been without one: a
good prediction only makes it come sooner.

The track keeps where the output stands in the prediction.  While the output follows it,
the next drafts are the prediction's next tokens.  Where the newest token departs from it,
that token is taken for a substitution and the drafts go on after the prediction's one.
Otherwise (an insertion, a deletion) the track finds the output's last tokens in the
prediction again (the longest of prompt_lookup_max
.. prompt_lookup_min that occurs, the first occurrence at or after the old place, else the
first anywhere) and drafts on from there; where they occur nowhere, it drafts nothing.
"""

from __future__ import annotations

import bisect

# Places a resync looks at per tail length (see PredictionTrack._find).
MAX_CANDIDATES = 16


class PredictionTrack:
    """One sequence's place in its prediction, and what the prediction's drafts earned."""

    __slots__ = ("accepted", "at", "drafted", "guessed", "index", "out", "rejected", "tokens")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.at = 0  # the prediction's token expected at output position `out`
        self.out = 0
        self.guessed = False  # the place was last set by a substitution guess
        self.index: dict[int, list[int]] | None = None  # token -> its positions, on demand
        self.drafted = 0  # drafts of the step in flight that came from here
        self.accepted = 0  # drafts verification kept, over the request's life
        self.rejected = 0  # drafts it refused

    def drafts(
        self, token_ids: list[int], prompt_len: int, k: int, n_min: int, n_max: int
    ) -> list[int]:
        """Up to k drafts for the tokens after `token_ids` (prompt, then output)."""
        pred = self.tokens
        m = len(token_ids) - prompt_len  # output tokens so far
        d = m - self.out
        at = self.at
        new = token_ids[prompt_len + self.out : prompt_len + m]
        if not (d >= 0 and at + d <= len(pred) and new == pred[at : at + d]):
            guess = not self.guessed and d > 0 and at + d <= len(pred)
            if guess and new[:-1] == pred[at : at + d - 1]:
                # Only the newest token departs: read it as a substitution for the
                # prediction's (a renamed word) and go on after it; a wrong guess costs
                # one refused draft, and the next step searches.
                self.at, self.out, self.guessed = at + d, m, True
                return pred[at + d : at + d + k]
            self.guessed = False
            found = self._find(token_ids, prompt_len, m, n_min, n_max)
            self.at, self.out = (found, m) if found is not None else (len(pred), m)
            return pred[found : found + k] if found is not None else []
        self.at, self.out, self.guessed = at + d, m, False
        return pred[at + d : at + d + k]

    def _find(
        self, token_ids: list[int], prompt_len: int, m: int, n_min: int, n_max: int
    ) -> int | None:
        """Where the prediction goes on after the output's last tokens, or None.  Each
        tail length looks at no more than MAX_CANDIDATES places its last token holds
        after the old place and as many from the start: a prediction that repeats one
        token thousands of times costs a step no more than any other."""
        pred = self.tokens
        if self.index is None:
            self.index = {}
            for i, t in enumerate(pred):
                self.index.setdefault(t, []).append(i)
        size = len(token_ids)
        for n in range(min(n_max, m), n_min - 1, -1):
            tail = token_ids[size - n :]
            ends = self.index.get(tail[-1], [])
            # (the place after an occurrence ending at i is i + 1)
            first = bisect.bisect_left(ends, self.at - 1)
            for part in (ends[first : first + MAX_CANDIDATES], ends[:MAX_CANDIDATES]):
                for i in part:
                    if i - n + 1 >= 0 and pred[i - n + 1 : i + 1] == tail:
                        return i + 1
        return None

    def settle(self, num_draft: int, num_accepted: int) -> None:
        """The step's verify kept `num_accepted` of its `num_draft` drafts (no more than
        were proposed here: the step may have cut them)."""
        if self.drafted:
            self.accepted += num_accepted
            self.rejected += num_draft - num_accepted
            self.drafted = 0
