"""bench.host drives the real server with its stand-in model over SSE and WebSocket and
reads the server's CPU and steps: every stream gets all its tokens, the figures add up."""

from __future__ import annotations

import argparse

from bench.host import run


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    return "\n".join([title, " | ".join(header), *(" | ".join(r) for r in rows)])


def test_host_section_measures_both_protocols_and_both_device_times():
    args = argparse.Namespace(host_streams="2,6", host_tokens=12, host_step_ms="0,5")
    text = run(args, _table)
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (p, n, d) for d in ("0", "5") for p in ("sse", "ws") for n in ("2", "6")
    ]
    # Server CPU comes from /proc in clock ticks (10 ms): a tiny round may read 0, but the
    # rounds together must show the server did the work.
    assert sum(float(r[6]) for r in rows) > 0
    for r in rows:
        assert float(r[3].replace(",", "")) > 0  # delivered tok/s
        assert float(r[6]) >= 0
        steps = int(r[7].split()[0])
        assert steps >= 12  # one token a step per stream: at least max_tokens steps
        if r[2] == "5":
            # A 5 ms device step bounds the rate: at most streams / 5 ms tokens a second.
            assert float(r[3].replace(",", "")) <= int(r[1]) / 0.005 * 1.05


def test_host_section_with_async_scheduling():
    """The real server with --async-scheduling on and a short switch interval: every
    stream runs to its end, a step a token."""
    args = argparse.Namespace(
        host_streams="6", host_tokens=12, host_step_ms="5", host_async_scheduling="on",
        host_switch_interval="0.5",
    )  # fmt: skip
    text = run(args, _table)
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert [(r[0], r[-2], r[-1]) for r in rows] == [("sse", "on", "0.5"), ("ws", "on", "0.5")]
    for r in rows:
        assert float(r[3].replace(",", "")) > 0
        assert int(r[7].split()[0]) >= 12


def test_host_section_with_the_engine_in_its_own_process():
    """`process` as an engine mode: the stand-in model is built in the engine's process
    (serve --engine-process); every stream runs to its end, and the steps the child takes
    reach the server's /metrics."""
    # The process alone, one size and a device time: the other modes and sizes are the
    # test above's (a server start a row is most of this test's time).
    args = argparse.Namespace(
        host_streams="3", host_tokens=12, host_step_ms="2", host_engine_thread="process"
    )
    text = run(args, _table)
    rows = [line.split(" | ") for line in text.splitlines()[2:]]
    assert {r[-3] for r in rows} == {"process"}
    assert len(rows) == 2  # the two protocols
    for r in rows:
        assert float(r[3].replace(",", "")) > 0
        assert int(r[7].split()[0]) >= 12
