"""`Scheduler.fill_masks` for a verify chunk under a grammar (scheduler/scheduler.py
_draft_masks): a mask for every row, the chunk cut at the first draft the grammar refuses,
the matcher left where it was."""

from __future__ import annotations

from scheduler.scheduler import _draft_masks

VOCAB = 64


class Allowed:
    """A matcher over a fixed sequence: position i allows only `seq[i]` (and the token
    after the sequence, anything)."""

    drafts = True

    def __init__(self, seq: list[int]) -> None:
        self.seq, self.pos = seq, 0
        self.rolled_back = 0

    def bitmask(self) -> bytes:
        out = bytearray(VOCAB // 8)
        allowed = [self.seq[self.pos]] if self.pos < len(self.seq) else range(VOCAB)
        for t in allowed:
            out[t // 8] |= 1 << (t % 8)
        return bytes(out)

    def accept(self, tok: int) -> bool:
        if self.pos < len(self.seq) and tok != self.seq[self.pos]:
            return False
        self.pos += 1
        return True

    def rollback(self, n: int) -> None:
        self.pos -= n
        self.rolled_back += n

    def error(self) -> str | None:
        return None

    @property
    def terminated(self) -> bool:
        return self.ends and self.pos >= len(self.seq)

    ends = False  # a grammar that is complete after its sequence (only end-of-text then)


def _rows(joined: bytes) -> list[list[int]]:
    """Each row's allowed tokens."""
    size = VOCAB // 8
    rows = [joined[i : i + size] for i in range(0, len(joined), size)]
    return [[t for t in range(VOCAB) if (r[t // 8] >> (t % 8)) & 1] for r in rows]


def test_every_draft_taken_gives_a_mask_per_row_and_rolls_back():
    m = Allowed([5, 9, 17, 3])
    joined, keep = _draft_masks(m, [5, 9, 17])
    assert keep == 3 and m.pos == 0 and m.rolled_back == 3
    # three drafts' rows and the row of the token after them
    assert _rows(joined) == [[5], [9], [17], [3]]


def test_the_chunk_is_cut_at_the_first_refused_draft():
    m = Allowed([5, 9, 17, 3])
    joined, keep = _draft_masks(m, [5, 8, 17])  # 8 is refused where 9 must come
    assert keep == 1 and m.pos == 0
    assert _rows(joined) == [[5], [9]]  # the first draft's row, then the one drawn after it
    joined, keep = _draft_masks(m, [6])
    assert keep == 0 and _rows(joined) == [[5]] and m.rolled_back == 1


class Broken(Allowed):
    """Fails at position 1."""

    def bitmask(self):
        return None if self.pos == 1 else super().bitmask()

    def error(self):
        return "broken" if self.pos == 1 else None


def test_a_matcher_in_error_gives_no_masks():
    m = Broken([5, 9])
    assert _draft_masks(m, [5, 9]) == (None, 0)
    assert m.pos == 0


def test_rows_a_reasoning_matcher_leaves_free_are_all_allowed():
    """AfterReasoning: no mask while thinking, the grammar's after the closing token."""
    from scheduler.structured import _THINKING, AfterReasoning

    end = 60
    after = AfterReasoning(Allowed([5, 9]), end)
    assert after.drafts
    joined, keep = _draft_masks(after, [1, 2, end, 5])
    assert keep == 4 and (after.state, after.thought, after.taken) == (_THINKING, 0, 0)
    rows = _rows(joined)
    assert rows[:3] == [list(range(VOCAB))] * 3 and rows[3:] == [[5], [9]]
    # Thinking throughout: no masks at all, and nothing cut.
    assert _draft_masks(AfterReasoning(Allowed([5]), end), [1, 2]) == (b"", 2)


def test_no_draft_is_taken_past_the_grammars_end():
    """Complete after [5, 9]: the request stops at 9, so a draft after it cannot count
    (and a matcher that took its end-of-text could not be rolled back past it)."""
    m = Allowed([5, 9])
    m.ends = True
    joined, keep = _draft_masks(m, [5, 9, 0, 0])
    assert keep == 2 and m.pos == 0 and m.rolled_back == 2
    assert len(_rows(joined)) == 3  # the two drafts' rows, and the row after the last


def test_a_medusa_tree_gets_each_rows_mask_after_its_path():
    from scheduler.scheduler import tree_masks

    m = Allowed([5, 9, 17, 3])
    # Root's children: 5 (allowed) and 6 (refused); 5's children: 9 and 8; 9's child: 17.
    tokens, parents = [5, 6, 9, 8, 17], [-1, -1, 0, 0, 2]
    rows = _rows(tree_masks(m, tokens, parents))
    every = list(range(VOCAB))
    # root; 5 -> [9]; 6 refused (its row free); 9 -> [17]; 8 refused; 17 -> [3]
    assert rows == [[5], [9], every, [17], every, [3]]
    assert m.pos == 0 and m.rolled_back == 3
    # A grammar complete after [5]: the rows past the completing token are free.
    done = Allowed([5])
    done.ends = True
    assert _rows(tree_masks(done, [5, 7], [-1, 0])) == [[5], every, every]
    assert done.pos == 0


def test_a_medusa_tree_whose_matcher_fails_gets_no_masks():
    from scheduler.scheduler import tree_masks

    m = Broken([5, 9])
    assert tree_masks(m, [5, 9], [-1, 0]) is None and m.pos == 0
