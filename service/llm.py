"""The offline batch API, shaped like vLLM's `LLM` so its users feel at home."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from scheduler.config import EngineConfig
from scheduler.sampling_params import SamplingParams
from service.async_engine import AsyncEngine, RequestOutput
from service.beam_search import BeamSearchOutput, BeamSearchParams, start_searches
from service.engine_setup import default_model_dir
from service.generation_defaults import GenerationDefaults
from service.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from service.pooling import Pooler, check_pooler_config, cosine
from service.tokenizer import Tokenizer

T = TypeVar("T")


def _offline_batch_tokens(device: str | None) -> int:
    """Offline batches favour throughput over inter-token latency: a larger step budget
    than the server's (vLLM makes the same split)."""
    import torch

    cuda = torch.cuda.is_available() and device != "cpu"
    return 8192 if cuda else 2048


class LLM:
    """Batch generation on the same engine the server runs.

    >>> llm = LLM(model="/path/to/checkpoint")
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> outs[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        pooler_config: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        """settings: the engine's, by their names in scheduler/config.py's EngineConfig
        (dtype, block_size, num_kv_blocks, max_num_seqs, speculative_config,
        tensor_parallel_size, ...; vLLM's enforce_eager too), checked as `serve`'s flags
        are; an unknown one is a ConfigError naming it.  generation_config: where
        `get_default_sampling_params` comes from, as `serve --generation-config`;
        pooler_config: how embeddings pool, as `serve --pooler-config`."""
        self.pooler_config = check_pooler_config(dict(pooler_config or {}))
        self.config = self.engine_config(model, **settings)
        where = Path(self.config.model.model) if self.config.model.model else default_model_dir()
        # (before the engine: a refused config leaves nothing running)
        self.defaults = GenerationDefaults.load(
            generation_config, where, override_generation_config
        )
        self.engine = AsyncEngine.from_config(self.config)
        self._start_loop()
        self._run(self.engine.start())
        self._counter = 0
        self._pooler: Pooler | None = None  # the model's embedding rules, on first embed

    @staticmethod
    def engine_config(model: str | None = None, **settings: Any) -> EngineConfig:
        """The config LLM(model, **settings) runs, built without loading anything: the
        same as `serve` builds for the same settings, but for the offline step budget
        when none is given."""
        if settings.get("max_num_batched_tokens") is None:
            settings["max_num_batched_tokens"] = _offline_batch_tokens(settings.get("device"))
        return EngineConfig.from_kwargs(model=None if model is None else str(model), **settings)

    def _start_loop(self) -> None:
        # The engine lives on its own loop thread, so LLM works from plain scripts and from
        # code that already runs an event loop (notebooks, async tests) alike.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pagestream-llm", daemon=True
        )
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling params: the model's generation config's
        sampling over SamplingParams' defaults, as vLLM's."""
        d = self.defaults
        return SamplingParams(**d.values, max_tokens=d.cap(SamplingParams().max_tokens))

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]] | list[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(plist)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling params for {len(plist)} prompts")
        return self._run(self._generate_all(plist, params))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.engine.render_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params)

    def embed(
        self,
        prompts: str | Sequence[str | list[int] | dict[str, Any]],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (text, token ids, or vLLM's prompt dicts), as vLLM's
        `LLM.embed`: the prompt's final hidden states pooled as the checkpoint says (the
        last token's by default), L2-normalized unless `normalize=False` (or the
        pooler_config's normalize), cut to `dimensions` on a Matryoshka model
        (service/pooling.py)."""
        pooler = self._pooling_rules()
        pooler.check(dimensions)
        outs = self._pooled(prompts, truncate_prompt_tokens)
        vecs = pooler.finish([o.embedding or [] for o in outs], normalize, dimensions)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(v))
            for o, v in zip(outs, vecs.tolist(), strict=True)
        ]

    def classify(
        self,
        prompts: str | Sequence[str | list[int] | dict[str, Any]],
        *,
        use_activation: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt from a sequence classifier, as vLLM's
        `LLM.classify`: softmax over the head's logits (sigmoid for one label), or the
        logits themselves with `use_activation=False`."""
        pooler = self._pooling_rules()
        pooler.check_classifier()
        outs = self._pooled(prompts, truncate_prompt_tokens)
        probs = pooler.probabilities([o.embedding or [] for o in outs], use_activation)
        return [
            ClassificationRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(p))
            for o, p in zip(outs, probs.tolist(), strict=True)
        ]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str]
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: text_1 against each text_2 (one against many, or pairs in
        order).  A cross-encoder (a one-label classifier) reads each pair as one input
        and scores it by the sigmoid of its logit; any other model scores by the cosine
        of the two texts' embeddings (the routes' rules, service/openai_embeddings.py)."""
        a = [text_1] if isinstance(text_1, str) else list(text_1)
        b = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(a) == 1:
            a = a * len(b)
        if not b or len(a) != len(b):
            raise ValueError(f"text_1 has {len(a)} texts and text_2 {len(b)}: give one "
                             "text_1, or as many as text_2")  # fmt: skip
        pooler = self._pooling_rules()
        if pooler.classifier:
            pooler.check_classifier(cross_encoder=True)
            ids = self.engine.tokenizer.codec.encode_pairs(list(zip(a, b, strict=True)))
            outs = self._pooled([{"prompt_token_ids": i} for i in ids], None)
            scores = pooler.probabilities([o.embedding or [] for o in outs])[:, 0]
        else:
            pooler.check(None)
            outs = self._pooled([*a, *b], None)
            vecs = pooler.finish([o.embedding or [] for o in outs], True, None)
            scores = cosine(vecs[: len(a)], vecs[len(a) :])
            outs = outs[len(a) :]
        return [
            ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(x)))
            for o, x in zip(outs, scores, strict=True)
        ]

    def _pooling_rules(self) -> Pooler:
        if self._pooler is None:
            self._pooler = Pooler(self.engine.model_dir, self.pooler_config)
        return self._pooler

    def _pooled(
        self,
        prompts: str | Sequence[str | list[int] | dict[str, Any]],
        truncate_prompt_tokens: int | None,
    ) -> list[RequestOutput]:
        """Each prompt run through one pass that returns its pooled vector."""
        plist = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [self._prompt_ids(p) for p in plist]  # type: ignore[arg-type]
        if truncate_prompt_tokens is not None:
            ids = [i[-truncate_prompt_tokens:] for i in ids]
        params = self._pooling_rules().params
        return self._run(self._generate_all(ids, [params] * len(ids)))  # type: ignore[arg-type, no-any-return]

    def beam_search(
        self,
        prompts: Sequence[str | list[int] | dict[str, Any]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text, token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`), as vLLM's `LLM.beam_search`: each output's
        `sequences` are the beam_width best, best first (service/beam_search.py)."""
        ids = [self._prompt_ids(p) for p in prompts]
        return self._run(self._beam_search_all(ids, params))

    def _prompt_ids(self, prompt: str | list[int] | dict[str, Any]) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt)
        return list(prompt)

    async def _beam_search_all(
        self, prompts: list[list[int]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        rids = []
        for _ in prompts:
            self._counter += 1
            rids.append(f"llm-{self._counter}")
        searches, _ = start_searches(
            self.engine, list(zip(rids, prompts, strict=True)), params, None
        )
        # One failing ends them all (a TaskGroup cancels the rest, which abort their step).
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(s.sequences()) for s in searches]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _generate_all(
        self, prompts: list[str | list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        async def one(prompt: str | list[int], p: SamplingParams) -> RequestOutput:
            self._counter += 1
            last = None
            rid = f"llm-{self._counter}"
            async for out in self.engine.generate(prompt, p, request_id=rid, final_only=True):
                last = out
            assert last is not None
            return last

        # Submitting in order keeps admission order = prompt order, like vLLM.
        tasks = [asyncio.ensure_future(one(pr, p)) for pr, p in zip(prompts, params, strict=True)]
        return list(await asyncio.gather(*tasks))

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._run(self.engine.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
