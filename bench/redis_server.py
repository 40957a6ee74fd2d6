"""A private redis-server: a free loopback port, no persistence, stopped by PID.

Used by benchmarks and tests alike; it knows nothing of pytest (tests/redis_server.py adds
the skip-or-fail policy).

The machine may already run a Redis on 6379; this never touches it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, maxmemory: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="pagestream-redis-")
        self.args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.dir, "--protected-mode", "yes",
        ]  # fmt: skip
        if maxmemory:
            self.args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_up()

    def kill(self) -> None:
        """SIGKILL, keeping the port and directory for restart() (a crash, not a stop)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """A fresh, empty redis-server on the same port."""
        self.kill()
        self._spawn()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
