"""Background responses (`background: true`): answered `queued` at once, run on as their
own task, polled with `GET /v1/responses/{id}` to their end, and cancelled with
`POST /v1/responses/{id}/cancel` on the replica running them or, through a shared Redis
store, on another one.  The oracle for the answer is the same request run in the
foreground (greedy)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from unittest import mock

import openai
import pytest

from tests.redis_server import RedisServer
from tests.service.live_server import live_server
from tests.service.test_responses_api import KEYS, make_client, post
from tests.service.test_structured_api import hermes_checkpoint

# An answer that takes hundreds of tokens whatever the weights: a string of fixed length.
LONG = {
    "format": {
        "type": "json_schema",
        "name": "long",
        "schema": {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 300, "maxLength": 300}},
            "required": ["s"],
            "additionalProperties": False,
        },
        "strict": True,
    }
}


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def servers(tmp_path_factory, redis):
    model = hermes_checkpoint(tmp_path_factory)
    kw = {
        "served_model_name": "tiny",
        "api_keys": KEYS,
        "engine_kwargs": {"max_model_len": 512, "threads": 1, "redis_url": redis.url},
        "resume_grace": 1.0,
    }
    with live_server(model, **kw) as a, live_server(model, **kw) as b:
        yield a, b


@contextlib.contextmanager
def slow_steps(server, seconds: float):
    """Every model step of `server` takes `seconds` longer (a long answer stays running)."""
    runner = server.engine.core.executor.runner
    original = runner.execute_model

    def slow(so):
        time.sleep(seconds)
        return original(so)

    runner.execute_model = slow
    try:
        yield
    finally:
        runner.execute_model = original


def get(server, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {KEYS[0]}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def poll(client, rid: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"{rid} still {r.status}"
        time.sleep(0.05)


def test_polled_to_the_foreground_answer(servers):
    a, b = servers
    ca, cb = make_client(a), make_client(b)
    kw = {"model": "tiny", "input": "Tell me about rivers.", "max_output_tokens": 24,
          "temperature": 0, "instructions": "Be brief."}  # fmt: skip
    r = ca.responses.create(background=True, **kw)
    assert r.status == "queued" and r.background and r.output == [] and r.usage is None
    done = poll(cb, r.id)  # read back on the other replica, through Redis
    fore = ca.responses.create(**kw)
    assert done.status == fore.status and done.output_text == fore.output_text
    assert done.usage.output_tokens == fore.usage.output_tokens and done.background
    # It continues like any stored response.
    nxt = cb.responses.create(model="tiny", input="More?", previous_response_id=r.id,
                              max_output_tokens=4, temperature=0)  # fmt: skip
    assert nxt.status in ("completed", "incomplete")
    assert a.wait_kv_free(30) is None and b.wait_kv_free(30) is None


@pytest.mark.parametrize("where", ["owner", "other"])
def test_cancelled_on_either_replica(servers, where):
    a, b = servers
    ca, cb = make_client(a), make_client(b)
    with slow_steps(a, 0.02):
        r = ca.responses.create(model="tiny", input="Write.", text=LONG, background=True,
                                max_output_tokens=400)  # fmt: skip
        # Continuing one still running is refused.
        code, reply = post(a, "/v1/responses", {"model": "tiny", "input": "x",
                                                "previous_response_id": r.id})  # fmt: skip
        assert code == 400 and reply["error"]["param"] == "previous_response_id", reply
        t0 = time.monotonic()
        cancelled = (ca if where == "owner" else cb).responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert poll(ca, r.id).status == "cancelled" == poll(cb, r.id).status
        # The running replica stopped it: nothing left running, every KV block free.
        deadline = time.monotonic() + 10
        while a.num_running() or not a.kv_all_free():
            assert time.monotonic() < deadline, "the cancelled turn ran on"
            time.sleep(0.02)
        assert time.monotonic() - t0 < 10
    # A finished one is returned as it is; a foreground one cannot be cancelled.
    assert ca.responses.cancel(r.id).status == "cancelled"
    fore = ca.responses.create(model="tiny", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        ca.responses.cancel(fore.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True, "store": False}, "background"),
    ],
)
def test_refusals_name_the_field(servers, body, param):
    code, reply = post(servers[0], "/v1/responses", {"model": "tiny", "input": "x", **body})
    assert code == 400 and reply["error"]["param"] == param, reply


def test_sigterm_drain_waits_for_background_turns(servers):
    """A background turn holds SIGTERM's drain as a stream does (it is counted in flight)."""
    a, _ = servers
    ca = make_client(a)
    with slow_steps(a, 0.02):
        r = ca.responses.create(model="tiny", input="Write.", text=LONG, background=True,
                                max_output_tokens=400)  # fmt: skip
        assert a.state.inflight >= 1
        with urllib.request.urlopen(a.url + "/metrics", timeout=10) as m:
            assert 'pagestream_background_responses_running{model_name="tiny"} 1.0' in (
                m.read().decode()
            )
        ca.responses.cancel(r.id)
    deadline = time.monotonic() + 10
    while a.state.inflight:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_in_memory_store_too(tmp_path_factory):
    """Without Redis (one replica, no watcher): polled to its end, cancelled while it runs."""
    kw = {"served_model_name": "tiny", "engine_kwargs": {"max_model_len": 512, "threads": 1}}
    with live_server(hermes_checkpoint(tmp_path_factory), **kw) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = client.responses.create(model="tiny", input="Hi", max_output_tokens=8, background=True)
        assert poll(client, r.id).status in ("completed", "incomplete")
        with slow_steps(s, 0.02):
            r = client.responses.create(model="tiny", input="Write.", text=LONG, background=True,
                                        max_output_tokens=400)  # fmt: skip
            assert client.responses.cancel(r.id).status == "cancelled"
            deadline = time.monotonic() + 10
            while s.num_running() or not s.kv_all_free():
                assert time.monotonic() < deadline, "the cancelled turn ran on"
                time.sleep(0.02)


def sse_events(server, body: dict, n: int) -> tuple[list[dict], str]:
    """POST a streamed response, read its first `n` events, and drop the connection."""
    req = urllib.request.Request(
        server.url + "/v1/responses",
        json.dumps({"model": "tiny", "stream": True, **body}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"},
    )
    events: list[dict] = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if len(events) == n:
                    break
    return events, events[0]["response"]["id"]


def text_of(events) -> str:
    return "".join(
        (e["delta"] if isinstance(e, dict) else e.delta)
        for e in events
        if (e["type"] if isinstance(e, dict) else e.type) == "response.output_text.delta"
    )


def test_a_dropped_stream_resumed_by_sequence_number(servers):
    """`GET /v1/responses/{id}?stream=true&starting_after=n` (the SDK's
    `responses.retrieve(id, stream=True, starting_after=n)`): the events after n, then the
    live tail, so the two parts make the whole answer."""
    a, _ = servers
    ca = make_client(a)
    with slow_steps(a, 0.02):
        first, rid = sse_events(a, {"input": "Write.", "text": LONG, "max_output_tokens": 400}, 6)
        k = first[-1]["sequence_number"]
        rest = list(ca.responses.retrieve(rid, stream=True, starting_after=k))
    assert rest[0].sequence_number == k + 1
    assert [e.sequence_number for e in rest] == list(range(k + 1, k + 1 + len(rest)))
    final = rest[-1].response
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert text_of(first) + text_of(rest) == final.output_text
    for query, param in [
        ("starting_after=x", "starting_after"),
        ("starting_after=9999", "starting_after"),
    ]:
        code, reply = get(a, f"/v1/responses/{rid}?stream=true&{query}")
        assert code == 400 and reply["error"]["param"] == param, reply
    code, reply = get(a, "/v1/responses/resp_nope?stream=true")
    assert code == 404 and reply["error"]["param"] == "response_id", reply


def test_a_background_stream_outlives_its_readers(servers):
    """A streamed background response runs on after its connection drops and the grace
    period passes; its stream is picked up again later, and polling gives its end."""
    a, b = servers
    ca, cb = make_client(a), make_client(b)
    with slow_steps(a, 0.02):
        first, rid = sse_events(
            a, {"input": "Write.", "text": LONG, "max_output_tokens": 400, "background": True}, 4
        )
        assert first[0]["response"]["background"] is True
        assert first[0]["response"]["status"] == "queued"  # created as stored
        assert first[1]["type"] == "response.in_progress"
        assert cb.responses.retrieve(rid).status == "queued"  # stored, read on the other
        time.sleep(a.state.config.resume_grace + 0.5)
        assert a.num_running() == 1  # past the grace, and still running
        k = first[-1]["sequence_number"]
        rest = list(ca.responses.retrieve(rid, stream=True, starting_after=k))
    final = poll(cb, rid)
    assert final.status in ("completed", "incomplete") and final.background
    assert text_of(first) + text_of(rest) == final.output_text
    # Cancelled while streamed: the stream ends and the stored response says so.
    with slow_steps(a, 0.02):
        first, rid = sse_events(
            a, {"input": "Write.", "text": LONG, "max_output_tokens": 400, "background": True}, 2
        )
        assert cb.responses.cancel(rid).status == "cancelled"
        assert poll(ca, rid).status == "cancelled"
        deadline = time.monotonic() + 10
        while a.num_running() or not a.kv_all_free():
            assert time.monotonic() < deadline, "the cancelled turn ran on"
            time.sleep(0.02)


def test_a_background_stream_resumes_on_another_replica(servers):
    """Behind a load balancer the resume may reach a replica that is not running the
    turn: its events come through the shared store (service/stream_relay.py), live, in
    order, to the end; another API key finds nothing."""
    a, b = servers
    cb = make_client(b)
    body = {"input": "Write.", "text": LONG, "max_output_tokens": 400, "background": True}
    with slow_steps(a, 0.02):
        first, rid = sse_events(a, body, 5)
        k = first[-1]["sequence_number"]
        # While it runs on a: b replays what a relayed, then follows the live tail.
        rest = list(cb.responses.retrieve(rid, stream=True, starting_after=k))
        assert b.num_running() == 0
    # Once it ended, from the start: the whole stream (kept a minute after its end).
    whole = list(cb.responses.retrieve(rid, stream=True))
    # A replica follows a bounded number of relayed streams at once.
    with mock.patch("service.openai_responses.MAX_RELAY_READERS", 0):
        code, reply = get(b, f"/v1/responses/{rid}?stream=true")
    assert code == 429 and reply["error"]["param"] == "response_id", reply
    assert [e.sequence_number for e in rest] == list(range(k + 1, k + 1 + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    final = poll(cb, rid)
    assert text_of(first) + text_of(rest) == final.output_text
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert text_of(whole) == final.output_text
    with pytest.raises(openai.NotFoundError):
        list(make_client(b, KEYS[1]).responses.retrieve(rid, stream=True))
    last = whole[-1].sequence_number
    for n in (last + 1, 99999):  # past the last event, as a local resume answers
        code, reply = get(b, f"/v1/responses/{rid}?stream=true&starting_after={n}")
        assert code == 400 and reply["error"]["param"] == "starting_after", reply
    code, reply = get(b, "/v1/responses/resp_nope?stream=true")
    assert code == 404 and reply["error"]["param"] == "response_id", reply


def test_a_turn_whose_replica_died_reads_failed(servers, redis):
    """A background response left queued by a replica that stopped (no heartbeat in the
    shared store) reads as failed on any replica, and stays so; a live one keeps beating
    past the heartbeat's lifetime and is not taken for dead."""
    import asyncio

    from service.response_store import RedisResponseStore, Stored
    from service.security import key_tenant

    a, b = servers

    async def orphan() -> None:
        store = RedisResponseStore(redis.url, 1024, 64 << 20)
        resp = {"id": "resp_orphan", "object": "response", "status": "queued",
                "background": True, "output": []}  # fmt: skip
        await store.put(key_tenant(KEYS[0]), "resp_orphan", Stored(resp, [], "root", 0))
        await store.close()

    asyncio.run(orphan())
    code, body = get(b, "/v1/responses/resp_orphan")
    assert code == 200 and body["status"] == "failed", body
    assert body["error"]["code"] == "server_error"
    code, again = get(a, "/v1/responses/resp_orphan")
    assert again["status"] == "failed"
    # A live turn longer than the heartbeat's lifetime is polled as running throughout.
    ca, cb = make_client(a), make_client(b)
    with (
        mock.patch("service.responses_background.WATCH_INTERVAL_S", 0.1),
        mock.patch("service.responses_background.HEARTBEAT_S", 0.2),
        mock.patch("service.openai_responses.HEARTBEAT_TTL_S", 1.0),
        mock.patch("service.responses_background.HEARTBEAT_TTL_S", 1.0),
        slow_steps(a, 0.05),
    ):
        r = ca.responses.create(model="tiny", input="Write.", text=LONG, background=True,
                                max_output_tokens=400)  # fmt: skip
        t0 = time.monotonic()
        while (status := cb.responses.retrieve(r.id).status) == "queued":
            if time.monotonic() - t0 > 2.5:  # past the heartbeat's lifetime, twice
                break
            time.sleep(0.1)
        assert status in ("queued", "completed", "incomplete"), status
        assert time.monotonic() - t0 > 1.5, "the turn ended before the heartbeat mattered"
        ca.responses.cancel(r.id)
