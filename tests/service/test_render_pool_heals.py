"""The chat-template render pool heals (issue 45, row 2): whatever goes wrong on the way to
a worker, through it or back, the worker is returned or replaced, and the pool then renders
again with every worker available.  Each failure is injected for real where it can be (a
job too deep to pickle, a worker killed mid-render) and by monkeypatching where it cannot."""

from __future__ import annotations

import asyncio
import operator
import os
import signal

import pytest

from service import render_pool
from service.chat_template import ChatTemplates, TemplateError
from service.render_pool import RenderJob, RenderPool

MSGS = [{"role": "user", "content": "hi"}]
BASE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ x | default('') }}"
SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


class _FailsToUnpickle:
    """Pickles fine here; unpickling it (in the worker) divides by zero."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


@pytest.fixture
async def pool():
    p = RenderPool(ChatTemplates(BASE), workers=2, timeout=20.0)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


async def assert_whole(pool: RenderPool, timeout: float = 60.0) -> None:
    """Every worker alive and idle again, and each one renders."""
    async with asyncio.timeout(timeout):
        while pool.live_workers < pool.size or pool.idle_workers < pool.size:
            await asyncio.sleep(0.05)
    outs = await asyncio.gather(*(pool.render(RenderJob(MSGS)) for _ in range(2 * pool.size)))
    assert outs == ["user: hi\n"] * (2 * pool.size)
    assert pool.live_workers == pool.idle_workers == pool.size


def busy_worker(pool: RenderPool) -> render_pool._Worker:
    idle = list(pool._idle._queue)  # type: ignore[union-attr]
    (busy,) = [w for w in pool._all if w not in idle]
    return busy


async def test_a_job_too_deep_to_pickle_returns_the_worker(pool):
    # The replay: twice as many such jobs as workers; none may cost a worker.
    for _ in range(2 * pool.size):
        with pytest.raises(TemplateError) as e:
            await pool.render(RenderJob(MSGS, kwargs={"x": deep(5000)}))
        assert e.value.param == "chat_template_kwargs"
    assert pool.killed == 0  # nothing reached a worker: each went straight back
    await assert_whole(pool)


async def test_unpicklable_tools_name_the_field(pool):
    with pytest.raises(TemplateError) as e:
        await pool.render(RenderJob(MSGS, tools=[{"f": lambda: 0}]))
    assert e.value.param == "tools"
    assert pool.killed == 0
    await assert_whole(pool)


async def test_a_job_the_worker_cannot_unpickle(pool):
    with pytest.raises(TemplateError, match="could not be read"):
        await pool.render(RenderJob(MSGS, kwargs={"x": _FailsToUnpickle()}))
    assert pool.killed == 0  # the worker answered and stays
    await assert_whole(pool)


async def test_a_worker_killed_mid_render_is_replaced(pool):
    task = asyncio.create_task(pool.render(RenderJob(MSGS, chat_template=SLOW)))
    await asyncio.sleep(0.3)
    os.kill(busy_worker(pool).proc.pid, signal.SIGKILL)
    with pytest.raises(TemplateError, match="crashed"):
        async with asyncio.timeout(10):  # not the 20 s deadline: the death is seen at once
            await task
    assert pool.killed == 1
    await assert_whole(pool)


async def test_a_worker_that_died_idle_costs_no_request(pool):
    victim = next(iter(pool._all))
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.join(5)
    # Every render succeeds: the dead worker is noticed when taken, and replaced.
    outs = await asyncio.gather(*(pool.render(RenderJob(MSGS)) for _ in range(4)))
    assert outs == ["user: hi\n"] * 4
    assert pool.killed == 1
    await assert_whole(pool)


async def test_a_render_past_its_deadline_is_replaced():
    pool = RenderPool(ChatTemplates(BASE), workers=2, timeout=0.5)
    await pool.start()
    try:
        with pytest.raises(TemplateError, match="longer than"):
            await pool.render(RenderJob(MSGS, chat_template=SLOW))
        assert pool.killed == 1
        await assert_whole(pool)
    finally:
        await pool.close()


async def test_an_unexpected_error_replaces_the_worker(pool, monkeypatch):
    real = render_pool._Worker.roundtrip
    calls = 0

    def flaky(self, job):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected")
        return real(self, job)

    monkeypatch.setattr(render_pool._Worker, "roundtrip", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        await pool.render(RenderJob(MSGS))
    assert pool.killed == 1  # its state was unknown: replaced, not reused
    await assert_whole(pool)


async def test_a_replacement_that_fails_to_start_is_retried(pool, monkeypatch):
    monkeypatch.setattr(render_pool, "_RESPAWN_BACKOFF", (0.01, 0.05))
    real = render_pool._Worker
    failures = 0

    def flaky_start(*args):
        nonlocal failures
        if failures < 3:
            failures += 1
            raise RuntimeError("injected: the worker did not start")
        return real(*args)

    monkeypatch.setattr(render_pool, "_Worker", flaky_start)
    os.kill(next(iter(pool._all)).proc.pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    outs = await asyncio.gather(*(pool.render(RenderJob(MSGS)) for _ in range(2)))
    assert outs == ["user: hi\n"] * 2
    await assert_whole(pool)
    assert failures == 3


async def test_a_cancelled_caller_returns_the_worker(pool):
    # About a second of rendering on a fast CPU: still running when the caller cancels.
    slow = "{% for i in range(20000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}ok"
    task = asyncio.create_task(pool.render(RenderJob(MSGS, chat_template=slow)))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_whole(pool)
    assert pool.killed == 0


async def test_close_mid_render_leaves_no_worker_behind():
    pool = RenderPool(ChatTemplates(BASE), workers=2, timeout=20.0)
    await pool.start()
    procs = [w.proc for w in pool._all]
    task = asyncio.create_task(pool.render(RenderJob(MSGS, chat_template=SLOW)))
    await asyncio.sleep(0.3)
    await pool.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    for p in procs:
        p.join(5)
        assert not p.is_alive()
    assert pool.live_workers == 0
