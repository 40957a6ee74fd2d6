"""Beam search (vLLM's `use_beam_search`, `length_penalty`), run as vLLM runs it: above the
engine, one step at a time.  Each step asks the engine for one token of every live beam
(its prompt + the beam's tokens, greedy, with the top 2 x width logprobs); the prefix
cache makes each of those a short prefill of the last, partly filled block.  Of every
beam's candidates, an end-of-sequence token retires the beam as finished; the rest
compete, and the `width` best by cumulative logprob go on.  After `max_tokens` steps the
finished and the live beams are ranked by cumulative logprob / length ** length_penalty
(length: prompt and output, without the eos) and the `width` best are the choices.

Logprobs are the model's raw ones (before temperature, which therefore changes nothing
here).  A step's requests are ordinary engine requests: they count in the metrics, wait
in the queue and can be refused by it (a 429 then ends the search)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from scheduler.engine_core import EngineOverloaded
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine, RequestFailed
from service.outputs import CompletionOutput, RequestOutput, Submitted

# The sampler reports at most 20 alternatives a token, and a step needs 2 x width.
MAX_BEAM_WIDTH = 10


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's names (its `LLM.beam_search` takes these); `temperature` is taken and
    changes nothing: the search is greedy on the raw logprobs."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    lora: str | None = None  # SamplingParams.lora: the adapter every step runs with

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: 1 to {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: at least 1, got {self.max_tokens}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam, as vLLM's offline beam search gives it: `tokens` are the
    prompt's and the output's, `text` the output's."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass(slots=True)
class _Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far (not the prompt)
    cum: float = 0.0  # cumulative logprob
    finish: str = "length"  # "stop": ended by an eos
    stop: int | None = None


def start_searches(
    engine: AsyncEngine,
    prompts: list[tuple[str, list[int]]],
    params: BeamSearchParams,
    cache_salt: str | None,
    *,
    tenant: str | None = None,
    priority: int = 0,
) -> tuple[list[BeamSearch], list[Submitted]]:
    """A search per (request id, prompt ids), each with its first step queued: all or none
    (one refused aborts the steps queued before it).  The caller releases the returned
    steps if it never runs the searches."""
    searches = [
        BeamSearch(engine, rid, ids, params, cache_salt, tenant=tenant, priority=priority)
        for rid, ids in prompts
    ]
    subs: list[Submitted] = []
    try:
        for s in searches:
            subs += s.start()
    except BaseException:
        for sub in subs:
            engine.release(sub)
        raise
    return searches, subs


class BeamSearch:
    """One prompt's search.  `start` queues its first step now, so whatever the engine
    refuses (too long a prompt, max_tokens past max_model_len, a full queue) is refused
    before the response starts; `run` yields the finished search as one RequestOutput."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompt_ids: list[int],
        spec: BeamSearchParams,
        cache_salt: str | None,
        *,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        self.engine, self.rid, self.prompt, self.spec = engine, request_id, prompt_ids, spec
        self.salt, self.tenant, self.priority = cache_salt, tenant, priority
        self.eos = frozenset(engine.eos_token_ids)
        self.step_params = SamplingParams(
            n=1,
            max_tokens=1,
            temperature=0.0,
            logprobs=2 * spec.beam_width,
            ignore_eos=True,
            skip_special_tokens=spec.skip_special_tokens,
            lora=spec.lora,
        )
        self.max_tokens = 0
        self.first: list[Submitted] = []
        self.cached = 0

    def start(self) -> list[Submitted]:
        probe = SamplingParams(max_tokens=self.spec.max_tokens)
        self.max_tokens = self.engine.resolve_max_tokens(len(self.prompt), probe)
        self.first = self._submit(0, [_Beam()])
        return self.first

    def _submit(self, step: int, beams: list[_Beam]) -> list[Submitted]:
        return self.engine.submit_many(
            [(f"{self.rid}~{step}.{i}", self.prompt + b.tokens) for i, b in enumerate(beams)],
            self.step_params,
            self.salt,
            tenant=self.tenant,
            priority=self.priority,
        )

    async def _step(self, subs: list[Submitted]) -> list[RequestOutput]:
        async def last(sub: Submitted) -> RequestOutput:
            gen = self.engine.generate("", submitted=sub, final_only=True)
            last = None
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for out in gen:
                    last = out
            assert last is not None
            return last

        try:
            return list(await asyncio.gather(*(last(s) for s in subs)))
        finally:
            for s in subs:
                self.engine.release(s)

    async def best(self) -> list[_Beam]:
        """The search, run: its width best beams, best first."""
        spec, beams, done = self.spec, [_Beam()], []
        subs = self.first
        for step in range(self.max_tokens):
            if step:
                try:
                    subs = self._submit(step, beams)
                except EngineOverloaded as e:
                    raise RequestFailed(f"beam search cut short: {e}", status=429) from e
            outs = await self._step(subs)
            if step == 0:
                self.cached = outs[0].num_cached_tokens
            candidates: list[_Beam] = []
            for beam, out in zip(beams, outs, strict=True):
                (lp,) = out.outputs[0].logprobs or ()
                options = dict(zip(lp.top_token_ids, lp.top_logprobs, strict=True))
                options.setdefault(lp.token_id, lp.logprob)
                for tid, value in options.items():
                    cum = beam.cum + value
                    if tid in self.eos and not spec.ignore_eos:
                        kept = [tid] if spec.include_stop_str_in_output else []
                        done.append(_Beam(beam.tokens + kept, cum, "stop", tid))
                    else:
                        candidates.append(_Beam([*beam.tokens, tid], cum))
            # Stable: equal scores keep the order they were found in.
            beams = sorted(candidates, key=lambda b: -b.cum)[: spec.beam_width]
            if not beams:
                break
        return sorted(done + beams, key=self._score, reverse=True)[: spec.beam_width]

    async def run(self) -> AsyncIterator[RequestOutput]:
        yield self._output(await self.best())

    async def sequences(self) -> BeamSearchOutput:
        """`best` as vLLM's offline beam search returns it."""
        return BeamSearchOutput(
            [
                BeamSearchSequence(self.prompt + b.tokens, self._text(b), b.cum, b.finish, b.stop)
                for b in await self.best()
            ]
        )

    def _score(self, b: _Beam) -> float:
        """vLLM's: an eos at the end (kept, or generated under ignore_eos) not counted."""
        n = len(self.prompt) + len(b.tokens)
        if b.tokens and b.tokens[-1] in self.eos:
            n -= 1
        return b.cum / (n**self.spec.length_penalty)

    def _text(self, b: _Beam) -> str:
        """The output's text, a kept eos left out of it."""
        shown = b.tokens[:-1] if b.finish == "stop" and b.tokens[-1:] == [b.stop] else b.tokens
        return self.engine.tokenizer.decode(
            shown, skip_special_tokens=self.spec.skip_special_tokens
        )

    def _output(self, best: list[_Beam]) -> RequestOutput:
        outputs = []
        for i, b in enumerate(best):
            text = self._text(b)
            o = CompletionOutput(
                index=i,
                token_ids=b.tokens,
                finish_reason=b.finish,
                stop_reason=b.stop,
                delta_text=text,
                delta_token_ids=b.tokens,
            )
            o.add_text(text)
            outputs.append(o)
        return RequestOutput(
            request_id=self.rid,
            prompt=None,
            prompt_token_ids=self.prompt,
            outputs=outputs,
            finished=True,
            num_cached_tokens=self.cached,
        )
