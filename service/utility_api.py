"""vLLM's utility routes: /tokenize, /detokenize, /version, /v1/load_lora_adapter and
/v1/unload_lora_adapter; and X-Request-Id echoing."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from scheduler.config import LORA_NAME, LoRAInUse
from service.http_util import json_response
from service.protocol import (
    BadRequest,
    ChatMessage,
    NonNegInt,
    Tool,
    check_tool_arguments,
    decode,
)
from service.tool_calls import tools_for_template

if TYPE_CHECKING:
    from service.openai_api import OpenAIServing


class TokenizeCompletion(Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Struct, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Detokenize(Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[NonNegInt]
    model: str | None = None


class LoadLoRA(Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096)]


class UnloadLoRA(Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_int_id: int | None = None  # vLLM's; names are what this server goes by


_load_lora = msgspec.json.Decoder(LoadLoRA)
_unload_lora = msgspec.json.Decoder(UnloadLoRA)
_tokenize_completion = msgspec.json.Decoder(TokenizeCompletion)
_tokenize_chat = msgspec.json.Decoder(TokenizeChat)
_detokenize = msgspec.json.Decoder(Detokenize)


def pagestream_version() -> str:
    try:
        return version("pagestream")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0+src"


async def tokenize(serving: OpenAIServing, request: web.Request) -> web.Response:
    body = await request.read()
    chat = b'"messages"' in body
    req = decode(_tokenize_chat if chat else _tokenize_completion, body)
    serving.check_model(req.model)
    engine = serving.engine
    if isinstance(req, TokenizeChat):
        if req.add_special_tokens:
            raise BadRequest(
                "add_special_tokens=true is not supported with messages (the template adds them)",
                "add_special_tokens",
            )
        # The same path as chat completions: sandboxed render in the worker pool (never on
        # the event loop), request templates only when the operator trusts them.
        check_tool_arguments(req.messages)
        kwargs = dict(req.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)
        ids = await serving.prep.chat_ids(
            [m.as_template_dict() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            chat_template=template,
            template_param="chat_template_kwargs.chat_template",
            kwargs=kwargs,
            tools=tools_for_template(req.tools) if req.tools else None,
        )
    else:
        (ids,) = await serving.prep.encode(
            [req.prompt], add_special_tokens=req.add_special_tokens, param="prompt"
        )
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = await serving.prep.token_strs(ids)
    return json_response(out)


async def detokenize(serving: OpenAIServing, request: web.Request) -> web.Response:
    req: Detokenize = decode(_detokenize, await request.read())
    serving.check_model(req.model)
    engine = serving.engine
    # No output of this model is longer than max_model_len: more ids than that would only
    # make the server build a huge text (a 4 MiB body holds 2 million ids).
    if len(req.tokens) > engine.max_model_len:
        raise BadRequest(
            f"{len(req.tokens)} token ids; at most max_model_len ({engine.max_model_len})",
            "tokens",
        )
    vocab = engine.vocab_size
    if req.tokens and max(req.tokens) >= vocab:
        bad = next(t for t in req.tokens if t >= vocab)
        raise BadRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    # Off the event loop past 512 ids (service/tokenize_pool.py).
    (text,) = await serving.prep.decode([req.tokens])
    return json_response({"prompt": text})


async def version_handler(request: web.Request) -> web.Response:
    return json_response({"version": pagestream_version()})


async def load_lora(serving: OpenAIServing, request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"} (--allow-runtime-lora):
    requests naming it as their `model` run it from the answer on."""
    req: LoadLoRA = decode(_load_lora, await request.read())
    name = req.lora_name
    if name in serving.names:
        raise BadRequest(f"{name!r} is the served model's name", "lora_name")
    if name in serving.engine.lora_salts:
        raise BadRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if not LORA_NAME.fullmatch(name):
        raise BadRequest(f"LoRA adapter names must match {LORA_NAME.pattern}", "lora_name")
    try:
        await serving.engine.load_lora(name, req.lora_path)
    except ValueError as e:  # the adapter: unreadable, or not one this model can serve
        raise BadRequest(str(e), "lora_path") from e
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora(serving: OpenAIServing, request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter {"lora_name"}: refused to new requests at once, gone
    once the requests that run it end (409 if some still do 30 s on; it stays)."""
    req: UnloadLoRA = decode(_unload_lora, await request.read())
    if req.lora_name not in serving.engine.lora_salts:
        raise BadRequest(
            f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name", status=404
        )
    try:
        await serving.engine.unload_lora(req.lora_name)
    except LoRAInUse as e:
        raise BadRequest(
            f"LoRA adapter {req.lora_name!r} still runs requests: {e}", "lora_name", status=409
        ) from e
    except KeyError:  # another call unloaded it meanwhile
        raise BadRequest(
            f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name", status=404
        ) from None
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
