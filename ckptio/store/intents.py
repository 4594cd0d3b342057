"""A save's intent, announced before its first object and kept fresh while it is in flight.

Whatever deletes (gc, retention, a re-save's cleanup) spares every object of
a save whose intent is live -- heartbeat younger than its lease -- whatever
the objects' age; so a slow save is never mistaken for a crashed one. A save
that dies stops beating: its intent goes stale after the lease and its
objects become orphans that gc (and the deletion of that step) remove.

:class:`Intents` reads and writes intents (``<step>/ckptio.intent.<save id>``);
:class:`Lease` (a thread) and :func:`async_lease` (a task) keep one fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, Protocol

from ckptio.backends.base import ObjectInfo, join_key
from ckptio.engine import run_sync
from ckptio.manifest.names import INTENT_PREFIX, intent_key, new_id, parse_intent
from ckptio.store.context import StoreContext
from ckptio.store.options import DEFAULT_LEASE_S

__all__ = ["Announcer", "Intents", "Lease", "async_lease", "new_id"]

log = logging.getLogger("ckptio.intents")


class Intents:
    """The intents of one store."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx

    async def announce(
        self, step_dir: str, save_id: str, host: int = 0, lease_s: float = DEFAULT_LEASE_S,
        covers: Iterable[str] = (),
    ) -> None:
        """Write (or refresh) a save's intent: from now on its objects are spared by every deleter.

        ``covers``: further save ids whose objects this writer produces or keeps (a copy keeps
        the source's object names; a DCP save's ranks share one id).
        """
        doc = {"save_id": save_id, "step": int(step_dir) if step_dir else None, "host": host,
               "lease_s": lease_s, "heartbeat": time.time(), "covers": sorted(set(covers))}
        await self.ctx.io.write(intent_key(step_dir, save_id), [memoryview(json.dumps(doc).encode())])

    async def retire(self, step_dir: str, save_id: str) -> None:
        """Remove a save's intent (after its commit, or its failure)."""
        await self.ctx.delete_keys([intent_key(step_dir, save_id)])

    async def live_saves(self, step_dir: str, listing: list[ObjectInfo] | None = None) -> set[str]:
        """Save ids with a live intent in ``step_dir`` (heartbeat younger than its lease).

        ``listing``: the step's intents as already listed (others in it are ignored).
        """
        if listing is None:
            listing = await self.ctx.io.list(join_key(step_dir, INTENT_PREFIX))
        live: set[str] = set()
        for info in listing:
            name = parse_intent(info.key)
            if name is not None and name.step_dir == step_dir:
                live |= await self._intent_covers(info, name.save_id)
        return live

    async def others_than(self, step_dir: str, writers: set[str]) -> bool:
        """True if intents of saves other than ``writers`` remain in ``step_dir`` (live or not)."""
        listed = await self.ctx.io.list(join_key(step_dir, INTENT_PREFIX))
        return any((n := parse_intent(i.key)) is not None and n.save_id not in writers for i in listed)

    async def _intent_covers(self, info: ObjectInfo, save_id: str) -> set[str]:
        """The save ids a live intent protects (none once its heartbeat is older than its lease).

        An intent retired while we look protects its ids this round (its save just committed);
        an unreadable one protects at least its own id.
        """
        try:
            doc = json.loads(await self.ctx.io.read(info.key))
            lease = float(doc.get("lease_s", DEFAULT_LEASE_S))
            covers = {save_id, *(c for c in doc.get("covers", []) if isinstance(c, str))}
            if doc.get("hold"):  # for older ckptio only (ckptio.store.pins): pins decide here
                return set()
        except FileNotFoundError:
            return {save_id}
        except (ValueError, TypeError, AttributeError):
            lease, covers = DEFAULT_LEASE_S, {save_id}
        return covers if time.time() - info.mtime < lease else set()


class Announcer(Protocol):
    """What a lease needs of a store (:class:`~ckptio.store.CheckpointStore` is one)."""

    lease_s: float

    def where(self, step_dir: str) -> str: ...

    async def announce(
        self, step_dir: str, save_id: str, host: int = 0, lease_s: float = DEFAULT_LEASE_S,
        covers: Iterable[str] = (),
    ) -> None: ...

    async def retire(self, step_dir: str, save_id: str) -> None: ...


class Lease:
    """One save's intent: :meth:`start` announces it, a daemon thread refreshes it, :meth:`close` ends it."""

    def __init__(
        self, store: Announcer, step_dir: str, save_id: str, host: int = 0, covers: Iterable[str] = ()
    ) -> None:
        self.store = store
        self.step_dir = step_dir
        self.save_id = save_id
        self.host = host
        self.covers = sorted(set(covers))
        self.lease_s = store.lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> Lease:
        """Announce the save (raises if the storage refuses: nothing has been written yet)."""
        run_sync(self._announce())
        self._thread = threading.Thread(target=self._beat, name=f"ckptio-lease-{self.save_id}", daemon=True)
        self._thread.start()
        return self

    def cover(self, save_ids: Iterable[str]) -> None:
        """Cover ``save_ids`` too from now on: announced at once, then by every beat."""
        self.covers = sorted(set(self.covers) | set(save_ids))
        run_sync(self._announce())

    def _announce(self) -> Coroutine[Any, Any, None]:
        return self.store.announce(self.step_dir, self.save_id, self.host, self.lease_s, self.covers)

    def _beat(self) -> None:
        # Four beats per lease: a beat or two may fail (throttling) before anyone may judge us dead.
        while not self._stop.wait(self.lease_s / 4):
            try:
                run_sync(self._announce())
            except Exception as e:  # noqa: BLE001 -- a missed beat is logged; the next one may work
                log.warning("%s: heartbeat of save %s failed: %r", self.store.where(self.step_dir), self.save_id, e)

    def close(self, *, retire: bool) -> None:
        """Stop beating; with ``retire`` remove the intent (after a commit, the manifest protects the objects).

        A failed save keeps its intent, which goes stale: it tells deleters
        of that step that a dead attempt left objects behind. Closing again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        run_sync(_end_intent(self.store, self.step_dir, self.save_id, self.host, self.covers, retire=retire))

    def __enter__(self) -> Lease:
        return self.start()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close(retire=exc_type is None)


@contextlib.asynccontextmanager
async def async_lease(
    store: Announcer, step_dir: str, save_id: str, host: int = 0, covers: Iterable[str] = ()
) -> AsyncIterator[None]:
    """:class:`Lease` for code running on the IO loop: announce, beat from a task, retire on success."""
    lease_s = store.lease_s
    ids = sorted(set(covers))
    await store.announce(step_dir, save_id, host, lease_s, ids)

    async def beat() -> None:
        while True:
            await asyncio.sleep(lease_s / 4)
            try:
                await store.announce(step_dir, save_id, host, lease_s, ids)
            except Exception as e:  # noqa: BLE001 -- the next beat may work
                log.warning("%s: heartbeat of %s failed: %r", store.where(step_dir), save_id, e)

    task = asyncio.ensure_future(beat())
    ok = False
    try:
        yield
        ok = True
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _end_intent(store, step_dir, save_id, host, ids, retire=ok)


async def _end_intent(
    store: Announcer, step_dir: str, save_id: str, host: int, covers: list[str], *, retire: bool
) -> None:
    """Retire an intent (its save committed), or mark it dead at once with a zero lease (its save
    failed: deleters need not wait a lease to treat its objects as a dead attempt's). Never raises."""
    try:
        if retire:
            await store.retire(step_dir, save_id)
        else:
            await store.announce(step_dir, save_id, host, 0.0, covers)
    except Exception as e:  # noqa: BLE001 -- a leftover intent goes stale and is collected by gc
        log.warning("%s: could not end intent of save %s: %r", store.where(step_dir), save_id, e)
