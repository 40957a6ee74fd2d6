"""LangChain's ChatOpenAI, unchanged, against a live server: structured output by JSON
schema and by function calling, bound tools, and streaming (text and tool calls), on chat
completions and on the Responses API (`use_responses_api`, `use_previous_response_id`)."""

from __future__ import annotations

import json

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI

from tests.clients.conftest import MODEL_NAME as MODEL
from tests.clients.test_openai_sdk import MODELS, Answer, PlaceOrder, Refund

PROMPT = "Order two widgets, then explain."


@pytest.fixture(scope="module")
def llm(server) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="x", temperature=0,
        max_tokens=300, max_retries=0, timeout=120,
    )  # fmt: skip


def test_structured_output_by_json_schema_keeps_key_order(llm):
    out = llm.with_structured_output(Answer, method="json_schema", include_raw=True).invoke(PROMPT)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Answer)
    assert list(json.loads(out["raw"].content)) == ["reasoning", "answer"]


def test_structured_output_by_function_calling_with_nested_models(llm):
    # LangChain names the function in tool_choice.  strict: without it the schema leaves
    # additionalProperties open, and this model fills them until max_tokens.
    out = llm.with_structured_output(Refund, method="function_calling", strict=True).invoke(PROMPT)
    assert isinstance(out, Refund)


def test_bind_tools_any_makes_calls_with_nested_models(llm):
    # tool_choice "any" is OpenAI's "required": both tools' schemas in one grammar.
    bound = llm.bind_tools(
        [PlaceOrder, Refund], tool_choice="any", parallel_tool_calls=False, strict=True
    )
    msg = bound.invoke(PROMPT)
    (call,) = msg.tool_calls
    assert msg.invalid_tool_calls == [] and msg.response_metadata["finish_reason"] == "tool_calls"
    assert isinstance(MODELS[call["name"]].model_validate(call["args"]), MODELS[call["name"]])


def test_streamed_text_is_the_invoked_text(llm):
    short = llm.bind(max_tokens=24)
    chunks = list(short.stream(PROMPT))
    assert len(chunks) > 3  # streamed as it came, not at the end
    assert "".join(c.content for c in chunks) == short.invoke(PROMPT).content


def test_streamed_tool_calls_merge_into_the_invoked_calls(llm):
    bound = llm.bind_tools(
        [PlaceOrder, Refund], tool_choice="any", parallel_tool_calls=False, strict=True, seed=2
    ).bind(temperature=1.0)
    whole = bound.invoke(PROMPT)
    merged: AIMessageChunk | None = None
    for chunk in bound.stream(PROMPT):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.content == ""
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]
    assert merged.response_metadata["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- on the Responses API
def on_responses(server, max_tokens: int = 300) -> ChatOpenAI:
    """The same ChatOpenAI on /v1/responses (`use_responses_api`), continuing a chat by
    `previous_response_id` (`use_previous_response_id`).  (Its token limit is the
    constructor's: a bound `max_tokens` is not what it sends as `max_output_tokens`.)"""
    return ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="x", temperature=0,
        max_tokens=max_tokens, max_retries=0, timeout=120, use_responses_api=True,
        use_previous_response_id=True,
    )  # fmt: skip


def test_responses_api_text_is_the_chat_text(llm, server):
    """The oracle: the same model's chat completion of the same messages."""
    short, chat = on_responses(server, 24), llm.bind(max_tokens=24)
    msg = short.invoke(PROMPT)
    assert msg.text == chat.invoke(PROMPT).content
    assert msg.response_metadata["id"].startswith("resp")
    streamed = list(short.stream(PROMPT))
    assert len(streamed) > 3 and "".join(c.text for c in streamed) == msg.text
    # A second turn sent with previous_response_id: LangChain sends only the new message.
    follow = [("human", PROMPT), msg, ("human", "And then?")]
    second = short.invoke(follow)
    whole = chat.invoke([("human", PROMPT), ("ai", msg.text), ("human", "And then?")])
    assert second.text == whole.content
    stored = openai.OpenAI(base_url=server.url + "/v1", api_key="x").responses.retrieve(
        second.response_metadata["id"]
    )
    assert stored.previous_response_id == msg.response_metadata["id"]


def test_responses_api_structured_output_and_tools(server):
    llm = on_responses(server)
    out = llm.with_structured_output(Answer, method="json_schema").invoke(PROMPT)
    assert isinstance(out, Answer)
    bound = llm.bind_tools(
        [PlaceOrder, Refund], tool_choice="any", parallel_tool_calls=False, strict=True
    )
    (call,) = bound.invoke(PROMPT).tool_calls
    assert isinstance(MODELS[call["name"]].model_validate(call["args"]), MODELS[call["name"]])


def test_openai_embeddings_reads_the_embeddings_route(server):
    """LangChain's OpenAIEmbeddings as vLLM's docs set it up for a self-hosted model: no
    tiktoken pre-tokenization (its ctx-length check would download OpenAI's BPE)."""
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model=MODEL, base_url=server.url + "/v1", api_key="x",
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    texts = ["The quick brown fox.", "A lazy dog sleeps."]
    docs = emb.embed_documents(texts)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    want = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
    assert [len(d) for d in docs] == [len(w.embedding) for w in want]
    for got, w in zip(docs, want, strict=True):
        assert max(abs(a - b) for a, b in zip(got, w.embedding, strict=True)) < 1e-5
    query = emb.embed_query(texts[0])
    assert max(abs(a - b) for a, b in zip(query, docs[0], strict=True)) < 1e-5
