"""`--data-parallel-size` (service/data_parallel.py): N whole engines, each in its own
process on its own cores, behind one server, through real HTTP clients: greedy output
equal to transformers' on every rank; the ranks are separate processes pinned to disjoint
cores; a prompt that shares a prefix with an earlier one goes to the rank that cached it;
a conversation stays on its rank; an abort frees its KV on its rank; metrics and
/debug/state add the ranks up; a rank that dies takes the server down (every stream
failed, exit code 70); ranks take whole NUMA nodes where they divide; the offline LLM
takes it too; bad combinations are refused naming the flag."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from scheduler.config import ConfigError, EngineConfig
from service.app import ENGINE_FAILURE_EXIT
from service.cli import build_parser, engine_config
from service.data_parallel import core_split, numa_nodes
from tests.checkpoints import tiny_checkpoint
from tests.gpu.test_tensor_parallel import hf_greedy
from tests.service.live_server import live_server, server_process
from tests.service.test_engine_process import (
    _failed_by_the_engine,
    _long_streams,
    engine_children,
    wait_gone,
)

BLOCK = 16


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def dp(model):
    kw = {"data_parallel_size": 2, "num_kv_blocks": 512, "block_size": BLOCK}
    with live_server(
        model, engine_kwargs=kw, enable_debug_routes=True, enable_prompt_tokens_details=True
    ) as srv:
        yield srv


def debug(url: str) -> dict:
    with urllib.request.urlopen(url + "/debug/state", timeout=10) as r:
        return json.loads(r.read())


def routed(url: str) -> list[int]:
    return [r["routed"] for r in debug(url)["data_parallel_ranks"]]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


async def complete(c: openai.AsyncOpenAI, prompt: list[int], n: int = 8):
    return await c.completions.create(
        model=(await c.models.list()).data[0].id, prompt=prompt, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip


async def test_greedy_equals_transformers_on_both_ranks(dp, model):
    prompts = [[5 + i, 40 + 3 * i, 7, 300 + i, 11] * (2 + i) for i in range(6)]
    before = routed(dp.url)
    async with client(dp.url) as c:
        outs = await asyncio.gather(*(complete(c, p) for p in prompts))
    after = routed(dp.url)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    for p, out in zip(prompts, outs, strict=True):
        want = await asyncio.to_thread(hf_greedy, model, p, 8)
        assert out.choices[0].model_extra["token_ids"] == want


def test_ranks_are_processes_on_disjoint_cores(dp):
    ranks = debug(dp.url)["data_parallel_ranks"]
    pids = [r["pid"] for r in ranks]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    allowed = []
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
        allowed.append(line.split(":")[1].strip())
    if len(os.sched_getaffinity(0)) >= 2:
        assert allowed[0] != allowed[1], allowed


async def test_a_shared_prefix_goes_to_the_rank_that_cached_it(dp):
    """Four 4-block prefixes land on both ranks (at once: the least loaded each); every
    later prompt that extends one finds it cached, sent one at a time (where ties would
    otherwise alternate ranks)."""
    prefixes = [[1000 + 10 * k + j % 7 for j in range(4 * BLOCK)] for k in range(4)]
    async with client(dp.url) as c:
        await asyncio.gather(*(complete(c, [*p, 3]) for p in prefixes))
        # Each prefix extended twice in a row: the second time load alone (ties in turn)
        # would send it to the other rank than the one that cached it.
        for k, p in enumerate(prefixes):
            for turn in range(2):
                out = await complete(c, [*p, 50 + turn, 60 + k], 2)
                cached = out.usage.prompt_tokens_details.cached_tokens
                assert cached >= 4 * BLOCK - BLOCK, (turn, k, cached)
    state = debug(dp.url)
    assert all(r["routed"] > 0 for r in state["data_parallel_ranks"])
    assert state["data_parallel_routed_by_prefix"] >= 4  # against the ties' turn


async def test_a_conversation_stays_on_its_rank(dp):
    """Turns of one conversation_id, each mostly its own text (so no prefix draws them
    together), still go to one rank, where its pinned KV is; requests one at a time with
    nothing in common otherwise alternate."""
    words = ["apple", "river", "stone", "cloud", "maple", "tiger", "copper", "lantern",
             "violet", "harbor"]  # fmt: skip
    async with client(dp.url) as c:
        m = (await c.models.list()).data[0].id
        before = routed(dp.url)
        for i in range(4):
            text = " ".join(words[(i + j) % 10] + str(i) for j in range(30))
            await c.chat.completions.create(
                model=m, messages=[{"role": "user", "content": text}], max_tokens=2,
                extra_body={"conversation_id": "dp-conv"},
            )  # fmt: skip
        delta = [a - b for a, b in zip(routed(dp.url), before, strict=True)]
        assert sorted(delta) == [0, 4], delta
        pins = [r["conversation_pins"] for r in debug(dp.url)["data_parallel_ranks"]]
        assert pins == [int(d == 4) for d in delta], pins  # its KV pinned there alone
        before = routed(dp.url)
        for i in range(4):
            await complete(c, [1500 + 17 * i + j for j in range(40)], 2)
        delta = [a - b for a, b in zip(routed(dp.url), before, strict=True)]
        assert delta == [2, 2], delta


async def test_abort_frees_kv_and_metrics_add_the_ranks(dp):
    async with client(dp.url) as c:
        m = (await c.models.list()).data[0].id
        streams = []
        for i in range(4):
            s = await c.completions.create(
                model=m, prompt=f"long {i}", max_tokens=2000, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            streams.append(s)
        for s in streams:  # each runs
            await s.__anext__()
        state = debug(dp.url)
        assert state["running"] == 4, state
        assert all(r["running"] > 0 for r in state["data_parallel_ranks"]), state
        async with aiohttp.ClientSession() as s, s.get(dp.url + "/metrics") as r:
            text = await r.text()
        running = [
            ln for ln in text.splitlines() if ln.startswith("pagestream_num_requests_running")
        ]
        assert float(running[0].split()[-1]) == 4, running
        per_rank = {}
        for ln in text.splitlines():
            if ln.startswith(("pagestream_dp_rank_requests_running{",
                              "pagestream_dp_rank_routed_requests_total{")):  # fmt: skip
                name, value = ln.rsplit(" ", 1)
                per_rank[name] = float(value)
        running_by_rank = [v for k, v in sorted(per_rank.items()) if "running" in k]
        assert sum(running_by_rank) == 4 and all(running_by_rank), per_rank
        routed_by_rank = [v for k, v in sorted(per_rank.items()) if "routed" in k]
        assert routed_by_rank == [r["routed"] for r in debug(dp.url)["data_parallel_ranks"]]
        for s in streams:
            await s.close()
    deadline = time.monotonic() + 30
    # (Free counts blocks a conversation pinned: the conversation test's are.)
    while (state := debug(dp.url))["kv_blocks_free"] < state["kv_blocks_total"] or state["running"]:
        assert time.monotonic() < deadline, json.dumps(state)
        await asyncio.sleep(0.1)
    assert state["kv_blocks_total"] == 2 * 512


async def test_a_rank_that_dies_takes_the_server_down(tmp_path, model):
    """`serve -dp 2`, a rank SIGKILLed under load: the streams on both ranks end with the
    engine's error, the server exits with code 70 for its supervisor, the other rank's
    process goes with it."""
    args = ["--model", model, "-dp", "2", "--num-kv-blocks", "256", "--dtype", "float32"]
    with server_process(tmp_path, "service.cli", *args) as (proc, url):
        kids = engine_children(proc.pid)
        assert len(kids) == 2, kids
        started = asyncio.Event()
        streams = asyncio.create_task(_long_streams(url, 4, started))
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.5)  # all four running, two a rank
        os.kill(kids[1], signal.SIGKILL)
        ends = await asyncio.wait_for(streams, 30)
        assert all(_failed_by_the_engine(ev) for ev in ends), [ev[-2:] for ev in ends]
        assert await asyncio.to_thread(proc.wait, 30) == ENGINE_FAILURE_EXIT
    assert await asyncio.to_thread(wait_gone, kids[0], 30), "rank 0 outlived its server"
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("server-*.log"))
    assert "[engine 0]" in log and "[engine 1]" in log  # each rank's lines say which


def test_bad_combinations_are_refused_naming_the_flag(model):
    a = build_parser().parse_args(["serve", "--model", model, "-dp", "2"])
    assert engine_config(a).parallel.data_parallel_size == 2
    for extra in (["--tensor-parallel-size", "2"], ["--engine-process", "off"],
                  ["--engine-thread", "on"]):  # fmt: skip
        a = build_parser().parse_args(["serve", "--model", model, "-dp", "2", *extra])
        with pytest.raises(ConfigError, match="--data-parallel-size"):
            engine_config(a)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineConfig.from_kwargs(data_parallel_size=0)


def test_offline_llm_with_data_parallel_ranks(model):
    """LLM(data_parallel_size=2): a batch spread over both ranks, each prompt's greedy
    tokens transformers'; both ranks' processes gone after shutdown."""
    from scheduler.sampling_params import SamplingParams
    from service.llm import LLM

    prompts = [[7 + i, 99, 3, 250 + i] * 3 for i in range(4)]
    llm = LLM(model, dtype="float32", threads=1, data_parallel_size=2, num_kv_blocks=256)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        core = llm.engine.core
        pids, routed = [r.pid for r in core.ranks], list(core.routed)
    finally:
        llm.shutdown()
    assert all(n > 0 for n in routed), routed
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 6)
    assert all(wait_gone(pid, 10) for pid in pids)


def test_ranks_take_whole_numa_nodes_where_they_divide(tmp_path):
    """Two sockets of 4 cores (numbered 0-3 and 4-7) and a hyperthreaded layout: each rank
    takes whole nodes where the nodes divide among the ranks, else an even share."""
    for i, cpus in enumerate(["0-1,4-5", "2-3,6-7"]):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus + "\n")
    nodes = numa_nodes(tmp_path)
    assert nodes == [[0, 1, 4, 5], [2, 3, 6, 7]]
    cores = list(range(8))
    assert core_split(cores, nodes, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert core_split(cores, nodes, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # 2 nodes, 4 ranks
    assert core_split([0, 1, 2, 3], nodes, 2) == [[0, 1], [2, 3]]  # affinity narrows nodes
    assert core_split([0], [], 2) is None


async def test_waiting_bounds_are_each_ranks_times_the_ranks(model):
    """--max-num-seqs 1 and --max-waiting-requests 1 on two ranks: two run (one a rank),
    two wait (one a rank's bound each, the server's twice it), the fifth is a 429."""
    kw = {"data_parallel_size": 2, "num_kv_blocks": 256, "max_num_seqs": 1,
          "max_waiting_requests": 1}  # fmt: skip
    with live_server(model, engine_kwargs=kw, enable_debug_routes=True) as srv:
        async with client(srv.url) as c:
            m = (await c.models.list()).data[0].id

            async def stream(i: int):
                return await c.completions.create(
                    model=m, prompt=[30 + i] * 8, max_tokens=2000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip

            running = [await stream(i) for i in range(2)]
            for s in running:
                await s.__anext__()
            waiting = [await stream(2 + i) for i in range(2)]
            deadline = time.monotonic() + 30
            while (state := debug(srv.url))["waiting"] < 2:
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.05)
            assert [r["running"] for r in state["data_parallel_ranks"]] == [1, 1], state
            with pytest.raises(openai.RateLimitError):
                await stream(9)
            for s in running + waiting:
                await s.close()


def test_ranks_share_kv_through_the_redis_tier(model):
    """-dp 2 with --redis-url: a registered system prompt is computed and published by one
    rank; requests one at a time, each mostly its own text, go to both ranks, and both
    find the system prompt cached: one in its own cache, the other loaded from Redis."""
    from tests.redis_server import RedisServer
    from tests.service.test_prefix_registration import SYSTEM, metric, post

    redis = RedisServer()
    try:
        kw = {"data_parallel_size": 2, "num_kv_blocks": 256, "redis_url": redis.url}
        with live_server(model, engine_kwargs=kw, enable_prompt_tokens_details=True,
                         enable_debug_routes=True) as srv:  # fmt: skip
            system = [{"role": "system", "content": SYSTEM}]
            code, info = post(srv.url + "/v1/cache/prefixes", {"messages": system})
            assert code == 200 and info["shared_tier"] == "redis", info
            published = "pagestream_prefix_tier_blocks_published_total"
            deadline = time.monotonic() + 30
            while metric(srv.url, published) < info["blocks"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            m = c.models.list().data[0].id
            before = routed(srv.url)
            for i in range(2):
                user = " ".join(f"word{i}x{j}" for j in range(120))  # past the system prompt
                r = c.chat.completions.create(
                    model=m, messages=[*system, {"role": "user", "content": user}],
                    max_tokens=2, temperature=0,
                )  # fmt: skip
                cached = r.usage.prompt_tokens_details.cached_tokens
                assert cached >= info["blocks"] * BLOCK - BLOCK, (i, cached, info)
            delta = [a - b for a, b in zip(routed(srv.url), before, strict=True)]
            assert delta == [1, 1], delta
            loaded = metric(srv.url, "pagestream_prefix_tier_blocks_loaded_total")
            assert loaded >= info["blocks"] - 1
    finally:
        redis.stop()


def test_a_live_id_is_refused_whichever_rank_holds_it(dp):
    """An id a live request holds on one rank is refused (DuplicateRequestId, a 409)
    though the next request would go to the other rank, and aborting with another stream
    leaves the live one alone."""
    from scheduler.engine_core import DuplicateRequestId
    from scheduler.sampling_params import SamplingParams
    from scheduler.stream import RequestStream

    async def go():
        eng = dp.engine
        long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        sub = eng.submit([5, 6, 7, 8], long, "dp-live-id")
        for ids in ([9, 10], [11, 12, 13]):  # one of them goes to the other rank's turn
            with pytest.raises(DuplicateRequestId):
                eng.submit(ids, SamplingParams(max_tokens=2), "dp-live-id")
        eng.core.abort("dp-live-id", RequestStream("dp-live-id"))
        last = None
        async for out in eng.generate("", submitted=sub):
            last = out
        return last

    last = dp.call(go())
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 200
