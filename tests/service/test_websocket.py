"""The WebSocket protocol with a real `websockets` client."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from websockets.exceptions import InvalidStatus

from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model):
    with live_server(model) as s:
        yield s


async def frames_until(ws, pred, timeout: float = 60.0) -> list[dict]:
    """Read frames until pred(frame) is true for one of them (returned list includes it)."""
    got = []
    async with asyncio.timeout(timeout):
        while True:
            f = json.loads(await ws.recv())
            got.append(f)
            if pred(f):
                return got


def text_of(frames: list[dict], gid: str) -> tuple[str, list[int]]:
    deltas = [f for f in frames if f["type"] == "delta" and f["id"] == gid]
    return "".join(f["text"] for f in deltas), [t for f in deltas for t in f["token_ids"]]


async def test_two_concurrent_generations_one_cancelled(server, model):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({
            "type": "generate", "id": "long", "prompt": "a very long story",
            "params": {"max_tokens": 1500, "temperature": 0, "ignore_eos": True},
        }))  # fmt: skip
        await ws.send(json.dumps({
            "type": "generate", "id": "short", "prompt": [7, 8, 9],
            "params": {"max_tokens": 10, "temperature": 0, "ignore_eos": True},
        }))  # fmt: skip
        frames = await frames_until(ws, lambda f: f["type"] == "delta" and f["id"] == "long")
        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
        done: dict[str, dict] = {}

        def both_done(f: dict) -> bool:
            if f["type"] == "done":
                done[f["id"]] = f
            return len(done) == 2

        frames += await frames_until(ws, both_done)
        assert done["long"]["finish_reason"] == "abort"
        assert done["short"]["finish_reason"] == "length"
        assert done["short"]["usage"]["completion_tokens"] == 10
        _, long_ids = text_of(frames, "long")
        assert 0 < len(long_ids) < 1500
        short_text, short_ids = text_of(frames, "short")
        # The socket is still usable after a cancel.
        await ws.send(json.dumps({"type": "ping"}))
        assert (await frames_until(ws, lambda f: f["type"] == "pong"))[-1] == {"type": "pong"}
    server.wait_kv_free()
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    try:
        ref = llm.generate(
            [[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        )
        assert short_ids == ref[0].outputs[0].token_ids
        assert short_text == ref[0].outputs[0].text
    finally:
        llm.shutdown()


async def test_chat_messages_over_ws_match_offline(server, model):
    messages = [{"role": "user", "content": "hello there"}]
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({
            "type": "generate", "id": "c", "messages": messages,
            "params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
        }))  # fmt: skip
        frames = await frames_until(ws, lambda f: f["type"] == "done")
    text, ids = text_of(frames, "c")
    llm = LLM(model, dtype="float32", num_kv_blocks=128)
    try:
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert ids == ref[0].outputs[0].token_ids and text == ref[0].outputs[0].text
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("frame", "param"),
    [
        ("not json", None),
        ('{"type": "warp"}', "type"),
        ('{"type": "generate", "prompt": "x"}', None),  # missing id
        ('{"type": "generate", "id": "g", "prompt": "x", "params": {"temperature": 5}}', "params.temperature"),
        ('{"type": "generate", "id": "g", "prompt": "x", "params": {"bogus": 1}}', "params.bogus"),
        ('{"type": "generate", "id": "g"}', "messages"),
        ('{"type": "generate", "id": "g", "prompt": [99999999]}', "prompt"),
        ('{"type": "cancel", "id": "nothing"}', None),
    ],
)  # fmt: skip
async def test_bad_frames_get_error_and_socket_stays_usable(server, frame, param):
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(frame)
        err = (await frames_until(ws, lambda f: f["type"] == "error"))[-1]
        assert err["code"] in (400, 404) and err["message"]
        if param is not None:
            assert err["param"] == param
        if '"id": "g"' in frame:
            assert err["id"] == "g", "the error must name the generation it belongs to"
        await ws.send(json.dumps({
            "type": "generate", "id": "ok", "prompt": "fine",
            "params": {"max_tokens": 2, "ignore_eos": True},
        }))  # fmt: skip
        done = (await frames_until(ws, lambda f: f["type"] == "done"))[-1]
        assert done["id"] == "ok" and done["finish_reason"] == "length"
    server.wait_kv_free()


async def test_duplicate_id_and_binary_frames(server):
    async with websockets.connect(server.ws_url) as ws:
        gen = {
            "type": "generate",
            "id": "d",
            "prompt": "x",
            "params": {"max_tokens": 300, "ignore_eos": True},
        }
        await ws.send(json.dumps(gen))
        await ws.send(json.dumps(gen))
        err = (await frames_until(ws, lambda f: f["type"] == "error"))[-1]
        assert err["id"] == "d" and "already running" in err["message"]
        await ws.send(b"\x00\x01")
        err = (await frames_until(ws, lambda f: f["type"] == "error"))[-1]
        assert "binary" in err["message"]
    # Closing the socket aborted the running generation.
    server.wait_kv_free()


async def test_closing_socket_aborts_generations(server):
    async with websockets.connect(server.ws_url) as ws:
        for i in range(3):
            await ws.send(json.dumps({
                "type": "generate", "id": f"g{i}", "prompt": f"p{i}",
                "params": {"max_tokens": 1500, "ignore_eos": True},
            }))  # fmt: skip
        await frames_until(ws, lambda f: f["type"] == "delta" and f["id"] == "g2")
        assert not server.kv_all_free()
    server.wait_kv_free()


async def test_cross_origin_refused(server):
    with pytest.raises(InvalidStatus) as e:
        async with websockets.connect(server.ws_url, origin="https://evil.example"):
            pass
    assert e.value.response.status_code == 403
    origin = f"http://127.0.0.1:{server.config.port}"
    async with websockets.connect(server.ws_url, origin=origin) as ws:
        await ws.send('{"type": "ping"}')
        assert json.loads(await ws.recv()) == {"type": "pong"}
