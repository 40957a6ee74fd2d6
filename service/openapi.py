"""The OpenAPI document served at /openapi.json, generated from the wire Structs.

The request schemas are exactly what the decoders accept (msgspec writes them from the
same Structs), so clients and fuzzers see the real contract.  The WebSocket frames have no
OpenAPI operation of their own; their schema is published as `ClientFrame` under
components and referenced from the `/v1/ws` GET's description.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from service.protocol import PrefixRegistration
from service.protocol_anthropic import CountTokensRequest, MessagesRequest
from service.protocol_embeddings import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from service.protocol_openai import ChatCompletionRequest, CompletionRequest
from service.protocol_responses import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    InputTokensRequest,
    ResponsesRequest,
)
from service.protocol_ws import ClientFrame
from service.utility_api import Detokenize, LoadLoRA, TokenizeChat, TokenizeCompletion, UnloadLoRA

_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _errors(*codes: int) -> dict[str, Any]:
    ref = {"$ref": _REF.format(name="ErrorResponse")}
    return {
        str(c): {"description": "error", "content": {"application/json": {"schema": ref}}}
        for c in codes
    }


def _post(summary: str, schema: dict[str, Any], streams: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": "OK", "content": ok},
                **_errors(400, 401, 404, 413, 429, 503),
            },
        }
    }


@cache
def openapi_document(root_path: str = "") -> dict[str, Any]:
    """The document; root_path (--root-path): the prefix a proxy serves the API under,
    given as its `servers` entry so generated clients call through it."""
    doc = _document()
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc


def _document() -> dict[str, Any]:
    schemas, components = msgspec.json.schema_components(
        [
            ChatCompletionRequest,
            CompletionRequest,
            ResponsesRequest,
            ClientFrame,
            PrefixRegistration,
            ConversationCreate,
            ConversationUpdate,
            ConversationItemsCreate,
            InputTokensRequest,
            TokenizeCompletion,
            TokenizeChat,
            Detokenize,
            LoadLoRA,
            UnloadLoRA,
            MessagesRequest,
            CountTokensRequest,
            EmbeddingRequest,
            ScoreRequest,
            RerankRequest,
            ClassificationRequest,
            PoolingRequest,
        ],
        ref_template=_REF,
    )
    chat, completion, responses, frame, prefix, conv, conv_update, conv_items, count = schemas[:9]
    tok_prompt, tok_chat, detok, load_lora, unload_lora, messages, count_messages = schemas[9:16]
    embeddings, score, rerank, classify, pooling = schemas[16:]
    components["ClientFrame"] = frame
    components["ErrorResponse"] = _ERROR
    plain = {"200": {"description": "OK", "content": {"application/json": {"schema": {}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagestream", "version": "0.1.0"},
        "paths": {
            "/v1/chat/completions": _post("Chat completion (OpenAI)", chat, streams=True),
            "/v1/completions": _post("Text completion (OpenAI)", completion, streams=True),
            "/v1/responses": _post("Response (OpenAI Responses API)", responses, streams=True),
            "/v1/responses/{id}": {
                "get": {"summary": "A stored response", "responses": plain},
                "delete": {"summary": "Delete a stored response", "responses": plain},
            },
            "/v1/responses/{id}/input_items": {
                "get": {"summary": "A stored response's input items", "responses": plain},
            },
            "/v1/responses/input_tokens": _post("Count a response's input tokens", count, False),
            "/v1/messages": _post("Message (Anthropic Messages API)", messages, streams=True),
            "/v1/messages/count_tokens": _post(
                "Count a message's input tokens (Anthropic)", count_messages, False
            ),
            "/v1/embeddings": _post("Embeddings (OpenAI)", embeddings, False),
            **{
                path: _post(
                    "Text pairs' similarity (cosine, or a cross-encoder's; vLLM)", score, False
                )
                for path in ("/score", "/v1/score")
            },
            **{
                path: _post("Documents ranked by relevance to a query", rerank, False)
                for path in ("/rerank", "/v1/rerank", "/v2/rerank")
            },
            **{
                path: _post(
                    "Label probabilities from a sequence classifier (vLLM)", classify, False
                )
                for path in ("/classify", "/v1/classify")
            },
            **{
                path: _post(
                    "Each input's pooled output: an embedding, or a classifier's "
                    "probabilities (vLLM)",
                    pooling,
                    False,
                )
                for path in ("/pooling", "/v1/pooling")
            },
            "/v1/responses/{id}/cancel": {
                "post": {"summary": "Cancel a background response", "responses": plain},
            },
            "/v1/conversations": _post("Create a conversation", conv, False),
            "/v1/conversations/{id}": {
                "get": {"summary": "A conversation", "responses": plain},
                **_post("Update a conversation's metadata", conv_update, False),
                "delete": {"summary": "Delete a conversation", "responses": plain},
            },
            "/v1/conversations/{id}/items": {
                "get": {"summary": "A conversation's items, paged", "responses": plain},
                **_post("Add items to a conversation", conv_items, False),
            },
            "/v1/conversations/{id}/items/{item_id}": {
                "get": {"summary": "One item of a conversation", "responses": plain},
                "delete": {"summary": "Delete an item of a conversation", "responses": plain},
            },
            "/v1/cache/prefixes": _post("Compute and publish a shared prefix", prefix, False),
            "/v1/models": {"get": {"summary": "Served models", "responses": plain}},
            "/v1/models/{model}": {"get": {"summary": "One served model", "responses": plain}},
            "/invocations": _post(
                "Any task, by the body's keys (SageMaker's route)",
                {"anyOf": [chat, completion, embeddings, rerank, score]},
                True,
            ),
            "/ping": {
                "get": {"summary": "/health's answer (SageMaker's)", "responses": plain},
                "post": {"summary": "/health's answer (SageMaker's)", "responses": plain},
            },
            "/v1/load_lora_adapter": _post(
                "Load a LoRA adapter (with --allow-runtime-lora)", load_lora, False
            ),
            "/v1/unload_lora_adapter": _post(
                "Unload a LoRA adapter (with --allow-runtime-lora)", unload_lora, False
            ),
            "/v1/streams/{id}": {
                "get": {
                    "summary": "Resume a stream from Last-Event-ID (with --resume-grace)",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        }
                    },
                },
            },
            "/tokenize": _post(
                "Token ids of a prompt, or of messages through the chat template",
                {"anyOf": [tok_prompt, tok_chat]},
                False,
            ),
            "/detokenize": _post("Text of token ids", detok, False),
            "/health": {"get": {"summary": "200 when serving, 503 otherwise", "responses": plain}},
            "/live": {"get": {"summary": "200 while the process serves", "responses": plain}},
            "/version": {"get": {"summary": "The server's version", "responses": plain}},
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/debug/state": {
                "get": {
                    "summary": "Engine queues, KV blocks, memory (with --enable-debug-routes)",
                    "responses": plain,
                }
            },
            "/v1/ws": {
                "get": {
                    "summary": "WebSocket: JSON text frames, client frames per the ClientFrame "
                    "schema (components)",
                    "responses": {"101": {"description": "Switching Protocols"}},
                }
            },
        },
        "components": {"schemas": components},
    }
