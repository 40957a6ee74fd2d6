"""HTTP helpers the OpenAI routes, the WebSocket and the app share: OpenAI-shaped error
and JSON bodies, bounded writes to a slow reader, and the tenant's prefix-cache salt."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import orjson
from aiohttp import web


class SlowClient(ConnectionResetError):
    """An SSE client stopped reading; its connection has been dropped."""


async def wait_drained(transport: asyncio.BaseTransport | None, limit: int) -> None:
    """Wait until at most `limit` bytes wait in the transport's buffer.  (aiohttp drains
    only every 64 KiB written, and only above asyncio's high-water mark; this bound is
    the operator's.)  Polls: it only runs for a client that is already behind."""
    if transport is None:
        return
    while transport.get_write_buffer_size() > limit:  # type: ignore[attr-defined]
        if transport.is_closing():
            raise ConnectionResetError("the client went away")
        await asyncio.sleep(0.05)


def write_cannot_wait(request: web.Request, size: int, limit: int) -> bool:
    """Whether writing `size` more bytes to `request`'s connection cannot wait: its
    writes are not paused and the transport's buffer stays within both its high-water
    mark (past it aiohttp's drain would wait) and `limit` (the caller's bound).  Then a
    write needs no timeout: arming and cancelling one per event, for every stream on
    every step, was a large share of the server's cost per token."""
    protocol = request.protocol
    transport = protocol.transport if protocol is not None else None
    if transport is None or protocol.writing_paused or transport.is_closing():
        return False
    high = transport.get_write_buffer_limits()[1]  # type: ignore[attr-defined]
    return transport.get_write_buffer_size() + size <= min(high, limit)  # type: ignore[attr-defined]


def write_now(request: web.Request, resp: web.StreamResponse, data: bytes, limit: int) -> bool:
    """Write `data` as one chunk of `resp`'s chunked body now, without a coroutine, when
    nothing about it can wait (`write_cannot_wait`) and the body is a plain one whose
    headers are out (no compression, no declared length, no send hooks).  False: nothing
    was written, take the awaited path (`resp.write`).  Per event it saves the three
    coroutines between the caller and the transport, for every stream on every step.
    Goes through aiohttp's own chunk writer, so its byte counts stay right; an aiohttp
    without these attributes always gets the awaited path."""
    w: Any = getattr(resp, "_payload_writer", None)
    try:
        if (
            w is None
            or w._headers_buf is not None  # the first write carries the headers
            or not w.chunked
            or w._compress is not None
            or w.length is not None
            or w._on_chunk_sent is not None
            or w.on_body_write is not None
            or not write_cannot_wait(request, len(data) + 16, limit)  # + the chunk's framing
        ):
            return False
        write = w._write_chunked_payload
    except AttributeError:
        return False
    write(data)
    return True


# The body field that asked for structured output: a grammar that fails mid-generation
# (the client's fault, RequestFailed.status 400) is reported against it.
SPEC_FIELD = web.RequestKey("pagestream_spec_field", str)


def limit_send_buffer(request: web.Request, nbytes: int | None) -> None:
    """Cap the kernel send buffer of a streaming connection (None: the OS autotunes it,
    up to net.ipv4.tcp_wmem's maximum, 4 MiB by default).  What a stalled reader can make
    the server hold is this plus the transport's and the outbox's bounds."""
    if not nbytes or request.transport is None:
        return
    sock = request.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)


SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


# Request key under which the auth middleware leaves the caller's API-key salt.
TENANT_SALT = web.RequestKey("pagestream_tenant_salt", str)


def salted(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's prefix blocks are hashed under: its API key's (None when the
    operator shares the cache or has no keys), then the client's own `cache_salt` inside
    it, so no client-chosen salt can reach another key's blocks."""
    if tenant is None:
        return cache_salt
    return f"{tenant}/{cache_salt}" if cache_salt else tenant


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> bytes:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "invalid_request_error",
        413: "invalid_request_error",
        421: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    )


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=error_body(message, status, param, code),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def json_response(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")
