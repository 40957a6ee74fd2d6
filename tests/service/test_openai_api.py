"""The OpenAI-compatible API against a live server, with the official openai client and
raw HTTP; greedy output must equal the offline LLM API's."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from scheduler.sampling_params import SamplingParams
from service.llm import LLM
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, served_model_name="tiny", max_request_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def post(server, path: str, body: dict | bytes, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "tiny"
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200


def test_completion_matches_offline(client, offline):
    prompt = "def add(a, b):"
    ref = offline.generate([prompt], greedy())[0].outputs[0]
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    assert c.text == ref.text
    assert c.model_extra["token_ids"] == ref.token_ids
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))


def test_completion_stream_matches_offline(client, offline):
    prompt = [11, 22, 33, 44, 55]
    ref = offline.generate([prompt], greedy())[0].outputs[0]
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    text, ids, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    assert text == ref.text and ids == ref.token_ids
    assert finish == "length"
    assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == 5


def test_chat_matches_offline_plain_and_streaming(client, offline):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ]
    ref = offline.chat(messages, greedy())[0].outputs[0]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces, roles = [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
    assert "".join(pieces) == ref.text
    assert roles == ["assistant"]
    assert len(pieces) > 1, "the answer should arrive in several chunks"


def test_n_and_multiple_prompts_and_logprobs(client, offline):
    r = client.completions.create(
        model="tiny", prompt=["one", "two"], max_tokens=4, n=2, temperature=0.8, seed=3,
        logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert len(c.logprobs.tokens) == 4
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="seed test", max_tokens=8, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_stop_strings_never_leak(client, offline):
    prompt = "Once upon a time"
    full = offline.generate([prompt], greedy(24))[0].outputs[0].text
    stop = full[6:9]
    assert stop and stop in full
    expect = full[: full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=stream,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        if stream:
            text = "".join(c.choices[0].text for c in r if c.choices)
        else:
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
            assert r.choices[0].model_extra["stop_reason"] == stop
        assert text == expect
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert r.choices[0].text == expect + stop


def test_offline_final_only_yields_once_with_the_streamed_tokens(offline):
    """LLM.generate consumes final-only (decode tokens do not wake it every step); the
    engine's streaming consumers and it see the same tokens and text."""
    prompt = "The quick brown fox"

    async def collect(final_only: bool):
        outs, text = [], ""
        async for out in offline.engine.generate(
            prompt, greedy(20), request_id=f"fo-{final_only}", final_only=final_only
        ):
            outs.append(out.outputs[0].token_ids[:])
            text = out.outputs[0].text
        return outs, text

    streamed, text = offline._run(collect(False))
    final, final_text = offline._run(collect(True))
    assert len(streamed) > 1 and len(final) == 1
    assert final[0] == streamed[-1] and len(final[0]) == 20 and final_text == text
    assert offline.generate([prompt], greedy(20))[0].outputs[0].text == text


def test_offline_stop_strings_stop_the_engine_promptly(offline):
    """Stop strings are matched by the consumer: a final-only request with stop strings
    still wakes per token, so the engine stops there rather than at max_tokens."""
    prompt = "Once upon a time"
    full = offline.generate([prompt], greedy(24))[0].outputs[0].text
    stop = full[6:9]
    core = offline.engine.core
    before = core.tokens_computed
    p = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop])
    out = offline.generate([prompt], p)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    # The prompt, the tokens up to the stop string and a step or two of slack: far from
    # the 400 a consumer that only woke at the end would let it run to.
    assert core.tokens_computed - before < 100, core.tokens_computed - before


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": "x", "foo": 1}, 400, "foo", "unknown field"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ({"prompt": "x", "temperature": 9}, 400, "temperature", "<= 2"),
        ({"prompt": "x", "logit_bias": {"a": 2}}, 400, "logit_bias", "token ids"),
        ({"prompt": "x", "logit_bias": {"1": 200}}, 400, "logit_bias", "[-100, 100]"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias", "vocabulary"),
        ({"prompt": "x", "use_beam_search": True, "n": 11}, 400, "n", "beam width"),
        ({"prompt": "x", "use_beam_search": True, "seed": 1}, 400, "seed", "use_beam_search"),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix", "fill-in-the-middle"),
        ({"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of", ">= n"),
        ({"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", "streamed"),
        ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "<= 20"),
        ({"prompt": [1, "a"]}, 400, "prompt", ""),
        ({"prompt": [999999]}, 400, "prompt", "vocabulary"),
        ({"prompt": "x", "model": "nope"}, 404, "model", "does not exist"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "max_model_len"),
        ({"prompt": "x", "n": 0}, 400, "n", ">= 1"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", ""),
    ],
)
def test_completion_errors(server, body, status, param, words):
    code, raw = post(server, "/v1/completions", body)
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param
    assert words in err["message"]
    assert err["type"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": []}, "messages", "length >= 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", ""),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]", "function"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].type", ""),
    ],
)  # fmt: skip
def test_chat_errors(server, body, param, words):
    code, raw = post(server, "/v1/chat/completions", body)
    assert code == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and words in err["message"]


def test_accepted_fields_that_do_not_change_output(server):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "response_format": {"type": "text"},
        "store": False,
    }
    code, raw = post(server, "/v1/chat/completions", body)
    assert code == 200, raw


def test_prompt_longer_than_max_model_len_names_both_numbers(server):
    limit = server.engine.max_model_len
    code, raw = post(server, "/v1/completions", {"prompt": [5] * (limit + 3)})
    assert code == 400
    msg = json.loads(raw)["error"]["message"]
    assert str(limit + 3) in msg and str(limit) in msg


def test_body_size_limit_and_bad_json(server):
    code, raw = post(server, "/v1/completions", {"prompt": "x" * (70 * 1024)})
    assert code == 413 and "limit" in json.loads(raw)["error"]["message"]
    code, raw = post(server, "/v1/completions", b"{not json")
    assert code == 400 and "JSON" in json.loads(raw)["error"]["message"]


def test_raw_sse_format(server):
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(
            {
                "prompt": "abc",
                "max_tokens": 5,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    # Each event is numbered (`id:`, what a resume starts after: service/resume.py).
    assert [e.split("\n")[0] for e in events] == [f"id: {i}" for i in range(1, len(events) + 1)]
    assert all(e.split("\n")[1].startswith("data: ") for e in events)
    assert events[-1].endswith("\ndata: [DONE]")
    payloads = [json.loads(e.split("\n")[1][6:]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_aborts_and_frees_blocks(server):
    """Read two SSE events of a long generation, drop the connection, and the engine
    must abort the request and free its blocks once the resume grace period is over
    (within a step or so with --resume-grace 0: tests/service/test_resume.py)."""
    import socket

    body = json.dumps(
        {"prompt": "tell me a long story", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    ).encode()
    s = socket.create_connection(("127.0.0.1", server.config.port), timeout=30)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    while got.count(b"data: ") < 3:
        chunk = s.recv(4096)
        assert chunk
        got += chunk
    assert not server.kv_all_free(), "the request should be running"
    s.close()
    server.wait_kv_free(timeout=server.config.resume_grace + 10)
    stats = server.on_loop(lambda: server.engine.scheduler.stats())
    assert stats.num_running == 0 and stats.kv_usage == 0


def test_metrics_exposed(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    for name in (
        "pagestream_time_to_first_token_seconds_bucket",
        "pagestream_inter_token_latency_seconds_bucket",
        "pagestream_e2e_request_latency_seconds_count",
        "pagestream_request_queue_time_seconds_count",
        "pagestream_num_requests_running",
        "pagestream_num_requests_waiting",
        "pagestream_kv_cache_usage_ratio",
        "pagestream_prefix_cache_queries_total",
        'pagestream_prefix_cache_hits_total{model_name="tiny",tier="local"}',
        'pagestream_prefix_cache_hits_total{model_name="tiny",tier="redis"}',
        "pagestream_num_preemptions_total",
        "pagestream_prompt_tokens_total",
        "pagestream_generation_tokens_total",
    ):
        assert name in text, name


def test_concurrent_requests_complete(server, client):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        r = client.completions.create(model="tiny", prompt=f"q{i}", max_tokens=6, temperature=0)
        results[i] = r.choices[0].finish_reason

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 12 and time.monotonic() - t0 < 60
    server.wait_kv_free()
