"""CORS: a browser page served from another origin may call the API when the operator
allows that origin (`--allowed-origins`, the list that also opens /v1/ws to it).

vLLM answers every origin by default (Starlette's CORSMiddleware with `*`); here no origin
is allowed until the operator lists it, so a page on an unrelated site cannot read a
response of a server on a private network (with an API key a client holds, `*` is harmless;
without one it is not).  With origins allowed, the answers are Starlette's: a preflight
(OPTIONS with Access-Control-Request-Method) is answered before authentication (browsers
send no Authorization on one) and refused with 400 when its origin, method or headers are
not allowed; every other response to an allowed origin carries Access-Control-Allow-Origin,
set as its headers are sent, so streamed responses (SSE) carry it too, and exposes
X-Request-Id and Retry-After to the page (Starlette's default exposes none).

Written here rather than with aiohttp-cors: that library answers preflights from an
OPTIONS handler on every registered route, behind the app's middlewares, where the API-key
check would refuse them (a browser sends no key on a preflight).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# Headers a browser may always send without asking (the CORS-safelisted ones).
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE = "600"
# Response headers of this server a page may read besides the safelisted ones: the
# request's id (to quote it, or to resume its stream) and how long to back off.
EXPOSED_HEADERS = "X-Request-Id, Retry-After"


@dataclass(frozen=True)
class CorsPolicy:
    origins: frozenset[str]
    any_origin: bool
    methods: tuple[str, ...]
    headers: frozenset[str] | None  # lower-cased; None: any
    credentials: bool

    @classmethod
    def build(
        cls,
        origins: Sequence[str],
        methods: Sequence[str] = ("*",),
        headers: Sequence[str] = ("*",),
        credentials: bool = False,
    ) -> CorsPolicy | None:
        """The policy, or None when no origin is allowed (no CORS headers at all)."""
        if not origins:
            return None
        any_method = "*" in methods
        return cls(
            origins=frozenset(o.rstrip("/") for o in origins if o != "*"),
            any_origin="*" in origins,
            methods=ALL_METHODS if any_method else tuple(m.upper() for m in methods),
            headers=None if "*" in headers else frozenset(h.lower() for h in headers),
            credentials=credentials,
        )

    def allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/") in self.origins

    def allow_origin(self, origin: str) -> str:
        """Access-Control-Allow-Origin's value for an allowed origin: "*" when any origin
        is allowed and no credentials are, else the origin itself (a credentialed answer
        may not say "*")."""
        return "*" if self.any_origin and not self.credentials else origin

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"].upper()
        asked = [
            h.strip().lower()
            for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
            if h.strip()
        ]
        refused = []
        if not self.allowed(origin):
            refused.append("origin")
        if method not in self.methods:
            refused.append("method")
        if self.headers is not None and any(
            h not in self.headers and h not in SAFELISTED_HEADERS for h in asked
        ):
            refused.append("headers")
        headers = {
            "Access-Control-Allow-Methods": ", ".join(self.methods),
            "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            "Vary": "Origin",
        }
        if self.headers is None:
            if asked:
                headers["Access-Control-Allow-Headers"] = ", ".join(asked)
        else:
            headers["Access-Control-Allow-Headers"] = ", ".join(
                sorted(self.headers | SAFELISTED_HEADERS)
            )
        if refused:
            return web.Response(
                status=400, text=f"Disallowed CORS {', '.join(refused)}", headers=headers
            )
        headers["Access-Control-Allow-Origin"] = self.allow_origin(origin)
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return web.Response(status=200, text="OK", headers=headers)

    def decorate(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """An answer to an allowed origin says so (called as its headers go out)."""
        origin = request.headers.get("Origin")
        if origin is None or not self.allowed(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = self.allow_origin(origin)
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        if self.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if not (self.any_origin and not self.credentials):
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"


CORS = web.AppKey("cors", CorsPolicy)


@web.middleware
async def cors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A preflight is answered here, ahead of the API key (browsers send none on one).
    In an app's middlewares only when it has a policy (`install`)."""
    if (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    ):
        return request.app[CORS].preflight(request)
    return await handler(request)


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    request.app[CORS].decorate(request, response)


def install(app: web.Application, policy: CorsPolicy | None) -> None:
    """The policy on `app` (cors_middleware must be in its middlewares when it has one)."""
    if policy is not None:
        app[CORS] = policy
        app.on_response_prepare.append(on_response_prepare)
