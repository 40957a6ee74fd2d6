"""Background responses (`background: true` on /v1/responses): the response is stored
`queued` and the request answered at once with it (streamed: its events, as any stream's);
the turn runs on as its own task whoever reads it, and its final state (completed,
incomplete, failed, or cancelled) replaces the stored one.  Clients poll
`GET /v1/responses/{id}`, pick a stream up again by sequence number, and may
`POST /v1/responses/{id}/cancel`.

Every write after the first is over the version this replica wrote last
(`put(expect=...)`), so a cancel wins against a turn finishing at the same moment on
any replica: a cancel that reaches another replica than the one running the turn marks
the stored response `cancelled`, and the running replica, which reads it back twice a
second while the store is shared (Redis), stops the turn.  The turn holds its queue slot,
its request id and SIGTERM's drain until it ends, as a resumable stream does."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from service.response_store import ResponseStoreBase, StoreConflict, Stored, StoreUnavailable

log = logging.getLogger(__name__)

TERMINAL = ("completed", "incomplete", "failed", "cancelled")
WATCH_INTERVAL_S = 0.5
# In a shared store the running replica's heartbeat says the turn is still running: a
# reader that finds a turn unfinished with no heartbeat (its replica crashed or was
# killed) settles it failed, so a client polling it is not left waiting forever.
HEARTBEAT_S = 5.0
HEARTBEAT_TTL_S = 20.0
LOST = {"code": "server_error", "message": "the replica running this response stopped first"}


class _Turn(Protocol):
    tenant: str | None
    ended: bool  # its end was reached (and stored, if it could be)

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]: ...

    async def full(self) -> dict[str, Any]: ...

    async def store_final(self, resp: dict[str, Any]) -> None: ...


class BackgroundResponses:
    def __init__(self) -> None:
        self.tasks: dict[tuple[str | None, str], asyncio.Task[None]] = {}

    def start(
        self,
        store: ResponseStoreBase,
        rid: str,
        turn: _Turn,
        on_exit: Callable[[], None],
        busy: tuple[Callable[[], None], Callable[[], None]] | None,
    ) -> None:
        """Run `turn` to its end as its own task; `on_exit` releases what it holds."""

        async def run() -> None:
            try:
                await turn.full()
            except asyncio.CancelledError:
                await _settle(turn, "cancelled", None)
            except Exception as e:  # the engine failed it: stored as failed, not lost
                log.warning("background response %s failed: %s", rid, e)
                await _settle(turn, "failed", {"code": "server_error", "message": str(e)})
            finally:
                on_exit()
                if busy is not None:
                    busy[1]()

        if busy is not None:
            busy[0]()
        self.adopt(store, rid, turn, asyncio.create_task(run(), name=f"background-{rid}"))

    def adopt(self, store: ResponseStoreBase, rid: str, turn: _Turn, task: Any) -> None:
        """`task` runs `turn`: a cancel finds it here, and while the store is shared
        a watcher stops it when another replica marks it cancelled."""
        key = (turn.tenant, rid)
        self.tasks[key] = task
        watcher = (
            asyncio.create_task(self._watch(store, rid, turn, task))
            if getattr(store, "shared", False)
            else None
        )

        def done(_: Any) -> None:
            if self.tasks.get(key) is task:
                del self.tasks[key]
            if watcher is not None:
                watcher.cancel()

        task.add_done_callback(done)

    async def _watch(self, store: ResponseStoreBase, rid: str, turn: _Turn, task: Any) -> None:
        """Stop the turn when another replica marked it cancelled; keep its heartbeat."""
        beat = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            with contextlib.suppress(StoreUnavailable):
                if asyncio.get_running_loop().time() - beat >= HEARTBEAT_S:
                    beat = asyncio.get_running_loop().time()
                    await store.beat(turn.tenant, rid, HEARTBEAT_TTL_S)
                got = await store.peek(turn.tenant, rid)
                # (the status, not the version: this replica's own final write moves it)
                if got is not None and got.get("status") == "cancelled":
                    task.cancel()
                    return

    async def cancel(
        self,
        store: ResponseStoreBase,
        tenant: str | None,
        rid: str,
        item: Stored,
        load: Callable[[], Awaitable[Stored | None]],
    ) -> dict[str, Any]:
        """Cancel a background response: here when this replica runs it, else by marking
        the stored one (its replica stops it).  A finished one is returned as it is."""
        for _ in range(8):
            if item.response["status"] in TERMINAL:
                return item.response
            task = self.tasks.get((tenant, rid))
            if task is not None:
                task.cancel()
                await asyncio.wait([task])  # it stores itself cancelled as it ends
            else:
                resp = {**item.response, "status": "cancelled"}
                try:
                    await store.put(
                        tenant, rid, dataclasses.replace(item, response=resp),
                        expect=item.version,
                    )  # fmt: skip
                    return resp
                except StoreConflict:
                    pass  # it finished (or was cancelled) meanwhile: read it again
            got = await load()
            if got is None:
                break
            item = got
        return item.response


async def orphan_checked(
    store: ResponseStoreBase, tenant: str | None, rid: str, item: Stored
) -> Stored:
    """`item` as read, unless it is a background turn left unfinished by a replica
    that no longer beats for it: then stored (and returned) failed."""
    resp = item.response
    if not (store.shared and resp.get("background") and resp["status"] not in TERMINAL):
        return item
    if await store.alive(tenant, rid):
        return item
    failed = {**resp, "status": "failed", "error": LOST}
    done = dataclasses.replace(item, response=failed)
    with contextlib.suppress(StoreConflict):  # it moved meanwhile: read as it is now
        await store.put(tenant, rid, done, expect=item.version)
        return done
    got = await store.get(tenant, rid)
    return got if got is not None else item


async def settled(turn: _Turn, produce: Awaitable[Any]) -> Any:
    """A background turn's stream: stored cancelled when cancelled, failed when it ended
    without storing its end (its stream carried the error)."""
    try:
        result = await produce
    except asyncio.CancelledError:
        await _settle(turn, "cancelled", None)
        raise
    if not turn.ended:
        await _settle(turn, "failed", {"code": "server_error", "message": "generation failed"})
    return result


async def _settle(turn: _Turn, status: str, error: dict[str, Any] | None) -> None:
    resp = turn.response(status, [])
    resp["error"] = error
    with contextlib.suppress(Exception):
        await turn.store_final(resp)
