"""Clients that hang up the moment they read [DONE] (they have the whole answer: the host
benchmark's client, `curl | head`).  The stream's chunked terminator then meets a closed
transport; against a real `pagestream serve` process that must not become an error in
the server's log (it was "Error handling request ... Cannot write to closing transport"
for 45 of 48 such streams)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.reliability.watch import serve_process


def _hang_up_after_done(host: str, port: int, request: bytes) -> None:
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(request)
        got = b""
        while b"data: [DONE]" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        # A reset rather than a FIN: the server's next write fails at once.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


# And with the engine core in a child process, whose log goes to the same file.
@pytest.mark.parametrize("mode", [[], ["--engine-process", "on"]], ids=["inline", "engine-process"])
def test_hanging_up_after_done_is_no_server_error(tmp_path, mode):
    model = str(tiny_checkpoint("llama"))
    with serve_process(model, *mode, log_dir=tmp_path) as server:
        u = urlparse(server.url)
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        with ThreadPoolExecutor(8) as pool:  # streams ending in the same steps
            list(pool.map(lambda _: _hang_up_after_done(u.hostname, u.port, request), range(32)))
        time.sleep(0.5)
        server.assert_alive()
        log = server.tail(200_000)
        assert "Error handling request" not in log and "Traceback" not in log, log[-3000:]
