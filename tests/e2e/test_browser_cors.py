"""A page served from another origin calls the API from a real headless chromium: the
browser runs the preflight, sends the key, and reads the stream when the operator allowed
that origin (`--allowed-origins`); from any other origin the browser withholds the answer."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.e2e.browser import chromium_context, chromium_path
from tests.service.live_server import free_port, live_server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

KEY = "cors-browser-key"
PAGE = b"""<!doctype html><html><body><script>
window.callApi = async ([url, key]) => {
  try {
    const r = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 3,
                            stream: true, ignore_eos: true}),
    });
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let text = "";
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      text += dec.decode(value);
    }
    return {ok: true, status: r.status, text, requestId: r.headers.get("X-Request-Id")};
  } catch (e) {
    return {ok: false, error: String(e)};
  }
};
</script></body></html>"""


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def page_server() -> Iterator[int]:
    """The page's own origin: a plain static server on another port."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Page)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_page_on_an_allowed_origin_reads_the_stream_and_others_cannot(tmp_path) -> None:
    chromium_path()
    with page_server() as page_port:
        allowed = f"http://localhost:{page_port}"
        with (
            live_server(str(tiny_checkpoint("llama")), api_key=KEY,
                        allowed_origins=[allowed]) as api,
            chromium_context(tmp_path / "profile") as ctx,
        ):  # fmt: skip
            page = ctx.new_page()
            page.goto(allowed + "/")
            got = page.evaluate("callApi", [api.url, KEY])
            assert got["ok"] and got["status"] == 200, got
            assert '"chat.completion.chunk"' in got["text"] and "[DONE]" in got["text"]
            # The exposed header is readable by the page (the chunks' id carries it).
            assert got["requestId"] and f"chatcmpl-{got['requestId']}" in got["text"], got
            # The same page from 127.0.0.1 is another origin: the browser refuses to let
            # it read the answer (the preflight is refused, so nothing is generated).
            page.goto(f"http://127.0.0.1:{page_port}/")
            got = page.evaluate("callApi", [api.url, KEY])
            assert not got["ok"] and "Failed to fetch" in got["error"], got
            api.wait_kv_free()
