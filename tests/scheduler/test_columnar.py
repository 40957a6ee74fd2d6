"""The columnar decode path (scheduler/columnar.py): plain decodes travel as DecodeColumns,
advance in bulk and reach their streams as bare tokens."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from scheduler.contract import (
    KEEP_TABLE,
    DecodeColumns,
    ModelOutput,
    SchedulerOutput,
    apply_block_delta,
    apply_decode_deltas,
)
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.scheduler_types import RequestUpdate, StepUpdates
from scheduler.stream import RequestStream
from tests.scheduler.fake_runner import FakeRunner, reference_generate
from tests.scheduler.helpers import assert_all_free, assert_pool_consistent, drive, make_group

EOS = 0


def req(rid: str, prompt_len: int, max_tokens: int, *, eos: bool = False) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, temperature=0)
    prompt = list(range(1, prompt_len + 1))
    return Request(rid, prompt, params, eos_token_ids=(EOS,), max_tokens=max_tokens)


def step(s: Scheduler, toks: dict[str, int] | None = None) -> tuple[SchedulerOutput, StepUpdates]:
    """One step whose every sampling row draws 11, or toks[req_id]."""
    so = s.schedule()
    ids = [r.req_id for r in so.all_scheduled() if r.sample]
    mo = ModelOutput(req_ids=ids, sampled_token_ids=[(toks or {}).get(i, 11) for i in ids])
    return so, s.update_from_output(so, mo)


def test_mixed_step_prefill_edge_and_ends_beside_columnar_decodes():
    s = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256))
    for r in (req("a", 6, 20), req("b", 3, 4), req("c", 3, 20, eos=True), req("d", 5, 20)):
        s.add_request([r])
    step(s)  # prompts
    so, _ = step(s)  # first decodes: the general path, which flags them
    assert not so.decodes.req_ids and len(so.scheduled) == 4
    so, _ = step(s)
    assert so.decodes.req_ids == ["a", "b", "c", "d"] and not so.scheduled
    # "b" and "c" cross into their second block (a delta each); "a" fills its second
    # block (registered in the prefix cache, no delta).
    assert so.decodes.delta_rows == [1, 2] and so.decodes.delta_kept == [1, 1]
    assert s.kv.num_cached_blocks["a"] == 2

    p = Request("p", list(range(50, 60)), SamplingParams(max_tokens=5), max_tokens=5)
    s.add_request([p])
    table_a = list(s.kv.block_ids("a"))
    so, ups = step(s, {"c": EOS})
    d = so.decodes
    assert d.req_ids == ["a", "b", "c", "d"]
    assert d.positions == [8, 5, 5, 7] and d.token_ids == [11] * 4
    assert [r.req_id for r in so.scheduled] == ["p"] and so.scheduled[0].input_ids
    assert [n.req_id for n in so.new_requests] == ["p"]
    # Only "a" crossed into a new block: one delta, keeping the two entries it had.
    assert d.delta_rows == [0] and d.delta_kept == [2]
    assert table_a + d.delta_blocks[0] == s.kv.block_ids("a") and len(d.delta_blocks[0]) == 1
    assert so.num_scheduled_tokens == 4 + 10

    assert [r.req_id for r in ups.decode_reqs] == ["a", "d"] and ups.decode_tokens == [11, 11]
    full = {u.req_id: u for u in ups.updates}
    assert full["b"].finish_reason == "length" and full["b"].new_token_ids == [11]
    assert full["c"].finish_reason == "stop" and full["c"].stop_token_id == EOS
    assert full["p"].new_token_ids == [11] and full["p"].finish_reason is None
    every = {u.req_id: u.new_token_ids for u in ups}
    assert every == {"a": [11], "b": [11], "c": [EOS], "d": [11], "p": [11]}
    assert_pool_consistent(s)

    so, _ = step(s)
    assert sorted(so.finished_req_ids) == ["b", "c"]
    assert so.decodes.req_ids == ["a", "d"] and [r.req_id for r in so.scheduled] == ["p"]


def test_columnar_request_is_preempted_and_recomputes_to_the_same_tokens():
    bs = 4
    s = Scheduler(SchedulerConfig(num_kv_blocks=7, block_size=bs, max_model_len=24))
    runner = FakeRunner(7, bs)
    groups = [make_group(f"r{i}", [3 + i, 4, 5, 6, 7, 8, 9], 12) for i in range(2)]
    for g in groups:
        s.add_request(g)
    outputs: dict[str, list[int]] = {}
    preempted_columnar = 0
    columnar_steps = 0
    while s.has_unfinished():
        before = {r.req_id for r in s.running if r.columnar}
        so = s.schedule()
        columnar_steps += bool(so.decodes.req_ids)
        waiting = {r.req_id: r for r in s.waiting}
        for rid in before & waiting.keys():
            assert not waiting[rid].columnar and waiting[rid].num_computed_tokens == 0
            preempted_columnar += 1
        for u in s.update_from_output(so, runner.execute_model(so)):
            outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
        assert_pool_consistent(s)
    runner.execute_model(s.schedule())
    assert preempted_columnar and columnar_steps and s.num_preemptions
    for g in groups:
        r = g[0]
        assert outputs[r.req_id] == reference_generate(r.token_ids[: r.prompt_len], 12, 1000, None)
    assert_all_free(s, runner)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_drive_with_forks_and_shared_prefixes_matches_reference(prefix_caching):
    """n > 1 (copy-on-write of the shared last block) and prefix hits beside columnar
    decodes: every sequence gets the tokens its true context gives."""
    cfg = SchedulerConfig(
        num_kv_blocks=48, block_size=4, max_num_batched_tokens=16, max_model_len=64,
        enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    s, runner = Scheduler(cfg), FakeRunner(48, 4)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    arrivals = {0: [make_group("f", prompt, 9, n=3)], 3: [make_group("g", [*prompt, 1], 6)]}
    run = drive(s, runner, arrivals)
    assert any(so.decodes.req_ids for so in run.steps)
    for i, rid in enumerate(("f", "f#1", "f#2")):
        assert run.outputs[rid] == reference_generate(prompt, 9, 1000, None, sample_index=i)
    assert run.outputs["g"] == reference_generate([*prompt, 1], 6, 1000, None)
    assert_all_free(s, runner)


def test_abort_between_schedule_and_update_drops_the_row():
    s = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256))
    s.add_request([req("a", 3, 20)])
    s.add_request([req("b", 3, 20)])
    step(s)
    step(s)
    so = s.schedule()
    assert so.decodes.req_ids == ["a", "b"]
    assert [u.finish_reason for u in s.abort("a")] == ["abort"]
    ups = s.update_from_output(so, ModelOutput(req_ids=["a", "b"], sampled_token_ids=[11, 12]))
    assert [r.req_id for r in ups.decode_reqs] == ["b"] and not ups.updates


def test_a_failed_row_is_skipped_and_the_rest_advance():
    s = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256))
    for rid in "abc":
        s.add_request([req(rid, 3, 20)])
    step(s)
    step(s)
    so = s.schedule()
    mo = ModelOutput(req_ids=["a", "c"], sampled_token_ids=[11, 13], errors={"b": "bad row"})
    ups = s.update_from_output(so, mo)
    assert [(r.req_id, t) for r, t in zip(ups.decode_reqs, ups.decode_tokens)] == [
        ("a", 11),
        ("c", 13),
    ]
    assert [(u.req_id, u.error) for u in ups.updates] == [("b", "bad row")]
    assert "b" not in s.requests


def test_decode_columns_cross_a_pipe_and_apply_to_a_runners_tables():
    d = DecodeColumns(
        req_ids=["a", "b", "c", "d"],
        token_ids=[1, 2, 3, 4],
        positions=[4, 8, 5, 1],
        delta_rows=[1, 2],
        delta_kept=[2, 0],
        delta_blocks=[[9], [4, 5]],
    )
    so = SchedulerOutput(step=1, new_requests=[], scheduled=[], finished_req_ids=[], decodes=d)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=SchedulerOutput)
    assert back == so and back.num_scheduled_tokens == 4 and not back.is_empty
    tables = {"a": [1], "b": [2, 3, 7], "d": [6]}  # "c" comes whole; "a" is too short
    assert apply_decode_deltas(tables, back.decodes, 4) == [0]
    assert tables == {"a": [1], "b": [2, 3, 9], "c": [4, 5], "d": [6]}
    rows = back.all_scheduled()
    assert [(r.req_id, r.input_ids, r.start_pos, r.sample) for r in rows][:2] == [
        ("a", [1], 4, True),
        ("b", [2], 8, True),
    ]
    assert rows[0].num_kept_blocks == KEEP_TABLE and rows[1].num_kept_blocks == 2
    assert apply_block_delta(tables, rows[3]) == [6]  # KEEP_TABLE: the table as it is
    assert back.decodes.select([1, 3]).req_ids == ["b", "d"]


async def test_stream_merges_bare_tokens_in_order_with_full_updates():
    stream = RequestStream("g", 1)

    def full(toks: list[int], finish: str | None = None) -> RequestUpdate:
        return RequestUpdate(
            req_id="g", group_id="g", sample_index=0, new_token_ids=toks,
            finish_reason=finish, num_prompt_tokens=3, num_cached_tokens=2,
            first_scheduled_time=1.5,
        )  # fmt: skip

    stream.put([full([4])])
    assert [u.new_token_ids for u in await stream.get()] == [[4]]
    stream.put_token("g", 5)
    stream.put_token("g", 6)
    (u,) = await stream.get()
    assert (u.new_token_ids, u.num_prompt_tokens, u.num_cached_tokens) == ([5, 6], 3, 2)
    assert u.first_scheduled_time == 1.5 and u.finish_reason is None
    stream.put_token("g", 7)
    stream.put([full([8], "length")])
    (u,) = await stream.get()
    assert u.new_token_ids == [7, 8] and u.finish_reason == "length" and stream.finished


async def test_stream_without_token_wakeups_wakes_on_full_updates_only():
    stream = RequestStream("g", 1, wake_on_tokens=False)

    def full(toks: list[int], finish: str | None = None) -> RequestUpdate:
        return RequestUpdate(
            req_id="g", group_id="g", sample_index=0, new_token_ids=toks,
            finish_reason=finish, num_prompt_tokens=3, num_cached_tokens=0,
        )  # fmt: skip

    stream.put([full([4])])
    assert [u.new_token_ids for u in await stream.get()] == [[4]]
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0)  # the consumer waits on the stream
    stream.put_token("g", 5)
    stream.put_token("g", 6)
    await asyncio.sleep(0.01)
    assert not waiter.done()  # bare tokens pile up without waking the consumer
    stream.put([full([7], "length")])
    (u,) = await asyncio.wait_for(waiter, 1)
    assert u.new_token_ids == [5, 6, 7] and u.finish_reason == "length" and stream.finished


def test_grammar_and_logprob_requests_stay_on_the_general_path():
    s = Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256))
    lp = Request("lp", [1, 2, 3], SamplingParams(logprobs=2, max_tokens=8), max_tokens=8)
    s.add_request([lp])
    s.add_request([req("plain", 3, 8)])
    for _ in range(4):
        so, _ = step(s)
    assert so.decodes.req_ids == ["plain"] and [r.req_id for r in so.scheduled] == ["lp"]
    assert s.requests["plain"].status == RequestStatus.RUNNING


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_blocks_filled_by_columnar_decodes_are_prefix_hits_for_a_later_prompt(block_size):
    """The edge work of the columnar path (a block for each row starting one, a cache
    entry for each row filling one) registers what the general path would: a prompt that
    repeats a finished request's whole sequence hits every full block of it."""
    bs = block_size
    cfg = SchedulerConfig(num_kv_blocks=96 // bs, block_size=bs, max_num_batched_tokens=64,
                          max_model_len=64)  # fmt: skip
    s, runner = Scheduler(cfg), FakeRunner(96 // bs, bs)
    prompt = [5, 6, 7]
    run = drive(s, runner, {0: [make_group("a", prompt, 17), make_group("b", [9, 8], 12)]})
    assert sum(len(so.decodes.req_ids) for so in run.steps) >= 20  # the columnar path ran
    seq = prompt + run.outputs["a"]
    again = drive(s, runner, {0: [make_group("c", [*seq, 3], 2)]})
    assert again.outputs["c"] == reference_generate([*seq, 3], 2, 1000, None)
    # The last sampled token was never fed back, so its KV (and its block) do not exist.
    assert s.kv.prefix_hits == (len(seq) - 1) // bs * bs
    assert_all_free(s, runner)
