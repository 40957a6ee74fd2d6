"""The compose topology run for real on loopback (bench/fleet.py): redis-server, three
`pagestream serve` replicas and Debian's nginx with docker/nginx.conf, driven through the
balancer.  Each scenario lives in bench/fleet_checks.py (shared with `make fleet`) and
asserts its own invariants; the tests below add what the report must show.

Needs nginx and redis-server (and chromium for the chat page): skipped without them on a
developer machine, a failure under CI=true, where .ci/run installs them.  The tests share
one fleet and run in file order (later ones use the sessions the affinity test mapped).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bench import fleet_checks as fc
from bench.fleet import Fleet, nginx_binary
from tests.checkpoints import tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.fleet, pytest.mark.timeout(180)]

RESULTS: dict[str, Any] = {}


def _need(what: str, found: object) -> None:
    if not found:
        msg = f"{what} is not installed (apt-get install -y {what}); the fleet test needs it"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    _need("nginx", nginx_binary())
    _need("redis-server", shutil.which("redis-server"))
    f = Fleet(str(tiny_checkpoint("llama")), workdir=tmp_path_factory.mktemp("fleet"))
    try:
        yield f.start()
    finally:
        f.stop()


def run(fleet: Fleet, scenario, *args: Any) -> Any:
    async def go() -> Any:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            return await scenario(fleet, http, *args)

    return asyncio.run(go())


def sessions() -> dict[str, str]:
    if "affinity" not in RESULTS:
        pytest.skip("needs the affinity test's session map")
    return RESULTS["affinity"]["sessions"]


def test_affinity(fleet: Fleet) -> None:
    res = run(fleet, fc.affinity)
    RESULTS["affinity"] = res
    assert set(res["spread"]) == {r.name for r in fleet.replicas}
    assert len(res["keys"]) == len(fleet.api_keys)


def test_shared_prefix_tier(fleet: Fleet) -> None:
    res = run(fleet, fc.prefix_tier, sessions())
    RESULTS["prefix"] = res
    assert res["computed_on"] != res["served_on"]
    assert res["redis_hit_tokens"] >= res["blocks"] * 16
    assert min(res["cached_tokens"]) >= res["prompt_tokens_each"] - 16


def test_responses_chain_across_replicas(fleet: Fleet) -> None:
    res = run(fleet, fc.responses_chain, sessions())
    RESULTS["responses"] = res
    assert len({t["replica"] for t in res["turns"]}) == len(fleet.replicas)
    tokens = [t["input_tokens"] for t in res["turns"]]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # the chain grows


def test_chat_page_through_the_balancer(fleet: Fleet, tmp_path) -> None:
    """The chat page over nginx: the WebSocket passes the Origin check (nginx forwards the
    Host with its port), the key travels as ?api_key= and reaches no log."""
    from playwright.sync_api import expect

    from tests.e2e.browser import SocketLog, ask, chromium_context, chromium_path, settings

    chromium_path()
    key = fleet.api_keys[1]
    with chromium_context(tmp_path / "profile") as ctx:
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        sockets = SocketLog(page)
        page.goto(fleet.url + "/")
        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
        expect(page.locator("#status")).to_have_attribute("data-state", "open")
        settings(page, max_tokens=12, seed=None)
        ask(page, "Hello through the balancer")
        assert any(f"api_key={key}" in u for u in sockets.urls)
        page.close()
    logs = fleet.nginx_log.read_text()
    assert re.search(r'"GET /v1/ws\?\[query with api_key redacted\] HTTP/1.1" 101', logs), logs
    replica_logs = "".join(r.tail(10**7) for r in fleet.replicas)
    assert "api_key=REDACTED" in replica_logs  # the replicas' access log ran, redacting
    for text in (logs, replica_logs):
        assert all(k not in text for k in fleet.api_keys)


def test_redis_killed_and_restarted_under_load(fleet: Fleet) -> None:
    if "prefix" not in RESULTS:
        pytest.skip("needs the prefix test's system prompts")
    res = run(fleet, fc.redis_restart, sessions(), RESULTS["prefix"]["hot"])
    RESULTS["redis"] = res
    assert res["failed"] == 0 and res["tier_errors"] > 0


def test_failover_and_rejoin(fleet: Fleet) -> None:
    res = run(fleet, fc.failover, sessions())
    RESULTS["failover"] = res
    events = [what for _, what in res["timeline"]]
    assert any("back on" in e for e in events), events


def test_sigterm_drains(fleet: Fleet) -> None:
    res = run(fleet, fc.drain, sessions())
    RESULTS["drain"] = res
    assert any("exited 0" in e for _, e in res["timeline"])
    # Everything the balancer answered is in its log, per replica.
    counts = fc.balancer_counts(fleet)
    assert all(n > 0 for n in counts.values()), counts


def test_report(fleet: Fleet) -> None:
    """What `make fleet` prints, from the results above."""
    if not {"affinity", "prefix", "responses", "redis", "failover", "drain"} <= set(RESULTS):
        pytest.skip("needs every scenario's results")
    text = fc.format_report({**RESULTS, "requests": fc.balancer_counts(fleet)})
    for r in fleet.replicas:
        assert re.search(rf"^  {r.name}: [1-9]\d*$", text, re.M), text
    assert "TTFT cold" in text and "Redis hit" in text and "responses chain" in text
    assert "failover timeline:" in text and "back on" in text
