"""Issue 45 row 3 replayed against a real `pagestream serve` process: 3.9 MB prompts, four
at once, to `/tokenize` (and to the other routes that tokenize).  Before: `Tokenizer.encode`
held the GIL and the event loop froze 2.7 s (10.6 s with four); the 3 s timeout could not
fire.  Now each gets a 4xx (or a bounded 200) within 3 s while a background stream and a
`/health` poller (tests/reliability/watch.py) see no stall, and the server then serves a
normal chat request.

Two servers: the generated llama's tokenizer cannot drop text, so a prompt too long to fit
in max_model_len is known by its length and refused before any tokenizing; a copy of it
with a Strip normalizer (a pipeline that can drop text, so no length bound holds) makes the
4 MB prompts really reach the tokenizer: in worker processes, killed at the deadline.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
import websockets

from tests.checkpoints import tiny_checkpoint
from tests.reliability.watch import (
    REPLY_BUDGET_S,
    Watch,
    assert_client_error,
    normal_chat,
    post,
    serve_process,
    tiny_server,
)

HUGE = 3_900_000  # under --max-request-bytes (4 MiB) with the JSON around it


def prose(nbytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["hello", "world", "the", "quick", "brown", "fox", "é", "日本", "\n"]
    return (
        " ".join(rng.choice(words) for _ in range(nbytes // 3))
        .encode()[:nbytes]
        .decode(errors="ignore")
    )


def utf8(body: dict) -> str:
    """The JSON body with its text as UTF-8, not \\u escapes (so 3.9 MB stays 3.9 MB)."""
    return json.dumps(body, ensure_ascii=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_server(tmp_path_factory, "hostile-tokenize") as s:
        yield s


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """The same checkpoint, its tokenizer given a Strip normalizer (links to the rest)."""
    src = tiny_checkpoint("llama")
    dst = tmp_path_factory.mktemp("strip-llama")
    for f in Path(src).iterdir():
        if f.name != "tokenizer.json":
            (dst / f.name).symlink_to(f)
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Strip", "strip_left": True, "strip_right": True}
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    with serve_process(str(dst), log_dir=tmp_path_factory.mktemp("hostile-tokenize-strip")) as s:
        yield s


async def ws_generate(url: str, frame: dict) -> tuple[dict, float]:
    data = utf8(frame)
    t0 = time.monotonic()
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/ws",
                                  max_size=None) as ws:  # fmt: skip
        await ws.send(data)
        while (reply := json.loads(await ws.recv()))["type"] == "delta":
            pass
    return reply, time.monotonic() - t0


async def test_row3_huge_prompts_are_refused_by_their_length(server):
    """Four 3.9 MB /tokenize at once, and the same text to completions, chat, chat
    /tokenize and a WebSocket frame: each a 400 naming the field, none tokenized."""
    huge = prose(HUGE)
    msgs = [{"role": "user", "content": huge}]
    # Bodies are built before the watch starts: dumping megabytes of JSON blocks this
    # (the client's) event loop, which the watch would count as the server's stall.
    bodies = [("/tokenize", utf8({"prompt": huge}), "prompt")] * 4 + [
        ("/v1/completions", utf8({"prompt": huge, "max_tokens": 4}), "prompt"),
        ("/v1/completions", utf8({"prompt": ["hi", huge[:1_000_000]]}), "prompt"),
        ("/v1/chat/completions", utf8({"messages": msgs, "max_tokens": 4}), "messages"),
        ("/tokenize", utf8({"messages": msgs}), "messages"),
    ]
    frame = {"type": "generate", "id": "g", "prompt": prose(1_000_000),
             "params": {"max_tokens": 4}}  # fmt: skip
    async with Watch(server.url) as w:
        results = await asyncio.gather(*(post(server.url, path, b) for path, b, _ in bodies))
        for (status, obj, took, _), (_, _, param) in zip(results, bodies, strict=True):
            assert_client_error(status, obj, took, param)
            assert "max_model_len" in obj["error"]["message"], obj  # type: ignore[index]
        reply, took = await ws_generate(server.url, frame)
        assert reply["type"] == "error" and reply["code"] == 400, reply
        assert reply["param"] == "prompt" and took < REPLY_BUDGET_S, (reply, took)
        await normal_chat(server.url)
        w.check("row 3")
    server.assert_alive()


async def test_row3_huge_prompts_that_reach_the_tokenizer_are_stopped_at_the_deadline(
    unbounded,
):
    """No length bound: four 3.9 MB /tokenize at once run in the tokenizer processes (two)
    or wait for one; each is answered by --tokenize-timeout (2 s): 413 for the two that
    ran (their workers killed), 429 for the two that waited.  The pool heals: a 300 KB
    prompt (a worker process's job) then gets its bounded 200."""
    body = utf8({"prompt": prose(HUGE)})
    mid = utf8({"prompt": prose(300_000, seed=1)})
    async with Watch(unbounded.url) as w:
        results = await asyncio.gather(*(post(unbounded.url, "/tokenize", body) for _ in range(4)))
        statuses = []
        for status, obj, took, _ in results:
            assert_client_error(status, obj, took, "prompt" if status == 413 else None)
            statuses.append(status)
        assert set(statuses) <= {200, 413, 429}, statuses
        await normal_chat(unbounded.url)
        deadline = time.monotonic() + 20
        while True:  # 429 while the killed workers are replaced
            status, obj, took, _ = await post(unbounded.url, "/tokenize", mid)
            assert took < REPLY_BUDGET_S, took
            if status == 200:
                break
            assert status == 429 and time.monotonic() < deadline, (status, obj)
            await asyncio.sleep(0.5)
        assert obj is not None and obj["count"] > 100_000, obj
        w.check("row 3, no length bound")
    unbounded.assert_alive()
