"""Edge security helpers: the WebSocket Origin check (also behind a trusted reverse
proxy), API-key salts for the prefix cache, and an access log that never shows a key."""

from __future__ import annotations

import hashlib
import ipaddress
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def key_salt(key: str) -> str:
    """The prefix-cache salt of one API key: the same on every replica (so a key's blocks
    are shared across the fleet through Redis), and a one-way function of the key (the
    block hashes in Redis reveal nothing about it)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16, person=b"ps-key-salt").hexdigest()
    return "key:" + digest


def parse_networks(items: list[str]) -> list[Network]:
    nets = []
    for item in items:
        if item == "*":
            nets += [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
        else:
            nets.append(ipaddress.ip_network(item, strict=False))
    return nets


def peer_trusted(request: web.Request, nets: list[Network]) -> bool:
    if not nets or request.remote is None:
        return False
    try:
        addr = ipaddress.ip_address(request.remote)
    except ValueError:  # a unix socket
        return False
    return any(addr.version == n.version and addr in n for n in nets)


def forwarded(request: web.Request) -> tuple[str | None, str | None]:
    """(host, scheme) the client used, as a trusted proxy reports it: X-Forwarded-Host /
    -Proto / -Port (nginx, most ingresses), else RFC 7239 Forwarded.  The first (client-
    side) entry counts when proxies are chained."""
    h = request.headers
    host = h.get("X-Forwarded-Host", "").split(",")[0].strip() or None
    scheme = h.get("X-Forwarded-Proto", "").split(",")[0].strip().lower() or None
    port = h.get("X-Forwarded-Port", "").split(",")[0].strip()
    if host is None and request.forwarded:
        first = request.forwarded[0]
        host, scheme = first.get("host"), (first.get("proto") or "").lower() or None
    if host and port and ":" not in host.rsplit("]", 1)[-1]:
        host = f"{host}:{port}"
    return host, scheme


def origin_key(scheme: str, netloc: str) -> tuple[str, str]:
    """scheme and host:port with the scheme's default port made explicit."""
    scheme = scheme.lower()
    netloc = netloc.lower()
    if ":" not in netloc.rsplit("]", 1)[-1]:
        netloc += ":443" if scheme in {"https", "wss"} else ":80"
    return {"wss": "https", "ws": "http"}.get(scheme, scheme), netloc


def check_origin(
    request: web.Request, allowed: list[str], trusted_proxies: list[Network] | None = None
) -> bool:
    """Refuse cross-site WebSocket hijacking: a browser always sends Origin; it must be the
    origin the page was served from (this server's Host, or what a trusted reverse proxy
    says the client asked for) or one the operator allowed.  Non-browser clients send none."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    parts = urlsplit(origin)
    if not parts.netloc:
        return False  # "null" (sandboxed frames, file://) is never our own page
    got = origin_key(parts.scheme, parts.netloc)
    if peer_trusted(request, trusted_proxies or []):
        host, scheme = forwarded(request)
        if host:
            return got == origin_key(scheme or request.scheme, host)
    # Scheme is not compared here: behind a TLS-terminating proxy that is not trusted the
    # server sees http while the page is https; the host:port still has to match.
    own = origin_key(parts.scheme, request.host)
    return got[1] == own[1] or parts.netloc.lower() == request.host.lower()


SECRET_PARAMS = frozenset({"api_key"})


def redacted_target(request: web.BaseRequest) -> str:
    """The request target with secrets in the query string masked (browsers send the API
    key as ?api_key= on /v1/ws; it must never reach a log)."""
    url = request.rel_url
    if not SECRET_PARAMS.intersection(url.query):
        return str(url)
    masked = [(k, "REDACTED" if k in SECRET_PARAMS else v) for k, v in url.query.items()]
    return str(url.with_query(masked))


class AccessLogger(AbstractAccessLogger):
    """One line per request, like uvicorn's and nginx's, with the API key redacted (the
    Authorization header is never logged at all)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %d %.3fs',
            request.remote, request.method, redacted_target(request),
            request.version.major, request.version.minor,
            response.status, response.body_length, time,
        )  # fmt: skip
