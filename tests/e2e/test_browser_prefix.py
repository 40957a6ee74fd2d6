"""The chat page behind a reverse proxy that serves it under a path prefix (nginx,
`location /llm/ { proxy_pass http://server/; }`), in a real headless chromium: its script,
style sheet, model list and WebSocket all resolve under the prefix, and a reply streams."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.e2e.browser import ask, chromium_context, chromium_path, settings
from tests.service.live_server import free_port, live_server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

CONF = """daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location /llm/ {{
            proxy_pass http://127.0.0.1:{upstream}/;
            proxy_http_version 1.1;
            proxy_set_header Host $http_host;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_buffering off;
        }}
    }}
}}
"""


def _nginx() -> str:
    path = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is not installed (apt-get install -y nginx)")
        pytest.skip("nginx is not installed")
    return path


@contextlib.contextmanager
def prefix_proxy(root: Path, upstream: int) -> Iterator[str]:
    """nginx serving the server under /llm/ on a port of its own."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = root / "nginx.conf"
    conf.write_text(CONF.format(root=root, port=port, upstream=upstream))
    proc = subprocess.Popen([_nginx(), "-c", str(conf), "-p", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/llm/"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (root / "error.log").read_text()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "health", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, "nginx did not come up"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_chat_page_works_under_a_path_prefix(tmp_path: Path) -> None:
    from playwright.sync_api import expect

    chromium_path()
    with (
        live_server(str(tiny_checkpoint("llama"))) as server,
        prefix_proxy(tmp_path / "nginx", int(server.url.rsplit(":", 1)[1])) as url,
        chromium_context(tmp_path / "profile") as ctx,
    ):
        page = ctx.new_page()
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        page.goto(url)
        expect(page.locator("#status")).to_have_attribute("data-state", "open")
        assert sockets and all("/llm/v1/ws" in u for u in sockets), sockets
        # The model list came through the prefix too (the page names the model).
        expect(page.locator("#model")).not_to_be_empty()
        settings(page, max_tokens=8, seed=None)
        ask(page, "Hello there")
        server.wait_kv_free()
