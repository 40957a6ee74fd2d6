"""/v1/completions: one or several prompts (text or token ids), each sampled `n` times
(or `best_of` times, the best `n` kept), answered in one JSON body or as a stream of
`text_completion` events, with `echo` and legacy per-token logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

from scheduler.contract import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from service.completion_extras import (
    OFF_LOOP_LOGPROB_ENTRIES,
    PromptLogprobs,
    best_of,
    finite,
    join_logprobs,
)
from service.fim import FimLayout, fim_layout
from service.http_util import TENANT_SALT, json_response, salted
from service.openai_common import ChoiceDelta, ServingBase, StreamUsage, sse
from service.outputs import CompletionOutput, RequestOutput
from service.protocol import BadRequest
from service.protocol_openai import CompletionRequest, decode_completion
from service.request_ids import TENANT, conversation_key, request_id


def _logprob_entries(
    req: CompletionRequest, prompts: list[list[int]], finals: list[RequestOutput]
) -> int:
    """Logprob entries the response carries: sampled tokens' and echoed prompts' (top
    alternatives + 1 each), and vLLM's prompt_logprobs, in every choice that repeats them."""
    prompt_tokens = sum(map(len, prompts))
    entries = 0
    if req.logprobs is not None:
        sampled = sum(len(o.token_ids) for out in finals for o in out.outputs)
        entries += (sampled + (prompt_tokens * req.n if req.echo else 0)) * (req.logprobs + 1)
    if req.prompt_logprobs is not None:
        entries += prompt_tokens * req.n * (req.prompt_logprobs + 1)
    return entries


async def final_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run every prompt's generator to its end, concurrently; one failing fails the request
    (the TaskGroup aborts the others)."""
    finals: dict[int, RequestOutput] = {}

    async def run(i: int, g: AsyncIterator[RequestOutput]) -> None:
        async with contextlib.aclosing(g):  # type: ignore[type-var]
            async for out in g:
                finals[i] = out

    try:
        async with asyncio.TaskGroup() as tg:
            for i, g in enumerate(gens):
                tg.create_task(run(i, g))
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [finals[i] for i in range(len(gens))]


class CompletionServing(ServingBase):
    # The model's fill-in-the-middle layout for `suffix`, found on first use (False: none).
    _fim: FimLayout | bool | None = None

    def completion_logprobs(
        self, lps: list[TokenLogprobs] | None, offset: int, label: Callable[[int], str] | None
    ) -> tuple[dict[str, Any] | None, int]:
        """label: how tokens are named (token_labels; None: their text); offsets count the
        text either way."""
        if lps is None:
            return None, offset
        label = label or self.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            tokens.append(label(lp.token_id))
            token_lps.append(finite(lp.logprob))
            tops.append(
                {
                    label(i): finite(v)
                    for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
            offsets.append(offset)
            offset += len(tok)
        return (
            {
                "tokens": tokens,
                "token_logprobs": token_lps,
                "top_logprobs": tops,
                "text_offset": offsets,
            },
            offset,
        )

    async def completions(self, request: web.Request, body: bytes) -> web.StreamResponse:
        req: CompletionRequest = decode_completion(body)
        lora = self.check_model(req.model)
        params = self.with_lora(req.to_sampling_params(self.defaults), lora)
        spec = req.structured()
        await self.compile(request, params, spec[1] if spec else None)
        raw = req.prompts()
        self.limits.check_prompt_count(len(raw))
        self.limits.check_sampling(params, prompts=len(raw))
        self.prep.check_vocab_ids(params)
        params = await self.prep.with_bad_words(params)
        truncate = req.keep_last(self.engine.max_model_len)
        if req.suffix:
            prompts = await self._fim_prompts(raw, req.suffix)
        else:
            prompts = await self.prep.prompt_ids(raw, truncate=truncate)
        self._check_prompt_logprobs(req, prompts)
        # A truncated prompt's text is that of the tokens kept (decoded from them for echo);
        # with a suffix the prompt is more than the text.
        texts = [p if isinstance(p, str) and truncate is None and not req.suffix else None
                 for p in raw]  # fmt: skip
        rid, engine_rid = request_id(request, req.request_id, "cmpl-")
        salt = salted(request.get(TENANT_SALT), req.cache_salt)
        tenant, cid = request.get(TENANT), req.conversation_id or req.session_id
        if cid is not None and len(prompts) > 1:
            field = "conversation_id" if req.conversation_id else "session_id"
            raise BadRequest(f"{field} takes one prompt (a conversation's next turn)", field)
        gens, subs = self._start(
            engine_rid, prompts, texts, params, salt,
            tenant=tenant, conversation=conversation_key(tenant, cid), priority=req.priority,
            beam=req.beam_spec(self.defaults.cap(req.max_tokens)),
        )  # fmt: skip
        model = req.model or self.names[0]
        try:
            echo = await self._echo_texts(texts, prompts) if req.echo else None
            if req.stream:
                stream = self._completion_stream(
                    request, req, rid, model, prompts, gens, params, echo
                )
                return await self.streamed(request, rid, subs, stream)
            return await self._completion_full(req, rid, model, prompts, gens, echo)
        finally:
            self._release(subs)

    async def _fim_prompts(self, raw: list[str | list[int]], suffix: str) -> list[list[int]]:
        """Each prompt as the text before the hole, `suffix` as the text after it, laid
        out with the model's fill-in-the-middle tokens (service/fim.py)."""
        if self._fim is None:
            self._fim = fim_layout(self.tokenizer) or False
        layout = self._fim
        if not layout:
            raise BadRequest(
                "suffix needs a code model with fill-in-the-middle tokens (<|fim_prefix|> "
                "<|fim_suffix|> <|fim_middle|>, <fim_prefix> ..., DeepSeek-Coder's or "
                "Codestral's); this model's tokenizer has none",
                "suffix",
            )
        (after,) = await self.prep.encode([suffix], add_special_tokens=False, param="suffix")
        texts = [p for p in raw if isinstance(p, str)]
        encoded = iter(await self.prep.encode(texts, add_special_tokens=False) if texts else ())
        prefixes = [
            next(encoded) if isinstance(p, str) else self.prep.checked(list(p), "prompt")
            for p in raw
        ]
        return [layout.ids(p, after) for p in prefixes]

    def _check_prompt_logprobs(self, req: CompletionRequest, prompts: list[list[int]]) -> None:
        """The prompt logprobs the response would carry, bounded before any work: each of
        a prompt's n choices repeats them (echo with logprobs, and prompt_logprobs)."""
        tokens = sum(map(len, prompts))
        parts = {}
        if req.echo and req.logprobs is not None:
            parts["logprobs"] = tokens * req.n * (req.logprobs + 1)
        if req.prompt_logprobs is not None:
            parts["prompt_logprobs"] = tokens * req.n * (req.prompt_logprobs + 1)
        self.limits.check_prompt_logprobs(parts)

    async def _echo_texts(self, texts: list[str | None], prompts: list[list[int]]) -> list[str]:
        """echo: each prompt as text (token-id prompts decoded, off the event loop past
        512 ids in all), put before its choices."""
        given = [ids for t, ids in zip(texts, prompts, strict=True) if t is None]
        decoded = iter(await self.prep.decode(given, param="prompt") if given else ())
        return [t if t is not None else next(decoded) for t in texts]

    async def _completion_full(
        self,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[list[int]],
        gens: list[AsyncIterator[RequestOutput]],
        echo: list[str] | None,
    ) -> web.Response:
        finals = await final_outputs(gens)

        def build() -> web.Response:
            choices = []
            completion = 0
            cached = 0
            shared = PromptLogprobs(self.token_text, self.labels(req))
            for i, out in enumerate(finals):
                cached += out.num_cached_tokens
                if not req.echo_only:
                    completion += sum(len(o.token_ids) for o in out.outputs)
                for o in best_of(out.outputs, req.n):
                    choices.append(
                        self._completion_choice(req, i, out, o, prompts[i], echo, shared)
                    )
            return json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": choices,
                    "usage": self._usage(sum(map(len, prompts)), completion, cached),
                }
            )

        # Logprobs make the body tokens x choices x (logprobs + 1) values: a large one is
        # built on a thread, so the event loop (other streams, /health) only waits its turn
        # for the GIL, not for the whole body.
        if _logprob_entries(req, prompts, finals) > OFF_LOOP_LOGPROB_ENTRIES:
            return await asyncio.to_thread(build)
        return build()

    def _completion_choice(
        self,
        req: CompletionRequest,
        i: int,
        out: RequestOutput,
        o: CompletionOutput,
        prompt: list[int],
        echo: list[str] | None,
        shared: PromptLogprobs,
    ) -> dict[str, Any]:
        """Choice `o` of prompt `i`, whole."""
        head = "" if echo is None else echo[i]
        only = req.echo_only
        lp, _ = self.completion_logprobs(None if only else o.logprobs, len(head), shared.label)
        if echo is not None and req.logprobs is not None and out.prompt_logprobs:
            lp = join_logprobs(shared.echo(i, out.prompt_logprobs, prompt), lp)
        choice: dict[str, Any] = {
            "index": i * req.n + o.index,
            "text": head if only else head + o.text,
            "logprobs": lp if req.logprobs is not None else None,
            # max_tokens 0 is reached before any token (OpenAI's legacy answer too)
            "finish_reason": "length" if only else o.finish_reason,
            "stop_reason": None if only else o.stop_reason,
        }
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = shared.vllm(i, out.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = prompt
            choice["token_ids"] = [] if only else o.token_ids
        return choice

    async def _completion_stream(
        self,
        request: web.Request,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[list[int]],
        gens: list[AsyncIterator[RequestOutput]],
        params: SamplingParams,
        echo: list[str] | None,
    ) -> web.StreamResponse:
        """A chunk per step of any prompt, with every choice that moved."""
        resp = await self._open_stream(request)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        usage = StreamUsage.of(sum(map(len, prompts)), req.stream_options, self.force_usage)
        chunks = _CompletionChunks(self, req, base, prompts, params.n, echo, usage)
        return await self._run_stream(request, resp, gens, params.n, chunks, base, usage)

    def _completion_choice_delta(
        self,
        req: CompletionRequest,
        d: ChoiceDelta,
        out: RequestOutput,
        indexed_prompt: tuple[int, list[int]],
        head: str,
        offsets: dict[int, int],
        shared: PromptLogprobs,
    ) -> dict[str, Any]:
        """One choice's part of a chunk; its first carries the echo (`head`) and the
        prompt's logprobs and token ids."""
        pi, prompt = indexed_prompt
        first = d.index not in offsets
        pre = None
        if head and req.logprobs is not None and out.prompt_logprobs:
            pre = shared.echo(pi, out.prompt_logprobs, prompt)
        lp, offsets[d.index] = self.completion_logprobs(
            d.logprobs, offsets.get(d.index, 0) + len(head), shared.label
        )
        c: dict[str, Any] = {
            "index": d.index,
            "text": head + d.text,
            "logprobs": lp if pre is None else join_logprobs(pre, lp),
            "finish_reason": d.finish_reason,
        }
        if first and req.prompt_logprobs is not None:
            c["prompt_logprobs"] = shared.vllm(pi, out.prompt_logprobs)
        if d.finish_reason is not None:
            c["stop_reason"] = d.stop_reason
        if req.return_token_ids:
            if first:
                c["prompt_token_ids"] = prompt
            c["token_ids"] = d.token_ids
        return c


class _CompletionChunks:
    """A completion stream's chunk for each output as it comes: a plain call per
    output rather than a generator layer, since it runs for every stream every step."""

    def __init__(
        self,
        serving: CompletionServing,
        req: CompletionRequest,
        base: dict[str, Any],
        prompts: list[list[int]],
        n: int,
        echo: list[str] | None,
        usage: StreamUsage,
    ) -> None:
        self.serving, self.req, self.base, self.prompts = serving, req, base, prompts
        self.n, self.echo, self.usage = n, echo, usage
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self.cached: dict[str, int] = {}  # per prompt (engine request id): cached tokens
        self.shared = PromptLogprobs(serving.token_text, serving.labels(req))
        # Nothing but text in a choice's middle chunks: those are built inline.
        plain = echo is None and not req.echo_only and not req.return_token_ids
        self.plain = plain and req.logprobs is None and req.prompt_logprobs is None
        # A plain middle chunk of one choice, as the event's bytes around its text: the
        # rest of it is the same every step (choice index -> (head, tail)).
        self.frames: dict[int, tuple[bytes, bytes]] = {}

    def _frame(self, index: int) -> tuple[bytes, bytes]:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        event = sse(self.serving._chunk(self.base, [choice], self.usage))
        at = event.rindex(b'"text":""')  # choices come last in the chunk
        self.frames[index] = frame = (event[: at + 7], event[at + 9 :])
        return frame

    def __call__(
        self, deltas: list[ChoiceDelta], out: RequestOutput
    ) -> list[dict[str, Any] | bytes]:
        req, n, usage, offsets, echo = self.req, self.n, self.usage, self.offsets, self.echo
        choices: list[dict[str, Any]] = []
        for d in deltas:
            if self.plain and d.finish_reason is None and d.index in offsets:
                usage.completion_tokens += len(d.token_ids)
                if len(deltas) == 1 and not usage.continuous:
                    head, tail = self.frames.get(d.index) or self._frame(d.index)
                    self.cached[out.request_id] = out.num_cached_tokens
                    usage.cached = sum(self.cached.values())
                    return [head + orjson.dumps(d.text) + tail]
                choices.append(
                    {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": None}
                )
                continue
            if req.echo_only:  # the one token it ran is not part of the reply
                d = ChoiceDelta(d.index, "", [], None, d.finish_reason and "length", None)
            usage.completion_tokens += len(d.token_ids)
            pi = d.index // n  # the prompt's index
            head = echo[pi] if echo is not None and d.index not in offsets else ""
            choices.append(
                self.serving._completion_choice_delta(
                    req, d, out, (pi, self.prompts[pi]), head, offsets, self.shared
                )
            )
        self.cached[out.request_id] = out.num_cached_tokens
        usage.cached = sum(self.cached.values())
        return [self.serving._chunk(self.base, choices, usage)] if choices else []
