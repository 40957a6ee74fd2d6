"""Conversation KV pins and fair shares through the real HTTP server: a pinned
conversation's next turn hits after a storm (cached_tokens), an unpinned one misses, the
cap holds (/metrics), pins are per API key and a WebSocket's are released on close; an
interactive key is admitted ahead of a flooding key's queue; bad ids are 400s."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import websockets

from service.security import key_tenant
from tests.checkpoints import tiny_checkpoint
from tests.redis_server import RedisServer
from tests.service.live_server import live_server

KEY_A, KEY_B = "key-alpha", "key-bravo"
BLOCKS, BS, CAP = 48, 16, 12  # 0.25 of the blocks


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


def post(url: str, body: dict, key: str = KEY_A) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def turn(url: str, prompt: list[int], key: str = KEY_A, **extra) -> tuple[list[int], int]:
    """(output ids, cached prompt tokens) of one greedy completion."""
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    code, out = post(url, body, key)
    assert code == 200, out
    return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 400) for _ in range(n)]


def _server(model: str, engine_process: bool = False, **engine):
    kw = {"num_kv_blocks": BLOCKS, "max_model_len": 400, **engine}
    return live_server(
        model, engine_kwargs=kw, api_keys=[KEY_A, KEY_B], enable_prompt_tokens_details=True,
        engine_process=engine_process,
    )  # fmt: skip


# The pins live with the scheduler: with the engine in a child process, a conversation's
# key crosses with its add, and a WebSocket's close sends its Release across.
MODES = pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])


@MODES
def test_pinned_turn_hits_after_storm_unpinned_misses_cap_holds(model, engine_process) -> None:
    rng = random.Random(5)
    with _server(model, engine_process) as s:
        pinned_1, plain_1 = _prompt(rng, 100), _prompt(rng, 100)
        out_p, _ = turn(s.url, pinned_1, conversation_id="trip")
        out_u, _ = turn(s.url, plain_1)
        # The other key's conversation of the same name is its own pin, not a replacement.
        turn(s.url, _prompt(rng, 40), key=KEY_B, session_id="trip")
        assert s.conversation_pins() == 2
        for _ in range(8):  # 13 blocks each through a pool of 48, 12 of them pinned
            turn(s.url, _prompt(rng, 200))
        _, hit_p = turn(s.url, pinned_1 + out_p + [20, 21, 22], conversation_id="trip")
        _, hit_u = turn(s.url, plain_1 + out_u + [20, 21, 22])
        assert hit_p >= 100 // BS * BS and hit_u == 0
        assert metric(s.url, "pagestream_conversation_followup_hit_turns_total") == 1
        # Many conversations: the cap holds.
        for i in range(6):
            turn(s.url, _prompt(rng, 60), conversation_id=f"c{i}")
            assert 0 < metric(s.url, "pagestream_kv_pinned_blocks") <= CAP
        s.wait_kv_free()


def test_bad_conversation_ids_and_priority_are_400s(model) -> None:
    with _server(model) as s:
        base = {"prompt": "x", "max_tokens": 1}
        for extra, param in (
            ({"conversation_id": 7}, "conversation_id"),
            ({"conversation_id": "x" * 257}, "conversation_id"),
            ({"session_id": "a\nb"}, "session_id"),
            ({"conversation_id": "a", "session_id": "b"}, "session_id"),
            ({"prompt": ["x", "y"], "conversation_id": "a"}, "conversation_id"),
            ({"priority": "high"}, "priority"),
        ):
            code, err = post(s.url, {**base, **extra})
            assert code == 400 and err["error"]["param"] == param, (extra, err)
        assert post(s.url, {**base, "priority": -5, "session_id": "ok"})[0] == 200


@MODES
async def test_websocket_session_pins_until_close(model, engine_process) -> None:
    with _server(model, engine_process) as s:
        async with websockets.connect(f"{s.ws_url}?api_key={KEY_B}") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "g", "prompt": list(range(20, 70)),
                                      "params": {"max_tokens": 4}}))  # fmt: skip
            while json.loads(await ws.recv())["type"] != "done":
                pass
            if engine_process:
                assert await asyncio.to_thread(s.conversation_pins) == 1
            else:
                convs = s.on_loop(lambda: list(s.engine.scheduler.kv.pins.convs))
                assert len(convs) == 1 and convs[0].startswith(key_tenant(KEY_B))
        for _ in range(200):
            if not await asyncio.to_thread(s.conversation_pins):
                break
            await asyncio.sleep(0.02)
        assert (await asyncio.to_thread(s.debug_counts))["kv_blocks_pinned"] == 0


@MODES
async def test_websocket_closed_mid_generation_releases_its_pin(model, engine_process) -> None:
    """Closed (close frame, then the connection) while a generation runs: its abort,
    then the socket's release, free the earlier turn's pinned KV (the release crosses
    to the engine's process after the abort)."""
    with _server(model, engine_process) as s:
        async with websockets.connect(f"{s.ws_url}?api_key={KEY_B}") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": list(range(20, 70)),
                                      "params": {"max_tokens": 4}}))  # fmt: skip
            while json.loads(await ws.recv())["type"] != "done":
                pass
            assert await asyncio.to_thread(s.conversation_pins) == 1
            await ws.send(json.dumps({"type": "generate", "id": "b", "prompt": list(range(80, 90)),
                                      "params": {"max_tokens": 300, "ignore_eos": True}}))  # fmt: skip
            async with asyncio.timeout(30):
                while (f := json.loads(await ws.recv()))["type"] != "delta":
                    assert f["type"] != "error", f
        deadline = time.monotonic() + 10
        while (counts := await asyncio.to_thread(s.debug_counts))["conversation_pins"] or counts[
            "kv_blocks_pinned"
        ]:
            assert time.monotonic() < deadline, f"the closed socket's pin is held: {counts}"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(s.wait_kv_free, 10)


def test_interactive_key_is_admitted_before_a_flooding_keys_queue(model) -> None:
    """One sequence at a time: the order requests finish in is the order they were
    admitted.  FCFS runs the other key's request after the whole flood; fair shares run it
    next."""
    rng = random.Random(9)
    for policy in ("fcfs", "fair"):
        with _server(model, max_num_seqs=1, scheduling_policy=policy) as s:
            done: list[str] = []

            def send(name: str, key: str, n: int, out: int, done: list[str] = done) -> None:
                turn(s.url, _prompt(rng, n), key=key, max_tokens=out)
                done.append(name)

            # Each flood request long enough (~100 steps) that the first cannot end before the
            # fifth has arrived and queued: on a fast CPU 12 tokens did, and the queue never
            # reached four.
            flood = [
                threading.Thread(target=send, args=(f"f{i}", KEY_A, 120, 100)) for i in range(5)
            ]
            for t in flood:
                t.start()
            deadline = time.monotonic() + 60
            while s.on_loop(lambda: len(s.engine.scheduler.waiting)) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            chat = threading.Thread(target=send, args=("chat", KEY_B, 20, 12))
            chat.start()
            for t in [*flood, chat]:
                t.join(120)
            assert sorted(done) == sorted(["chat", *(f"f{i}" for i in range(5))])
            at = done.index("chat")
            assert at >= 4 if policy == "fcfs" else at <= 2, (policy, done)


def _seat_race(model: str, policy: str, prompts: list[list[int]], short: list[int]) -> tuple:
    """Four long generations of KEY_A, two seats; once both run and two wait, a short
    request of KEY_B.  (order they finished in, outputs, fair-share preemptions)"""
    with _server(model, max_num_seqs=2, scheduling_policy=policy) as s:
        done: list[str] = []
        got: dict[str, list[int]] = {}

        def send(name: str, key: str, prompt: list[int], n: int) -> None:
            got[name] = turn(s.url, prompt, key=key, max_tokens=n)[0]
            done.append(name)

        flood = [threading.Thread(target=send, args=(f"f{i}", KEY_A, p, 150))
                 for i, p in enumerate(prompts)]  # fmt: skip
        for t in flood:
            t.start()
        deadline = time.monotonic() + 60
        sched = s.engine.scheduler
        while s.on_loop(lambda: (len(sched.running), len(sched.waiting))) != (2, 2):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        chat = threading.Thread(target=send, args=("chat", KEY_B, short, 4))
        chat.start()
        for t in [*flood, chat]:
            t.join(120)
        return done, got, s.on_loop(lambda: sched.num_fair_preemptions)


def test_a_key_holding_every_running_seat_makes_room_for_another(model) -> None:
    """Fair shares inside the step, not only at admission: the flooding key's long
    generations hold both running seats; under fair shares the other key's request runs
    at once (one of the flood's is preempted, then recomputed to the same greedy output),
    under FCFS only after the flood's running requests."""
    rng = random.Random(13)
    prompts = [_prompt(rng, 40) for _ in range(4)]
    short = _prompt(rng, 10)
    outs = {}
    for policy in ("fcfs", "fair"):
        done, outs[policy], preempted = _seat_race(model, policy, prompts, short)
        assert sorted(done) == sorted(["chat", "f0", "f1", "f2", "f3"])
        at = done.index("chat")
        assert at == 0 if policy == "fair" else at >= 2, (policy, done)
        assert preempted >= 1 if policy == "fair" else preempted == 0
    assert outs["fair"] == outs["fcfs"]


@pytest.mark.redis
def test_pinned_turn_is_published_for_another_replica(model) -> None:
    redis = RedisServer()
    rng = random.Random(11)
    try:
        kw = {"redis_url": redis.url, "redis_hit_threshold": 1000}
        with _server(model, **kw) as a, _server(model, **kw) as b:
            first = _prompt(rng, 100)
            out, _ = turn(a.url, first, conversation_id="move")
            deadline = time.monotonic() + 30
            while a.on_loop(lambda: a.engine.tier.stats.blocks_published) < 100 // BS:
                assert time.monotonic() < deadline, "the pinned turn was not published"
                time.sleep(0.02)
            _, hit = turn(b.url, first + out + [30, 31], conversation_id="move")
            assert hit >= 100 // BS * BS
    finally:
        redis.stop()


def test_key_file_weights(tmp_path) -> None:
    from service.cli import parse_key_file, read_key_file

    f = tmp_path / "keys"
    f.write_text("# tenants\nkey-one\n  key-two weight=3  \nkey-three weight=0.5\n")
    assert parse_key_file(str(f)) == [("key-one", 1.0), ("key-two", 3.0), ("key-three", 0.5)]
    assert read_key_file(str(f)) == ["key-one", "key-two", "key-three"]
    for bad in ("k weight=0\n", "k weight=x\n", "k share=2\n", "k weight=inf\n"):
        f.write_text(bad)
        with pytest.raises(SystemExit, match="line 1"):
            parse_key_file(str(f))
