"""/v1/conversations (OpenAI's Conversations API): a conversation is a list of items
(messages, function calls and their outputs) kept per API key in the response store, in
memory or, with --redis-url, in Redis for the whole fleet (service/response_store.py).

Clients add items themselves (`POST .../items`, as the OpenAI Agents SDK's
`OpenAIConversationsSession` does) or name the conversation in `POST /v1/responses`
(`conversation`): the turn then sees every item before its input, and its input and
output items are appended when it ends.  The conversation's KV is pinned between turns
under its id (scheduler/pins.py), as a `conversation_id` pins it.

Entries are read, extended and written back under the version read (`put(expect=...)`),
so two writers on different replicas never lose each other's items: the later one reads
again and retries."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
import weakref
from typing import Any

import msgspec
from aiohttp import web

from service.http_util import json_response
from service.openai_common import ServingBase
from service.protocol import BadRequest, decode
from service.protocol_responses import (
    LOGPROBS_INCLUDE,
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    normalize_item,
)
from service.request_ids import TENANT
from service.response_store import ResponseStoreBase, StoreConflict, Stored, StoreUnavailable

_create = msgspec.json.Decoder(ConversationCreate)
_update = msgspec.json.Decoder(ConversationUpdate)
_items = msgspec.json.Decoder(ConversationItemsCreate)
_RETRIES = 16  # reads and writes back before a writer gives up under contention (409)
# One lock per conversation being written on this replica (dropped with its last holder).
_writers: weakref.WeakValueDictionary[tuple[int, str | None, str], asyncio.Lock] = (
    weakref.WeakValueDictionary()
)


# A conversation's bound (its items as JSON): every turn in it decodes all of them on the
# event loop (~20 ms a MiB), and far more text than any context holds is no use to a turn.
MAX_CONVERSATION_BYTES = 2 << 20


def _entry(conv: dict[str, Any], items: list[dict[str, Any]], param: str = "items") -> Stored:
    record = {**conv, "items": items}
    size = len(msgspec.json.encode(record))
    if size > MAX_CONVERSATION_BYTES:
        raise BadRequest(
            f"the conversation would take {size:,} bytes; at most "
            f"{MAX_CONVERSATION_BYTES:,} are kept (delete items or start another)",
            param,
        )
    return Stored(record, [], conv["id"], size)


def _public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "items"}


def new_items(raw: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Items as a conversation keeps them, each with an id (the client's or a new one);
    a bad item is a 400 naming it."""
    out = [normalize_item(r, f"{where}[{i}]", uuid.uuid4().hex) for i, r in enumerate(raw)]
    _no_duplicates(out, set(), where)
    return out


def check_new(items: list[dict[str, Any]], old: list[dict[str, Any]], where: str) -> None:
    """New items must not reuse an id the conversation holds."""
    _no_duplicates(items, {i["id"] for i in old}, where)


def _no_duplicates(items: list[dict[str, Any]], ids: set[str], where: str) -> None:
    seen = set(ids)
    for i, item in enumerate(items):
        if item["id"] in seen:
            raise BadRequest(f"duplicate item id {item['id']!r}", f"{where}[{i}].id")
        seen.add(item["id"])


async def load(store: ResponseStoreBase, tenant: str | None, cid: str, param: str) -> Stored:
    """The conversation `cid` of this API key, else a 404 naming `param` (503 while the
    store is unreachable)."""
    try:
        got = await store.get(tenant, cid)
    except StoreUnavailable as e:
        raise BadRequest(f"{e}; try again", param, status=503) from e
    if got is None or got.response.get("object") != "conversation":
        raise BadRequest(f"conversation {cid!r} not found", param, status=404)
    return got


async def change(
    store: ResponseStoreBase,
    tenant: str | None,
    cid: str,
    param: str,
    edit: Any,
) -> dict[str, Any]:
    """Read the conversation, `edit(record) -> record`, and write it back over the
    version read; read again when another writer came between.  Returns the record.
    Writers on this replica take turns (a lock per conversation); only other replicas'
    writes can come between, and a writer that lost backs off a random while."""
    key = (id(store), tenant, cid)
    lock = _writers.get(key)
    if lock is None:
        lock = _writers[key] = asyncio.Lock()
    async with lock:
        for attempt in range(_RETRIES):
            cur = await load(store, tenant, cid, param)
            record = edit(dict(cur.response))
            entry = _entry(_public(record), record["items"], param)
            try:
                kept = await store.put(tenant, cid, entry, expect=cur.version)
            except StoreConflict:
                await asyncio.sleep(random.uniform(0, 0.002 * 2 ** min(attempt, 6)))
                continue
            except StoreUnavailable as e:
                raise BadRequest(f"{e}; try again", param, status=503) from e
            if not kept:
                raise BadRequest(
                    "the conversation no longer fits in the response store "
                    "(--max-stored-response-bytes)",
                    param,
                )
            return record
    raise BadRequest("the conversation is being changed by other requests; try again",
                     param, status=409)  # fmt: skip


async def append(
    store: ResponseStoreBase, tenant: str | None, cid: str, items: list[dict[str, Any]], param: str
) -> None:
    def add(record: dict[str, Any]) -> dict[str, Any]:
        old = record["items"]
        _no_duplicates(items, {i["id"] for i in old}, param)
        record["items"] = old + items
        return record

    await change(store, tenant, cid, param, add)


def page_args(query: Any) -> tuple[str, int]:
    """A list query's `order` and `limit` (and its `include`), checked."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be an integer in [1, 100]", "limit")
    for inc in query.getall("include", []) + query.getall("include[]", []):
        if inc != LOGPROBS_INCLUDE:
            raise BadRequest(f"include {inc!r} is not supported", "include")
    return order, limit


def page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """A list of items paged as OpenAI pages them: `order` desc (default) or asc,
    `limit` 1-100 (20), cursors `after` and `before` (item ids)."""
    order, limit = page_args(query)
    items = items[::-1] if order == "desc" else list(items)
    ids = [i["id"] for i in items]
    lo, hi = 0, len(items)
    for name in ("after", "before"):
        at = query.get(name)
        if at is None:
            continue
        if at not in ids:
            raise BadRequest(f"{name}: no item {at!r} in this list", name)
        if name == "after":
            lo = max(lo, ids.index(at) + 1)
        else:
            hi = min(hi, ids.index(at))
    data = items[lo : min(hi, lo + limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": lo + limit < hi,
    }


class ConversationsServing(ServingBase):
    store: ResponseStoreBase  # the Responses store (service/openai_responses.py)

    async def create_conversation(self, request: web.Request) -> web.Response:
        req = decode(_create, await request.read())
        items = new_items(req.items or [], "items")
        conv = {
            "id": f"conv_{uuid.uuid4().hex}",
            "object": "conversation",
            "created_at": int(time.time()),
            "metadata": req.metadata or {},
        }
        if not self.store.enabled:
            raise BadRequest("conversations are off on this server (--max-stored-responses 0)")
        try:
            kept = await self.store.put(request.get(TENANT), conv["id"], _entry(conv, items))
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", None, status=503) from e
        if not kept:
            raise BadRequest(
                "the conversation does not fit in the response store (--max-stored-response-bytes)",
                "items",
            )
        return json_response(conv)

    async def get_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        got = await load(self.store, request.get(TENANT), cid, "conversation_id")
        return json_response(_public(got.response))

    async def update_conversation(self, request: web.Request) -> web.Response:
        req = decode(_update, await request.read())
        cid = request.match_info["id"]

        def edit(record: dict[str, Any]) -> dict[str, Any]:
            record["metadata"] = req.metadata
            return record

        record = await change(self.store, request.get(TENANT), cid, "conversation_id", edit)
        return json_response(_public(record))

    async def delete_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        tenant = request.get(TENANT)
        await load(self.store, tenant, cid, "conversation_id")
        try:
            await self.store.delete(tenant, cid)
        except StoreUnavailable as e:
            raise BadRequest(f"{e}; try again", "conversation_id", status=503) from e
        return json_response({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def create_items(self, request: web.Request) -> web.Response:
        req = decode(_items, await request.read())
        cid = request.match_info["id"]
        items = new_items(req.items, "items")
        await append(self.store, request.get(TENANT), cid, items, "items")
        return json_response(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"],
                "last_id": items[-1]["id"],
                "has_more": False,
            }
        )

    async def list_items(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        got = await load(self.store, request.get(TENANT), cid, "conversation_id")
        return json_response(page(got.response["items"], request.query))

    async def get_item(self, request: web.Request) -> web.Response:
        cid, iid = request.match_info["id"], request.match_info["item_id"]
        got = await load(self.store, request.get(TENANT), cid, "conversation_id")
        for item in got.response["items"]:
            if item["id"] == iid:
                return json_response(item)
        raise BadRequest(f"item {iid!r} not found in conversation {cid!r}", "item_id", status=404)

    async def delete_item(self, request: web.Request) -> web.Response:
        cid, iid = request.match_info["id"], request.match_info["item_id"]

        def drop(record: dict[str, Any]) -> dict[str, Any]:
            kept = [i for i in record["items"] if i["id"] != iid]
            if len(kept) == len(record["items"]):
                raise BadRequest(
                    f"item {iid!r} not found in conversation {cid!r}", "item_id", status=404
                )
            record["items"] = kept
            return record

        record = await change(self.store, request.get(TENANT), cid, "conversation_id", drop)
        return json_response(_public(record))
