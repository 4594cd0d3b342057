"""The write transaction: the one way any writer saves a step into a store.

Native saves, streamed writes and converters, DCP's writer, the tiers' durable round and ``cp``
all run the same protocol, here and nowhere else::

    tx = store.begin_save(step_dir, covers=...)   # prepare the step, announce the intent, heartbeat
    ...write objects...                           # spared by every deleter while the intent is live
    await tx.vouch(sizes)                         # optional: this writer's objects are all there
    tx.commit(manifest)                           # the manifest, last, fenced (one writer of the step)
    tx.end(ok=True)                               # retire the intent; ok=False: mark it dead at once

As a context manager (``with`` / ``async with``) it ends when the block does: retired if the
block finished, marked dead if it raised. A writer whose step is committed by another (a
host of a multi-host save, whose coordinator commits) ends with the job's verdict.

A writer announces before its first object so that gc and retention can tell "slow" from
"crashed": an intent whose heartbeat is younger than its lease protects every object of the save
ids it covers, whatever their age. A failed writer's intent is marked dead at once (a zero
lease), so deleters and a retry of the step need not wait the lease out; a writer that dies
stops beating and its intent goes stale by itself. A paused writer that wakes after its lease is
not trusted: its commit is fenced (:mod:`ckptio.store.fence`) and rolls back if a deleter revoked it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from typing import Any, Protocol

from ckptio.engine import run_sync
from ckptio.manifest.model import Manifest
from ckptio.manifest.names import new_id

__all__ = ["WriteTransaction", "new_id"]

log = logging.getLogger("ckptio.intents")


class _Store(Protocol):
    """What a transaction needs of its store (:class:`~ckptio.store.facade.CheckpointStore`)."""

    lease_s: float

    def where(self, step_dir: str) -> str: ...
    async def prepare_save(self, step_dir: str) -> bool: ...
    async def announce(self, step_dir: str, save_id: str, host: int, lease_s: float, covers: Iterable[str]) -> None: ...
    async def retire(self, step_dir: str, save_id: str) -> None: ...
    async def object_sizes(self, keys: Iterable[str]) -> dict[str, int]: ...
    async def commit(self, step_dir: str, manifest: Manifest, data: bytes | None = None) -> None: ...
    async def close(self) -> None: ...


class WriteTransaction:
    """One writer's save of one step: begun (announced), then committed and/or ended exactly once.

    Built by :meth:`CheckpointStore.begin_save <ckptio.store.facade.CheckpointStore.begin_save>`
    (begun on the calling thread, heartbeat from a thread) or :meth:`~CheckpointStore.begin_save_async`
    (begun on the IO loop, heartbeat from a task). ``covers``: further save ids whose objects this
    writer produces or keeps (a copy keeps the source's object names; a DCP save's ranks share one id).
    """

    def __init__(self, store: _Store, step_dir: str, save_id: str | None = None, *, host: int = 0,
                 covers: Iterable[str] = ()) -> None:
        self.store = store
        self.step_dir = step_dir
        self.save_id = save_id or new_id()
        self.host = host
        self.covers = sorted(set(covers))
        self.lease_s = store.lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Future[None] | None = None
        self._ended = False

    # -- begin --------------------------------------------------------------------------------

    def begin(self, *, prepare: bool = True) -> WriteTransaction:
        """Prepare the step (finish an interrupted deletion, refuse a committed step, settle a dead
        save's commit: :meth:`~ckptio.store.facade.CheckpointStore.prepare_save`), then announce the
        intent and keep it fresh from a thread. Raises if either refuses: nothing was written yet."""
        if prepare:
            run_sync(self.store.prepare_save(self.step_dir))
        run_sync(self._announce())
        self._thread = threading.Thread(target=self._beat, name=f"ckptio-lease-{self.save_id}", daemon=True)
        self._thread.start()
        return self

    async def begin_async(self, *, prepare: bool = True) -> WriteTransaction:
        """:meth:`begin` for code running on the IO loop: the heartbeat is a task of that loop."""
        if prepare:
            await self.store.prepare_save(self.step_dir)
        await self._announce()
        self._task = asyncio.ensure_future(self._beat_async())
        return self

    def cover(self, save_ids: Iterable[str]) -> None:
        """Cover ``save_ids`` too from now on: announced at once, then by every beat."""
        self.covers = sorted(set(self.covers) | set(save_ids))
        run_sync(self._announce())

    async def _announce(self, lease_s: float | None = None) -> None:
        await self.store.announce(self.step_dir, self.save_id, self.host,
                                  self.lease_s if lease_s is None else lease_s, self.covers)

    def _beat(self) -> None:
        # Four beats per lease: a beat or two may fail (throttling) before anyone may judge us dead.
        while not self._stop.wait(self.lease_s / 4):
            try:
                run_sync(self._announce())
            except Exception as e:  # noqa: BLE001 -- a missed beat is logged; the next one may work
                self._missed(e)

    async def _beat_async(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            try:
                await self._announce()
            except Exception as e:  # noqa: BLE001 -- the next beat may work
                self._missed(e)

    def _missed(self, e: BaseException) -> None:
        log.warning("%s: heartbeat of save %s failed: %r", self.store.where(self.step_dir), self.save_id, e)

    # -- write, commit ------------------------------------------------------------------------

    async def vouch(self, sizes: dict[str, int]) -> None:
        """FileNotFoundError unless this writer's objects (by key, their least length) are all there:
        where the committer sees only a summary (a fragment, a record), each writer vouches for its own."""
        have = await self.store.object_sizes(sizes)
        for key, size in sizes.items():
            if have.get(key, -1) < size:
                raise FileNotFoundError(f"{self.store.where(self.step_dir)}: object {key!r} is missing or short "
                                        "after its write")

    async def commit_async(self, manifest: Manifest, data: bytes | None = None) -> None:
        """Commit the step: its manifest, created once, atomically, after its objects, fenced."""
        await self.store.commit(self.step_dir, manifest, data)

    def commit(self, manifest: Manifest, data: bytes | None = None) -> None:
        """:meth:`commit_async` from a thread outside the IO loop."""
        run_sync(self.commit_async(manifest, data))

    # -- end ----------------------------------------------------------------------------------

    def end(self, *, ok: bool) -> None:
        """Stop beating; ``ok``: retire the intent (the manifest now protects the objects); else mark it
        dead at once (a zero lease: its objects are a dead attempt's). Never raises; again: nothing."""
        if self._ended:
            return
        self._ended = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        run_sync(self._end_intent(ok))

    async def end_async(self, *, ok: bool) -> None:
        """:meth:`end` on the IO loop."""
        if self._ended:
            return
        self._ended = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._end_intent(ok)

    async def _end_intent(self, ok: bool) -> None:
        try:
            if ok:
                await self.store.retire(self.step_dir, self.save_id)
            else:
                await self._announce(lease_s=0.0)
        except Exception as e:  # noqa: BLE001 -- a leftover intent goes stale and is collected by gc
            log.warning("%s: could not end intent of save %s: %r", self.store.where(self.step_dir), self.save_id, e)

    def __enter__(self) -> WriteTransaction:
        return self

    def __exit__(self, exc_type: object, *rest: Any) -> None:
        self.end(ok=exc_type is None)

    async def __aenter__(self) -> WriteTransaction:
        return self

    async def __aexit__(self, exc_type: object, *rest: Any) -> None:
        await self.end_async(ok=exc_type is None)
