"""Turning a request's messages or prompts into token ids (and ids back into text), off
the event loop.

Chat templates render in killable worker processes (service/render_pool.py).  Text is
tokenized by service/tokenize_pool.py: short texts inline, the rest on threads through
the tokenizer's GIL-releasing calls, huge ones in worker processes killed at
`--tokenize-timeout`.  Before any of that, a text that cannot fit in max_model_len by its
length alone is refused: when the tokenizer cannot drop text, no token stands for more
than `Tokenizer.max_bytes_per_token` bytes, so a text of more than max_model_len times
that many UTF-8 bytes has more than max_model_len tokens (a 400 without tokenizing).
Every failure is a BadRequest naming the field (or EngineOverloaded: busy, retry).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from scheduler.engine_core import EngineOverloaded
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestRejected
from service.async_engine import AsyncEngine
from service.bad_words import check_words, nothing_allowed, spellings, token_sequences
from service.chat_template import TemplateError
from service.limits import Limits
from service.protocol import BadRequest
from service.render_pool import RenderBusy, RenderJob, RenderPool
from service.tokenize_pool import (
    TokenizeBusy,
    TokenizeFailed,
    TokenizePool,
    TokenizeTimeout,
    utf8_len,
)
from service.truncation import PromptTooLong, output_room, truncated_ids


class Preprocessor:
    def __init__(self, engine: AsyncEngine, limits: Limits, max_queued: int = 1024) -> None:
        self.engine = engine
        self.limits = limits
        # Told how many messages truncation "auto" left out of a request (the metrics).
        self.on_truncated: Callable[[int], None] | None = None
        engine.tokenizer.templates.max_output_chars = limits.max_template_output_chars
        self.pool = RenderPool(
            engine.tokenizer.templates,
            workers=limits.template_workers,
            timeout=limits.template_timeout,
            max_queued=max_queued,
            max_memory=limits.template_memory_bytes,
        )
        per_token = engine.tokenizer.max_bytes_per_token
        # The longest prompt text that could still fit (None: no bound holds for this
        # tokenizer, and only the request and template size caps bound a text).
        self.max_prompt_bytes = engine.max_model_len * per_token if per_token else None
        # No worker processes when no text that passes that bound can need one (then only
        # id lists, bounded by max_model_len and the prompt count, can be bigger: a thread).
        small = (
            self.max_prompt_bytes is not None
            and self.max_prompt_bytes <= limits.tokenize_process_bytes
        )
        self.tokens = TokenizePool(
            engine.tokenizer.codec,
            workers=limits.tokenize_workers,
            processes=0 if small else limits.tokenize_workers,
            timeout=limits.tokenize_timeout,
            process_bytes=limits.tokenize_process_bytes,
            max_queued=max_queued,
        )

    async def start(self) -> None:
        await self.pool.start()
        await self.tokens.start()

    async def close(self) -> None:
        await self.pool.close()
        await self.tokens.close()

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
        truncate: int | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render the conversation and tokenize it; `truncate`: keep its last so many
        tokens (vLLM's truncate_prompt_tokens)."""
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise BadRequest(
                "a request may not supply its own chat template on this server (the operator "
                "can allow it with --trust-request-chat-template)",
                template_param,
            )
        job = RenderJob(
            messages,
            add_generation_prompt,
            chat_template,
            dict(kwargs or {}),
            tools,
            continue_final_message,
        )
        try:
            text = await self.pool.render(job)
        except TemplateError as e:
            where = e.param
            if where == "chat_template":
                where = template_param
            raise BadRequest(str(e), where) from e
        except RenderBusy as e:
            raise EngineOverloaded(f"the server is overloaded: {e}") from e
        (ids,) = await self.encode(
            [text], add_special_tokens=False, param=param, bounded=truncate is None
        )
        return ids[-truncate:] if truncate else ids

    async def chat_ids_auto(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int | None,
        param: str = "messages",
        **render: Any,
    ) -> list[int]:
        """chat_ids under `truncation: "auto"` (service/truncation.py): the oldest turns
        dropped until the prompt leaves room for `max_tokens` (the request's, as the
        generation config caps it)."""

        async def measure(texts: list[str]) -> list[int]:
            ids = await self.encode(texts, add_special_tokens=False, param=param, bounded=False)
            return [len(x) for x in ids]

        ids, dropped = await truncated_ids(
            messages,
            lambda keep: self.chat_ids(keep, param=param, **render),
            measure,
            self.engine.max_model_len,
            output_room(max_tokens, self.engine.max_model_len),
            self.max_prompt_bytes,
        )
        if dropped and self.on_truncated is not None:
            self.on_truncated(dropped)
        return ids

    async def prompt_ids(
        self,
        prompts: list[str | list[int]],
        param: str = "prompt",
        truncate: int | None = None,
        add_special_tokens: bool = True,
        keep_first: bool = False,
    ) -> list[list[int]]:
        """Text prompts tokenized, token-id prompts range-checked; each non-empty;
        `truncate`: each keeps its last so many tokens (vLLM's truncate_prompt_tokens),
        or its first with `keep_first` (Cohere's max_tokens_per_doc)."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = (
            iter(await self.encode(texts, add_special_tokens, param, bounded=truncate is None))
            if texts
            else iter(())
        )
        out = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else self.checked(list(p), param)
            if not ids:
                raise BadRequest("the prompt encodes to no tokens", param)
            if truncate:
                ids = ids[:truncate] if keep_first else ids[-truncate:]
            out.append(ids)
        return out

    async def encode(
        self,
        texts: list[str],
        add_special_tokens: bool = True,
        param: str = "prompt",
        bounded: bool = True,
    ) -> list[list[int]]:
        """Token ids of each text, checked against the model's vocabulary.  bounded=False
        (a prompt to be truncated): no refusal by length, which the request size cap and
        the pool's timeouts and worker processes still bound."""
        for t in texts if bounded else ():
            self._check_length(t, param)
        try:
            return await self.tokens.encode(
                texts, add_special_tokens, check=self.engine.check_token_ids
            )
        except RequestRejected as e:
            raise BadRequest(str(e), param) from e
        except (TokenizeTimeout, TokenizeBusy, TokenizeFailed) as e:
            raise _refusal(e, "tokenizing the prompt", param) from e

    async def pair_ids(
        self,
        pairs: list[tuple[str, str]],
        params: tuple[str, str],
        truncate: int | None = None,
        second_max: int | None = None,
    ) -> list[list[int]]:
        """Each text pair tokenized as one cross-encoder input (TokenizePool.encode_pairs);
        `params`: the fields the two texts came from; `truncate`: each keeps at most so
        many tokens, cut longest part first as transformers' (and so vLLM's) `truncation=
        True` cuts, special tokens kept; `second_max`: the second text keeps its first so
        many."""
        first_param, param = params
        for a, b in pairs if truncate is None else ():
            self._check_length(a, first_param)
            if second_max is None:
                self._check_length(b, param)
        try:
            out = await self.tokens.encode_pairs(
                pairs, second_max, check=self.engine.check_token_ids, max_len=truncate
            )
        except RequestRejected as e:
            raise BadRequest(str(e), param) from e
        except (TokenizeTimeout, TokenizeBusy, TokenizeFailed) as e:
            raise _refusal(e, "tokenizing the texts", param) from e
        return out

    async def decode(
        self,
        seqs: Sequence[Sequence[int]],
        skip_special_tokens: bool = True,
        param: str = "tokens",
    ) -> list[str]:
        """The text of each id list (ids already checked against the vocabulary)."""
        try:
            return await self.tokens.decode(seqs, skip_special_tokens)
        except (TokenizeTimeout, TokenizeBusy, TokenizeFailed) as e:
            raise _refusal(e, "decoding the token ids", param) from e

    async def token_strs(self, ids: Sequence[int], param: str = "prompt") -> list[str]:
        """Each id's own text (special tokens kept), as `/tokenize` returns them."""
        try:
            return await self.tokens.token_strs(ids)
        except (TokenizeTimeout, TokenizeBusy, TokenizeFailed) as e:
            raise _refusal(e, "decoding the tokens", param) from e

    def _check_length(self, text: str, param: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit (see the module docs)."""
        bound = self.max_prompt_bytes
        if bound is None or 4 * len(text) <= bound:  # at most 4 UTF-8 bytes a character
            return
        size = len(text) if len(text) > bound else utf8_len(text)
        if size > bound:
            per_token = self.engine.tokenizer.max_bytes_per_token
            raise PromptTooLong(
                f"the prompt is {'over ' if size == len(text) else ''}{size} bytes of text; "
                f"a token of this model's tokenizer stands for at most {per_token} bytes, so "
                f"it has more than max_model_len ({self.engine.max_model_len}) tokens",
                param,
            )

    async def with_bad_words(
        self, params: SamplingParams, param: str = "bad_words"
    ) -> SamplingParams:
        """params with its bad_words tokenized (off the event loop, as prompts are), or a
        400 naming the field; also a 400 when allowed_token_ids leaves no token
        (`nothing_allowed`)."""
        words = params.bad_words
        if not words:
            self.check_some_token_allowed(params, param.removesuffix("bad_words"))
            return params
        try:
            check_words(words)
            encoded = await self.encode(spellings(words), add_special_tokens=False, param=param)
            seqs = token_sequences(words, encoded)
        except ValueError as e:
            raise BadRequest(str(e), param) from e
        params = msgspec.structs.replace(params, bad_words_token_ids=seqs)
        self.check_some_token_allowed(params, param.removesuffix("bad_words"))
        return params

    def check_some_token_allowed(self, params: SamplingParams, prefix: str = "") -> None:
        why = nothing_allowed(params, self.engine.eos_token_ids)
        if why is not None:
            raise BadRequest(why, prefix + "allowed_token_ids")

    def check_vocab_ids(self, params: SamplingParams, prefix: str = "") -> None:
        """logit_bias keys and allowed_token_ids are token ids of this model: one outside
        its vocabulary is a 400 naming the field (the engine's own check cannot say which
        field it was).  An allowed list longer than the vocabulary repeats ids: refused
        before the sampler builds its mask from it."""
        vocab = self.engine.vocab_size
        allowed = params.allowed_token_ids or ()
        if len(allowed) > vocab:
            raise BadRequest(
                f"allowed_token_ids: {len(allowed)} ids, more than the vocabulary's {vocab}",
                prefix + "allowed_token_ids",
            )
        for field, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", allowed)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(
                    f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                    prefix + field,
                )

    def checked(self, ids: list[int], param: str) -> list[int]:
        try:
            return self.engine.check_token_ids(ids)
        except RequestRejected as e:
            raise BadRequest(str(e), param) from e


def _refusal(e: Exception, what: str, param: str) -> Exception:
    """A tokenize-pool failure as the client's answer: busy -> 429; a job that ran past
    its deadline -> 413; input the tokenizer refused -> 400."""
    if isinstance(e, TokenizeBusy) or (isinstance(e, TokenizeTimeout) and not e.started):
        return EngineOverloaded(f"the server is overloaded: {e}")
    if isinstance(e, TokenizeTimeout):
        return BadRequest(f"{what} ran {e}", param, status=413)
    return BadRequest(f"{what} failed: {e}", param)
