"""How many threads a CPU step uses: what this process may use, less what others take now.

A step's parallel regions end at barriers, so a team of N threads runs at the pace of its
slowest member.  On a CPU shared with a busy neighbour, one of two threads keeps losing its
core, and every barrier waits a scheduler time slice for it: served beside one busy
process, two threads gave twice the TPOT of one (docs/PERFORMANCE.md, section crowded),
while on a quiet machine two are the faster.  A fixed default cannot fit both, so the
executor thread re-decides before a step, at most every `INTERVAL_S`:

- the ceiling is the CPUs the process may really use: its affinity mask, capped by the
  cgroup CPU quota (`cpu.max` in v2, `cpu.cfs_quota_us` in v1) that containers and
  Kubernetes CPU limits set;
- the CPU others take is read from this process's own threads' scheduler statistics
  (`/proc/self/task/*/schedstat`: time on a CPU and time runnable but waiting for one):
  over an interval our threads wanted `demand` CPUs (run + wait) and got `got` (run);
  min(demand, ceiling) - got is what other processes held.  Our own threads waiting for
  each other (the event loop beside a full team) do not count: then we got every CPU.
  Host-wide counts (/proc/loadavg) would see a whole node's load inside a container;
  these see only what kept our threads off the CPUs we may use;
- the team is the ceiling less that share (smoothed, with hysteresis), never below one.
  A smaller team cannot see a neighbour that still holds the CPU it gave up (it no longer
  wants that CPU), so taking a thread back is a probe: if the share comes back within
  `PROBE_S`, the thread is shed again and the next probe waits twice as long (up to
  `MAX_BACKOFF_S`, ~2% of the time spent probing beside a neighbour that stays).
- an interval in which our threads wanted less than `BUSY_AT` of a CPU (a server between
  requests) says nothing about the neighbours: it neither moves the share nor counts
  toward a probe's judgement, or every idle spell would read as "nobody else here" and
  the first steps of the next burst would run a probe beside a neighbour still there.

At DEBUG level every interval is logged (team, steps, what our threads got and wanted,
the share), and `steps_at` / `seconds_at` keep each team size's step count and time, to
see what the governor did during a run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scheduler import envs

log = logging.getLogger(__name__)

INTERVAL_S = 0.2  # one read of ~20-40 small /proc files: ~0.2% of a core
SMOOTHING = 0.5  # weight of the newest interval in the running share (~0.5 s horizon)
SHED_AT = 0.45  # others hold more than this share of a CPU: one thread fewer
# (k of our threads beside m busy ones on C CPUs: others hold C*m/(k+m), 0.67 for 2/1/2)
REGAIN_AT = 0.25  # others hold less than this of the CPU we would take back: one more
PROBE_S = 3.0  # a thread taken back and shed again within this is a failed probe
MIN_BACKOFF_S = 4.0
MAX_BACKOFF_S = 30.0
BUSY_AT = 0.5  # CPUs our threads must want over an interval for it to count


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (1.5 = 150 ms per 100 ms), or None
    when unlimited or unreadable."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2
            f = root / rel / "cpu.max"
            if f.is_file():
                quota, _, period = f.read_text().partition(" ")
                if quota != "max":
                    return int(quota) / int(period)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            base = next((root / d for d in ("cpu", "cpu,cpuacct") if (root / d).is_dir()), None)
            if base is None:
                continue
            q, p = base / rel / "cpu.cfs_quota_us", base / rel / "cpu.cfs_period_us"
            if q.is_file() and p.is_file():
                quota = int(q.read_text())
                if quota > 0:
                    return quota / int(p.read_text())
    return None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cpus() -> int:
    """CPUs this process may run on at once: the affinity mask, capped by the cgroup quota
    (rounded down: 1.5 CPUs of quota throttles a two-thread team half the time)."""
    cpus = _affinity()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


def _our_cpu_ns() -> tuple[int, int]:
    """(run, wait) nanoseconds summed over this process's threads, live ones only."""
    run = wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
        except OSError:  # the thread ended meanwhile
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return run, wait


class ThreadGovernor:
    """Sets torch's (and the CPU kernels') thread count; call `tick()` on the executor
    thread before each step (OpenMP's team size belongs to the thread that starts it)."""

    def __init__(
        self,
        ceiling: int | None = None,
        *,
        sample: Callable[[], tuple[int, int]] = _our_cpu_ns,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling = ceiling or usable_cpus()
        self._sample, self._clock = sample, clock
        self.threads = self.ceiling
        self.others = 0.0  # smoothed CPUs other processes hold of the ones we may use
        self.changes = 0
        self.steps_at: dict[int, int] = {}  # team size -> steps started at it
        self.seconds_at: dict[int, float] = {}  # team size -> wall time at it
        self._steps = 0  # steps since the last interval
        self._regained_at = -math.inf
        self._backoff = MIN_BACKOFF_S
        self._hold_until = 0.0  # no thread is taken back before this
        why = ""
        try:
            self._prev = sample()
            self._enabled = True
        except (OSError, ValueError, IndexError):  # no schedstat (CONFIG_SCHED_INFO off)
            self._prev, self._enabled, why = (0, 0), False, "; no schedstat, so fixed"
        # Shedding answers spinning: a member waiting at a barrier holds its CPU while the
        # one it waits for queues behind a neighbour.  A passive wait sleeps and gives that
        # CPU to the late member, so the wider team keeps its share of the CPUs instead.
        if self._enabled and envs.OMP_WAIT_POLICY == "passive":
            self._enabled, why = False, "; OpenMP waits passively, so fixed"
        self._last = clock()
        torch.set_num_threads(self.threads)
        log.info(
            "CPU threads: %d (the CPUs this process may use: affinity %s, cgroup quota %s)%s",
            self.threads, _affinity(), cgroup_cpu_limit(), why,
        )  # fmt: skip

    def tick(self) -> int:
        """The team for the step about to start (re-decided at most every INTERVAL_S)."""
        now = self._clock()
        if self._enabled and now - self._last >= INTERVAL_S:
            self._interval(now)
        self.steps_at[self.threads] = self.steps_at.get(self.threads, 0) + 1
        self._steps += 1
        return self.threads

    def _interval(self, now: float) -> None:
        wall = now - self._last
        run, wait = self._sample()
        d_run, d_wait = run - self._prev[0], wait - self._prev[1]
        self._last, self._prev = now, (run, wait)
        self.seconds_at[self.threads] = self.seconds_at.get(self.threads, 0.0) + wall
        got = d_run / 1e9 / wall
        demand = (d_run + d_wait) / 1e9 / wall
        held = max(0.0, min(demand, self.ceiling) - got)
        probing = now - self._regained_at < PROBE_S
        if demand < BUSY_AT:  # idle: nothing learned, and a probe's clock stops
            if probing:
                self._regained_at += wall
        elif probing:
            self.others = held  # a probe is judged on what it sees, at once
        else:
            self.others += SMOOTHING * (held - self.others)
        log.debug(
            "CPU threads %d: %d steps in %.2f s; ours ran %.2f CPUs, wanted %.2f; "
            "others held %.2f (share %.2f)",
            self.threads, self._steps, wall, got, demand, held, self.others,
        )  # fmt: skip
        self._steps = 0
        if demand >= BUSY_AT:
            self._decide(now)

    def _decide(self, now: float) -> None:
        want = self.threads
        if self.threads == self.ceiling and now - self._regained_at > PROBE_S:
            self._backoff = MIN_BACKOFF_S  # a probe that held: the neighbour left
        if self.threads > 1 and self.others > SHED_AT:
            want = max(1, min(self.threads - 1, round(self.ceiling - self.others)))
            if now - self._regained_at < PROBE_S:  # the neighbour is still there
                self._backoff = min(MAX_BACKOFF_S, self._backoff * 2)
            self._hold_until = now + self._backoff
        elif self.threads < self.ceiling and self.others < REGAIN_AT and now >= self._hold_until:
            want = self.threads + 1
            self._regained_at = now
        if want != self.threads:
            log.info(
                "CPU threads %d -> %d (other processes hold %.2f of %d CPUs)",
                self.threads, want, self.others, self.ceiling,
            )  # fmt: skip
            self.threads = want
            self.changes += 1
            torch.set_num_threads(want)
