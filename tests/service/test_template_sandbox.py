"""Chat templates as hostile code: the sandbox's size limits, the bounded compile cache,
request kwargs filtering, and the render pool that kills a runaway render."""

from __future__ import annotations

import asyncio
import time

import pytest

from service.chat_template import ChatTemplates, TemplateError
from service.render_pool import RenderJob, RenderPool

MSGS = [{"role": "user", "content": "hi"}]
BASE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 100000000 }}",
        "{{ [1] * 100000000 }}",
        "{{ 'x' | center(1000000000) }}",
        "{{ 'x'.ljust(1000000000) }}",
        "{{ '{:>999999999}'.format('a') }}",
        "{{ '%999999999s' % 'a' }}",
        "{{ 10 ** 100000000 }}",
        "{{ range(10000000) | list | length }}",
    ],
)
def test_one_shot_allocations_are_refused(template: str) -> None:
    t = ChatTemplates(BASE)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        t.render(MSGS, chat_template=template)
    assert time.monotonic() - t0 < 5.0
    assert isinstance(e.value, TemplateError) or "range" in str(e.value)


def test_output_is_capped() -> None:
    t = ChatTemplates(BASE, max_output_chars=10_000)
    many = "{% for i in range(1000) %}{% for j in range(1000) %}ab{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match="exceeds 10000 characters") as e:
        t.render(MSGS, chat_template=many)
    assert e.value.param == "chat_template"
    assert t.render(MSGS) == "user: hi\n"


def test_sandbox_still_refuses_unsafe_access() -> None:
    t = ChatTemplates(BASE)
    with pytest.raises(ValueError):
        t.render(MSGS, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError):  # immutable: no list mutation
        t.render(MSGS, chat_template="{% set l = [] %}{{ l.append(1) }}")


def test_compile_cache_is_bounded() -> None:
    t = ChatTemplates(BASE)
    for i in range(200):
        assert t.render(MSGS, chat_template=f"T{i} {{{{ messages | length }}}}") == f"T{i} 1"
    assert len(t._compiled) <= 32


def test_request_kwargs_keep_only_template_variables() -> None:
    t = ChatTemplates(BASE + "{{ 'think' if enable_thinking else '' }}")
    src = t.select(None)
    assert t.request_kwargs(src, {"enable_thinking": True, "other": 1}) == {"enable_thinking": True}
    for name in ("messages", "add_generation_prompt", "bos_token", "chat_template"):
        with pytest.raises(TemplateError) as e:
            t.request_kwargs(src, {name: "x"})
        assert e.value.param == f"chat_template_kwargs.{name}"


async def test_render_pool_kills_a_runaway_render_and_recovers() -> None:
    pool = RenderPool(ChatTemplates(BASE), workers=1, timeout=1.0)
    await pool.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TemplateError, match="longer than 1 s") as e:
            await pool.render(RenderJob(MSGS, chat_template=LOOP))
        assert e.value.param == "chat_template"
        assert time.monotonic() - t0 < 10
        assert pool.killed == 1
        # The loop was free meanwhile, and the replacement worker serves the next render.
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(TemplateError):
            await pool.render(RenderJob(MSGS, chat_template=LOOP))
        ticker.cancel()
        assert ticks > 20
        assert await pool.render(RenderJob(MSGS)) == "user: hi\n"
        # A template's own error is a 4xx-style TemplateError naming the field.
        with pytest.raises(TemplateError, match="nope"):
            await pool.render(RenderJob(MSGS, chat_template="{{ raise_exception('nope') }}"))
    finally:
        await pool.close()


async def test_render_pool_memory_limit() -> None:
    # Doubling a namespace string passes every per-call size check, but not the worker's
    # address-space limit: the worker dies or raises MemoryError, the caller gets a 4xx.
    pool = RenderPool(ChatTemplates(BASE), workers=1, timeout=20.0, max_memory=256 << 20)
    await pool.start()
    grow = (
        "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    )
    try:
        with pytest.raises(TemplateError):
            await pool.render(RenderJob(MSGS, chat_template=grow))
        assert await pool.render(RenderJob(MSGS)) == "user: hi\n"
    finally:
        await pool.close()


async def test_cancelled_render_returns_its_worker() -> None:
    pool = RenderPool(ChatTemplates(BASE), workers=1, timeout=30.0)
    await pool.start()
    # ~10M loop steps: about a second on an idle machine, so the cancel surely lands
    # mid-render (1M steps once finished inside the 50 ms before the cancel).
    slow = "{% for i in range(20000) %}{% for j in range(500) %}{% endfor %}{% endfor %}ok"
    try:
        task = asyncio.create_task(pool.render(RenderJob(MSGS, chat_template=slow)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker finishes the abandoned render and serves the next one: not killed.
        assert await pool.render(RenderJob(MSGS)) == "user: hi\n"
        assert pool.killed == 0
    finally:
        await pool.close()
