"""Fault injection against a real server: a request's failure is that request's alone;
an engine failure ends a real `pagestream serve` process with a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from service.app import ENGINE_FAILURE_EXIT
from tests.checkpoints import tiny_checkpoint
from tests.reliability.clients import completion, sse_completion, ws_generations
from tests.service.live_server import free_port, live_server
from tests.service.test_engine_process import engine_children, wait_gone

# Marker tokens (tiny vocabulary: 2048): a prompt holding one picks its fault.
SAMPLE, REGISTER, DETOK, FORWARD = 2040, 2041, 2042, 2043
PLAN = f"sample-token={SAMPLE}@2,register-token={REGISTER},detok-token={DETOK}@1"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


def clean_prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def body(prompt: list[int], max_tokens: int = 24, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}  # fmt: skip


# With the engine in a child process too: the sampling and registration faults fire
# there and cross the boundary as that request's failure; detokenization stays here.
@pytest.mark.parametrize("engine_process", [False, True], ids=["inline", "engine-process"])
async def test_request_faults_fail_only_their_request(model, engine_process):
    prompts = clean_prompts(8)
    with live_server(
        model, engine_kwargs={"fault_injection": PLAN}, engine_process=engine_process
    ) as server:
        url = server.url
        async with aiohttp.ClientSession() as s:
            clean = await asyncio.gather(*(sse_completion(s, url, body(p)) for p in prompts))
            assert all(c.finish == "length" and len(c.token_ids) == 24 for c in clean)

            # The same requests again, with failing ones interleaved.
            faulty = [
                sse_completion(s, url, body([5, SAMPLE, 9, 11])),  # fails at its 3rd token
                completion(s, url, body([5, REGISTER, 9])),  # fails on its first step
                sse_completion(s, url, body([4, SAMPLE, 6], n=3)),  # parent fails after fork
                completion(s, url, body([7, 8, SAMPLE], max_tokens=8, n=1)),
            ]
            ws = ws_generations(server.ws_url, [
                {"id": "bad", "prompt": [3, DETOK, 4], "params": {"max_tokens": 16}},
                {"id": "good", "prompt": prompts[0], "params": {
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}},
            ])  # fmt: skip
            again = [sse_completion(s, url, body(p)) for p in prompts]
            results = await asyncio.wait_for(asyncio.gather(*again, *faulty, ws), 120)
        for before, after in zip(clean, results[: len(prompts)], strict=True):
            assert after.finish == "length" and after.error is None
            assert after.token_ids == before.token_ids
        sse_bad, full_bad, sse_n3, full_bad2, ws_out = results[len(prompts) :]
        # SSE: the tokens before the failure, then an error event in OpenAI's shape, [DONE].
        assert sse_bad.status == 200 and sse_bad.done and len(sse_bad.token_ids) == 2
        assert sse_bad.error["type"] == "server_error" and "sampling" in sse_bad.error["message"]
        assert sse_n3.error is not None and sse_n3.done
        for full in (full_bad, full_bad2):
            assert full.status == 500 and full.error["code"] == "request_failed"
        assert "start" in full_bad.error["message"]
        assert (
            ws_out["bad"].error["code"] == 500
            and "output processing" in (ws_out["bad"].error["message"])
        )
        assert ws_out["good"].token_ids == clean[0].token_ids
        server.wait_kv_free()
        # The runner drops finished requests at the next step, which may still be running.
        for _ in range(100):
            if server.debug_counts()["runner_requests"] == 0:
                break
            time.sleep(0.05)
        assert server.debug_counts()["runner_requests"] == 0
        with urllib.request.urlopen(url + "/health", timeout=5) as h:
            assert h.status == 200
        with urllib.request.urlopen(url + "/metrics", timeout=5) as m:
            text = m.read().decode()
        errors = [ln for ln in text.splitlines() if ln.startswith("pagestream_request_errors")]
        assert errors and float(errors[0].split()[-1]) == 5


async def test_failing_step_hook_is_logged_and_serving_goes_on(model):
    with live_server(model) as server:

        def boom(info) -> None:
            raise RuntimeError("a broken metrics exporter")

        server.on_loop(lambda: server.engine.add_step_hook(boom))
        async with aiohttp.ClientSession() as s:
            outs = await asyncio.gather(
                *(sse_completion(s, server.url, body(p, 8)) for p in clean_prompts(4))
            )
        assert all(o.finish == "length" and o.error is None for o in outs)
        errs = server.on_loop(lambda: dict(server.engine.core.hook_errors))
        assert any("boom" in k for k in errs), errs
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as m:
            assert "pagestream_engine_hook_errors" in m.read().decode()


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not start")


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--engine-process", "on"]], ids=["inline", "engine-process"])
async def test_engine_failure_answers_clients_then_exits_nonzero(model, mode):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PAGESTREAM_FAULT_INJECTION": f"forward-token={FORWARD}"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", model, "--port", str(port),
         "--num-kv-blocks", "256", "--dtype", "float32", "--threads", "1", *mode],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        _wait_health(url, proc)
        children = engine_children(proc.pid)
        assert len(children) == (1 if mode else 0), children
        long = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/ws")
            for i in range(3):
                await ws.send(json.dumps({"type": "generate", "id": f"g{i}",
                                          "prompt": [5, 6, 7 + i], "params": long}))  # fmt: skip
            streams = [
                asyncio.ensure_future(sse_completion(s, url, body([9, 10 + i], 1500)))
                for i in range(3)
            ]
            # Everyone is streaming; then the poisoned request arrives.
            first = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert first["type"] == "delta"
            poison = asyncio.ensure_future(completion(s, url, body([1, FORWARD, 2], 4)))
            ws_errors: set[str] = set()
            close_code = None
            try:
                async with asyncio.timeout(60):
                    while True:
                        f = json.loads(await ws.recv())
                        if f["type"] == "error":
                            ws_errors.add(f["id"])
            except ConnectionClosed as e:
                close_code = e.rcvd.code if e.rcvd else None
            seen = await asyncio.wait_for(asyncio.gather(*streams, poison), 60)
        assert ws_errors == {"g0", "g1", "g2"} and close_code == 1011
        for st in seen[:3]:
            assert st.done and st.error is not None and st.error["code"] == 503, st
        assert seen[3].status == 503 and "engine" in seen[3].error["message"]
        rc = proc.wait(60)
        log = proc.stdout.read() if proc.stdout else ""
        assert rc == ENGINE_FAILURE_EXIT, log
        assert "injected engine fault" in log
        for c in children:  # the engine's process does not outlive its server
            assert wait_gone(c, 10), f"engine process {c} outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
