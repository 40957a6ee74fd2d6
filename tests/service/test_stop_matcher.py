"""The Aho-Corasick stop matcher agrees with the obvious definition, and its memory is
linear in the stop strings' length."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from service.detokenizer import StopChecker, _automaton


def reference(stops: list[str], text: str, include: bool) -> tuple[str, str | None]:
    """Earliest end wins; at the same end the longer stop wins."""
    best = None
    for s in dict.fromkeys(x for x in stops if x):
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s), s)
            best = key if best is None or key < best else best
    if best is None:
        return text, None
    end, neg, s = best
    return text[: end if include else end + neg], s


alphabet = st.sampled_from("abc\n")


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=4),
    deltas=st.lists(st.text(alphabet, max_size=4), max_size=12),
    include=st.booleans(),
)
def test_matches_reference(stops: list[str], deltas: list[str], include: bool) -> None:
    checker = StopChecker(stops, include)
    out = []
    stopped = False
    for d in deltas:
        emit, stopped = checker.push(d)
        out.append(emit)
        # Never emit text that may still turn out to be part of a stop string.
        if not stopped:
            so_far = "".join(out)
            assert all(so_far.find(s) < 0 for s in stops)
        if stopped:
            break
    if not stopped:
        out.append(checker.flush())
    want, matched = reference(stops, "".join(deltas), include)
    assert "".join(out) == want
    assert checker.matched == matched


def test_memory_is_linear_in_stop_length() -> None:
    def cost(n: int) -> int:
        _automaton.cache_clear()
        tracemalloc.start()
        checker = StopChecker(["ab" * (n // 2)])
        checker.push("ab" * (n // 4))
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return size

    small, big = cost(2000), cost(8000)
    # Quadratic (every prefix kept) would be ~16x; linear is ~4x.
    assert big < 6 * small, (small, big)
    assert big < 8 << 20
