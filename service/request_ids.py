"""Request ids from the client: an X-Request-Id header (else the body's request_id) is
echoed on the response and names it (`chatcmpl-<id>`), but it never becomes the engine's
request id as is.

Ids never let one client touch another's request:

- The engine's id is `<serial>:<public id>` (`LiveRequestIds.engine_id`): the serial is
  unique in the process, so no client-chosen id can equal, or through the `-<i>` /
  `#<i>` suffixes of prompts and samples collide with, another request's engine id, and
  nothing a client sends can abort, read or replace another's request.
- A client id is live from its request's arrival until its response ends, per tenant
  (the API key's one-way hash, `security.key_tenant`; one tenant when no keys are set).
  A second request with an id its own tenant has live is refused with 409 naming the
  header (or body field) that carried it; the running request is never touched.  Other
  tenants' ids are in other namespaces: the same id from another key just runs.
- WebSocket generations are namespaced by their socket (service/ws.py): a `cancel`
  only reaches its own socket's generations, and a duplicate id on one socket is an
  `error` frame (409).
"""

from __future__ import annotations

import itertools
import uuid

from aiohttp import web

from service.protocol import BadRequest

REQUEST_ID = web.RequestKey("pagestream_request_id", str)
# The caller's tenant (its API key's hash, security.key_tenant), set by the auth
# middleware when keys are configured.
TENANT = web.RequestKey("pagestream_tenant", str)
# The (tenant, client id) this request holds live, released when its handler ends.
_CLAIM = web.RequestKey("pagestream_request_id_claim", tuple)


class LiveRequestIds:
    """The client ids of requests in flight, per tenant, and the serial that makes every
    engine request id unique.  Owned by the event loop thread."""

    def __init__(self) -> None:
        self.live: set[tuple[str | None, str]] = set()
        self._serial = itertools.count(1)

    def engine_id(self, public: str) -> str:
        return f"{next(self._serial)}:{public}"

    def claim(self, tenant: str | None, client_id: str) -> bool:
        """Hold `client_id` for `tenant`; False if that tenant already holds it."""
        key = (tenant, client_id)
        if key in self.live:
            return False
        self.live.add(key)
        return True

    def release(self, tenant: str | None, client_id: str) -> None:
        self.live.discard((tenant, client_id))


LIVE_IDS = web.AppKey("pagestream_live_request_ids", LiveRequestIds)


def request_id(request: web.Request, body_id: str | None, prefix: str) -> tuple[str, str]:
    """(public id, engine id) of a request: the public one is `<prefix><client id>`
    (X-Request-Id header, else the body's request_id, else a fresh one), echoed in the
    response; the engine one is unique (see the module docstring).  A client id the same
    tenant has live is a 409.  The id stays held until `release_request_id`."""
    header = request.headers.get("X-Request-Id")
    given = header or body_id
    param = "X-Request-Id" if header else "request_id"
    if given is not None and not (0 < len(given) <= 256 and given.isprintable()):
        raise BadRequest("X-Request-Id must be 1-256 printable characters", param)
    rid = given or uuid.uuid4().hex
    request[REQUEST_ID] = rid
    ids = request.app[LIVE_IDS]
    if given:
        tenant = request.get(TENANT)
        if not ids.claim(tenant, given):
            raise BadRequest(
                f"request id {given!r} is already in use by a request in progress; "
                "use a new id for each request",
                param,
                status=409,
            )
        request[_CLAIM] = (tenant, given)
    public = prefix + rid
    return public, ids.engine_id(public)


def take_claim(request: web.Request) -> tuple[str | None, str] | None:
    """Take the request's client-id claim over (a resumable stream outlives its handler
    and releases the id when its log is dropped, service/resume.py)."""
    return request.pop(_CLAIM, None)  # type: ignore[no-any-return]


def release_request_id(request: web.Request) -> None:
    """The request's handler is done: its client id may be used again."""
    claim = request.get(_CLAIM)
    if claim is not None:
        del request[_CLAIM]
        request.app[LIVE_IDS].release(*claim)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response carries the request's id (the client's
    X-Request-Id when it sent one), streams included."""
    rid = request.get(REQUEST_ID) or request.headers.get("X-Request-Id")
    if rid and rid.isprintable() and len(rid) <= 256:
        response.headers["X-Request-Id"] = rid


def conversation_key(tenant: str | None, conversation_id: str | None) -> str | None:
    """The engine's key of a client's conversation (scheduler/pins.py), in its tenant's
    namespace like request ids: the same id from another API key is another conversation,
    so no key can pin, replace or release another's."""
    if conversation_id is None:
        return None
    return f"{tenant or ''}\x1f{conversation_id}"
