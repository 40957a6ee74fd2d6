"""bench/crowded.py: the engine's team sizes over a loaded run, read from its server log."""

from __future__ import annotations

import argparse
from datetime import datetime

import pytest

from bench.crowded import _levels, _team_cell, team_seconds


def _at(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


LOG = [
    "2026-12-05 07:12:16,550 INFO gpu.cpu.threads: CPU threads: 2 (the CPUs this process "
    "may use: affinity 2, cgroup quota None)",
    "2026-12-05 07:12:30,000 INFO service.app: model loaded",
    "2026-12-05 07:13:00,500 INFO gpu.cpu.threads: CPU threads 2 -> 1 (other processes hold "
    "0.55 of 2 CPUs)",
    "2026-12-05 07:13:01,000 DEBUG gpu.cpu.threads: CPU threads 1: 4 steps in 0.21 s; ours "
    "ran 1.00 CPUs, wanted 1.10; others held 0.10 (share 0.20)",
    "2026-12-05 07:13:10,500 INFO gpu.cpu.threads: CPU threads 1 -> 2 (other processes hold "
    "0.10 of 2 CPUs)",
    "2026-12-05 07:13:11,000 INFO gpu.cpu.threads: CPU threads 2 -> 1 (other processes hold "
    "0.67 of 2 CPUs)",
    "2026-12-05 07:14:00,000 INFO gpu.cpu.threads: CPU threads 1 -> 2 (other processes hold "
    "0.00 of 2 CPUs)",
]


def test_team_seconds_over_the_loaded_window():
    t0, t1 = _at("2026-12-05 07:13:00,000"), _at("2026-12-05 07:13:20,000")
    seconds, changes = team_seconds(LOG, t0, t1)
    assert changes == 3  # the change after t1 is not the run's
    assert seconds[2] == pytest.approx(0.5 + 0.5)
    assert seconds[1] == pytest.approx(10.0 + 9.0)
    assert _team_cell((seconds, changes)) == "1: 95%, 2: 5% (3 changes)"


def test_team_seconds_without_a_change_and_without_a_log():
    t0, t1 = _at("2026-12-05 07:12:20,000"), _at("2026-12-05 07:12:30,000")
    assert team_seconds(LOG[:2], t0, t1) == ({2: pytest.approx(10.0)}, 0)
    assert team_seconds([], t0, t1) == ({}, 0)


def test_levels_always_start_quiet():
    assert _levels(argparse.Namespace(crowded_levels="1")) == (0, 1)
    assert _levels(argparse.Namespace(crowded_levels="2,0,1")) == (0, 1, 2)
    assert _levels(argparse.Namespace()) == (0, 1, 2)
