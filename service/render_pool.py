"""Chat templates rendered in worker processes, with a deadline the server can enforce.

Why processes: a template is a program (a request-supplied one when the operator trusts
them, and any checkpoint's own can loop for a long time on a long conversation).  Python
cannot stop a thread, so a render in a thread that runs past its deadline keeps a core and
its memory until it ends by itself.  A worker process can be killed: a render that runs
past `timeout` is answered with a 4xx, its worker is killed and replaced, and the event
loop never notices.  Each worker also runs under an address-space limit, so a template
that allocates without bound dies alone (MemoryError or a killed worker -> 4xx).
The rendered text is tokenized by service/tokenize_pool.py (threads, or killable processes
for large texts), never on the event loop.

The pool heals: on every path a worker taken for a render goes back to the pool (the job
could not be pickled, so nothing reached it; its render failed in an orderly way) or is
killed and replaced (timeout, death, cancellation by close, any unexpected error), and a
replacement that fails to start is retried until one does.
"""

from __future__ import annotations

import asyncio
import multiprocessing.connection
import os
import sys
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

from service.chat_template import ChatTemplates, TemplateError
from service.worker_pool import Worker, WorkerPool

_RESPAWN_BACKOFF = (0.1, 10.0)  # first and longest wait before retrying a failed start


@dataclass
class RenderJob:
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a request-supplied template (trusted by the caller)
    kwargs: dict[str, Any] = field(default_factory=dict)  # client chat_template_kwargs
    tools: list[dict[str, Any]] | None = None  # the request's tools, as HF templates read them
    continue_final_message: bool = False  # end on the final message's content, left open


class RenderBusy(RuntimeError):
    """Every worker is busy and the queue of renders waiting for one is full."""


class _Unsendable(Exception):
    """The job could not be pickled: nothing was sent, the worker is as it was."""

    def __init__(self, cause: BaseException, param: str) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}"[:200])
        self.param = param


def _pickle_job(job: RenderJob) -> memoryview:
    """The job as bytes for the pipe, or _Unsendable naming the part that cannot be sent
    (a value nested too deeply for the pickler, an object that does not pickle)."""
    try:
        return ForkingPickler.dumps(job)
    except Exception as e:  # RecursionError, PicklingError, TypeError, MemoryError...
        parts = (("chat_template_kwargs", job.kwargs), ("tools", job.tools),
                 ("chat_template", job.chat_template), ("messages", job.messages))  # fmt: skip
        param = "messages"
        for name, value in parts:
            try:
                ForkingPickler.dumps(value)
            except Exception:
                param = name
                break
        raise _Unsendable(e, param) from e


def limit_memory(max_bytes: int) -> None:
    if max_bytes <= 0 or sys.platform != "linux":
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    # What this worker already maps, plus the allowance.
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + max_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def render_job(templates: ChatTemplates, job: RenderJob) -> str:
    """One job: client kwargs filtered against the template they will reach, then render.
    (Runs in a worker process; also usable in-process.)"""
    source = templates.select(job.chat_template)
    kwargs = templates.request_kwargs(source, job.kwargs) if job.kwargs else {}
    return templates.render(
        job.messages,
        job.add_generation_prompt,
        chat_template=job.chat_template,
        tools=job.tools,
        continue_final_message=job.continue_final_message,
        **kwargs,
    )


def _worker_main(conn: multiprocessing.connection.Connection, templates: ChatTemplates,
                 max_memory: int) -> None:  # fmt: skip
    limit_memory(max_memory)
    if isinstance(templates.source, str):  # warm the checkpoint's own template
        templates.compile(templates.source)
    conn.send(("ready", "", None))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            job: RenderJob = ForkingPickler.loads(data)
        except Exception as e:  # the whole message was read: the pipe is still in step
            conn.send(("err", f"the render job could not be read ({e!r})"[:300], "messages"))
            continue
        param = "chat_template" if job.chat_template else "messages"
        try:
            reply: tuple[str, str, str | None] = ("ok", render_job(templates, job), None)
        except TemplateError as e:
            reply = ("err", str(e), e.param)
        except MemoryError:
            reply = ("err", "the chat template ran out of its memory allowance", param)
        except RecursionError:
            reply = ("err", "the chat template recursed too deeply", param)
        except Exception as e:  # a template's own error, raise_exception(), bad content
            reply = ("err", str(e), param)
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


class _Worker(Worker):
    target = _worker_main
    name = "pagestream-render"

    def roundtrip(self, job: RenderJob) -> tuple[str, str, str | None]:
        payload = _pickle_job(job)  # raises _Unsendable before anything is sent
        self.conn.send_bytes(payload)
        return self.conn.recv()


class RenderPool(WorkerPool[_Worker]):
    """`workers` render processes; `render()` waits for a free one (at most `max_queued`
    renders wait; past that RenderBusy), and a render past `timeout` seconds is killed."""

    def __init__(
        self,
        templates: ChatTemplates,
        workers: int = 2,
        timeout: float = 5.0,
        max_queued: int = 256,
        max_memory: int = 1 << 30,
    ) -> None:
        super().__init__(max(1, workers), "render", "a chat-template worker")
        self.templates = templates
        self.timeout = timeout
        self.max_queued = max_queued
        self.max_memory = max_memory

    def _start_worker(self) -> _Worker:
        return _Worker(self._ctx, self.templates, self.max_memory)

    def _respawn_backoff(self) -> tuple[float, float]:
        return _RESPAWN_BACKOFF

    async def start(self) -> None:
        self._open()
        await asyncio.gather(*(self._start_one() for _ in range(self.size)))

    async def render(self, job: RenderJob) -> str:
        """The rendered prompt text; TemplateError (a 4xx) for a bad or runaway template."""
        assert self._idle is not None, "RenderPool.start() was not awaited"
        if self._waiting >= self.max_queued and self._idle.empty():
            raise RenderBusy(f"{self._waiting} chat templates are already waiting to render")
        worker = await self._take()
        param = "chat_template" if job.chat_template else "messages"
        try:
            reply = await self._run(
                worker, lambda w: w.roundtrip(job), self.timeout, keeps=(_Unsendable,)
            )
        except _Unsendable as e:  # nothing reached the worker
            raise TemplateError(
                f"{e.param} cannot be passed to the chat template ({e})", e.param
            ) from None
        except TimeoutError:
            raise TemplateError(
                f"rendering the chat template took longer than {self.timeout:g} s", param
            ) from None
        except (EOFError, OSError, ValueError) as e:  # the worker died (memory limit)
            raise TemplateError(f"the chat template crashed its renderer ({e!r})", param) from e
        status, text, err_param = reply
        if status != "ok":
            raise TemplateError(text, err_param)
        return text
