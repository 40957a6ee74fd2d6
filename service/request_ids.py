"""Request ids from the client: an X-Request-Id header (else the body's request_id)
becomes the engine's request id and is echoed on the response."""

from __future__ import annotations

import uuid

from aiohttp import web

from service.protocol import BadRequest

REQUEST_ID = web.RequestKey("pagestream_request_id", str)


def request_id(request: web.Request, body_id: str | None, prefix: str) -> str:
    """The client's id (X-Request-Id header, else the body's request_id) or a fresh one;
    remembered on the request so the response echoes it."""
    given = request.headers.get("X-Request-Id") or body_id
    if given is not None and not (0 < len(given) <= 256 and given.isprintable()):
        raise BadRequest("X-Request-Id must be 1-256 printable characters", "X-Request-Id")
    rid = given or uuid.uuid4().hex
    request[REQUEST_ID] = rid
    return f"{prefix}-{rid}"


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response carries the request's id (the client's
    X-Request-Id when it sent one), streams included."""
    rid = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
    if rid and rid.isprintable() and len(rid) <= 256:
        response.headers["X-Request-Id"] = rid
