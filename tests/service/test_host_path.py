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


async def test_write_now_writes_what_the_awaited_write_would() -> None:
    """`write_now` refuses a compressed body and a write past the caller's bound;
    otherwise its chunks reach the client exactly as `resp.write`'s, in order."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from service.http_util import write_now

    seen: dict[str, list[bool]] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        if request.query.get("gzip"):
            resp.enable_compression(web.ContentCoding.gzip)
        await resp.prepare(request)
        got = seen.setdefault(request.query.get("gzip", "plain"), [])
        ok = write_now(request, resp, b"a", 1 << 20)  # prepare sent the headers
        got.append(ok)
        if not ok:
            await resp.write(b"a")
        for i in range(5):
            data = b"<%d>" % i
            ok = write_now(request, resp, data, 1 << 20)
            got.append(ok)
            if not ok:
                await resp.write(data)
        got.append(write_now(request, resp, b"x" * 100, 50))  # past the caller's bound
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/")
        assert await r.read() == b"a<0><1><2><3><4>"
        assert r.headers["Transfer-Encoding"] == "chunked"
        assert seen["plain"] == [True, True, True, True, True, True, False]
        r = await client.get("/?gzip=1")
        assert await r.read() == b"a<0><1><2><3><4>"
        assert seen["1"] == [False] * 7


async def test_take_tokens_only_when_nothing_but_tokens_waits() -> None:
    from scheduler.scheduler import RequestUpdate
    from scheduler.stream import RequestStream

    s = RequestStream("g")
    first = RequestUpdate(req_id="r", group_id="g", sample_index=0, new_token_ids=[7])
    s.put([first])
    assert s.take_tokens() is None  # a full update waits: nothing taken
    assert [u.new_token_ids for u in s.take()] == [[7]]
    s.put_token("r", 8)
    s.put_token("r", 9)
    await s.wait()
    assert s.take_tokens() == [8, 9]
    s.put_token("r", 10)
    assert s.take_tokens() == [10]
    s.put_token("r", 11)
    s.put([RequestUpdate(req_id="r", group_id="g", sample_index=0, new_token_ids=[12],
                         finish_reason="length")])  # fmt: skip
    assert s.take_tokens() is None
    (u,) = await s.get()
    assert u.new_token_ids == [11, 12] and u.finish_reason == "length"


def test_plain_completion_chunk_is_the_dicts_event() -> None:
    """A plain middle chunk built from its pre-encoded frame is byte for byte the event
    the dict path encodes (text with quotes, escapes and multi-byte characters)."""
    import functools

    from service.openai_common import ChoiceDelta, ServingBase, StreamUsage, sse
    from service.openai_completions import _CompletionChunks

    serving = SimpleNamespace(token_text=None, _chunk=functools.partial(ServingBase._chunk, None),
                              labels=lambda req: None)  # fmt: skip
    req = SimpleNamespace(echo_only=False, return_token_ids=False, logprobs=None,
                          prompt_logprobs=None, return_tokens_as_token_ids=False)  # fmt: skip
    base = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": 'm"x'}
    usage = StreamUsage(3, include=True, continuous=False)
    chunks = _CompletionChunks(serving, req, base, [[1, 2, 3]], 1, None, usage)  # type: ignore[arg-type]
    chunks.offsets[0] = 0  # past the choice's first chunk
    out = SimpleNamespace(request_id="r", num_cached_tokens=2)
    for text in ['hé "x"\n\\', "", "🎉", '"text":""']:
        (got,) = chunks([ChoiceDelta(0, text, [9], None, None, None)], out)  # type: ignore[arg-type]
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        assert got == sse({**base, "choices": [choice]})
    assert usage.completion_tokens == 4 and usage.cached == 2
