"""`truncation: "auto"` (service/truncation.py): a conversation too long for the window
loses its oldest turns, at places that stay put as it grows, so the turns after a cut keep
hitting the cache.

The rules on a simulated conversation (a render that counts characters), then through a
live server: the Responses API over a stored chain (the official openai client), chat
completions and the WebSocket.  The oracle for what the model saw: the same server's chat
completion of the kept messages sent whole gives the same prompt tokens and, greedy, the
same text."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time

import httpx
import openai
import pytest
import websockets

from service.truncation import chain, head_and_turns, output_room, truncated_ids
from tests.service.live_server import live_server
from tests.service.test_structured_api import hermes_checkpoint

MAX_LEN = 512
INSTRUCTIONS = "You are a helpful assistant who answers briefly."
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu"]  # fmt: skip


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, calls: list | None = None) -> dict:
    m = {"role": "assistant", "content": text}
    if calls:
        m["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": n, "arguments": "{}"}}
                           for n in calls]  # fmt: skip
    return m


# ----------------------------------------------------------------------------- the rules
def test_turns_start_at_user_messages_after_the_head():
    msgs = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
            user("a"), assistant("", ["f"]), {"role": "tool", "content": "r"}, assistant("b"),
            user("c"), assistant("d"), user("e")]  # fmt: skip
    assert head_and_turns(msgs) == (2, [2, 6, 8])
    assert head_and_turns([assistant("x"), user("y")]) == (0, [0, 1])
    assert head_and_turns([{"role": "system", "content": "s"}]) == (1, [])


def test_chain_places_are_fixed_by_the_turns_before_them():
    assert chain([5, 5, 5, 5, 5], 10) == [0, 2, 4]
    assert chain([5, 5, 5], 1) == [0, 1, 2]
    assert chain([100], 10) == [0]
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        step = rng.randint(1, 120)
        full = chain(costs, step)
        for k in range(1, len(costs) + 1):  # a conversation that grows keeps its chain
            assert full[: len(chain(costs[:k], step))] == chain(costs[:k], step)


class Fake:
    """A template that costs 3 tokens a message and 5 for the head's framing, a token per
    character of text; renders counted."""

    def __init__(self) -> None:
        self.renders = 0

    async def render(self, msgs: list[dict]) -> list[int]:
        self.renders += 1
        n = 5 + sum(3 + len(m["content"]) for m in msgs)
        return list(range(n))

    async def measure(self, texts: list[str]) -> list[int]:
        return [len(t) for t in texts]


def _conversation(turns: int, rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": "x" * 20}]
    for t in range(turns):
        msgs.append(user("u" * rng.randint(5, 40)))
        if t % 3 == 1:  # a tool round inside the turn
            msgs += [assistant("", ["f"]), {"role": "tool", "content": "r" * 10}]
        msgs.append(assistant("a" * rng.randint(5, 40)))
    return msgs[:-1]  # ends with the new user message


def test_a_growing_conversation_is_cut_in_steps_that_keep_its_prefix():
    rng = random.Random(1)
    full = _conversation(120, rng)
    room, budget = 20, 1000 - 20
    prev: list[dict] | None = None
    cuts = extends = 0
    for end in range(1, len(full) + 1):
        msgs = full[:end]
        if msgs[-1]["role"] != "user":
            continue
        fake = Fake()
        ids, dropped = asyncio.run(truncated_ids(msgs, fake.render, fake.measure, 1000, room))
        kept = msgs[:1] + msgs[1 + dropped :]
        assert len(ids) == len(asyncio.run(Fake().render(kept))) <= budget
        assert kept[1]["role"] == "user"  # whole turns: a tool round stays with its call
        assert fake.renders <= 3 + 1 + 8  # the whole, two probes, a binary search
        if prev is not None:
            if kept[: len(prev)] == prev:
                extends += 1  # the last prompt is this one's prefix: it hits the cache
            else:
                cuts += 1
                # at least half of what the window leaves the turns went, then the new turn
                assert len(ids) <= budget - (budget - 28) // 2 + 120
        prev = kept
    # ~120 turns of ~60 tokens through a 950-token window: a cut every few turns, not one
    # each turn as dropping the fewest turns would do once the window is full
    assert cuts >= 10 and extends >= 2 * cuts, (cuts, extends)


def test_parts_too_big_by_their_bytes_are_not_rendered():
    msgs = [{"role": "system", "content": "s"}]
    for _ in range(300):
        msgs += [user("u" * 500), assistant("a" * 500)]
    msgs.append(user("q"))
    sizes: list[int] = []
    fake = Fake()

    async def render(keep: list[dict]) -> list[int]:
        ids = await fake.render(keep)
        sizes.append(len(ids))
        return ids

    ids, dropped = asyncio.run(truncated_ids(msgs, render, fake.measure, 4000, 100, 8000))
    assert len(ids) <= 3900 and dropped > 0
    # (the Fake's ids are its characters: a render of more than 8,000 would be refused)
    assert max(sizes) <= 8000 + 5 + 3 * 40 and len(sizes) <= 3 + 8, sizes


def test_the_last_turn_alone_is_the_last_resort():
    msgs = [
        {"role": "system", "content": "s"},
        user("a" * 50),
        assistant("b" * 50),
        user("c" * 300),
    ]
    fake = Fake()
    ids, dropped = asyncio.run(truncated_ids(msgs, fake.render, fake.measure, 400, 20))
    assert dropped == 2 and len(ids) == 5 + 4 + 303
    ids, dropped = asyncio.run(truncated_ids(msgs[:2], fake.render, fake.measure, 40, 20))
    assert dropped == 0 and len(ids) == 5 + 4 + 53  # one turn: nothing goes (then a 400)


def test_output_room():
    assert output_room(10, 512) == 10  # max_tokens, as the generation config caps it
    assert output_room(50, 512) == 50
    assert output_room(None, 512) == 128


# ----------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(
        hermes_checkpoint(tmp_path_factory),
        served_model_name="tiny",
        enable_prompt_tokens_details=True,
        engine_kwargs={"max_model_len": MAX_LEN},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _ask(t: int) -> str:
    return f"Turn {t}: tell me about " + " ".join(WORDS[(t + j) % 12] for j in range(14))


def _chat(client, messages: list[dict], **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          temperature=0, **kw)  # fmt: skip


def _kept_by_chat(client, messages: list[dict], prompt_tokens: int):
    """The kept messages (the system message and the last turns) whose whole prompt has
    prompt_tokens tokens, asked through chat without truncation: (how many dropped, the
    answer)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for s in starts:
        kept = messages[:1] + messages[s:]
        try:
            r = _chat(client, kept)
        except openai.BadRequestError:  # too long whole
            continue
        if r.usage.prompt_tokens == prompt_tokens:
            return s - 1, r.choices[0].message.content
    raise AssertionError(f"no suffix of whole turns has {prompt_tokens} tokens")


def test_a_stored_chain_goes_on_past_the_window_and_keeps_hitting(server, client):
    prev, history, seen = None, [{"role": "system", "content": INSTRUCTIONS}], []
    for t in range(16):
        r = client.responses.create(
            model="tiny", input=_ask(t), instructions=INSTRUCTIONS, max_output_tokens=12,
            temperature=0, truncation="auto", previous_response_id=prev,
        )  # fmt: skip
        assert r.truncation == "auto" and r.status in ("completed", "incomplete")
        u = r.usage
        assert u.input_tokens + 12 <= MAX_LEN
        seen.append((u.input_tokens, u.input_tokens_details.cached_tokens))
        history += [user(_ask(t)), assistant(r.output_text)]
        prev = r.id
    cuts = [t for t in range(1, 16) if seen[t][0] < seen[t - 1][0]]
    assert len(cuts) >= 2, seen  # the window was outgrown more than once
    for t in range(1, 16):
        if t not in cuts:  # the previous turn's prompt is this one's prefix: a hit
            assert seen[t][1] >= seen[t - 1][0] - 16, (t, seen)
    # half a window at a time: most turns are not cuts
    assert len(cuts) * 2 <= 15, seen
    # What the model saw, through chat: the instructions and the last turns, whole
    dropped, text = _kept_by_chat(client, history[:-1], seen[-1][0])
    assert dropped > 0 and text == history[-1]["content"]
    # /v1/responses/input_tokens counts the same cut (it takes no max_output_tokens: both
    # leave the default room, a quarter of the window)
    body = {"model": "tiny", "input": _ask(16), "instructions": INSTRUCTIONS,
            "truncation": "auto", "previous_response_id": prev}  # fmt: skip
    got = httpx.post(server.url + "/v1/responses/input_tokens", json=body).json()
    r = client.responses.create(**body, temperature=0)
    assert got["input_tokens"] == r.usage.input_tokens <= MAX_LEN - MAX_LEN // 4
    metrics = httpx.get(server.url + "/metrics").text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("pagestream_truncated_")}  # fmt: skip
    assert counts["pagestream_truncated_requests_total"] >= len(cuts)
    assert (
        counts["pagestream_truncated_messages_total"]
        >= 2 * counts["pagestream_truncated_requests_total"]
    )
    # without truncation, the same chain no longer fits
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=_ask(16), instructions=INSTRUCTIONS,
                                max_output_tokens=12, previous_response_id=prev)  # fmt: skip
    assert e.value.body["param"] == "input"
    server.wait_kv_free(10)


def _long_chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": INSTRUCTIONS}]
    for t in range(turns):
        msgs += [user(_ask(t)), assistant(" ".join(WORDS[t % 12 :] + WORDS[: t % 12]))]
    return [*msgs, user(_ask(turns))]


def test_chat_completions_take_it_too(client, server):
    msgs = _long_chat(12)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, msgs)
    assert e.value.body["param"] == "messages"
    r = _chat(client, msgs, extra_body={"truncation": "auto"})
    assert r.usage.prompt_tokens + 12 <= MAX_LEN
    dropped, text = _kept_by_chat(client, msgs, r.usage.prompt_tokens)
    assert dropped > 0 and text == r.choices[0].message.content
    # a prompt that fits is left whole
    short = _long_chat(1)
    assert (_chat(client, short, extra_body={"truncation": "auto"}).usage.prompt_tokens
            == _chat(client, short).usage.prompt_tokens)  # fmt: skip
    server.wait_kv_free(10)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"truncation": "most"}, "truncation"),
        ({"truncation": "auto", "truncate_prompt_tokens": 100}, "truncation"),
    ],
)
def test_refusals(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, _long_chat(1), extra_body=extra)
    assert e.value.body["param"] == param


def test_a_last_turn_too_long_alone_is_refused_as_before(client, server):
    msgs = [*_long_chat(2)[:-1], user("fox " * 600)]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, msgs, extra_body={"truncation": "auto"})
    assert e.value.body["param"] == "messages" and "max_model_len" in e.value.body["message"]
    server.wait_kv_free(10)


def test_websocket_generations_take_it(server, client):
    msgs = _long_chat(12)

    async def ask(extra: dict) -> dict:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "g", "messages": msgs,
                                      "params": {"max_tokens": 12, "temperature": 0}, **extra}))  # fmt: skip
            text = ""
            async with asyncio.timeout(60):
                while True:
                    f = json.loads(await ws.recv())
                    if f["type"] == "delta":
                        text += f["text"]
                    if f["type"] in ("done", "error"):
                        return {**f, "text": text}

    refused = asyncio.run(ask({}))
    assert refused["type"] == "error" and refused["param"] == "messages", refused
    done = asyncio.run(ask({"truncation": "auto"}))
    no_turns = asyncio.run(ask({"truncation": "auto", "messages": None, "prompt": "hi"}))
    assert no_turns["type"] == "error" and no_turns["param"] == "truncation", no_turns
    assert done["type"] == "done", done
    want = _chat(client, msgs, extra_body={"truncation": "auto"})
    assert done["text"] == want.choices[0].message.content
    server.wait_kv_free(10)


def test_a_huge_history_is_cut_in_seconds_and_the_loop_stays_free(server):
    """60,000 one-word messages (near the 4 MiB body cap) under truncation "auto": the
    search skips parts too big by their bytes, the rest runs off the event loop."""
    msgs = [{"role": "system", "content": INSTRUCTIONS}]
    for t in range(30_000):
        msgs += [user(WORDS[t % 12]), assistant(WORDS[(t + 1) % 12])]
    body = {"model": "tiny", "messages": [*msgs, user("last")], "max_tokens": 4,
            "truncation": "auto"}  # fmt: skip
    worst = 0.0
    with httpx.Client(timeout=60) as h, concurrent.futures.ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        fut = pool.submit(h.post, server.url + "/v1/chat/completions", json=body)
        while not fut.done():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.05)
        r = fut.result()
        took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] + 4 <= MAX_LEN
    assert took < 30 and worst < 1.0, (took, worst)
    server.wait_kv_free(10)
