"""Request bodies of /v1/embeddings (OpenAI's, with vLLM's extensions: chat `messages`
as input, truncation, normalize, priority), and of vLLM's /pooling, /classify, /score and
/rerank."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from service.protocol import BadRequest, ChatMessage, NonNegInt, PositiveInt, RequestId, decode


class PromptInputs(Struct, forbid_unknown_fields=True, kw_only=True):
    """What /v1/embeddings and /classify share: the inputs and how they become prompts."""

    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of token-id lists
    # (OpenAI's); or vLLM's `messages`, one conversation through the chat template.
    input: str | list[str | NonNegInt | list[NonNegInt]] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # Text inputs: the tokenizer's special tokens (BOS, or the EOS an embedding model's
    # post-processor appends) are added unless this is false; messages: the template's.
    add_special_tokens: bool | None = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    request_id: RequestId | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    mm_processor_kwargs: Any = None

    def check(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise BadRequest("give exactly one of input and messages", "input")
        if self.mm_processor_kwargs is not None:
            raise BadRequest("mm_processor_kwargs is not supported (no multimodal models)",
                             "mm_processor_kwargs")  # fmt: skip
        if self.messages is None:
            for name in ("chat_template", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise BadRequest(f"{name} applies to messages only", name)
        elif self.add_special_tokens:
            raise BadRequest(
                "add_special_tokens=true is not supported with messages (the template adds them)",
                "add_special_tokens",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )


class EmbeddingRequest(PromptInputs, forbid_unknown_fields=True, kw_only=True):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    normalize: bool | None = None  # L2 (default true)
    embed_dtype: str | None = None

    def check(self) -> None:
        super().check()
        if self.embed_dtype not in (None, "float32"):
            raise BadRequest("embed_dtype: only float32 is supported", "embed_dtype")


class ClassificationRequest(PromptInputs, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /classify: each input's label probabilities from a sequence classifier."""

    # false: the head's raw logits in `probs` (vLLM's use_activation).
    use_activation: bool | None = None


class PoolingRequest(EmbeddingRequest, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /pooling: each input's pooled output as the model's task makes it: an
    embedding model's vector (as /v1/embeddings), a classifier's probabilities (as
    /classify)."""

    # vLLM's pooling tasks; the per-token ones are refused (this server pools prompts).
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    use_activation: bool | None = None  # classify: false gives the head's raw logits

    def check(self) -> None:
        super().check()
        if self.task in ("token_embed", "token_classify"):
            raise BadRequest(
                f"task {self.task!r} is not supported: this server returns one output per "
                "input (embed or classify)",
                "task",
            )


_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
_pooling_decoder = msgspec.json.Decoder(PoolingRequest)


_classification_decoder = msgspec.json.Decoder(ClassificationRequest)


def decode_embedding(body: bytes) -> EmbeddingRequest:
    return decode(_embedding_decoder, body)


def decode_pooling(body: bytes) -> PoolingRequest:
    return decode(_pooling_decoder, body)


def decode_classification(body: bytes) -> ClassificationRequest:
    return decode(_classification_decoder, body)


TextOrTexts = str | list[str]


class PairwiseRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields vLLM's /score and /rerank share."""

    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0
    request_id: RequestId | None = None
    user: str | None = None
    mm_processor_kwargs: Any = None

    def check(self) -> None:
        if self.mm_processor_kwargs is not None:
            raise BadRequest("mm_processor_kwargs is not supported (no multimodal models)",
                             "mm_processor_kwargs")  # fmt: skip


class ScoreRequest(PairwiseRequest, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /score: text_1 against text_2 (1:1, 1:N, or N:N paired in order)."""

    text_1: TextOrTexts
    text_2: TextOrTexts

    def pairs(self) -> tuple[list[str], list[str]]:
        a = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        b = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        for name, texts in (("text_1", a), ("text_2", b)):
            if not texts:
                raise BadRequest(f"{name} must not be empty", name)
        if len(a) == 1:
            a = a * len(b)
        if len(a) != len(b):
            raise BadRequest(
                f"text_1 has {len(a)} texts and text_2 {len(b)}: give one text_1, or as many "
                "as text_2",
                "text_2",
            )
        return a, b


class RerankRequest(PairwiseRequest, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /rerank (Jina's and Cohere's shape): documents ranked by relevance to the
    query, best first; top_n 0 keeps all."""

    query: str
    documents: list[str]
    top_n: NonNegInt = 0
    return_documents: bool = True
    # Cohere's: each document is cut to its first so many tokens.
    max_tokens_per_doc: PositiveInt | None = None
    relevant_spans: Any = None

    def check(self) -> None:
        super().check()
        if not self.documents:
            raise BadRequest("documents must not be empty", "documents")
        if self.relevant_spans is not None:
            raise BadRequest("relevant_spans is not supported", "relevant_spans")


_score_decoder = msgspec.json.Decoder(ScoreRequest)
_rerank_decoder = msgspec.json.Decoder(RerankRequest)


def decode_score(body: bytes) -> ScoreRequest:
    return decode(_score_decoder, body)


def decode_rerank(body: bytes) -> RerankRequest:
    return decode(_rerank_decoder, body)
