"""The per-token shortcuts of the serving path (issue 47): each must do exactly what the
general path it skips does."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.http_util import write_cannot_wait
from service.metrics import _ITL_BUCKETS, observe_many
from service.outputs import CompletionOutput


def _hist() -> tuple[CollectorRegistry, Histogram]:
    reg = CollectorRegistry()
    return reg, Histogram("itl", "d", ["model"], buckets=_ITL_BUCKETS, registry=reg)


def test_observe_many_equals_one_observe_per_value() -> None:
    rng = random.Random(7)
    # Bucket bounds exactly, values past the last bound, zero and a negative one.
    values = [*_ITL_BUCKETS, 0.0, -0.5, 9.0, 1e9] + [rng.expovariate(30) for _ in range(3000)]
    one_reg, one = _hist()
    many_reg, many = _hist()
    for v in values:
        one.labels("m").observe(v)
    observe_many(many.labels("m"), values)
    observe_many(many.labels("m"), [])
    assert generate_latest(many_reg) == generate_latest(one_reg)


def test_observe_many_falls_back_to_observe() -> None:
    seen: list[float] = []
    observe_many(SimpleNamespace(observe=seen.append), [0.5, 0.25])  # type: ignore[arg-type]
    assert seen == [0.5, 0.25]


def test_completion_text_joins_its_pieces() -> None:
    o = CompletionOutput(index=0)
    assert o.text == ""
    for piece in ["a", "", "é", "🎉 b"]:
        o.add_text(piece)
    assert o.text == "aé🎉 b"
    o.add_text("c")
    assert o.text == "aé🎉 bc" and o.text == "aé🎉 bc"


class _Transport:
    def __init__(self, buffered: int, closing: bool = False) -> None:
        self.buffered, self.closing = buffered, closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16384, 65536)

    def is_closing(self) -> bool:
        return self.closing


def _request(transport: _Transport | None, paused: bool = False) -> SimpleNamespace:
    return SimpleNamespace(protocol=SimpleNamespace(transport=transport, writing_paused=paused))


@pytest.mark.parametrize(
    ("transport", "paused", "size", "limit", "fits"),
    [
        (_Transport(0), False, 100, 1 << 20, True),
        (_Transport(65436), False, 100, 1 << 20, True),  # up to the high-water mark
        (_Transport(65437), False, 100, 1 << 20, False),  # past it aiohttp's drain waits
        (_Transport(0), False, 100, 99, False),  # past the caller's bound
        (_Transport(0), True, 100, 1 << 20, False),  # writes paused
        (_Transport(0, closing=True), False, 100, 1 << 20, False),
        (None, False, 100, 1 << 20, False),  # connection gone
    ],
)
def test_write_cannot_wait(
    transport: _Transport | None, paused: bool, size: int, limit: int, fits: bool
) -> None:
    assert write_cannot_wait(_request(transport, paused), size, limit) is fits  # type: ignore[arg-type]


def test_switch_interval_flag_sets_the_interpreters_and_only_when_given():
    import sys

    from scheduler.config import EngineConfig
    from service.async_engine import THREADED_SWITCH_INTERVAL_MS, switch_interval
    from service.cli import build_parser, engine_config

    before = sys.getswitchinterval()
    try:
        a = build_parser().parse_args(["serve", "--switch-interval-ms", "0.5"])
        assert switch_interval(engine_config(a)) == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        sys.setswitchinterval(before)
        assert switch_interval(EngineConfig.from_kwargs()) == before  # not given: untouched
        # not given, but the engine's threads run Python at once: the threaded default
        assert switch_interval(EngineConfig.from_kwargs(), threaded=True) == pytest.approx(
            THREADED_SWITCH_INTERVAL_MS / 1e3
        )
    finally:
        sys.setswitchinterval(before)
