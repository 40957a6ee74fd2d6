"""bench/spec.py's comparison: paired ratios against the plain runs beside each run."""

from __future__ import annotations

from bench.spec import MODES, _medians, _rows, paired_ratios, round_order


def test_round_order_puts_plain_beside_every_mode_and_rotates():
    for rep in range(len(MODES)):
        order = round_order(rep)
        assert order[0::2] == ["off"] * (len(MODES) + 1)
        assert sorted(order[1::2]) == sorted(MODES)
        assert order[1] == MODES[rep]


def test_paired_ratios_cancel_a_drift_of_load():
    # The machine slows down steadily through the rounds; the mode is always 0.9x of
    # plain decoding run at the same moment.
    seq = []
    speed = 1000.0
    for rep in range(5):
        for mode in round_order(rep):
            f = speed * (0.9 if mode == "draft" else 1.0)
            seq.append((mode, (f, f, 1.0)))
            speed *= 0.93
    pairs = paired_ratios(seq, "draft")
    assert len(pairs) == 5
    # Against the mean of its neighbours (one step of drift either side) it reads within
    # a fraction of a percent of 0.9x; a ratio of medians reads it far off.
    assert all(abs(cpu - 0.9) < 0.005 and abs(wall - 0.9) < 0.005 for cpu, wall in pairs)
    off = _medians([f for m, f in seq if m == "off"])[0]
    draft = _medians([f for m, f in seq if m == "draft"])[0]
    assert abs(draft / off - 0.9) > 0.03


def test_a_batch_the_corpus_cannot_fill_says_how_many_rows_it_had():
    seq = [(m, (100.0, 100.0, 1.0)) for rep in range(2) for m in round_order(rep)]
    runs = {("free", 4): seq, ("free", 32): seq}
    rows = _rows(["free"], runs, (4, 32), {("free", 4): 4, ("free", 32): 14})
    assert [r[1] for r in rows] == ["4", "14 (of 32 asked)"]
    assert rows[0][3].startswith("100 (1.00x")
