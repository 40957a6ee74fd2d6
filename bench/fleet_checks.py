"""Scenarios against a running Fleet (bench/fleet.py), all through its nginx balancer.

Each scenario asserts what must hold (an AssertionError says what broke) and returns what
it measured, for `make fleet` to print and tests/fleet/test_fleet.py to check further.
Which replica served a request is read from the replicas' own counters
(pagestream_request_success_total) around requests sent one at a time.
"""

from __future__ import annotations

import asyncio
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.fleet import SERVED_NAME, Fleet, Replica, metric

# `make fleet` runs this module: python -m bench.fleet_checks

QUESTION = "Which berth should the ferry use at low tide?"


def system_prompt(tag: str, words: int = 300) -> str:
    """A long system prompt, distinct per tag from its first block on."""
    filler = ("harbour pilot tide berth ferry crane manifest customs quay anchor " * 80).split()
    return f"[{tag}] You are the operations assistant of the port. " + " ".join(filler[:words])


@dataclass
class Reply:
    status: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float | None = None
    complete: bool = False  # the stream reached [DONE] (or a full JSON body came back)
    error: str | None = None


async def chat(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    *,
    key: str | None = None,
    session: str | None = None,
    system: str | None = None,
    user: str = QUESTION,
    max_tokens: int = 4,
    stream: bool = False,
    first_chunk: asyncio.Event | None = None,
) -> Reply:
    """One chat completion through the balancer (greedy, ignore_eos)."""
    headers = {"Authorization": f"Bearer {key or fleet.api_keys[0]}"}
    if session is not None:
        headers["X-Session-ID"] = session
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    body: dict[str, Any] = {
        "model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    try:
        async with http.post(fleet.url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200 or not stream:
                return await _json_reply(r)
            return await _stream_reply(r, t0, first_chunk)
    except (TimeoutError, aiohttp.ClientError) as e:
        return Reply(0, error=f"{type(e).__name__}: {e}")


async def _json_reply(r: aiohttp.ClientResponse) -> Reply:
    data = await r.json(content_type=None)
    if r.status != 200:
        return Reply(r.status, error=str(data))
    details = data["usage"]["prompt_tokens_details"]
    return Reply(
        200, data["choices"][0]["message"]["content"],
        data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"],
        details and details["cached_tokens"], complete=True,
    )  # fmt: skip


async def _stream_reply(
    r: aiohttp.ClientResponse, t0: float, first_chunk: asyncio.Event | None
) -> Reply:
    """Read an SSE stream to [DONE] (or its end), timing the first content delta."""
    reply = Reply(200)
    parts: list[str] = []
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            reply.complete = True
            break
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            reply.error = str(chunk["error"])
        for c in chunk.get("choices", []):
            if c["delta"].get("content"):
                if reply.ttft is None:
                    reply.ttft = time.monotonic() - t0
                    if first_chunk is not None:
                        first_chunk.set()
                parts.append(c["delta"]["content"])
            reply.finish_reason = c.get("finish_reason") or reply.finish_reason
        if chunk.get("usage"):
            reply.completion_tokens = chunk["usage"]["completion_tokens"]
            d = chunk["usage"]["prompt_tokens_details"]
            reply.cached_tokens = d and d["cached_tokens"]
    reply.text = "".join(parts)
    return reply


async def counts(fleet: Fleet) -> dict[str, float | None]:
    async def one(r: Replica) -> float | None:
        try:
            return await asyncio.to_thread(r.requests_done)
        except OSError:
            return None  # down

    values = await asyncio.gather(*(one(r) for r in fleet.replicas))
    return {r.name: v for r, v in zip(fleet.replicas, values, strict=True)}


async def served_by(fleet: Fleet, fn: Callable[[], Awaitable[Any]]) -> tuple[Any, Counter[str]]:
    """Run fn (requests one at a time) and say how many each replica finished meanwhile."""
    before = await counts(fleet)
    result = await fn()
    after = await counts(fleet)
    diff: Counter[str] = Counter()
    for name, b in before.items():
        a = after[name]
        if a is not None and a - (b or 0) > 0:
            diff[name] = int(a - (b or 0))
    return result, diff


def _only(diff: Counter[str], n: int, what: str) -> str:
    assert len(diff) == 1 and sum(diff.values()) == n, f"{what}: served by {dict(diff)}"
    return next(iter(diff))


# ----------------------------------------------------------------------------- affinity
async def affinity(fleet: Fleet, http: aiohttp.ClientSession) -> dict[str, Any]:
    """One X-Session-ID (or one API key) -> one replica; sessions spread over all."""
    sessions: dict[str, str] = {}
    for i in range(60):
        sid = f"conversation-{i}"

        async def two(sid: str = sid) -> list[Reply]:
            return [await chat(http, fleet, session=sid) for _ in range(2)]

        replies, diff = await served_by(fleet, two)
        assert all(r.status == 200 for r in replies), replies
        sessions[sid] = _only(diff, 2, f"session {sid}")
        if i >= 11 and len(set(sessions.values())) == len(fleet.replicas):
            break
    keys: dict[str, str] = {}
    for key in fleet.api_keys:

        async def two_keyed(key: str = key) -> list[Reply]:
            return [await chat(http, fleet, key=key) for _ in range(2)]

        replies, diff = await served_by(fleet, two_keyed)
        assert all(r.status == 200 for r in replies), replies
        keys[key] = _only(diff, 2, f"API key {key}")
    spread = Counter(sessions.values())
    assert len(spread) == len(fleet.replicas), f"sessions did not spread: {dict(spread)}"
    return {"sessions": sessions, "keys": keys, "spread": dict(spread)}


def session_on(sessions: dict[str, str], replica: str) -> str:
    return next(s for s, r in sessions.items() if r == replica)


# ----------------------------------------------------------------------------- responses
async def responses_chain(
    fleet: Fleet, http: aiohttp.ClientSession, sessions: dict[str, str]
) -> dict[str, Any]:
    """A /v1/responses chain whose turns the balancer sends to a different replica each
    (by X-Session-ID): each turn continues the one before from the shared Redis store,
    equal to the chat completion of the whole conversation, and any replica reads it."""
    key = fleet.api_keys[0]
    names = [r.name for r in fleet.replicas]
    prev: str | None = None
    messages: list[dict[str, str]] = []
    turns = []
    for i, name in enumerate(names):
        headers = {"Authorization": f"Bearer {key}", "X-Session-ID": session_on(sessions, name)}
        body = {"model": SERVED_NAME, "input": f"Turn {i}: {QUESTION}",
                "max_output_tokens": 4, "temperature": 0, "previous_response_id": prev}  # fmt: skip

        async def one(body: dict[str, Any] = body, h: dict[str, str] = headers) -> Any:
            async with http.post(fleet.url + "/v1/responses", json=body, headers=h) as r:
                return r.status, await r.json(content_type=None)

        (status, resp), diff = await served_by(fleet, one)
        assert status == 200, resp
        assert _only(diff, 1, f"turn {i}") == name
        messages.append({"role": "user", "content": body["input"]})
        text = "".join(p["text"] for o in resp["output"] for p in o.get("content", []))
        oracle = {"model": SERVED_NAME, "messages": messages, "max_tokens": 4, "temperature": 0}
        async with http.post(fleet.url + "/v1/chat/completions", json=oracle, headers=headers) as r:
            want = await r.json(content_type=None)
        assert text == want["choices"][0]["message"]["content"], (text, want)
        assert resp["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": text})
        turns.append({"replica": name, "input_tokens": resp["usage"]["input_tokens"]})
        prev = resp["id"]
    for name in names:  # every replica reads the last turn back
        h = {"Authorization": f"Bearer {key}", "X-Session-ID": session_on(sessions, name)}
        async with http.get(f"{fleet.url}/v1/responses/{prev}", headers=h) as r:
            assert r.status == 200 and (await r.json())["id"] == prev
    return {"turns": turns}


# ----------------------------------------------------------------------------- prefix tier
async def _published(r: Replica) -> float:
    m = await asyncio.to_thread(r.metrics)
    return metric(m, "pagestream_prefix_tier_blocks_published_total")


async def prefix_tier(
    fleet: Fleet, http: aiohttp.ClientSession, sessions: dict[str, str], samples: int = 3
) -> dict[str, Any]:
    """System prompts registered on one replica are Redis hits on another: the redis-tier
    hit counter rises, cached tokens cover the prompt, greedy output is identical, and
    TTFT falls against cold prompts of the same length on the same replica."""
    a, b = fleet.replicas[0], fleet.replicas[1]
    sa, sb = session_on(sessions, a.name), session_on(sessions, b.name)
    key = fleet.api_keys[0]
    hot = [system_prompt(f"hot-{i}") for i in range(samples)]
    cold = [system_prompt(f"cold-{i}") for i in range(samples)]
    published0 = await _published(a)
    blocks = 0
    for s in hot:
        async with http.post(
            fleet.url + "/v1/cache/prefixes",
            json={"messages": [{"role": "system", "content": s}]},
            headers={"Authorization": f"Bearer {key}", "X-Session-ID": sa},
        ) as r:
            info = await r.json()
            assert r.status == 200 and info["shared_tier"] == "redis", info
            blocks += info["blocks"]
    deadline = time.monotonic() + 20
    while await _published(a) - published0 < blocks:
        assert time.monotonic() < deadline, "registered blocks never reached Redis"
        await asyncio.sleep(0.05)
    hits0 = metric(await asyncio.to_thread(b.metrics), "pagestream_prefix_cache_hits_total",
                   tier="redis")  # fmt: skip
    hit_replies, cold_replies = [], []
    for h, c in zip(hot, cold, strict=True):
        cold_replies.append(
            await chat(http, fleet, session=sb, system=c, stream=True, max_tokens=8)
        )
        hit_replies.append(await chat(http, fleet, session=sb, system=h, stream=True, max_tokens=8))
    hits = metric(await asyncio.to_thread(b.metrics), "pagestream_prefix_cache_hits_total",
                  tier="redis") - hits0  # fmt: skip
    for rep in hit_replies + cold_replies:
        assert rep.status == 200 and rep.complete, rep
    assert hits >= blocks * 16, f"redis-tier hits on {b.name}: {hits} tokens, want {blocks * 16}"
    assert all(r.cached_tokens and r.cached_tokens >= 16 for r in hit_replies), hit_replies
    # The same conversation on the replica that computed the prompt gives the same text.
    ref = await chat(http, fleet, session=sa, system=hot[0], max_tokens=8)
    assert ref.text == hit_replies[0].text, (ref.text, hit_replies[0].text)
    # Another API key on the same replica gets none of those blocks.
    other = await chat(http, fleet, key=fleet.api_keys[1], session=sb, system=hot[0])
    assert other.status == 200 and other.cached_tokens == 0, other
    cold_ttft = statistics.median(r.ttft or 0 for r in cold_replies)
    hit_ttft = statistics.median(r.ttft or 0 for r in hit_replies)
    return {
        "computed_on": a.name, "served_on": b.name, "blocks": blocks, "redis_hit_tokens": hits,
        "cached_tokens": [r.cached_tokens for r in hit_replies],
        "cold_ttft_ms": 1000 * cold_ttft, "hit_ttft_ms": 1000 * hit_ttft,
        "prompt_tokens_each": blocks // samples * 16, "identical": True, "hot": hot,
    }  # fmt: skip


# ----------------------------------------------------------------------------- redis restart
async def redis_restart(
    fleet: Fleet, http: aiohttp.ClientSession, sessions: dict[str, str], hot: list[str],
    total: int = 24, concurrency: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """Redis killed and restarted while requests run: not one fails."""
    assert fleet.redis is not None
    sids = list(sessions)
    done = 0
    events: list[tuple[float, str]] = []
    t0 = time.monotonic()
    sem = asyncio.Semaphore(concurrency)
    killed, restarted = asyncio.Event(), asyncio.Event()

    async def one(i: int) -> Reply:
        # A question long enough to fill new blocks: every request asks Redis for them.
        nonlocal done
        async with sem:
            rep = await chat(http, fleet, session=sids[i % len(sids)], system=hot[i % len(hot)],
                             user=f"Question {i}: " + QUESTION * 4, max_tokens=6)  # fmt: skip
        done += 1
        if done == total // 4 and not killed.is_set():
            fleet.redis.kill()
            killed.set()
            events.append((time.monotonic() - t0, "redis-server killed (SIGKILL)"))
        elif done == total * 2 // 3 and not restarted.is_set():
            await asyncio.to_thread(fleet.redis.restart)
            restarted.set()
            events.append((time.monotonic() - t0, "redis-server restarted (empty)"))
        return rep

    replies = await asyncio.gather(*(one(i) for i in range(total)))
    failed = [r for r in replies if r.status != 200 or not r.complete]
    assert killed.is_set() and restarted.is_set()
    assert not failed, f"{len(failed)} of {total} requests failed: {failed[:3]}"
    events.append((time.monotonic() - t0, f"all {total} requests done, none failed"))
    # Every replica finds Redis again on its own (back-off, then the next look-up).
    deadline = time.monotonic() + 60
    pending = {r.name for r in fleet.replicas}
    while pending:
        assert time.monotonic() < deadline, f"prefix tier still down on {pending}"
        for r in fleet.replicas:
            if r.name in pending:
                await chat(http, fleet, session=session_on(sessions, r.name), system=hot[0],
                           user=f"probe {time.monotonic()}", max_tokens=1)  # fmt: skip
                m = await asyncio.to_thread(r.metrics)
                if metric(m, "pagestream_prefix_tier_up") == 1:
                    pending.discard(r.name)
        await asyncio.sleep(0.5)
    events.append((time.monotonic() - t0, "every replica's prefix tier up again"))
    errors = 0.0
    for r in fleet.replicas:
        errors += metric(await asyncio.to_thread(r.metrics), "pagestream_prefix_tier_errors_total")
    assert errors > 0, "no replica noticed Redis was gone: the check proved nothing"
    return {"requests": total, "failed": 0, "tier_errors": errors, "timeline": events}


# ----------------------------------------------------------------------------- failover
@dataclass
class Timeline:
    t0: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)

    def __call__(self, what: str) -> None:
        self.events.append((time.monotonic() - self.t0, what))


async def _until_served_by(
    fleet: Fleet, http: aiohttp.ClientSession, sid: str, want: str, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rep, diff = await served_by(fleet, lambda: chat(http, fleet, session=sid))
        assert rep.status == 200, rep
        if want in diff:
            return
        assert time.monotonic() < deadline, f"{sid} never went back to {want}"
        await asyncio.sleep(0.5)


async def failover(
    fleet: Fleet, http: aiohttp.ClientSession, sessions: dict[str, str], tokens: int = 300
) -> dict[str, Any]:
    """SIGKILL one replica mid-run: its sessions go elsewhere, streams on the others
    finish untouched, and the restarted replica gets its sessions back."""
    victim = fleet.replicas[0]
    others = fleet.replicas[1:]
    sv = session_on(sessions, victim.name)
    so = [session_on(sessions, r.name) for r in others]
    firsts = [asyncio.Event() for _ in range(len(others) + 1)]
    streams = [
        asyncio.create_task(chat(http, fleet, session=s, stream=True, max_tokens=tokens,
                                 user=f"Long answer {i}", first_chunk=firsts[i]))
        for i, s in enumerate([sv, *so])
    ]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
    tl = Timeline()
    victim.signal(signal.SIGKILL)
    await asyncio.to_thread(victim.wait_exit, 10)
    tl(f"{victim.name} killed (SIGKILL) with a stream on each replica in flight")
    rep, diff = await served_by(fleet, lambda: chat(http, fleet, session=sv))
    assert rep.status == 200, f"{victim.name}'s session failed after the kill: {rep}"
    tl(f"{victim.name}'s session served by {', '.join(diff) or '?'}")
    results = await asyncio.gather(*streams)
    cut, intact = results[0], results[1:]
    for r in intact:
        assert r.complete and r.completion_tokens == tokens and r.finish_reason == "length", r
    tl(f"streams on {', '.join(r.name for r in others)} finished intact ({tokens} tokens each)")
    assert not cut.complete, "the killed replica's stream cannot have finished"
    # Untouched: the same greedy request again gives the same text.
    again = await chat(http, fleet, session=so[0], stream=True, max_tokens=tokens,
                       user="Long answer 1")  # fmt: skip
    assert again.text == intact[0].text
    victim.start()
    await asyncio.to_thread(victim.wait_ready)
    tl(f"{victim.name} restarted and healthy")
    await _until_served_by(fleet, http, sv, victim.name, timeout=40)
    tl(f"{victim.name}'s session back on {victim.name} (nginx fail_timeout passed)")
    return {"victim": victim.name, "timeline": tl.events, "cut_stream_error": cut.error}


async def drain(
    fleet: Fleet, http: aiohttp.ClientSession, sessions: dict[str, str], tokens: int = 1000
) -> dict[str, Any]:
    """SIGTERM on a replica: its running stream finishes, nginx sends new requests of its
    sessions elsewhere meanwhile, and it exits 0."""
    r = fleet.replicas[1]
    sid = session_on(sessions, r.name)
    first = asyncio.Event()
    stream = asyncio.create_task(chat(http, fleet, session=sid, stream=True, max_tokens=tokens,
                                      user="Drain me", first_chunk=first))  # fmt: skip
    await asyncio.wait_for(first.wait(), 60)
    tl = Timeline()
    r.signal(signal.SIGTERM)
    tl(f"{r.name} got SIGTERM with a stream in flight")
    await asyncio.sleep(0.2)
    seen = len(_answered(fleet))
    rep = await chat(http, fleet, session=sid)
    during_drain = not stream.done()
    assert rep.status == 200, rep
    assert during_drain, "the stream ended before the new request was answered"
    # Which replica answered, from nginx's log: the stream's own line comes only when it
    # ends, so the next line logged is this request's.
    deadline = time.monotonic() + 5
    while len(lines := _answered(fleet)) == seen:
        assert time.monotonic() < deadline, "nginx logged no line for the request"
        await asyncio.sleep(0.05)
    server = lines[seen]
    assert server != r.name, f"{r.name} took a new request while draining"
    tl(f"new request of its session served by {server} while it drains")
    done = await stream
    assert done.complete and done.completion_tokens == tokens, done
    tl(f"the in-flight stream finished ({tokens} tokens)")
    rc = await asyncio.to_thread(r.wait_exit, 40)
    assert rc == 0, f"{r.name} exited {rc} after SIGTERM:\n{r.tail()}"
    tl(f"{r.name} exited 0")
    r.start()
    await asyncio.to_thread(r.wait_ready)
    tl(f"{r.name} restarted and healthy")
    return {"replica": r.name, "timeline": tl.events}


# ----------------------------------------------------------------------------- all
async def run_all(fleet: Fleet) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        report: dict[str, Any] = {}
        report["affinity"] = await affinity(fleet, http)
        sessions = report["affinity"]["sessions"]
        report["prefix"] = await prefix_tier(fleet, http, sessions)
        report["responses"] = await responses_chain(fleet, http, sessions)
        report["redis"] = await redis_restart(fleet, http, sessions, report["prefix"]["hot"])
        report["failover"] = await failover(fleet, http, sessions)
        report["drain"] = await drain(fleet, http, sessions)
        report["requests"] = balancer_counts(fleet)
        return report


def _answered(fleet: Fleet) -> list[str]:
    """The replica that answered each request nginx logged, in log order (after a retry
    the last upstream address is the one that answered)."""
    by_port = {str(r.port): r.name for r in fleet.replicas}
    out = []
    for line in fleet.nginx_log.read_text(errors="replace").splitlines():
        m = re.search(r'" (\d{3}) .* upstream=(\S+(?:, \S+)*) ust=', line)
        if m and m.group(1) == "200":
            port = m.group(2).split(", ")[-1].rpartition(":")[2]
            if port in by_port:
                out.append(by_port[port])
    return out


def balancer_counts(fleet: Fleet) -> dict[str, int]:
    """Requests answered per replica, from nginx's access log (across restarts)."""
    out = Counter({r.name: 0 for r in fleet.replicas})
    out.update(_answered(fleet))
    return dict(out)


def format_report(rep: dict[str, Any]) -> str:
    lines = ["", "requests answered per replica (nginx access log):"]
    for name, n in rep["requests"].items():
        lines.append(f"  {name}: {n}")
    aff = rep["affinity"]
    lines.append(
        f"affinity: {len(aff['sessions'])} sessions, each on one replica; spread "
        + ", ".join(f"{k}={v}" for k, v in sorted(aff["spread"].items()))
        + "; API keys -> "
        + ", ".join(sorted(set(aff["keys"].values())))
    )
    p = rep["prefix"]
    ratio = p["cold_ttft_ms"] / p["hit_ttft_ms"] if p["hit_ttft_ms"] else float("nan")
    lines += [
        f"shared prefix tier: system prompts of ~{p['prompt_tokens_each']} tokens registered on "
        f"{p['computed_on']}, asked on {p['served_on']}",
        f"  TTFT cold {p['cold_ttft_ms']:.1f} ms, Redis hit {p['hit_ttft_ms']:.1f} ms "
        f"({ratio:.2f}x); redis-tier hit tokens {p['redis_hit_tokens']:.0f}; "
        f"cached_tokens {p['cached_tokens']}; greedy output identical",
    ]
    lines.append(
        "responses chain across replicas (stored in Redis): "
        + " -> ".join(
            f"{t['replica']} ({t['input_tokens']} input tokens)" for t in rep["responses"]["turns"]
        )
    )
    for title, key in (("redis killed/restarted under load", "redis"),
                       ("failover timeline", "failover"), ("drain timeline", "drain")):  # fmt: skip
        lines.append(f"{title}:")
        lines += [f"  +{t:6.2f} s  {what}" for t, what in rep[key]["timeline"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`make fleet`: start the fleet, run every scenario, print the report."""
    import argparse
    import shutil

    from bench.fleet import default_model

    ap = argparse.ArgumentParser(
        prog="python -m bench.fleet_checks", description="the compose topology on loopback"
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny preset)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (logs)")
    a = ap.parse_args(argv)
    model = a.model or default_model()
    t0 = time.monotonic()
    fleet = Fleet(model, replicas_n=a.replicas)
    print(f"fleet: {a.replicas} replicas + redis-server + nginx in {fleet.workdir}", flush=True)
    try:
        fleet.start()
        print(f"up in {time.monotonic() - t0:.1f} s; balancer at {fleet.url}", flush=True)
        report = asyncio.run(run_all(fleet))
    finally:
        fleet.stop()
        if not a.keep:
            shutil.rmtree(fleet.workdir, ignore_errors=True)
    print(format_report(report))
    print(f"total {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
