"""CORS on the HTTP API: no origin is answered until the operator allows it
(`--allowed-origins`); an allowed one gets Starlette's answers (vLLM's), preflights before
the API key, and the header on streamed responses too.  A real browser's view of the same is
tests/e2e/test_browser_cors.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from service.cli import build_parser, server_config
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import LiveServer, live_server

KEY = "cors-key"
ALLOWED = "https://chat.example.com"
PREFLIGHT = {
    "Origin": ALLOWED,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[LiveServer]:
    with live_server(model, api_key=KEY, allowed_origins=[ALLOWED]) as s:
        yield s


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _call(
    url: str, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, headers=headers, json=body) as r,
    ):
        return r.status, dict(r.headers), await r.read()


def test_a_preflight_from_an_allowed_origin_is_answered_before_the_key(server) -> None:
    status, h, _ = _run(_call(server.url, "OPTIONS", "/v1/chat/completions", PREFLIGHT))
    assert status == 200
    assert h["Access-Control-Allow-Origin"] == ALLOWED and "Origin" in h["Vary"]
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "Access-Control-Allow-Credentials" not in h


def test_a_preflight_from_another_origin_is_refused(server) -> None:
    status, h, body = _run(
        _call(server.url, "OPTIONS", "/v1/chat/completions", PREFLIGHT | {"Origin": "https://evil.example"})
    )  # fmt: skip
    assert status == 400 and b"Disallowed CORS origin" in body
    assert "Access-Control-Allow-Origin" not in h


def test_a_streamed_answer_to_an_allowed_origin_carries_the_header(server) -> None:
    body = {"prompt": "one", "max_tokens": 3, "stream": True, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    status, h, raw = _run(
        _call(server.url, "POST", "/v1/completions", auth | {"Origin": ALLOWED}, body)
    )
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    assert h["Access-Control-Allow-Origin"] == ALLOWED
    # The page may read the request's id (to quote it, or resume the stream).
    lower = {k.lower(): v for k, v in h.items()}
    assert lower["x-request-id"] and "X-Request-Id" in h["Access-Control-Expose-Headers"]
    # Another origin's call is served (the key decides that) but not readable by its page.
    status, h, _ = _run(
        _call(server.url, "POST", "/v1/completions", auth | {"Origin": "https://evil.example"},
              body)
    )  # fmt: skip
    assert status == 200 and "Access-Control-Allow-Origin" not in h
    # An error answer says so too, so the page can read why.
    status, h, _ = _run(_call(server.url, "POST", "/v1/completions", {"Origin": ALLOWED}, body))
    assert status == 401 and h["Access-Control-Allow-Origin"] == ALLOWED


def test_without_allowed_origins_there_is_no_cors(model: str) -> None:
    with live_server(model) as s:
        status, h, _ = _run(_call(s.url, "OPTIONS", "/v1/chat/completions", PREFLIGHT))
        assert status == 405 and "Access-Control-Allow-Origin" not in h
        status, h, _ = _run(_call(s.url, "GET", "/v1/models", {"Origin": ALLOWED}))
        assert status == 200 and "Access-Control-Allow-Origin" not in h


def test_the_flags_as_vllm_gives_them_and_credentials(model: str) -> None:
    argv = [
        "--allowed-origins", '["*"]', "--allowed-methods", "GET,POST",
        "--allowed-headers", '["Authorization"]', "--allow-credentials",
    ]  # fmt: skip
    c = server_config(build_parser().parse_args(["serve", *argv]))
    assert c.allowed_origins == ["*"] and c.allowed_methods == ["GET", "POST"]
    assert c.allowed_headers == ["Authorization"] and c.allow_credentials
    with live_server(
        model, allowed_origins=["*"], allowed_methods=["GET", "POST"],
        allowed_headers=["Authorization"], allow_credentials=True,
    ) as s:  # fmt: skip
        origin = {"Origin": "https://any.example"}
        status, h, _ = _run(_call(s.url, "OPTIONS", "/v1/models", PREFLIGHT | origin))
        # A credentialed answer names the origin (never "*").
        assert status == 200 and h["Access-Control-Allow-Origin"] == "https://any.example"
        assert h["Access-Control-Allow-Credentials"] == "true"
        assert h["Access-Control-Allow-Methods"] == "GET, POST"
        bad = PREFLIGHT | origin | {"Access-Control-Request-Method": "DELETE"}
        status, _, body = _run(_call(s.url, "OPTIONS", "/v1/models", bad))
        assert status == 400 and b"method" in body
        bad = PREFLIGHT | origin | {"Access-Control-Request-Headers": "x-custom"}
        status, _, body = _run(_call(s.url, "OPTIONS", "/v1/models", bad))
        assert status == 400 and b"headers" in body
