"""StepCostPolicy on a fake clock: what each side's steps cost is given, so every choice
and the time a run takes are deterministic.

The clock charges a side's steady step time, plus its switch cost on the first step after
the other side ran (a draft model catching up on the tokens it sat out); a run is judged
by its seconds per emitted token against decoding plain all along."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from scheduler.spec import StepCostPolicy


def simulate(
    policy: StepCostPolicy,
    steps: int,
    rows: int,
    expected: float,
    worst: float,
    spec: float,
    plain: float,
    spec_switch: float = 0.0,
    catch_up: Callable[[int], float] | None = None,
) -> tuple[float, list[bool]]:
    """(seconds per emitted token relative to plain decoding, each step's choice).
    `catch_up(n)`: a switch to speculating after n plain steps costs that on top of
    `spec_switch` (a draft model catching up on the tokens it sat out)."""
    choices: list[bool] = []
    seconds = tokens = 0.0
    last: bool | None = None
    sat = 0
    for _ in range(steps):
        side = policy.choose(rows, expected, worst)
        cost = spec if side else plain
        if side and last is not True:
            cost += spec_switch + (catch_up(sat) if catch_up is not None else 0.0)
        sat = 0 if side else sat + 1
        policy.observe(rows, side, cost)
        seconds += cost
        tokens += expected if side else rows
        choices.append(side)
        last = side
    return (seconds / tokens) / (plain / rows), choices


def warm_up(
    p: StepCostPolicy, rows: int, expected: float, worst: float, spec: float, plain: float
) -> None:
    """A batch size's first choices: a timing run on each side, speculating first."""
    for side, secs in ((True, spec), (False, plain)):
        for _ in range(p.RUN):
            assert p.choose(rows, expected, worst) == side
            p.observe(rows, side, secs)


def test_a_far_dearer_side_costs_little_over_a_short_run():
    # A draft model on free text at batch 4: a verify step 5x a plain one, each row
    # expecting 1.75 tokens, and 10 plain steps' worth of catch-up whenever it starts
    # again.  Only the warm-up and (once the plain time run covers its cost 1/REGRET
    # times) one re-timing speculate: within 5% of plain decoding over 1000 steps.
    p = StepCostPolicy()
    ratio, choices = simulate(p, 1000, 4, 7.0, 1.75, 5.0, 1.0, spec_switch=10.0)
    assert choices[: 2 * p.RUN] == [True] * p.RUN + [False] * p.RUN
    assert sum(choices) <= 2 * p.RUN
    assert ratio < 1.05
    # The catch-up never entered the figure a choice reads.
    assert p.seconds(4, True) == 5.0 and p.switch[(4, True)] == 15.0


def test_switch_costs_do_not_hide_a_winning_side():
    # Speculating wins (2 tokens per step for 1.2x a plain step), but a speculating step
    # after plain ones pays a 30x catch-up: read as a step time, it would keep the choice
    # on plain for good.
    p = StepCostPolicy()
    ratio, choices = simulate(p, 600, 1, 2.0, 2.0, 1.2, 1.0, spec_switch=30.0)
    assert sum(choices[2 * p.RUN :]) > 0.9 * len(choices[2 * p.RUN :])
    assert ratio < 0.75


def test_close_sides_are_retimed_often_far_ones_rarely():
    # Plain re-timed while speculating wins: its run loses little, so it comes back at
    # the floor of MIN_EXPLORE steps; a side far worse waits until the time run covers
    # its cost 1/REGRET times.
    near = StepCostPolicy()
    _, choices = simulate(near, 400, 4, 8.0, 1.5, 1.5, 1.0)
    plain_runs = sum(1 for a, b in pairwise(choices) if a and not b)
    assert plain_runs >= 400 // (near.MIN_EXPLORE + near.RUN) - 2
    far = StepCostPolicy()
    _, choices = simulate(far, 400, 4, 5.0, 1.25, 4.0, 1.0, spec_switch=4.0)
    assert sum(choices[2 * far.RUN :]) == 0


def test_the_tail_of_a_batch_borrows_the_nearest_figures():
    # A batch of 4 measured plain as far better: as its rows finish (3, 2, 1 left) no new
    # size pays a speculating warm-up of its own.
    p = StepCostPolicy()
    simulate(p, 40, 4, 7.0, 1.75, 5.0, 1.0)
    for rows in (3, 2, 1):
        assert not any(p.choose(rows, 1.75 * rows, 1.75) for _ in range(5))
        for _ in range(5):
            p.observe(rows, False, 1.0)
    # A far size (32 from 4) is measured afresh.
    assert p.choose(32, 56.0, 1.75)


def test_the_side_running_keeps_a_close_choice():
    # A switch to the draft model pays its catch-up, so the side running keeps the choice
    # until the other wins by SWITCH_MARGIN, not at the first tie noise makes.
    p = StepCostPolicy()
    warm_up(p, 2, 4.4, 2.2, 2.0, 1.0)
    assert p.choose(2, 4.4, 2.2)  # 2.2 tokens a row for 2x a plain step
    p.ratios[2].extend([2.2] * p.SAMPLES)  # re-timed: now a tie
    assert p.choose(2, 4.4, 2.2)
    p.ratios[2].extend([2.35] * p.SAMPLES)  # plain ahead by over the margin
    assert not p.choose(2, 4.4, 2.2)
    p.ratios[2].extend([2.2] * p.SAMPLES)  # and back to the tie: plain stays
    assert not p.choose(2, 4.4, 2.2)


def test_the_ratio_pairs_a_timing_run_with_the_side_just_running():
    # The machine slows down 3x (a busy neighbour) after the warm-up: every step costs
    # more, but the speculating re-timing step is read against the plain steps just
    # before it, so the ratio, and the choice, stay.
    p = StepCostPolicy()
    warm_up(p, 4, 6.0, 1.5, 2.0, 1.0)
    assert set(p.ratios[4]) == {2.0}
    assert not p.choose(4, 6.0, 1.5)  # 1.5 tokens a row for 2x a plain step: plain
    load, spec_steps = 3.0, 0
    for _ in range(600):
        side = p.choose(4, 6.0, 1.5)
        spec_steps += side
        p.observe(4, side, (2.0 if side else 1.0) * load)
    assert spec_steps and p.figures(4) == (6.0, 3.0)
    assert set(p.ratios[4]) == {2.0}


def test_a_new_request_starts_from_the_recent_acceptance():
    # Free text keeps few drafts: a request arriving after many such verifies starts
    # from their rate, not from "every draft accepted" (which would have the policy
    # expect k + 1 tokens from each new row).
    from scheduler.request import Request
    from scheduler.sampling_params import SamplingParams
    from scheduler.spec import SpecConfig, SpecDecoder

    spec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=4))
    fresh = Request("a", [1, 2, 3], SamplingParams(), max_tokens=100)
    assert spec.wanted(fresh, 10) == 4  # nothing measured yet
    old = Request("b", [1, 2, 3], SamplingParams(), max_tokens=100)
    spec.wanted(old, 10)
    for i in range(60):
        spec.observe(old, 2, 0 if i % 4 else 1)
    new = Request("c", [1, 2, 3], SamplingParams(), max_tokens=100)
    k = spec.wanted(new, 10)
    assert new.spec_rate < 0.3 and k <= 1
    assert spec.expected_accepted(new, max(k, 1)) < 0.3
    # A request already running keeps its own estimate.
    assert spec.wanted(fresh, 10) == 4 and fresh.spec_rate == 1.0


def test_the_estimate_is_calibrated_by_what_verifies_kept():
    # Acceptance in runs: a request accepts all 4 drafts or none, half the time each.
    # Its per-token rate reads ~0.67, and independent draws at that rate promise ~1.6
    # tokens of 4; the verifies keep 2 on average, and the promise follows them.
    from scheduler.request import Request
    from scheduler.sampling_params import SamplingParams
    from scheduler.spec import SpecConfig, SpecDecoder

    spec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=4))
    req = Request("a", [1, 2, 3], SamplingParams(), max_tokens=1000)
    spec.wanted(req, 10)
    promised, raw = [], []
    for i in range(400):
        if i >= 200:  # what the policy is told before each verify
            promised.append(spec.expected_accepted(req, 4))
            raw.append(spec._estimate(req, 4))
        spec.observe(req, 4, 4 if i % 2 else 0)
    assert abs(sum(promised) / 200 - 2.0) < 0.1 < abs(sum(raw) / 200 - 2.0)


def test_a_catch_up_that_grows_with_the_steps_sat_out_is_priced_so():
    # The draft model at batch 4 on free text: its warm-up prefills the prompts (10 plain
    # steps), and a later switch catches up on every step it sat out (half a plain step
    # each).  Priced at the warm-up's switch alone, a re-timing after ~500 plain steps
    # paid ~250 of them; read per step sat out, re-timing that side never pays under the
    # REGRET rule, and the run stays within 1% of plain decoding.
    p = StepCostPolicy()
    ratio, choices = simulate(
        p, 3000, 4, 7.0, 1.75, 5.0, 1.0, spec_switch=10.0, catch_up=lambda n: 0.5 * n
    )
    assert sum(choices) == p.RUN
    assert ratio < 1.01


def test_untimed_steps_start_no_timing_run():
    # A step with a prompt chunk in it is not timed: it neither starts nor takes a step of
    # a warm-up run (its time would teach nothing), and it speculates only where the timed
    # steps of its size chose to.
    p = StepCostPolicy()
    assert not any(p.choose(4, 7.0, 1.75, timed=False) for _ in range(5))
    warm_up(p, 4, 8.0, 2.0, 1.2, 1.0)  # 2 tokens a row for 1.2x a plain step: speculate
    assert p.choose(4, 8.0, 2.0) and p.choose(4, 8.0, 2.0, timed=False)
    # Size 2 borrows size 4's figures, but no timed step of its own chose speculation.
    assert not p.choose(2, 4.0, 2.0, timed=False)


def test_a_switch_to_speculating_must_repay_its_catch_up():
    # Speculating is a little ahead (1.4 tokens a row for 1.2x a plain step), but its last
    # switch step cost 400 plain steps (a new batch's prompts through the draft model):
    # not repaid within PAYBACK steps, so plain stays.  A cheap switch does not hold it.
    for switch, speculates in ((400.0, False), (1.3, True)):
        p = StepCostPolicy()
        for side, secs in ((True, 1.2), (False, 1.0)):
            for i in range(p.RUN):
                assert p.choose(4, 5.6, 1.4) == side
                p.observe(4, side, switch if side and i == 0 else secs)
        assert p.choose(4, 5.6, 1.4) == speculates


def test_plain_for_sure_skips_only_choices_that_are_plain_anyway():
    # The scheduler asks plain_for_sure (no per-row estimates) before a full choice: over
    # a run where plain wins by far and the speculating side is re-timed now and then, the
    # choices are the same step for step as with full choices only.
    def run(fast: bool) -> list[bool]:
        p = StepCostPolicy()
        out: list[bool] = []
        for _ in range(3000):
            if fast and p.plain_for_sure(4, 5.0):
                side = False
            else:
                side = p.choose(4, 7.0, 1.75)
            p.observe(4, side, 6.0 if side else 1.0)
            out.append(side)
        return out

    full, fast = run(False), run(True)
    assert fast == full
    assert sum(full) > 2 * StepCostPolicy.RUN  # re-timed after the warm-up
    p = StepCostPolicy()
    assert not p.plain_for_sure(4, 5.0)  # nothing measured yet
    warm_up(p, 4, 8.0, 2.0, 1.2, 1.0)
    assert not p.plain_for_sure(4, 5.0)  # speculating chosen
