"""What the server's handlers share: its configuration and its state.

Both the HTTP routes (app.py) and the WebSocket handler (ws.py) import this module; it
imports neither, so the service's modules form no loop.  The Host allow-list, the Origin
check, the API-key salts and tenant ids are in service/security.py; live request ids in
service/request_ids.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from scheduler.config import EngineConfig
from service.async_engine import AsyncEngine
from service.limits import Limits
from service.metrics import Metrics
from service.openai_api import OpenAIServing
from service.prep import Preprocessor
from service.request_ids import LiveRequestIds
from service.resume import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_GRACE_S,
    DEFAULT_TOTAL_BUFFER_BYTES,
    StreamRegistry,
)
from service.security import AllowedHosts, key_salt, key_tenant, parse_networks


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # More keys (--api-key repeated, --api-key-file); any one of them (or api_key) passes.
    api_keys: list[str] = field(default_factory=list)
    # --admin-api-key: when set, the operator's routes (LoRA load and unload, /debug) take
    # only these keys, and no API key opens them.
    admin_api_keys: list[str] = field(default_factory=list)
    # The names requests may give as `model` (the first is the one responses report);
    # None: the checkpoint's directory name.  A str is one name.
    served_model_name: str | list[str] | None = None
    # Origins (besides the server's own) a browser page may come from: to open /v1/ws,
    # and to call the API (CORS, service/cors.py; "*": any).  Empty: none.
    allowed_origins: list[str] = field(default_factory=list)
    # What a cross-origin call may use (vLLM's defaults: any), and whether it may carry
    # the browser's credentials (cookies, HTTP auth).
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # Host headers answered (DNS rebinding; see security.AllowedHosts): None = the --host
    # name (plus the machine's hostname on 0.0.0.0 / ::); IP addresses and localhost
    # always pass; ["*"] = any.  Anything else gets 421.
    allowed_hosts: list[str] | None = None
    # /tokenize and /detokenize without the API key (they are behind it when keys are set).
    public_tokenize: bool = False
    # Peers whose X-Forwarded-Host/-Proto/-Port and Forwarded headers are believed (IPs or
    # CIDRs; "*" = any).  Empty: those headers are ignored, as a client could forge them.
    forwarded_allow_ips: list[str] = field(default_factory=list)
    # usage.prompt_tokens_details.cached_tokens tells a caller how much of its prompt was
    # cached: off by default (vLLM's --enable-prompt-tokens-details), since with a shared
    # cache that is an oracle for what others sent.
    enable_prompt_tokens_details: bool = False
    # Off: each API key's prefix blocks are salted with that key, so no key can hit (or
    # probe) another's.  On: every caller shares one prefix cache.
    shared_prefix_cache: bool = False
    max_request_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits)
    # Back-pressure: bytes the server may hold for one slow reader (WebSocket outbox plus
    # the socket's write buffer), and how long one write may wait for the client to drain.
    max_buffered_bytes: int = 4 << 20
    send_timeout: float = 30.0
    socket_send_buffer: int | None = None  # SO_SNDBUF of streaming connections (None: OS)
    # Resumable streams (service/resume.py): how long a generation whose connection
    # dropped runs on waiting for a resume (0: aborted at once), and the newest event
    # bytes kept per stream for one, and across all streams no connection holds.
    resume_grace: float = DEFAULT_GRACE_S
    resume_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    resume_buffer_total_bytes: int = DEFAULT_TOTAL_BUFFER_BYTES
    # An engine failure ends the process (exit code ENGINE_FAILURE_EXIT) once clients have
    # their errors, so a supervisor restarts it.  `pagestream serve` sets it; an embedded
    # server (tests) keeps running, unhealthy.
    exit_on_engine_failure: bool = False
    # GET /debug/state (engine queues, KV blocks, memory, tasks) for operators and tests.
    enable_debug_routes: bool = False
    access_log: bool = True
    tool_call_parser: str | None = None  # hermes | llama3_json: parses tool_choice "auto"
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3 (service/reasoning.py)
    # Sampling defaults (service/generation_defaults.py): "auto" (the model's
    # generation_config.json), "vllm" (the API's), or a directory; fields set over them.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # /v1/responses' store (service/openai_responses.py): responses kept for GET and
    # previous_response_id; past a bound the API key holding the most loses its least
    # recently used; 0 turns storing off.
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 64 << 20
    # Where they are kept: memory (this replica's), redis (the fleet's, at the prefix
    # tier's --redis-url: any replica continues a chain), auto (redis when there is one).
    response_store: str = "auto"
    # Chat templates: --chat-template's source (None: the checkpoint's own) and how
    # message content reaches a template (service/chat_template.CONTENT_FORMATS).
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    response_role: str = "assistant"  # a chat reply's role after a generation prompt
    # vLLM's --pooler-config: how embeddings pool, over the checkpoint's own rule
    # (service/pooling.py).
    pooler_config: dict[str, Any] | None = None
    # Logprobs name tokens "token_id:N" whatever a request asks (vLLM's flag).
    return_tokens_as_token_ids: bool = False
    # Every streamed chat or completion ends with a usage chunk, asked for or not.
    enable_force_include_usage: bool = False
    # Where it listens: TLS on the TCP port when a certificate and key are given (client
    # certificates checked against ssl_ca_certs when ssl_cert_reqs is 1 or 2, as
    # ssl.CERT_OPTIONAL / CERT_REQUIRED), or a Unix socket (uds) instead of host:port.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    uds: str | None = None
    # Each queued prompt and its parameters logged (pagestream.requests, INFO), its text
    # and ids cut to max_log_len (None: whole); off by default, as prompts are private.
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # The path prefix a reverse proxy serves this server under (it strips it before
    # passing requests on): the OpenAPI document's `servers` entry.  The chat page needs
    # none (its URLs are relative).
    root_path: str = ""
    # GET /openapi.json (vLLM's --disable-fastapi-docs turns its docs off).
    openapi_docs: bool = True


class ServerState:
    """What handlers share; owned by the event loop thread."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        keys = ([config.api_key] if config.api_key else []) + list(config.api_keys)
        # Each key with the salt its prefix blocks are hashed under (None when shared) and
        # its tenant id (request-id namespace, share of the shared prefix tier).
        self.keys: list[tuple[bytes, str | None, str]] = [
            (k.encode(), None if config.shared_prefix_cache else key_salt(k), key_tenant(k))
            for k in dict.fromkeys(keys)
        ]
        self.admin_keys = [k.encode() for k in dict.fromkeys(config.admin_api_keys)]
        self.trusted_proxies = parse_networks(config.forwarded_allow_ips)
        self.allowed_hosts = AllowedHosts.build(config.allowed_hosts, config.host)
        self.request_ids = LiveRequestIds()
        self.streams = StreamRegistry(
            config.resume_grace,
            config.resume_buffer_bytes,
            self.request_ids,
            busy=(self.inflight_inc, self.inflight_dec),
            total_cap=config.resume_buffer_total_bytes,
        )
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.prep: Preprocessor | None = None
        self.metrics: Metrics | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.websockets: set[web.WebSocketResponse] = set()
        self.ws_opening = 0  # WebSocket handshakes in progress
        # Every HTTP connection a request came in on -> its requests in progress (0 = an
        # idle keep-alive connection), so SIGTERM can close the idle ones (on_shutdown).
        self.connections: dict[Any, int] = {}
        self.connections_prune_at = 64  # see app.connection_middleware
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._conn_ids = itertools.count(1)
        self.started = time.time()
        self.exit_code = 0
        self.fatal_task: asyncio.Task[None] | None = None

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
