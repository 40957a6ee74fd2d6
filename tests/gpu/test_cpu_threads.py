"""gpu/cpu/threads.py: the thread team from the CPUs a process may use and what other
processes take of them."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import gpu.cpu.threads as ct
from gpu.cpu.threads import ThreadGovernor, cgroup_cpu_limit, usable_cpus


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    m = tmp_path / "cgroup"
    m.write_text(membership)
    return root, m


@pytest.mark.parametrize(
    ("membership", "files", "cpus"),
    [
        ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "max 100000\n"}, None),
        ("4:memory:/x\n1:cpu,cpuacct:/docker/c2\n",
         {"cpu,cpuacct/docker/c2/cpu.cfs_quota_us": "100000\n",
          "cpu,cpuacct/docker/c2/cpu.cfs_period_us": "100000\n"}, 1.0),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ("0::/\n", {}, None),
    ],
    ids=["v2-limited", "v2-max", "v1-limited", "v1-unlimited", "none"],
)  # fmt: skip
def test_cgroup_cpu_limit(tmp_path, membership, files, cpus):
    root, m = _cgroup(tmp_path, membership, files)
    assert cgroup_cpu_limit(root, m) == cpus


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(ct, "_affinity", lambda: 8)
    monkeypatch.setattr(ct, "cgroup_cpu_limit", lambda: 2.5)
    assert usable_cpus() == 2
    monkeypatch.setattr(ct, "cgroup_cpu_limit", lambda: 0.5)
    assert usable_cpus() == 1
    monkeypatch.setattr(ct, "cgroup_cpu_limit", lambda: None)
    assert usable_cpus() == 8


class FakeCPU:
    """Our threads' schedstat sums, advanced by what each interval looked like."""

    def __init__(self) -> None:
        self.t = 0.0
        self.run = self.wait = 0

    def advance(self, seconds: float, got: float, wanted: float) -> None:
        self.t += seconds
        self.run += int(got * seconds * 1e9)
        self.wait += int((wanted - got) * seconds * 1e9)

    def sample(self) -> tuple[int, int]:
        return self.run, self.wait


def _run(gov: ThreadGovernor, cpu: FakeCPU, seconds: float, got: float, wanted: float) -> list:
    seen = []
    for _ in range(round(seconds / 0.1)):
        cpu.advance(0.1, got, wanted)
        seen.append(gov.tick())
    return seen


def test_governor_sheds_beside_a_neighbour_and_probes_back():
    cpu = FakeCPU()
    gov = ThreadGovernor(2, sample=cpu.sample, clock=lambda: cpu.t)
    assert gov.threads == 2 == torch.get_num_threads()
    # Quiet, and our own threads oversubscribe (the event loop beside a full team):
    # we got every CPU we may use, so nobody else is taking any.
    assert set(_run(gov, cpu, 3, got=2.0, wanted=2.6)) == {2}
    # A neighbour: two threads wanting two CPUs get 1.33.
    assert _run(gov, cpu, 2, got=1.33, wanted=2.0)[-1] == 1
    assert torch.get_num_threads() == 1
    # At one thread we get all we want; the governor probes back after its backoff, sees
    # the neighbour at once, and waits twice as long before the next probe.
    probes = []
    for _ in range(300):  # 30 s
        before = gov.threads
        wanted = 1.0 if before == 1 else 2.0
        cpu.advance(0.1, wanted if before == 1 else 1.33, wanted)
        if gov.tick() == 2 and before == 1:
            probes.append(cpu.t)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 2 and all(g2 > g1 for g1, g2 in itertools.pairwise(gaps))
    assert gov.threads == 1 or cpu.t - probes[-1] < 1.0
    # The neighbour leaves: the next probe holds.
    seen = _run(gov, cpu, 40, got=2.0, wanted=2.0)
    assert seen[-1] == 2 and set(seen[-50:]) == {2}


def test_idle_spells_neither_move_the_share_nor_end_a_probe():
    """A server between requests wants almost no CPU, which would read as "nobody else
    here": the share keeps its last busy reading, no thread is taken back meanwhile, and a
    probe started before the spell is judged on the first busy interval after it."""
    cpu = FakeCPU()
    gov = ThreadGovernor(2, sample=cpu.sample, clock=lambda: cpu.t)
    assert _run(gov, cpu, 2, got=1.33, wanted=2.0)[-1] == 1
    _run(gov, cpu, 0.3, got=0.02, wanted=0.02)  # the interval the spell began in
    share, changes = gov.others, gov.changes
    assert set(_run(gov, cpu, 60, got=0.02, wanted=0.02)) == {1}
    assert gov.others == share and gov.changes == changes
    # The burst after the spell starts on one thread: the neighbour never left.
    assert _run(gov, cpu, 0.3, got=1.0, wanted=1.0)[0] == 1
    # A probe, then an idle spell longer than PROBE_S, then work beside the neighbour:
    # the probe fails (and the next waits twice as long) as it would have without the
    # spell, instead of passing for one that held through it.
    while gov.threads == 1:
        _run(gov, cpu, 0.1, got=1.0, wanted=1.0)
    _run(gov, cpu, 2 * ct.PROBE_S, got=0.02, wanted=0.02)
    assert gov.threads == 2
    shed_at = None
    for _ in range(100):
        _run(gov, cpu, 0.1, got=1.0 if gov.threads == 1 else 1.33,
             wanted=1.0 if gov.threads == 1 else 2.0)  # fmt: skip
        if shed_at is None and gov.threads == 1:
            shed_at = cpu.t
        if shed_at is not None and gov.threads == 2:
            break
    assert shed_at is not None and cpu.t - shed_at > 1.5 * ct.MIN_BACKOFF_S


def test_steps_and_seconds_at_each_team_size():
    cpu = FakeCPU()
    gov = ThreadGovernor(2, sample=cpu.sample, clock=lambda: cpu.t)
    _run(gov, cpu, 1.0, got=2.0, wanted=2.0)
    _run(gov, cpu, 2.0, got=1.33, wanted=2.0)
    assert sum(gov.steps_at.values()) == 30
    assert sum(gov.seconds_at.values()) == pytest.approx(3.0, abs=0.11)
    assert gov.steps_at[1] >= 10 and gov.seconds_at[2] >= 1.0


def test_passive_openmp_waits_keep_every_usable_cpu(monkeypatch):
    """With OMP_WAIT_POLICY=passive a member waiting at a barrier sleeps, so a busy
    neighbour costs the team its share of a CPU, not a stall at every barrier: the team
    stays at the ceiling (which still follows affinity and quota)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    cpu = FakeCPU()
    gov = ThreadGovernor(2, sample=cpu.sample, clock=lambda: cpu.t)
    assert set(_run(gov, cpu, 5, got=1.33, wanted=2.0)) == {2}
    assert gov.changes == 0 and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    gov = ThreadGovernor(2, sample=cpu.sample, clock=lambda: cpu.t)
    assert _run(gov, cpu, 5, got=1.33, wanted=2.0)[-1] == 1


def test_governor_with_one_cpu_never_changes():
    cpu = FakeCPU()
    gov = ThreadGovernor(1, sample=cpu.sample, clock=lambda: cpu.t)
    assert set(_run(gov, cpu, 5, got=0.5, wanted=1.0)) == {1}
    assert gov.changes == 0


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or len(ct.os.sched_getaffinity(0)) < 2,
    reason="needs Linux schedstat and two CPUs",
)
def test_a_real_neighbour_is_seen_and_its_leaving_too():
    """Two-thread matmuls beside a real `while True: pass`: the governor drops to one
    thread within seconds, and takes the second back once the neighbour is gone."""
    gov = ThreadGovernor(2)
    a = torch.randn(768, 768)
    stop = threading.Event()
    seen: list[int] = []

    def steps() -> None:  # the executor thread: tick, then a step's work
        while not stop.is_set():
            seen.append(gov.tick())
            for _ in range(4):
                a @ a

    worker = threading.Thread(target=steps, daemon=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        worker.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and gov.threads != 1:
            time.sleep(0.1)
        assert gov.threads == 1, f"never shed: share {gov.others:.2f}"
        busy.kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and gov.threads != 2:
            time.sleep(0.1)
        assert gov.threads == 2, f"never took the thread back: share {gov.others:.2f}"
    finally:
        busy.kill()
        busy.wait()
        stop.set()
        worker.join()
