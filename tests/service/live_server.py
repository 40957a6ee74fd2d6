"""A real pagestream server on a loopback port, run in a background thread.

The server has its own event loop (as in production), so tests can use blocking clients
(the official openai client) as well as async ones without sharing a loop with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from scheduler.config import EngineConfig
from service.app import STATE, ServerConfig, create_app
from service.async_engine import AsyncEngine

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=2)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2)
        self.sock.connect(self.path)


def _health(url: str, tls: ssl.SSLContext | None, uds: str | None) -> int:
    """/health's status, or 0 when nothing answers yet."""
    try:
        if uds is not None:
            conn = _UnixHTTPConnection(uds)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status
            finally:
                conn.close()
        with urllib.request.urlopen(url + "/health", timeout=2, context=tls) as r:
            return int(r.status)
    except OSError:
        return 0


@contextlib.contextmanager
def server_process(
    tmp_path: Path,
    module: str,
    *args: str,
    new_session: bool = False,
    graceful: bool = False,
    tls: ssl.SSLContext | None = None,
    uds: str | None = None,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real server process (`service.cli serve` or `bench.host_server`), healthy, its
    output in tmp_path; new_session: in a process group of its own (a signal to the group
    spares pytest); graceful: stopped with SIGTERM (killed past 30 s), else killed.
    tls: the client context its /health is polled with (an https:// url comes back);
    uds: the Unix socket it listens on (--uds is added)."""
    port = free_port()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    logf = tmp_path / f"server-{port}.log"
    pre = ["serve"] if module == "service.cli" else []
    where = ["--uds", uds] if uds else ["--port", str(port)]
    cmd = [sys.executable, "-m", module, *pre, *where, "--threads", "1", *args]
    with logf.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, logf.read_text()[-3000:]
            if _health(url, tls, uds) == 200:
                break
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            if graceful:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            else:
                proc.kill()
                proc.wait(10)


class LiveServer:
    def __init__(self, config: ServerConfig, engine: AsyncEngine | None = None) -> None:
        self.config = config
        self.config.host = "127.0.0.1"
        if not self.config.port or self.config.port == 8000:
            self.config.port = free_port()
        self._engine = engine
        self.loop = asyncio.new_event_loop()
        self.app = create_app(config, engine)
        self.runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.config.port}/v1/ws"

    @property
    def state(self):
        return self.app[STATE]

    @property
    def engine(self) -> AsyncEngine:
        engine = self.state.engine
        assert engine is not None
        return engine

    def start(self, timeout: float = 120.0) -> LiveServer:
        self._thread.start()

        async def up() -> None:
            self.runner = web.AppRunner(
                self.app, handler_cancellation=True, shutdown_timeout=self.config.shutdown_timeout
            )
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.config.port).start()

        self.call(up())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return self
            if self.state.load_error is not None:
                raise RuntimeError(f"model failed to load: {self.state.load_error}")
            time.sleep(0.05)
        raise TimeoutError("server did not become healthy")

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Call fn on the server's loop thread (engine state is owned by that thread)."""

        async def wrap() -> T:
            return fn()

        return self.call(wrap(), timeout)

    @property
    def in_child(self) -> bool:
        """The engine runs in a child process (`engine_process`): no scheduler here."""
        return self.engine.in_child

    def debug_counts(self) -> dict[str, Any]:
        """The engine's own counts (`/debug/state`'s), through its query path: with the
        engine in a child process they cross the boundary as the server's do."""
        return self.call(self.engine.debug_counts(), timeout=30)

    def _busy(self) -> dict[str, Any]:
        """What is still held, running, waiting or streaming (empty: idle)."""
        if not self.in_child:

            def check() -> dict[str, Any]:
                sched = self.engine.scheduler
                pool = sched.kv.pool
                busy: dict[str, Any] = {
                    "unfinished": sched.has_unfinished(),
                    "requests": list(sched.requests),
                    "kv_blocks_held": pool.num_blocks - pool.num_free,
                    "streams": list(self.engine.core.streams),
                }
                return {k: v for k, v in busy.items() if v}

            return self.on_loop(check)
        c = self.debug_counts()
        busy = {k: c[k] for k in ("running", "waiting", "requests", "groups", "streams",
                                  "runner_requests") if c[k]}  # fmt: skip
        if c["kv_blocks_total"] != c["kv_blocks_free"]:
            busy["kv_blocks_held"] = c["kv_blocks_total"] - c["kv_blocks_free"]

        def here() -> dict[str, Any]:
            # The server's side of the boundary: streams it still delivers into, adds the
            # child has not taken.
            core = self.engine.core
            mine = {"server_streams": list(core.streams), "server_sids": list(core._by_sid),
                    "inbox": list(core._inbox)}  # fmt: skip
            return {k: v for k, v in mine.items() if v}

        return busy | self.on_loop(here)

    def kv_all_free(self) -> bool:
        return not self._busy()

    def wait_kv_free(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = self._busy()
            if not busy:
                return
            time.sleep(0.02)
        raise AssertionError(f"KV blocks not freed (engine not idle): {busy}")

    def num_running(self) -> int:
        if self.in_child:
            return int(self.debug_counts()["running"])
        return self.on_loop(lambda: self.engine.scheduler.stats().num_running)

    def kv_free_blocks(self) -> int:
        if self.in_child:
            return int(self.debug_counts()["kv_blocks_free"])
        return self.on_loop(lambda: self.engine.scheduler.kv.pool.num_free)

    def conversation_pins(self) -> int:
        if self.in_child:
            return int(self.debug_counts()["conversation_pins"])
        return self.on_loop(lambda: len(self.engine.scheduler.kv.pins.convs))

    def stop(self) -> None:
        if self.runner is not None:
            with contextlib.suppress(Exception):
                self.call(self.runner.cleanup(), timeout=self.config.shutdown_timeout + 30)

        async def drain() -> None:
            # Let cancelled handler tasks (socket writers) run to their end.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(drain(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@contextlib.contextmanager
def live_server(
    model: str,
    *,
    engine_kwargs: dict[str, Any] | None = None,
    engine_process: bool = False,
    **config: Any,
) -> Iterator[LiveServer]:
    """engine_process: the engine core in a child process (`serve --engine-process`)."""
    # One torch thread: the server shares two cores with the test's clients, and torch's
    # default (every core) oversubscribes them (several times slower here).
    defaults = {"dtype": "float32", "num_kv_blocks": 256, "threads": 1}
    if engine_process:
        defaults["engine_process"] = True
    args = EngineConfig.from_kwargs(model=model, **(defaults | (engine_kwargs or {})))
    server = LiveServer(ServerConfig(engine=args, **config)).start()
    try:
        yield server
    finally:
        server.stop()
