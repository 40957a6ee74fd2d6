"""OpenAI's predicted outputs as drafts: the track follows the output through the
prediction, finds its place again after an edit, drafts nothing where the output has left
it, and counts what verification kept and refused."""

from __future__ import annotations

from scheduler.prediction import MAX_CANDIDATES, PredictionTrack

PROMPT = [900, 901, 902]


def drafts(track: PredictionTrack, output: list[int], k: int = 4) -> list[int]:
    return track.drafts(PROMPT + output, len(PROMPT), k, 1, 3)


def test_an_output_that_follows_the_prediction_drafts_its_next_tokens():
    pred = list(range(10, 40))
    t = PredictionTrack(pred)
    assert drafts(t, []) == pred[:4]
    assert drafts(t, pred[:1]) == pred[1:5]
    assert drafts(t, pred[:6]) == pred[6:10]
    assert drafts(t, pred[:28]) == pred[28:]
    assert drafts(t, pred) == []


def test_after_an_edit_the_track_finds_its_place_again():
    pred = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    t = PredictionTrack(pred)
    assert drafts(t, [1, 2]) == [3, 4, 5, 6]
    # The output replaced 3 4 with 50 51, then went on with 5: found by its last token.
    assert drafts(t, [1, 2, 50, 51, 5]) == [6, 7, 8, 9]
    # Inserted text the prediction does not hold: nothing to draft...
    assert drafts(t, [1, 2, 50, 51, 5, 60, 61]) == []
    # ...until the output meets the prediction again.
    assert drafts(t, [1, 2, 50, 51, 5, 60, 61, 9, 10]) == [11, 12]


def test_a_substituted_token_is_stepped_over():
    pred = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    t = PredictionTrack(pred)
    assert drafts(t, [1, 2]) == [3, 4, 5, 6]
    # 3 came out as 50: the drafts go on after the prediction's 3.
    assert drafts(t, [1, 2, 50]) == [4, 5, 6, 7]
    assert drafts(t, [1, 2, 50, 4, 5]) == [6, 7, 8, 9]


def test_a_repeated_passage_resumes_after_the_old_place():
    # "x y" occurs twice: after the output has passed the first, the second is taken.
    pred = [7, 8, 1, 2, 3, 7, 8, 4, 5, 6]
    t = PredictionTrack(pred)
    assert drafts(t, [7, 8, 1, 2, 3]) == [7, 8, 4, 5]
    assert drafts(t, [7, 8, 1, 2, 3, 9, 7, 8]) == [4, 5, 6]


def test_settle_counts_kept_and_refused_drafts():
    t = PredictionTrack(list(range(20)))
    t.drafted = 4
    t.settle(4, 3)
    t.settle(4, 4)  # not drafted from the prediction: not counted
    t.drafted = 2
    t.settle(2, 0)
    assert (t.accepted, t.rejected, t.drafted) == (3, 3, 0)


def test_a_resync_looks_at_a_bounded_number_of_places():
    # 7 is everywhere but the tail "5 7" occurs once, past MAX_CANDIDATES other 7s: the
    # search gives up rather than scan the whole prediction on every step.
    def pairs_only(pred: list[int]) -> list[int]:  # (tails of 2 or 3 tokens)
        return PredictionTrack(pred).drafts([*PROMPT, 5, 7], len(PROMPT), 4, 2, 3)

    assert pairs_only([1, 7] * (MAX_CANDIDATES + 4) + [5, 7, 8, 9]) == []
    assert pairs_only([1, 7] * (MAX_CANDIDATES - 4) + [5, 7, 8, 9]) == [8, 9]
