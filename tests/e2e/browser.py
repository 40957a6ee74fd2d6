"""Helpers for driving the chat page in Debian's chromium with playwright.

Chromium comes from apt (`apt-get install -y chromium`), not from playwright's own
download, so the tests run the same browser locally and in CI.  Without it the browser
tests skip, except under CI=true, where a missing browser is a broken CI image and fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Records the last assistant bubble's text length at every DOM mutation.  The tiny test
# model streams a token every few milliseconds, faster than any polling from the test
# process, but each WebSocket message is its own task, so the observer (a microtask) sees
# the bubble between deltas.  Installed before the page's scripts run.
STREAM_RECORDER_JS = """
window.__streamLog = [];
new MutationObserver(() => {
  const bubbles = document.querySelectorAll(".msg.assistant");
  const last = bubbles[bubbles.length - 1];
  if (!last) return;
  const text = last.querySelector(".text");
  window.__streamLog.push({
    bubble: bubbles.length,
    len: text ? text.textContent.length : 0,
    finish: last.dataset.finish || null,
  });
}).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
"""


def _missing(what: str) -> None:
    msg = f"{what}; browser tests need it (CI installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def chromium_path() -> str:
    """Debian's chromium binary, or skip (fail under CI=true)."""
    path = shutil.which("chromium")
    if path is None and os.access("/usr/bin/chromium", os.X_OK):
        path = "/usr/bin/chromium"
    if path is None:
        _missing("Debian's chromium is not installed (apt-get install -y chromium)")
    return path  # type: ignore[return-value]


@contextlib.contextmanager
def chromium_context(user_data_dir: Path, timeout_ms: float = 15_000) -> Iterator[Any]:
    """A headless chromium with a fresh profile; yields a playwright BrowserContext."""
    executable = chromium_path()
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    # `expect` assertions have their own 5 s default that set_default_timeout does not
    # touch; a reply streaming on a loaded 2-core machine can take longer than that.
    expect.set_options(timeout=timeout_ms)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            timeout=30_000,
        )
        context.set_default_timeout(timeout_ms)
        context.set_default_navigation_timeout(timeout_ms)
        try:
            yield context
        finally:
            context.close()


def _decode(payload: str | bytes) -> dict[str, Any]:
    try:
        return json.loads(payload)
    except ValueError:
        return {"type": "<not json>", "raw": payload}


class SocketLog:
    """Every JSON frame the page sends and receives on /v1/ws (all its sockets)."""

    def __init__(self, page: Any) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self.urls: list[str] = []
        page.on("websocket", self._on_socket)

    def _on_socket(self, ws: Any) -> None:
        if ws.url.split("?", 1)[0].endswith("/v1/ws"):
            self.urls.append(ws.url)
            ws.on("framesent", lambda p: self.sent.append(_decode(p)))
            ws.on("framereceived", lambda p: self.received.append(_decode(p)))

    def sent_of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.sent if f.get("type") == kind]

    def received_of(self, kind: str, gen_id: str | None = None) -> list[dict[str, Any]]:
        return [
            f
            for f in self.received
            if f.get("type") == kind and (gen_id is None or f.get("id") == gen_id)
        ]


# ---------------------------------------------------------------- the chat page
def wait_connected(page: Any) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#status")).to_have_attribute("data-state", "open")
    expect(page.locator("#send")).to_be_enabled()


def settings(page: Any, *, max_tokens: int, seed: int | None = 1, ignore_eos: bool = True) -> None:
    """The chat page's advanced settings.  A fixed seed and ignore_eos make the
    random-weight model's reply length predictable."""
    if not page.eval_on_selector("#advanced", "d => d.open"):
        page.click("#advanced summary")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#seed", "" if seed is None else str(seed))
    page.set_checked("#ignore-eos", ignore_eos)


def ask(page: Any, text: str, finish: str = "length") -> Any:
    """Send `text` as the conversation's first message; the reply's bubble once it ended
    with `finish`, its text non-empty."""
    from playwright.sync_api import expect

    page.fill("#input", text)
    page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").nth(0)
    expect(reply).to_have_attribute("data-finish", finish)
    assert reply.locator(".text").text_content()
    return reply


def wait_until(page: Any, cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll `cond` while letting playwright deliver events (frame logs fill in between)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or cond}")
        page.wait_for_timeout(20)


@contextlib.contextmanager
def record_chats(prep: Any) -> Iterator[list[list[dict[str, Any]]]]:
    """The chat messages the server renders into prompts (service.prep.Preprocessor)."""
    seen: list[list[dict[str, Any]]] = []
    original = prep.chat_ids

    async def spy(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        seen.append([dict(m) for m in messages])
        return await original(messages, *args, **kwargs)

    prep.chat_ids = spy  # an instance attribute shadows the method
    try:
        yield seen
    finally:
        del prep.chat_ids
