"""What the server's handlers share: its configuration, its state, and the Origin check.

Both the HTTP routes (app.py) and the WebSocket handler (ws.py) import this module; it
imports neither, so the service's modules form no loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import web

from service.async_engine import AsyncEngine, EngineArgs
from service.metrics import Metrics
from service.openai_api import OpenAIServing


@dataclass
class ServerConfig:
    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_request_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # hermes | llama3_json: parses tool_choice "auto"


class ServerState:
    """What handlers share; owned by the event loop thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: Metrics | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.websockets: set[web.WebSocketResponse] = set()
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._conn_ids = itertools.count(1)
        self.started = time.time()

    def next_conn_id(self) -> str:
        return str(next(self._conn_ids))

    def inflight_inc(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def inflight_dec(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None and not self.draining


STATE = web.AppKey("pagestream_state", ServerState)


def check_origin(request: web.Request, allowed: list[str]) -> bool:
    """Refuse cross-site WebSocket hijacking: a browser always sends Origin; it must be this
    server's own origin or one the operator allowed.  Non-browser clients send none."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed or origin in allowed:
        return True
    host = urlsplit(origin).netloc
    return host.lower() == request.host.lower()
