"""Turning a request's messages or prompts into token ids, off the event loop.

Chat templates render in killable worker processes (service/render_pool.py); tokenization
of anything but a short text runs on a small thread pool (the Rust tokenizer releases the
GIL), under the same time cap.  Every failure is a BadRequest naming the field.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scheduler.engine_core import EngineOverloaded
from scheduler.scheduler import RequestRejected
from service.async_engine import AsyncEngine
from service.chat_template import TemplateError
from service.limits import Limits
from service.protocol import BadRequest
from service.render_pool import RenderBusy, RenderJob, RenderPool

# Below this many characters a text is encoded inline: a thread hop costs more.
_INLINE_CHARS = 2048


class Preprocessor:
    def __init__(self, engine: AsyncEngine, limits: Limits, max_queued: int = 1024) -> None:
        self.engine = engine
        self.limits = limits
        engine.tokenizer.templates.max_output_chars = limits.max_template_output_chars
        self.pool = RenderPool(
            engine.tokenizer.templates,
            workers=limits.template_workers,
            timeout=limits.template_timeout,
            max_queued=max_queued,
            max_memory=limits.template_memory_bytes,
        )
        self._threads = ThreadPoolExecutor(
            max(1, limits.template_workers), thread_name_prefix="pagestream-tokenize"
        )
        self._max_queued = max_queued
        self._queued = 0

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_param: str = "chat_template",
        kwargs: dict[str, Any] | None = None,
        param: str = "messages",
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render the conversation and tokenize it."""
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise BadRequest(
                "a request may not supply its own chat template on this server (the operator "
                "can allow it with --trust-request-chat-template)",
                template_param,
            )
        job = RenderJob(messages, add_generation_prompt, chat_template, dict(kwargs or {}), tools)
        try:
            text = await self.pool.render(job)
        except TemplateError as e:
            where = e.param
            if where == "chat_template":
                where = template_param
            raise BadRequest(str(e), where) from e
        except RenderBusy as e:
            raise EngineOverloaded(f"the server is overloaded: {e}") from e
        (ids,) = await self.encode([text], add_special_tokens=False, param=param)
        return ids

    async def prompt_ids(
        self, prompts: list[str | list[int]], param: str = "prompt"
    ) -> list[list[int]]:
        """Text prompts tokenized, token-id prompts range-checked; each non-empty."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await self.encode(texts, param=param)) if texts else iter(())
        out = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else self._checked(list(p), param)
            if not ids:
                raise BadRequest("the prompt encodes to no tokens", param)
            out.append(ids)
        return out

    async def encode(
        self, texts: list[str], add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[list[int]]:
        tok = self.engine.tokenizer

        def run() -> list[list[int]]:
            return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

        if sum(map(len, texts)) <= _INLINE_CHARS:
            batch = run()
        else:
            if self._queued >= self._max_queued:
                raise EngineOverloaded("the server is overloaded: too many prompts to tokenize")
            self._queued += 1
            loop = asyncio.get_running_loop()
            try:
                # The thread cannot be stopped, but its input is bounded (request size, the
                # template's output cap), so it ends soon after the deadline even so.
                batch = await asyncio.wait_for(
                    loop.run_in_executor(self._threads, run), self.limits.template_timeout
                )
            except TimeoutError:
                raise BadRequest(
                    f"tokenizing the prompt took longer than {self.limits.template_timeout:g} s",
                    param,
                    status=413,
                ) from None
            finally:
                self._queued -= 1
        return [self._checked(ids, param) for ids in batch]

    def _checked(self, ids: list[int], param: str) -> list[int]:
        try:
            return self.engine.check_token_ids(ids)
        except RequestRejected as e:
            raise BadRequest(str(e), param) from e
