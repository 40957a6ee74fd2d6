"""`pagestream bench serve`: arrival times, metric math and the SSE parser on synthetic
data, then whole benchmarks against a live server over SSE and WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from bench import serve as bs
from bench.serve import (
    BenchConfig,
    RequestResult,
    SSEParser,
    arrival_offsets,
    parse_sse_payload,
    random_requests,
    run_benchmark,
    summarize,
)
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import live_server


# ----------------------------------------------------------------------------- arrivals
def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_have_the_asked_rate_and_spread(burstiness):
    rate, n = 50.0, 40_001
    t = np.asarray(arrival_offsets(n, rate, burstiness, seed=3))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # A gamma of shape k has squared coefficient of variation 1/k (1 for Poisson).
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_arrivals_are_seeded():
    assert arrival_offsets(10, 5.0, seed=1) == arrival_offsets(10, 5.0, seed=1)
    assert arrival_offsets(10, 5.0, seed=1) != arrival_offsets(10, 5.0, seed=2)


# ----------------------------------------------------------------------------- dataset
def test_random_requests_lengths_and_ids():
    reqs = random_requests(200, 100, 20, range_ratio=0.5, vocab_size=300, seed=7)
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert all(0 <= t < 300 for r in reqs for t in r.prompt)  # type: ignore[union-attr]
    assert len({r.prompt_len for r in reqs}) > 20  # actually spread
    assert reqs == random_requests(200, 100, 20, range_ratio=0.5, vocab_size=300, seed=7)

    exact = random_requests(5, 16, 8, vocab_size=1000, prefix_len=4)
    assert all(r.prompt_len == 20 == len(r.prompt) and r.output_len == 8 for r in exact)
    assert len({tuple(r.prompt[:4]) for r in exact}) == 1  # the shared prefix

    text = random_requests(3, 12, 8, text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in text)
    with pytest.raises(ValueError):
        random_requests(1, 4, 4)  # token ids without a vocabulary


# ----------------------------------------------------------------------------- metrics
def _ok(ttft: float, itl: list[float], out: int, prompt: int = 10) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=prompt,
        output_tokens=out,
        ttft=ttft,
        itl=itl,
        e2e=ttft + sum(itl),
    )


def test_summary_math():
    results = [
        _ok(0.1, [0.02, 0.02, 0.02], 4),  # TPOT 20 ms
        _ok(0.2, [0.05], 2),  # TPOT 50 ms
        _ok(0.3, [], 1),  # one token: no TPOT sample
        RequestResult(error="HTTP 400: nope", prompt_len=99, output_tokens=0),
    ]
    s = summarize(results, duration=2.0, percentiles=[50, 90, 99])
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == s["p50_ttft_ms"] == pytest.approx(200.0)
    # Linear interpolation between the order statistics 100, 200, 300.
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["mean_tpot_ms"] == pytest.approx(35.0)
    assert s["median_itl_ms"] == pytest.approx(20.0)  # all four gaps pooled
    assert s["mean_itl_ms"] == pytest.approx(27.5)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 250 + 300) / 3)
    assert s["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))


def test_summary_of_nothing_is_zeros():
    s = summarize([RequestResult(error="x")], duration=0.0, percentiles=[99.9])
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    assert s["p99.9_ttft_ms"] == 0.0 and s["mean_tpot_ms"] == 0.0


def test_report_table():
    s = summarize([_ok(0.1, [0.02], 2)], 1.0, [50, 99])
    s |= {"backend": "pagestream-sse", "max_concurrency": None, "percentiles": [50, 99]}
    s["errors"] = ["", "HTTP 500: boom"]
    text = bs.format_report(s)
    assert "Successful requests:" in text and "Mean TTFT (ms):" in text
    assert "P99 E2EL (ms):" in text and "P50" not in text  # the median row says p50
    assert "HTTP 500: boom" in text
    assert all(line == line.rstrip() for line in text.splitlines())


# ----------------------------------------------------------------------------- SSE parsing
CANNED = (
    b": keep-alive\n\n"
    b'data: {"choices":[{"index":0,"text":"He","token_ids":[5],"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"llo","token_ids":[6, 7],"finish_reason":null}]}\r\n\r\n'
    b'data: {"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("step", [1, 2, 7, len(CANNED)])
def test_sse_parser_reassembles_split_chunks(step):
    p = SSEParser()
    events = []
    for i in range(0, len(CANNED), step):
        events += p.feed(CANNED[i : i + step])
    events += p.close()
    assert len(events) == 5 and events[-1] == "[DONE]"
    evs = [parse_sse_payload(e, chat=False) for e in events]
    assert [e.kind for e in evs] == ["delta", "delta", "other", "other", "done"]
    assert evs[1].text == "llo" and evs[1].token_ids == [6, 7]
    assert evs[2].finish_reason == "length"
    assert (evs[3].prompt_tokens, evs[3].completion_tokens) == (3, 3)


def test_sse_parser_edge_cases():
    p = SSEParser()
    # Multi-line data joins with a newline; event/id fields are ignored; "data:" may omit
    # the space; an event without its blank line still counts at end of stream.
    assert p.feed(b"event: x\nid: 1\ndata: a\ndata:b\n\ndata: tail") == ["a\nb"]
    assert p.close() == ["tail"]
    small = SSEParser(max_line=8)
    with pytest.raises(ValueError):
        small.feed(b"data: 0123456789")


def test_sse_payloads():
    head = '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    assert parse_sse_payload(head, chat=True).kind == "other"
    d = parse_sse_payload('{"choices":[{"index":0,"delta":{"content":"hi"}}]}', chat=True)
    assert d.kind == "delta" and d.text == "hi" and d.token_ids is None
    err = parse_sse_payload('{"error":{"message":"generation failed: x","code":500}}', False)
    assert err.kind == "error" and err.error == "generation failed: x"
    assert parse_sse_payload('{"error":"plain"}', False).error == "plain"
    assert parse_sse_payload(" [DONE] ", True).kind == "done"
    # Token ids without text (a partial UTF-8 character held back) are still a token delta.
    held = parse_sse_payload('{"choices":[{"index":0,"text":"","token_ids":[9]}]}', False)
    assert held.kind == "delta"


def test_recorder_counts_ids_then_usage_then_text():
    ev = bs.StreamEvent
    r = bs._Recorder(RequestResult(), sent=10.0)
    r.event(10.5, ev("delta", text="a", token_ids=[1, 2]))
    r.event(10.7, ev("delta", text="b", token_ids=[3]))
    r.event(10.8, ev("other", completion_tokens=99, prompt_tokens=4))
    out = r.finish(11.0)
    assert out.success and out.output_tokens == 3 and out.prompt_len == 4
    assert out.ttft == pytest.approx(0.5) and out.itl == pytest.approx([0.2])
    assert out.e2e == pytest.approx(1.0)

    r = bs._Recorder(RequestResult(), sent=0.0)
    r.event(1.0, ev("delta", text="a"))
    r.event(2.0, ev("other", completion_tokens=5))
    assert r.finish(3.0).output_tokens == 5
    r = bs._Recorder(RequestResult(), sent=0.0)
    r.event(1.0, ev("delta", text="a"))
    r.event(2.0, ev("delta", text="b"))
    assert r.finish(3.0).output_tokens == 2
    assert not bs._Recorder(RequestResult(), sent=0.0).finish(1.0).success


# ----------------------------------------------------------------------------- canned server
@contextlib.asynccontextmanager
async def canned_server() -> AsyncIterator[str]:
    """A fake server whose streams break in the ways a real one might."""

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["prompt"][0]
        if kind == 0:
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"x","token_ids":[1]}]}\n\n')
        if kind == 1:  # an error event mid-stream
            await resp.write(b'data: {"error":{"message":"generation failed: boom"}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        elif kind == 2:  # the stream just ends
            pass
        elif kind == 3:  # too slow for the client's timeout
            await asyncio.sleep(5)
        else:  # fine, in pieces
            await resp.write(b'data: {"choices":[{"index":0,"text":"y",')
            await asyncio.sleep(0.01)
            await resp.write(b'"token_ids":[2]}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_sse_request_failure_modes():
    async with canned_server() as url:
        cfg = BenchConfig(base_url=url, request_timeout=0.5)
        async with aiohttp.ClientSession() as session:

            async def one(kind: int) -> RequestResult:
                req = bs.SampleRequest([kind], 1, 2)
                return await bs.sse_request(session, cfg, "m", req, 0.0)

            r = await asyncio.gather(*(one(k) for k in range(5)))
        assert r[0].error == "HTTP 400: bad prompt"
        assert r[1].error == "generation failed: boom"
        assert r[2].error == "the stream ended before [DONE]"
        assert r[3].error.startswith("timed out")
        assert r[4].success and r[4].output_tokens == 2 and len(r[4].itl) == 1
        assert not any(x.success for x in r[:4])


# ----------------------------------------------------------------------------- CLI
def test_cli_arguments():
    a = bs.build_parser().parse_args(
        ["--transport", "ws", "--request-rate", "inf", "--percentiles", "50,99.9",
         "--max-concurrency", "3", "--range-ratio", "0.2"]
    )  # fmt: skip
    cfg = bs.config_from_args(a)
    assert cfg.transport == "ws" and math.isinf(cfg.request_rate)
    assert cfg.percentiles == (50.0, 99.9) and cfg.max_concurrency == 3
    cfg.validate()
    with pytest.raises(SystemExit) as e:
        bs.main(["--range-ratio", "1.5"])
    assert e.value.code == 2
    with pytest.raises(ValueError):
        BenchConfig(temperature=3.0).validate()


# ----------------------------------------------------------------------------- live server
@pytest.fixture(scope="module")
def server():
    with live_server(str(tiny_checkpoint("llama"))) as s:
        yield s


def _check_clean_run(res: dict, n: int, input_len: int, output_len: int) -> None:
    assert res["completed"] == n and res["failed"] == 0, res["errors"]
    assert res["output_lens"] == [output_len] * n
    if input_len:
        assert res["input_lens"] == [input_len] * n
    assert res["total_output_tokens"] == n * output_len
    for ttft, e2e, itl in zip(res["ttfts"], res["e2els"], res["itls"]):
        assert 0 < ttft <= e2e
        assert 1 <= len(itl) <= output_len - 1 and all(g >= 0 for g in itl)
    assert res["duration"] > 0 and res["request_throughput"] > 0
    assert res["output_throughput"] > 0
    assert res["total_token_throughput"] > res["output_throughput"]
    assert res["mean_ttft_ms"] > 0 and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert res["mean_tpot_ms"] > 0 and res["p99_itl_ms"] >= res["median_itl_ms"]


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_benchmark_against_live_server(server, transport):
    cfg = BenchConfig(
        base_url=server.url,
        transport=transport,
        num_prompts=8,
        input_len=16,
        output_len=8,
        request_rate=math.inf,
        max_concurrency=4,
        request_timeout=120,
    )
    res = await run_benchmark(cfg)
    _check_clean_run(res, 8, 16, 8)
    assert res["max_concurrent_requests"] <= 4
    assert res["backend"] == f"pagestream-{transport}"
    assert res["model_id"] == server.state.serving.names[0]
    await asyncio.to_thread(server.wait_kv_free)


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_chat_endpoint_counts_the_rendered_prompt(server, transport):
    cfg = BenchConfig(
        base_url=server.url,
        transport=transport,
        endpoint="chat",
        num_prompts=3,
        input_len=10,
        output_len=5,
        request_timeout=120,
    )
    res = await run_benchmark(cfg)
    _check_clean_run(res, 3, 0, 5)
    # The server's usage report, which includes the chat template, is what counts.
    assert all(n > 10 for n in res["input_lens"])


def test_cli_run_with_poisson_arrivals_and_warmup(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = bs.main(
        ["--base-url", server.url, "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
         "--request-rate", "40", "--warmup", "2", "--seed", "1", "--result-json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert " Serving Benchmark Result " in printed and "Median ITL (ms):" in printed
    saved = json.loads(out.read_text())
    _check_clean_run(saved, 6, 8, 4)
    assert saved["request_rate"] == 40.0 and "api_key" not in saved["config"]
    assert saved["start_times"] == sorted(saved["start_times"])  # no semaphore: on schedule
    assert saved["start_times"][-1] > 0.02  # spread out, not all at once


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_rejected_requests_are_failures_not_crashes(server, transport):
    cfg = BenchConfig(
        base_url=server.url,
        transport=transport,
        num_prompts=3,
        input_len=8,
        output_len=4,
        vocab_size=10**9,  # ids the model does not have
        request_timeout=60,
    )
    res = await run_benchmark(cfg)
    assert res["completed"] == 0 and res["failed"] == 3
    assert all("outside the vocabulary" in e for e in res["errors"]), res["errors"]
    assert res["request_throughput"] == 0.0


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_request_timeout_aborts_and_frees_the_server(server, transport):
    cfg = BenchConfig(
        base_url=server.url,
        transport=transport,
        num_prompts=2,
        input_len=8,
        output_len=1500,  # seconds of decoding on a CPU
        request_timeout=0.3,
    )
    res = await run_benchmark(cfg)
    assert res["failed"] == 2
    assert all(e.startswith("timed out") for e in res["errors"])
    # The client going away (SSE) or its cancel frame (WS) frees the KV cache.
    await asyncio.to_thread(server.wait_kv_free, 30.0)


async def test_api_key_is_sent_on_both_transports():
    with live_server(str(tiny_checkpoint("llama")), api_key="sekrit") as s:
        for transport in ("sse", "ws"):
            cfg = BenchConfig(
                base_url=s.url,
                api_key="sekrit",
                transport=transport,  # type: ignore[arg-type]
                num_prompts=2,
                input_len=4,
                output_len=3,
                request_timeout=60,
            )
            _check_clean_run(await run_benchmark(cfg), 2, 4, 3)
        with pytest.raises(RuntimeError, match="401"):
            await run_benchmark(BenchConfig(base_url=s.url, api_key="wrong", num_prompts=1))


async def test_vocab_size_is_learned_from_the_server(server):
    cfg = BenchConfig(base_url=server.url)
    async with aiohttp.ClientSession() as session:
        model, entry = await bs._model_info(session, cfg)
        local = await bs._vocab_size(session, cfg, model, entry)  # config.json on disk
        probed = await bs._vocab_size(session, cfg, model, {})  # the server's 400
    assert local == probed == server.engine.runner.config.vocab_size  # type: ignore[attr-defined]
