"""Edge security helpers: the Host allow-list (DNS rebinding), the WebSocket Origin check
(also behind a trusted reverse proxy), API-key salts for the prefix cache and tenant ids,
and an access log that never shows a key."""

from __future__ import annotations

import hashlib
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from typing import Any
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


def key_tenant(key: str) -> str:
    """The tenant id of one API key: what request ids are namespaced by and the shared
    prefix tier's per-key share is counted under.  A one-way function of the key (safe in
    logs and in Redis key names; the key itself is never logged), the same on every
    replica."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"ps-tenant").hexdigest()
    return "t" + digest


# ------------------------------------------------------------------ Host allow-list
LOCAL_HOST_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def split_host(value: str) -> str:
    """The host part of a Host header (or X-Forwarded-Host) value, lower case, without
    port, brackets or trailing dot: `[::1]:8000` -> `::1`, `Example.com.:80` -> `example.com`."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1 : v.find("]")] if "]" in v else v[1:]
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowedHosts:
    """Which Host headers the server answers (`--allowed-hosts`), against DNS rebinding:
    a page on attacker.example whose name is re-pointed at this server gets its requests
    in with `Host: attacker.example`, which is not on the list.

    Always allowed: a Host that is an IP address (a browser only sends one when the user
    typed the address: no name was rebound; probes and scrapers that use pod IPs keep
    working), `localhost` and `*.localhost` (browsers resolve those to loopback without
    DNS), and a request with no Host (HTTP/1.0 tools; no browser).  Then the names listed:
    exact (`chat.example.com`), `.example.com` for it and every subdomain, or `*` for any.
    Unset, the list is the `--host` name when it is one, plus this machine's hostname when
    bound to every interface (`0.0.0.0`, `::`); behind a proxy or ingress that passes the
    client's Host on, list the public names (or `*`)."""

    names: frozenset[str]
    suffixes: tuple[str, ...] = ()
    any_host: bool = False

    @classmethod
    def build(cls, items: list[str] | None, bind_host: str = "127.0.0.1") -> AllowedHosts:
        if items is None:
            items = [bind_host] if bind_host not in WILDCARD_BINDS else [socket.gethostname()]
        names: set[str] = set()
        suffixes: list[str] = []
        for raw in items:
            item = raw.strip().lower()
            if item == "*":
                return cls(frozenset(), (), any_host=True)
            if item.startswith("*."):
                item = item[1:]
            if item.startswith("."):
                suffixes.append(item.rstrip("."))
                names.add(item.strip("."))
            elif item:
                names.add(split_host(item))
        return cls(frozenset(names), tuple(suffixes))

    def allows(self, host: str | None) -> bool:
        """Whether a Host header value (port and all) may be answered."""
        if host is None or self.any_host:
            return True
        h = split_host(host)
        if h in LOCAL_HOST_NAMES or h.endswith(".localhost") or h in self.names or _is_ip(h):
            return True
        return any(h.endswith(suffix) for suffix in self.suffixes)


def host_refusal(
    request: web.Request, allowed: AllowedHosts, trusted_proxies: list[Network] | None = None
) -> str | None:
    """The header whose host is not allowed (`Host`, or `X-Forwarded-Host` / `Forwarded`
    from a trusted proxy, which speaks for the client's browser), or None when both pass."""
    if not allowed.allows(request.headers.get("Host")):
        return "Host"
    if trusted_proxies and peer_trusted(request, trusted_proxies):
        host, _ = forwarded(request)
        if host is not None and not allowed.allows(host):
            return "X-Forwarded-Host" if "X-Forwarded-Host" in request.headers else "Forwarded"
    return None


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
    request: web.Request,
    allowed: list[str],
    trusted_proxies: list[Network] | None = None,
    allowed_hosts: AllowedHosts | None = None,
) -> bool:
    """Refuse cross-site WebSocket hijacking: a browser always sends Origin; it must be the
    origin the page was served from (this server's Host, or what a trusted reverse proxy
    says the client asked for) or one the operator allowed.  Non-browser clients send none.
    "Same origin as the Host" only counts for a Host on the allow-list: with DNS
    rebinding, Origin and Host are both the attacker's name (the HTTP middleware refuses
    such a Host first; this holds on its own too)."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    parts = urlsplit(origin)
    if not parts.netloc:
        return False  # "null" (sandboxed frames, file://) is never our own page
    if allowed_hosts is not None and host_refusal(request, allowed_hosts, trusted_proxies):
        return False
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


def server_ssl_context(config: Any) -> ssl.SSLContext | None:
    """TLS for the listening socket (--ssl-certfile / --ssl-keyfile, as vLLM's uvicorn
    takes them), or None for plain HTTP.  With --ssl-ca-certs and --ssl-cert-reqs 1 or 2
    (ssl.CERT_OPTIONAL / CERT_REQUIRED) client certificates are checked against those CAs:
    mutual TLS.  A file that cannot be read is a ValueError naming its flag."""
    if not (config.ssl_certfile or config.ssl_keyfile):
        if config.ssl_ca_certs or config.ssl_cert_reqs:
            raise ValueError(
                "--ssl-ca-certs / --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile"
            )
        return None
    if not (config.ssl_certfile and config.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if config.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
    if config.ssl_cert_reqs and not config.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check clients against")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile / --ssl-keyfile: {e}") from None
    if config.ssl_ca_certs:
        try:
            ctx.load_verify_locations(cafile=config.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs: {e}") from None
    ctx.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    return ctx
