"""Resumable streams in a real headless chromium (issue 51): the browser reaches the
server through a TCP proxy on loopback that stands for its network, slow (so answers are
mid-way when it goes) and cut on demand (every connection reset at once, as when a phone
changes networks).  SSE through the browser's own EventSource, which reconnects by
itself and sends Last-Event-ID; and the chat page, whose WebSocket generation resumes by
itself on the next socket.  The answer equals an uninterrupted greedy run's, every event
arriving once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.sync.client import connect

from tests.checkpoints import tiny_checkpoint
from tests.e2e.browser import (
    SocketLog,
    chromium_context,
    chromium_path,
    settings,
    wait_connected,
    wait_until,
)
from tests.service.live_server import LiveServer, free_port, live_server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]


class Network:
    """A TCP forwarder: the browser's network.  Server-to-browser bytes go at most
    `chunk` bytes every 10 ms; `cut()` resets every open connection at once; the
    browser-to-server bytes are kept, so a test can see the requests it sent."""

    def __init__(self, target_port: int, chunk: int) -> None:
        self.target = target_port
        self.chunk = chunk
        self.port = free_port()
        self.sent = bytearray()  # everything the browser sent
        self.loop = asyncio.new_event_loop()
        self.writers: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers |= {down_w, up_w}
        up = asyncio.create_task(self._pipe(down_r, up_w, 1 << 16, 0.0, self.sent))
        await self._pipe(up_r, down_w, self.chunk, 0.01, None)
        up.cancel()

    async def _pipe(self, r: Any, w: Any, n: int, pause: float, keep: bytearray | None) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(n):
                if keep is not None:
                    keep += data
                w.write(data)
                await w.drain()
                await asyncio.sleep(pause)
        w.transport.abort()

    def cut(self) -> None:
        def reset() -> None:
            for w in self.writers:
                w.transport.abort()
            self.writers.clear()

        self.loop.call_soon_threadsafe(reset)

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.server.close)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    chromium_path()  # skip before loading anything when there is no browser
    with live_server(str(tiny_checkpoint("llama"))) as s:
        yield s


@pytest.fixture
def context(tmp_path: Any) -> Iterator[Any]:
    with chromium_context(tmp_path / "profile") as ctx:
        yield ctx


@contextlib.contextmanager
def network(server: LiveServer, chunk: int) -> Iterator[Network]:
    net = Network(server.config.port, chunk)
    try:
        yield net
    finally:
        net.close()


# The page's half of the SSE test: POST the request with fetch, read `n` events, then
# drop the connection (abort); go on with an EventSource on the resume address, from the
# last event seen.  Everything received lands in window.__got.
START_JS = """
async ([body, n]) => {
  const got = (window.__got = {events: [], opens: 0, errors: 0, done: false});
  const ctrl = new AbortController();
  const resp = await fetch("/v1/completions", {method: "POST", signal: ctrl.signal,
    headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const reader = resp.body.getReader();
  const text = new TextDecoder();
  let buf = "";
  while (got.events.length < n) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += text.decode(value, {stream: true});
    let end;
    while ((end = buf.indexOf("\\n\\n")) >= 0) {
      const ev = {};
      for (const line of buf.slice(0, end).split("\\n")) {
        const at = line.indexOf(": ");
        ev[line.slice(0, at)] = line.slice(at + 2);
      }
      buf = buf.slice(end + 2);
      got.events.push({id: ev.id, data: ev.data});
    }
  }
  ctrl.abort();
  const last = got.events[got.events.length - 1];
  const rid = JSON.parse(last.data).id;
  const source = new EventSource(`/v1/streams/${rid}?last_event_id=${last.id}`);
  source.onopen = () => { got.opens += 1; };
  source.onerror = () => { got.errors += 1; };
  source.onmessage = (e) => {
    got.events.push({id: e.lastEventId, data: e.data});
    if (e.data === "[DONE]") { source.close(); got.done = true; }
  };
  return got.events.length;
}
"""


def completion_text(events: list[dict[str, str]]) -> tuple[str, list[int]]:
    chunks = [json.loads(e["data"]) for e in events if e["data"] != "[DONE]"]
    return (
        "".join(c["choices"][0]["text"] for c in chunks),
        [t for c in chunks for t in c["choices"][0]["token_ids"]],
    )


def test_event_source_resumes_through_two_cuts(server: LiveServer, context: Any) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:  # the uninterrupted run
        want = [b[6:] for b in r.read().decode().split("\n") if b.startswith("data: ")]
    want_answer = completion_text([{"data": d} for d in want])
    with network(server, chunk=512) as net:
        page = context.new_page()
        page.goto(net.url + "/health")
        # Cut 1: the page drops its fetch mid-answer, after 10 events (or a few more).
        seen = page.evaluate(START_JS, [body, 10])
        got = lambda: page.evaluate("window.__got")  # noqa: E731
        wait_until(page, lambda: len(got()["events"]) >= 40, 30, "events on the EventSource")
        net.cut()  # cut 2: the network; EventSource reconnects by itself
        wait_until(page, lambda: got()["done"], 60, "the stream's [DONE]")
        # The reconnect carried the position in the header a browser sets itself.
        sent = net.sent.decode("latin-1").lower()
        resumes = re.findall(r"get /v1/streams/[^\r]*\r\n(?:[^\r]+\r\n)*", sent)
        assert len(resumes) == 2, resumes
        assert "last-event-id:" not in resumes[0] and f"?last_event_id={seen} " in resumes[0]
        assert "\r\nlast-event-id: " in resumes[1]
        final = got()
    assert final["opens"] == 2 and final["errors"] >= 1
    events = final["events"]
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == want_answer
    assert len(want_answer[1]) == 300
    server.wait_kv_free(timeout=10)


def test_chat_page_resumes_by_itself_after_a_blip(server: LiveServer, context: Any) -> None:
    from playwright.sync_api import expect

    with network(server, chunk=96) as net:
        page = context.new_page()
        sockets = SocketLog(page)
        page.goto(net.url + "/")
        wait_connected(page)
        settings(page, max_tokens=300)
        page.fill("#temperature", "0")
        page.fill("#input", "Tell me a story")
        page.press("#input", "Enter")
        bubble = page.locator(".msg.assistant").nth(0)
        page.wait_for_function(
            "() => (document.querySelector('.msg.assistant .text')?.textContent.length ?? 0) > 0"
        )
        net.cut()  # the network blips mid-reply
        expect(bubble).to_have_attribute("data-finish", "length", timeout=60_000)
        shown = bubble.locator(".text").text_content()
        wait_until(page, lambda: sockets.sent_of("resume"), what="the resume frame")
    (gen,) = sockets.sent_of("generate")
    (resume,) = sockets.sent_of("resume")
    frames = sockets.received_of("delta", gen["id"]) + sockets.received_of("done", gen["id"])
    assert len(sockets.urls) == 2 and resume["id"] == gen["id"] and resume["after"] >= 1
    assert sorted(f["seq"] for f in frames) == list(range(1, len(frames) + 1))
    assert "".join(f["text"] for f in frames if f["type"] == "delta") == shown
    assert shown == uninterrupted(server, gen)
    assert bubble.get_attribute("class") and "excluded" not in bubble.get_attribute("class")
    server.wait_kv_free(timeout=10)


def uninterrupted(server: LiveServer, frame: dict[str, Any]) -> str:
    """The page's own generate frame, straight to the server on one socket."""
    with connect(server.ws_url) as ws:
        ws.send(json.dumps(frame))
        text = ""
        while (f := json.loads(ws.recv(timeout=60)))["type"] != "done":
            text += f.get("text", "")
        return text
