"""SIGTERM closes idle keep-alive connections at once.  A balancer keeps connections to a
replica open between requests; if a draining replica left those open but ignored what
arrives on them (aiohttp's own shutdown does), the balancer's next request would wait out
the whole drain before it could retry elsewhere.  Found by the fleet test's drain check."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import free_port
from tests.service.test_auth_and_shutdown import _wait_health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _request(sock: socket.socket, method: str, path: str, body: bytes = b"") -> None:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(
        line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    ))  # fmt: skip
    while len(rest) < length:
        rest += sock.recv(4096)
    return head


def test_idle_keepalive_connection_is_closed_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", str(tiny_checkpoint("llama")),
         "--port", str(port), "--num-kv-blocks", "256", "--dtype", "float32",
         "--shutdown-timeout", "300", "--disable-access-log"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc)
        idle = socket.create_connection(("127.0.0.1", port), timeout=30)
        _request(idle, "GET", "/health")
        assert b" 200 " in _read_response(idle)  # now an idle keep-alive connection
        # A long stream keeps the drain going.
        busy = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = {"prompt": "drain", "max_tokens": 500, "stream": True, "ignore_eos": True}
        _request(busy, "POST", "/v1/completions", json.dumps(body).encode())
        got = b""
        while b"data: " not in got:
            chunk = busy.recv(65536)
            assert chunk
            got += chunk
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        idle.settimeout(20)
        try:
            _request(idle, "GET", "/health")
            answer = idle.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
        # Closed (the balancer then retries elsewhere) or refused with 503; not ignored.
        assert answer == b"" or b" 503 " in answer.split(b"\r\n")[0], answer
        assert time.monotonic() - t0 < 5
        # ... while the stream is still running, and it finishes.
        busy.settimeout(300)
        rest = got
        while b"data: [DONE]" not in rest:
            chunk = busy.recv(65536)
            assert chunk, "the stream was cut off"
            rest += chunk
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
