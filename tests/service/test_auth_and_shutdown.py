"""API keys (HTTP and WebSocket) and SIGTERM draining of a real `pagestream serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import free_port, live_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


def test_api_key_http(model):
    with live_server(model, api_key=KEY) as server:
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="x", prompt="a", max_tokens=1)
        assert e.value.status_code == 401
        req = urllib.request.Request(server.url + "/v1/models")
        with pytest.raises(urllib.error.HTTPError) as e2:
            urllib.request.urlopen(req)
        assert e2.value.code == 401
        assert json.loads(e2.value.read())["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        r = good.completions.create(model=good.models.list().data[0].id, prompt="a", max_tokens=2)
        assert r.choices[0].text is not None
        # Health and metrics stay open for probes.
        with urllib.request.urlopen(server.url + "/health") as h:
            assert h.status == 200


async def test_api_key_websocket(model):
    with live_server(model, api_key=KEY) as server:
        with pytest.raises(InvalidStatus) as e:
            async with websockets.connect(server.ws_url):
                pass
        assert e.value.response.status_code == 401
        async with websockets.connect(server.ws_url + "?api_key=" + KEY) as ws:
            await ws.send('{"type": "ping"}')
            assert json.loads(await ws.recv()) == {"type": "pong"}
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(server.ws_url, additional_headers=hdr) as ws:
            await ws.send('{"type": "ping"}')
            assert json.loads(await ws.recv()) == {"type": "pong"}


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not start")


def _stream(url: str, model: str, result: dict, first_chunk: threading.Event) -> None:
    """A 150-token SSE completion; its finish reason (or error) lands in `result`, and
    `first_chunk` is set once the server is streaming it (or it failed)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        chunks = client.completions.create(
            model=model, prompt="drain me", max_tokens=150, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = None
        for c in chunks:
            first_chunk.set()
            if c.choices:
                finish = c.choices[0].finish_reason or finish
        result["finish"] = finish
    except Exception as e:  # reported by the test's assertions, not lost in the thread
        result["error"] = repr(e)
    finally:
        first_chunk.set()


@pytest.mark.slow
async def test_sigterm_drains_streams_then_going_away(model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", model, "--port", str(port),
         "--num-kv-blocks", "256", "--dtype", "float32", "--shutdown-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        _wait_health(url, proc)
        # An SSE stream in flight when SIGTERM arrives must complete.
        result: dict = {}
        first_chunk = threading.Event()
        t = threading.Thread(target=_stream, args=(url, model, result, first_chunk))
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/ws")
        t.start()
        # SIGTERM once the stream is being served (a fixed sleep could fire before a loaded
        # machine had even accepted the request, which then fails instead of draining).
        assert await asyncio.to_thread(first_chunk.wait, 60), "the stream never started"
        assert "error" not in result, result
        proc.send_signal(signal.SIGTERM)
        # Generous bounds: on a loaded 2-core machine 150 tokens can take tens of seconds,
        # and the drain must outlast them (what is tested is that it completes at all).
        # Joined off the loop: a blocked loop could not answer the server's WebSocket
        # heartbeat, and the idle socket would die before its GOING_AWAY.
        await asyncio.to_thread(t.join, 100)
        assert result.get("finish") == "length", result
        # The idle WebSocket is closed with 1001 GOING_AWAY.
        with pytest.raises(ConnectionClosed) as e:
            while True:
                await ws.recv()
        rc = proc.wait(60)
        log = proc.stdout.read()[-3000:] if proc.stdout else ""  # the server's, on failure
        assert e.value.rcvd is not None and e.value.rcvd.code == 1001, (repr(e.value), log)
        assert rc == 0, log
        # And nothing listens any more.
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
