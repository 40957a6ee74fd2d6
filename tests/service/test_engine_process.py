"""The engine core in its own process (`serve --engine-process`, service/engine_proc.py),
through real `pagestream serve` processes and real HTTP clients: greedy output identical
to the inline engine's and the engine thread's (plain, n = 2, stop strings, streaming, a
JSON-schema grammar, and the engine serving on after an abort mid-stream frees the
request's KV); the engine's process killed under load fails the streams, /health says
503 and the server exits for its supervisor; no engine process outlives its server
(stopped or killed); --engine-thread on is refused beside it at start-up, naming the
flag.  (The shared prefix tier and tensor parallelism under the engine process:
tests/service/test_prefix_registration.py, tests/reliability/test_tp_engine_process.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from service.app import ENGINE_FAILURE_EXIT
from tests.checkpoints import tiny_checkpoint
from tests.service.live_server import free_port, live_server
from tests.service.live_server import server_process as server

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


def engine_children(pid: int) -> list[int]:
    """The server's engine processes (direct children running service.engine_proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for c in (task / "children").read_text().split():
                cmd = Path(f"/proc/{c}/cmdline").read_bytes()
                if b"service.engine_proc" in cmd:
                    out.append(int(c))
    return out


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url + "/v1/completions", json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return json.loads(text)


async def _stream_text(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, str]:
    text, finish = "", None
    async with session.post(url + "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                finish = c["finish_reason"] or finish
    return text, finish


async def workload(url: str) -> dict:
    """Greedy requests one at a time (each computes alone, so every mode batches them
    alike), then an abort mid-stream and the same request again."""
    out: dict = {}
    greedy = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            m = (await r.json())["data"][0]["id"]
        base = {"model": m, **greedy}

        def choices(r: dict) -> list:
            return [(c["text"], c.get("token_ids"), c["finish_reason"]) for c in r["choices"]]

        plain = await _post(s, url, base | {"prompt": "Once upon a time", "max_tokens": 24})
        out["plain"] = choices(plain)
        text = plain["choices"][0]["text"]
        assert len(text) > 6, text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        r = await _post(s, url, base | {"prompt": "Once upon a time", "max_tokens": 24,
                                        "stop": [stop]})  # fmt: skip
        out["stop"] = choices(r)
        assert out["stop"][0][2] == "stop", (stop, out["stop"])
        r = await _post(s, url, base | {"prompt": "The cat", "max_tokens": 12, "n": 2})
        out["n2"] = choices(r)
        r = await _post(s, url, base | {"prompt": "The dog", "max_tokens": 6, "logprobs": 2,
                                        "prompt_logprobs": 1})  # fmt: skip
        c0 = r["choices"][0]
        out["logprobs"] = (choices(r), c0["logprobs"], c0.get("prompt_logprobs"))
        assert out["logprobs"][1]["top_logprobs"] and out["logprobs"][2], r
        out["stream"] = await _stream_text(s, url, base | {"prompt": "Hello", "max_tokens": 16})
        r = await _post(s, url, base | {"prompt": "Answer:", "max_tokens": 40,
                                        "ignore_eos": False, "guided_json": SCHEMA})  # fmt: skip
        out["json"] = choices(r)
        json.loads(out["json"][0][0])  # the grammar held
        # Abort mid-stream: the client leaves after three chunks.
        body = base | {"prompt": "A long story", "max_tokens": 400, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: {")
                if seen == 3:
                    break
        deadline = time.monotonic() + 20
        while True:
            async with s.get(url + "/debug/state") as r:
                st = await r.json()
            if st["running"] == 0 and st["requests"] == 0 and st["kv_blocks_used"] == 0:
                break
            assert time.monotonic() < deadline, f"the aborted request still holds KV: {st}"
            await asyncio.sleep(0.05)
        out["streams_after_abort"] = st["streams"]
        r = await _post(s, url, base | {"prompt": "Once upon a time", "max_tokens": 24})
        out["after_abort"] = choices(r)
    return out


@pytest.mark.slow
async def test_process_engine_serves_what_inline_and_thread_serve(tmp_path, model):
    results = {}
    for mode in (["--engine-thread", "off"], ["--engine-thread", "on"], ["--engine-process"]):
        args = ["--model", model, "--dtype", "float32", "--num-kv-blocks", "256",
                "--enable-debug-routes", *mode]  # fmt: skip
        with server(tmp_path, "service.cli", *args) as (proc, url):
            kids = engine_children(proc.pid)
            assert len(kids) == (1 if mode == ["--engine-process"] else 0), kids
            results[mode[-1]] = await workload(url)
            if kids:  # the HTTP process loads no model: torch is the child's alone
                assert not torch_mapped(proc.pid) and torch_mapped(kids[0])
                with urllib.request.urlopen(url + "/debug/state", timeout=10) as r:
                    state = json.load(r)
                assert state["engine_rss_bytes"] > 2 * state["rss_bytes"] > 0, state
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 60) == 0
            for k in kids:  # no engine process left behind a clean exit
                assert wait_gone(k, 10), f"engine process {k} outlived its server"
    inline = results["off"]
    assert inline["plain"][0][1] and len(inline["plain"][0][1]) == 24
    assert inline["after_abort"] == inline["plain"]
    assert inline["n2"][0][:2] == inline["n2"][1][:2]
    assert results["on"] == inline
    assert results["--engine-process"] == inline


def torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _host_args(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--engine-process", *extra]


async def _long_streams(
    url: str, n: int, started: asyncio.Event, max_tokens: int = 1500
) -> list[list[str]]:
    """n SSE streams (by default far longer than the test): each one's events, to its
    end."""

    async def one(s: aiohttp.ClientSession, m: str, i: int) -> list[str]:
        body = {"model": m, "prompt": f"go {i}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        events = []
        with contextlib.suppress(aiohttp.ClientError):
            async with s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        started.set()
                        events.append(line.decode())
        return events

    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            m = (await r.json())["data"][0]["id"]
        return await asyncio.gather(*(one(s, m, i) for i in range(n)))


def _failed_by_the_engine(events: list[str]) -> bool:
    return any('"error"' in e and "engine" in e for e in events)


FORWARD = 2043  # a prompt token the fault plan fails the forward pass on


@pytest.mark.parametrize("how", ["killed", "step raises"])
async def test_engine_process_death_fails_streams_and_health(model, how):
    """The engine's process SIGKILLed, or its step raising (fault injection in the child),
    under load: every stream ends with the engine's error (no hang), /health and /live
    answer 503 naming it, a new request gets 503."""
    kw = {"engine_process": True, "fault_injection": f"forward-token={FORWARD}"}
    with live_server(model, engine_kwargs=kw) as srv:
        core = srv.engine.core
        assert srv.engine.in_child and srv.engine.executor is None
        started = asyncio.Event()
        streams = asyncio.create_task(_long_streams(srv.url, 3, started))
        await asyncio.wait_for(started.wait(), 60)
        if how == "killed":
            core.kill()
            why = "engine process exited unexpectedly (signal 9)"
        else:
            async with aiohttp.ClientSession() as s:
                body = {"model": model, "prompt": [1, FORWARD, 2], "max_tokens": 4}
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    assert r.status == 503, await r.text()
            why = "injected"
        ends = await asyncio.wait_for(streams, 30)
        assert all(_failed_by_the_engine(ev) for ev in ends), [ev[-2:] for ev in ends]
        # The child fails its requests' streams first, then says it stopped: on a loaded
        # machine that notice may trail the streams' ends by a moment.
        deadline = time.monotonic() + 10
        while srv.engine.dead is None:
            assert time.monotonic() < deadline, "the engine's death was never reported"
            await asyncio.sleep(0.02)
        for path in ("/health", "/live"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(srv.url + path, timeout=5)
            assert e.value.code == 503
            assert why in e.value.read().decode()
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            srv.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 503
        assert await asyncio.to_thread(wait_gone, core.pid, 10)


async def test_server_exits_for_its_supervisor_when_the_engine_process_is_killed(tmp_path, model):
    with server(tmp_path, "bench.host_server", *_host_args(model, "--step-ms", "20")) as (
        proc,
        url,
    ):
        (kid,) = engine_children(proc.pid)
        started = asyncio.Event()
        streams = asyncio.create_task(_long_streams(url, 3, started))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(kid, signal.SIGKILL)
        ends = await asyncio.wait_for(streams, 30)
        assert all(_failed_by_the_engine(ev) for ev in ends), [ev[-2:] for ev in ends]
        assert await asyncio.to_thread(proc.wait, 30) == ENGINE_FAILURE_EXIT


async def test_admission_reads_the_engine_process_queue(tmp_path, model):
    """--max-waiting-requests with the queue in the engine's process: one running (one
    seat), one waiting, the next refused with 429 from the local copy of the counts."""
    args = _host_args(model, "--step-ms", "50", "--max-num-seqs", "1",
                      "--max-waiting-requests", "1")  # fmt: skip
    with server(tmp_path, "bench.host_server", *args) as (_, url):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                m = (await r.json())["data"][0]["id"]
            body = {"model": m, "prompt": "hi", "max_tokens": 40, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            async with s.post(url + "/v1/completions", json=body) as first:
                assert first.status == 200
                await first.content.readline()  # its first event: it runs
                second = asyncio.create_task(_stream_text(s, url, body))
                deadline = time.monotonic() + 10
                while True:  # the second is queued behind the only seat
                    async with s.get(url + "/metrics") as r:
                        text = await r.text()
                    waiting = [ln for ln in text.splitlines()
                               if ln.startswith("pagestream_num_requests_waiting")]  # fmt: skip
                    if waiting and float(waiting[0].split()[-1]) == 1:
                        break
                    assert time.monotonic() < deadline, waiting
                    await asyncio.sleep(0.05)
                async with s.post(url + "/v1/completions", json=body) as third:
                    assert third.status == 429, await third.text()
                async for _ in first.content:
                    pass
            assert (await asyncio.wait_for(second, 30))[1] == "length"


def test_engine_process_dies_with_a_killed_server(tmp_path, model):
    with server(tmp_path, "bench.host_server", *_host_args(model)) as (proc, _):
        (kid,) = engine_children(proc.pid)
        proc.kill()
        proc.wait(10)
        assert wait_gone(kid, 10), "the engine process outlived its SIGKILLed server"


def test_engine_thread_on_is_refused_beside_the_process_at_start(model):
    r = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--model", model, "--engine-process",
         "--port", str(free_port()), "--engine-thread", "on"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--engine-process" in r.stderr and "--engine-thread on" in r.stderr, r.stderr[-2000:]


def test_engine_process_outlives_the_thread_that_started_it(model):
    """Started from a thread that then ends (as the server's loader thread may), the
    engine's process serves on, and its engine's shutdown ends it."""
    from scheduler.config import EngineConfig
    from scheduler.sampling_params import SamplingParams
    from service.async_engine import AsyncEngine

    box: dict = {}
    config = EngineConfig.from_kwargs(model=model, dtype="float32", threads=1,
                                      engine_process=True)  # fmt: skip
    t = threading.Thread(target=lambda: box.update(engine=AsyncEngine.in_process(config)))
    t.start()
    t.join(120)
    engine = box["engine"]
    time.sleep(0.5)
    assert alive(engine.core.pid)

    async def use() -> list[int]:
        await engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            async for out in engine.generate("Hello", params):
                last = out
            return last.outputs[0].token_ids
        finally:
            await engine.shutdown()

    assert len(asyncio.run(use())) == 5
    assert wait_gone(engine.core.pid, 10)


def _boom(info) -> None:
    raise RuntimeError("a broken exporter in the engine's process")


def failing_hook_engine(config):
    """A builder (run in the engine's process): the engine with a step hook that fails."""
    from service.async_engine import default_builder

    engine = default_builder(config)
    engine.add_step_hook(_boom)
    return engine


async def test_hooks_in_the_engine_process_fail_alone_and_are_counted(model):
    """A step hook failing in the engine's process: serving goes on, the failures reach
    the server's /metrics; the server's own step hooks see every step."""
    from scheduler.config import EngineConfig
    from service.async_engine import AsyncEngine
    from service.state import ServerConfig
    from tests.service.live_server import LiveServer

    config = EngineConfig.from_kwargs(model=model, dtype="float32", threads=1,
                                      num_kv_blocks=256, engine_process=True)  # fmt: skip
    engine = await asyncio.to_thread(AsyncEngine.in_process, config, failing_hook_engine)
    seen = []
    engine.add_step_hook(lambda info: seen.append((info.so, len(info.mo.req_ids), info.stats)))
    srv = LiveServer(ServerConfig(engine=config), engine).start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": model, "prompt": "Hi", "max_tokens": 6, "ignore_eos": True}
            r = await _post(s, srv.url, body)
            assert r["choices"][0]["finish_reason"] == "length"
            async with s.get(srv.url + "/metrics") as m:
                text = await m.text()
        lines = [ln for ln in text.splitlines() if ln.startswith("pagestream_engine_hook_errors")]
        assert any("_boom" in ln and float(ln.split()[-1]) >= 6 for ln in lines), lines
        assert len(seen) >= 6 and all(so is None and st is not None for so, _, st in seen)
        assert sum(n for _, n, _ in seen) >= 6  # every sampled token counted
    finally:
        srv.stop()


async def test_sigterm_to_the_whole_group_drains_through_the_server(tmp_path, model):
    """SIGTERM to the server's process group (a supervisor stopping them all): the engine's
    process ignores it, the server drains its streams to their end, then stops the
    engine; both exit cleanly."""
    args = _host_args(model, "--step-ms", "20")
    with server(tmp_path, "bench.host_server", *args, new_session=True) as (proc, url):
        (kid,) = engine_children(proc.pid)
        started = asyncio.Event()
        streams = asyncio.create_task(_long_streams(url, 2, started, max_tokens=60))
        await asyncio.wait_for(started.wait(), 60)
        os.killpg(proc.pid, signal.SIGTERM)
        ends = await asyncio.wait_for(streams, 60)
        for events in ends:
            assert events[-1].strip() == "data: [DONE]", events[-2:]
            assert '"finish_reason":"length"' in events[-2].replace(" ", ""), events[-2:]
            assert not any('"error"' in e for e in events)
        assert await asyncio.to_thread(proc.wait, 60) == 0
        assert wait_gone(kid, 10)


def test_offline_llm_with_the_engine_process(model):
    """LLM(engine_process=True): the same greedy tokens as the inline engine (its
    final-only streams: tokens that wake no one until the end)."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["Hello there", "The cat sat"]
    got = {}
    for proc in (True, False):
        llm = LLM(model, dtype="float32", threads=1, engine_process=proc)
        try:
            got[proc] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
            pid = getattr(llm.engine.core, "pid", None)
        finally:
            llm.shutdown()
        if proc:
            assert pid is not None and wait_gone(pid, 10)
    assert got[True] == got[False] and all(len(t) == 10 for t in got[True])
