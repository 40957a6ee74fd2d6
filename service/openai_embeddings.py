"""/v1/embeddings: each input is a prompt the engine runs through one prefill, batched with
every other request (continuous batching, chunked prefill, the prefix cache), and whose
last position's final hidden state comes back as its embedding (service/pooling.py).

The same engine serves generation and embeddings at once: an embedding request is a
request that samples one token nobody reads, so it shares the scheduler's queues, limits,
priorities, API-key fairness and prefix cache with chat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from service.completion_extras import OFF_LOOP_LOGPROB_ENTRIES
from service.http_util import TENANT_SALT, json_response, salted
from service.openai_common import ServingBase
from service.openai_completions import final_outputs
from service.outputs import RequestOutput
from service.pooling import Pooler, cosine, encode_vectors
from service.protocol import BadRequest, check_messages
from service.protocol_embeddings import (
    PairwiseRequest,
    PromptInputs,
    decode_classification,
    decode_embedding,
    decode_pooling,
    decode_rerank,
    decode_score,
)
from service.protocol_openai import prompt_list, template_choice, truncation
from service.request_ids import TENANT, request_id


class EmbeddingServing(ServingBase):
    _pooler: Pooler | None = None
    pooler_config: dict[str, Any] | None = None  # --pooler-config

    @property
    def pooler(self) -> Pooler:
        if self._pooler is None:
            self._pooler = Pooler(self.engine.model_dir, self.pooler_config)
        return self._pooler

    @property
    def max_embed_len(self) -> int:
        return self.engine.max_model_len

    async def embed_prompts(
        self, request: web.Request, prompts: list[list[int]],
        *, lora: str | None, id_prefix: str, body_id: str | None = None,
        cache_salt: str | None = None, priority: int = 0, field: str = "input",
    ) -> tuple[str, list[RequestOutput]]:  # fmt: skip
        """Run each prompt to its embedding, concurrently; (public request id, outputs)."""
        params = self.with_lora(self.pooler.params, lora)
        rid, engine_rid = request_id(request, body_id, id_prefix)
        salt = salted(request.get(TENANT_SALT), cache_salt)
        gens, subs = self._start(
            engine_rid, prompts, [None] * len(prompts), params, salt,
            tenant=request.get(TENANT), priority=priority, prompt_field=field,
        )  # fmt: skip
        try:
            finals = await final_outputs(gens)
        finally:
            self._release(subs)
        return rid, finals

    def check_embed_lengths(self, prompts: list[list[int]], field: str) -> None:
        limit = self.max_embed_len
        for i, ids in enumerate(prompts):
            if len(ids) > limit:
                where = f"{field}[{i}]" if len(prompts) > 1 else field
                raise BadRequest(
                    f"{where} has {len(ids)} tokens; at most max_model_len ({limit}) can be "
                    "read: shorten it or set truncate_prompt_tokens",
                    field,
                )

    async def embedding_prompt_ids(self, req: PromptInputs) -> list[list[int]]:
        truncate = truncation(req.truncate_prompt_tokens, self.max_embed_len)
        if req.messages is not None:
            check_messages(req.messages)
            template, template_field, kwargs = template_choice(
                req.chat_template, req.chat_template_kwargs
            )
            ids = await self.prep.chat_ids(
                [m.as_template_dict() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                chat_template=template,
                template_param=template_field,
                kwargs=kwargs,
                truncate=truncate,
                continue_final_message=req.continue_final_message,
            )
            return [ids]
        assert req.input is not None
        raw = prompt_list(req.input, "input")
        self.limits.check_prompt_count(len(raw), "input")
        return await self.prep.prompt_ids(  # type: ignore[no-any-return]
            raw,
            param="input",
            truncate=truncate,
            add_special_tokens=req.add_special_tokens is not False,
        )

    async def _pool_inputs(
        self, request: web.Request, req: PromptInputs, id_prefix: str, check: Callable[[], None]
    ) -> tuple[str, list[list[int]], list[RequestOutput]]:
        """A body's inputs as prompts, each run to its pooled vector: (public request id,
        prompts, outputs).  `check`: the model's own refusal, after the body's checks."""
        lora = self.check_model(req.model)
        req.check()
        check()
        prompts = await self.embedding_prompt_ids(req)
        self.check_embed_lengths(prompts, "messages" if req.messages is not None else "input")
        rid, finals = await self.embed_prompts(
            request, prompts, lora=lora, id_prefix=id_prefix, body_id=req.request_id,
            cache_salt=req.cache_salt, priority=req.priority,
        )  # fmt: skip
        return rid, prompts, finals

    async def embeddings(self, request: web.Request, body: bytes) -> web.Response:
        req = decode_embedding(body)
        rid, prompts, finals = await self._pool_inputs(
            request, req, "embd-", lambda: self.pooler.check(req.dimensions)
        )
        model = req.model or self.names[0]

        def build() -> web.Response:
            x = self.pooler.finish([_vector(out) for out in finals], req.normalize, req.dimensions)
            data = [
                {"object": "embedding", "index": i, "embedding": e}
                for i, e in enumerate(encode_vectors(x, req.encoding_format))
            ]
            return _list_response(rid, model, data, sum(map(len, prompts)))

        return await self._respond(build, finals)

    @staticmethod
    async def _respond(
        build: Callable[[], web.Response], finals: list[RequestOutput]
    ) -> web.Response:
        """Thousands of floats per input: a large body is built on a thread, so the event
        loop (other streams, /health) only waits its turn for the GIL."""
        if sum(len(out.embedding or ()) for out in finals) > OFF_LOOP_LOGPROB_ENTRIES:
            return await asyncio.to_thread(build)
        return build()

    async def pooling(self, request: web.Request, body: bytes) -> web.Response:
        """vLLM's /pooling: an embedding model's vectors (as /v1/embeddings) or a
        classifier's probabilities (as /classify), each as an item's `data`."""
        req = decode_pooling(body)
        pooler = self.pooler
        task = req.task or ("classify" if pooler.classifier else "embed")
        if task == "classify" and (req.dimensions is not None or req.normalize is not None):
            raise BadRequest("dimensions and normalize apply to task embed", "task")
        if task == "embed" and req.use_activation is not None:
            raise BadRequest("use_activation applies to task classify", "use_activation")

        def check() -> None:
            if task == "classify":
                pooler.check_classifier()
            else:
                pooler.check(req.dimensions)

        rid, prompts, finals = await self._pool_inputs(request, req, "pool-", check)

        def build() -> web.Response:
            vectors = [_vector(out) for out in finals]
            if task == "classify":
                x = pooler.probabilities(vectors, req.use_activation is not False)
            else:
                x = pooler.finish(vectors, req.normalize, req.dimensions)
            data = [
                {"index": i, "object": "pooling", "data": v}
                for i, v in enumerate(encode_vectors(x, req.encoding_format))
            ]
            model = req.model or self.names[0]
            return _list_response(rid, model, data, sum(map(len, prompts)))

        return await self._respond(build, finals)

    async def classify(self, request: web.Request, body: bytes) -> web.Response:
        """vLLM's /classify: each input's label probabilities from a sequence classifier
        (the same one-prefill pass as an embedding; the runner applies the head)."""
        req = decode_classification(body)
        rid, prompts, finals = await self._pool_inputs(
            request, req, "classify-", self.pooler.check_classifier
        )
        probs = self.pooler.probabilities(
            [_vector(out) for out in finals], req.use_activation is not False
        )
        labels = self.pooler.labels
        data = [
            {
                "index": i,
                "label": labels[int(np.argmax(p))],
                "probs": p.tolist(),
                "num_classes": len(labels),
            }
            for i, p in enumerate(probs)
        ]
        return _list_response(rid, req.model or self.names[0], data, sum(map(len, prompts)))


def _list_response(rid: str, model: str, data: list[dict[str, Any]], tokens: int) -> web.Response:
    return json_response(
        {
            "id": rid,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


def _vector(out: RequestOutput) -> list[float]:
    if out.embedding is None:  # the runner pools every embed request that samples
        raise RuntimeError(f"request {out.request_id} finished without its embedding")
    return out.embedding


class PairwiseServing(EmbeddingServing):
    """vLLM's /score and /rerank.  For an embedding model (a bi-encoder) each text is
    embedded once and a pair's score is the cosine similarity of its two embeddings; for
    a one-label sequence classifier (a cross-encoder) each pair is one input and its score
    the head's sigmoid."""

    async def _embed_texts(
        self,
        request: web.Request,
        req: PairwiseRequest,
        groups: list[tuple[str, list[str]]],
        id_prefix: str,
        doc_tokens: int | None = None,
    ) -> tuple[str, list[np.ndarray], int]:
        """Every distinct text of the (field, texts) groups embedded (normalized) in one
        batch: (request id, each group's vectors in its texts' order, prompt tokens).
        doc_tokens: the last group's texts keep their first so many tokens (Cohere's
        max_tokens_per_doc), so they are embedded apart from the same text elsewhere."""
        lora = self.check_model(req.model)
        req.check()
        self.pooler.check(None)
        truncate = truncation(req.truncate_prompt_tokens, self.max_embed_len)
        last = len(groups) - 1
        cuts = [doc_tokens if i == last else None for i in range(len(groups))]
        row: dict[tuple[int | None, str], int] = {}  # (cut, text) -> its prompt's index
        todo: list[tuple[str, int | None, list[str]]] = []
        for (field, texts), cut in zip(groups, cuts, strict=True):
            fresh = [t for t in dict.fromkeys(texts) if (cut, t) not in row]
            row.update({(cut, t): len(row) + k for k, t in enumerate(fresh)})
            todo.append((field, cut, fresh))
        self.limits.check_prompt_count(len(row), groups[-1][0])
        prompts: list[list[int]] = []
        for field, cut, fresh in todo:
            ids = await self.prep.prompt_ids(
                fresh, param=field,  # type: ignore[arg-type]
                truncate=min(cut, self.max_embed_len) if cut else truncate, keep_first=bool(cut),
            )  # fmt: skip
            self.check_embed_lengths(ids, field)
            prompts += ids
        rid, finals = await self.embed_prompts(
            request, prompts, lora=lora, id_prefix=id_prefix, body_id=req.request_id,
            priority=req.priority, field=groups[-1][0],
        )  # fmt: skip
        vecs = self.pooler.finish([_vector(o) for o in finals], True, None)
        out = [
            vecs[[row[(cut, t)] for t in texts]]
            for (_, texts), cut in zip(groups, cuts, strict=True)
        ]
        return rid, out, sum(map(len, prompts))

    async def _cross_scores(
        self,
        request: web.Request,
        req: PairwiseRequest,
        firsts: list[str],
        seconds: list[str],
        fields: tuple[str, str],
        id_prefix: str,
        second_max: int | None = None,
    ) -> tuple[str, np.ndarray, int]:
        """A cross-encoder's relevance of each (first, second) pair, read together as one
        input: (request id, scores, prompt tokens)."""
        lora = self.check_model(req.model)
        req.check()
        self.pooler.check_classifier(cross_encoder=True)
        field = fields[1]
        self.limits.check_prompt_count(len(seconds), field)
        truncate = truncation(req.truncate_prompt_tokens, self.max_embed_len)
        prompts = await self.prep.pair_ids(
            list(zip(firsts, seconds, strict=True)), fields, truncate, second_max
        )
        self.check_embed_lengths(prompts, field)
        rid, finals = await self.embed_prompts(
            request, prompts, lora=lora, id_prefix=id_prefix, body_id=req.request_id,
            priority=req.priority, field=field,
        )  # fmt: skip
        scores = self.pooler.probabilities([_vector(o) for o in finals])[:, 0]
        return rid, scores, sum(map(len, prompts))

    async def score(self, request: web.Request, body: bytes) -> web.Response:
        req = decode_score(body)
        a, b = req.pairs()
        if self.pooler.classifier:
            rid, scores, tokens = await self._cross_scores(
                request, req, a, b, ("text_1", "text_2"), "score-"
            )
        else:
            rid, (va, vb), tokens = await self._embed_texts(
                request, req, [("text_1", a), ("text_2", b)], "score-"
            )
            scores = cosine(va, vb)
        data = [{"index": i, "object": "score", "score": float(x)} for i, x in enumerate(scores)]
        return _list_response(rid, req.model or self.names[0], data, tokens)

    async def rerank(self, request: web.Request, body: bytes) -> web.Response:
        req = decode_rerank(body)
        if self.pooler.classifier:
            rid, scores, tokens = await self._cross_scores(
                request, req, [req.query] * len(req.documents), req.documents,
                ("query", "documents"), "rerank-", second_max=req.max_tokens_per_doc,
            )  # fmt: skip
        else:
            rid, (vq, vd), tokens = await self._embed_texts(
                request,
                req,
                [("query", [req.query]), ("documents", req.documents)],
                "rerank-",
                doc_tokens=req.max_tokens_per_doc,
            )
            scores = cosine(np.repeat(vq, len(vd), axis=0), vd)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents:
                r["document"] = {"text": req.documents[i]}
            results.append(r)
        return json_response(
            {
                "id": rid,
                "model": req.model or self.names[0],
                "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
