"""Clients that stop reading: a raw WebSocket and a raw HTTP/SSE connection with a tiny
receive buffer, on loopback.  They send what a real client sends and then let the
server's writes pile up, as a stalled browser tab or a stuck proxy does."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from typing import Any


def _connect(port: int, rcvbuf: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Set before connect, so the advertised window stays small.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def _read_headers(s: socket.socket) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(1)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        buf += chunk
    return buf


class RawWebSocket:
    """A minimal RFC 6455 client: masked text frames out, frames parsed in on demand."""

    def __init__(self, port: int, rcvbuf: int = 4096) -> None:
        self.sock = _connect(port, rcvbuf)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = _read_headers(self.sock)
        assert head.startswith(b"HTTP/1.1 101"), head
        self._buf = b""

    def send_json(self, obj: dict[str, Any]) -> None:
        payload = json.dumps(obj).encode()
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x81, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x81, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _need(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_frame(self) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame."""
        b0, b1 = self._need(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self._need(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._need(8))
        return b0 & 0x0F, self._need(n)

    def read_until_close(self, limit: int = 1_000_000) -> tuple[int | None, str, int]:
        """Drain frames until the close frame: (close code, reason, data frames read);
        code None when the connection was dropped without one."""
        frames = 0
        try:
            for _ in range(limit):
                op, payload = self.read_frame()
                if op == 0x8:
                    code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                    return code, payload[2:].decode(errors="replace"), frames
                frames += 1
        except (ConnectionError, OSError):
            return None, "", frames
        return None, "", frames

    def close(self) -> None:
        self.sock.close()


class RawSSE:
    """POST a streaming completion and then read nothing."""

    def __init__(self, port: int, body: dict[str, Any], rcvbuf: int = 4096) -> None:
        self.sock = _connect(port, rcvbuf)
        data = json.dumps({**body, "stream": True}).encode()
        self.sock.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
            + data
        )

    def drain(self) -> tuple[int, bool]:
        """Read to the end: (bytes read, whether the stream ended with [DONE])."""
        got = b""
        try:
            while chunk := self.sock.recv(65536):
                got += chunk
        except OSError:
            pass
        return len(got), b"data: [DONE]" in got

    def close(self) -> None:
        self.sock.close()
