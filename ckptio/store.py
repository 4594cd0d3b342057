"""Checkpoints under one root URL: where they live, which are committed, deletion, orphan sweep.

A checkpoint of step ``s`` lives in the step directory ``<root>/<s>`` (the
root itself when saved without a step); it exists once
``<step dir>/ckptio.manifest.json`` does. Deletion first writes a tombstone
(``ckptio.deleting``), so no reader picks a checkpoint whose objects are
going away, then deletes the objects the manifest lists, the manifest, and
the tombstone last. The orphan sweep deletes what no committed manifest
names (crashed saves), once older than a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from ckptio.backends import Backend, open_backend
from ckptio.backends.base import join_key

from .engine import Engine, EngineConfig
from .errors import CheckpointNotFoundError, IntegrityError, ManifestError
from .layout import FanoutNaming, FlatNaming, HashedNaming, Naming
from .manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest, unseal

__all__ = ["CheckpointStore", "step_dir_of"]

log = logging.getLogger("ckptio.store")


def step_dir_of(step: int | None) -> str:
    """The step directory name (relative to the root); ``""`` for a step-less checkpoint."""
    if step is None:
        return ""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return str(step)


class CheckpointStore:
    """A root URL with its backend, engine and naming strategy."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        backend: Backend | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = os.fspath(url).rstrip("/") or "/"
        self.backend = backend if backend is not None else open_backend(self.url, **(backend_options or {}))
        self.engine = Engine(self.backend, engine_config)
        self.naming = naming or _default_naming(self.backend)

    def where(self, step_dir: str) -> str:
        """A human-readable URL of a step directory, for error messages."""
        return f"{self.url}/{step_dir}" if step_dir else self.url

    # -- finding checkpoints ---------------------------------------------

    async def is_committed(self, step_dir: str) -> bool:
        manifest, tombstone = await asyncio.gather(
            self._exists(join_key(step_dir, MANIFEST_NAME)), self._exists(join_key(step_dir, TOMBSTONE_NAME))
        )
        return manifest and not tombstone

    async def step_dirs(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending."""
        names = await self.engine.retrying(f"list {self.url}", lambda: self.backend.list_children(""))
        return sorted(int(n) for n in names if n.isdigit() and str(int(n)) == n)

    async def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present, no tombstone), ascending."""
        steps = await self.step_dirs()
        flags = await asyncio.gather(*(self.is_committed(str(s)) for s in steps))
        return [s for s, ok in zip(steps, flags) if ok]

    async def read_manifest(self, step_dir: str) -> Manifest:
        """The validated manifest of a committed checkpoint; CheckpointNotFoundError otherwise."""
        where = self.where(step_dir)
        key = join_key(step_dir, MANIFEST_NAME)
        try:
            data = await self.engine.retrying(f"read manifest of {where}", lambda: self.backend.read(key))
            try:
                unseal(data, f"{where}/{MANIFEST_NAME}")
            except (IntegrityError, ManifestError):  # corrupted in flight? one more read tells
                data = await self.engine.retrying(f"read manifest of {where}", lambda: self.backend.read(key))
        except FileNotFoundError:
            if step_dir and int(step_dir) in await self.step_dirs():
                raise CheckpointNotFoundError(
                    f"checkpoint {where} is not committed (it has no manifest): its save did not finish; "
                    "its objects will be collected by the orphan sweep"
                ) from None
            raise CheckpointNotFoundError(f"no checkpoint at {where}") from None
        if await self._exists(join_key(step_dir, TOMBSTONE_NAME)):
            raise CheckpointNotFoundError(f"checkpoint {where} is being deleted")
        return Manifest.from_json(data, f"{where}/{MANIFEST_NAME}")

    async def _exists(self, key: str) -> bool:
        try:
            await self.engine.retrying(f"stat {key!r}", lambda: self.backend.stat(key))
            return True
        except FileNotFoundError:
            return False

    async def resolve(self, step: int | None) -> str:
        """The step directory to restore: ``step``'s, or the newest committed one.

        With no step, a checkpoint saved directly at the root wins; else the
        newest committed step. CheckpointNotFoundError names the URL.
        """
        if step is not None:
            return step_dir_of(step)
        if await self.is_committed(""):
            return ""
        steps = await self.committed_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.url}")
        return str(steps[-1])

    # -- commit ----------------------------------------------------------

    async def commit(self, step_dir: str, manifest: Manifest) -> None:
        """Write the manifest once, atomically; FileExistsError if the checkpoint exists."""
        data = manifest.to_json()
        key = join_key(step_dir, MANIFEST_NAME)
        try:
            await self.engine.retrying(
                f"commit {self.where(step_dir)}", lambda: self.backend.create_if_absent(key, data)
            )
        except FileExistsError:
            # A retried create may meet its own first attempt, which won but lost its reply:
            # the manifest is unique to this save (id, time), so equal bytes mean we won.
            try:
                if await self.backend.read(key) == data:
                    return
            except FileNotFoundError:
                pass
            raise FileExistsError(f"checkpoint {self.where(step_dir)} is already committed") from None

    # -- deletion --------------------------------------------------------

    async def delete(self, step_dir: str) -> None:
        """Delete a checkpoint: tombstone, objects, manifest, tombstone (crash-safe order)."""
        where = self.where(step_dir)
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        try:
            await self.engine.retrying(f"tombstone {where}", lambda: self.backend.create_if_absent(tomb, b""))
        except FileExistsError:
            pass  # an earlier deletion was interrupted: finish it
        try:
            key = join_key(step_dir, MANIFEST_NAME)
            data = await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key))
            manifest = Manifest.from_json(data, where)
            keys = list(manifest.objects)
        except FileNotFoundError:
            keys = []
        except (ManifestError, IntegrityError) as e:
            log.warning("deleting %s: its manifest is unreadable (%s); leaving its objects to the sweep", where, e)
            keys = []
        await self._delete_keys(keys)
        await self._delete_keys([join_key(step_dir, MANIFEST_NAME)])
        if step_dir and not self.backend.capabilities.hashed_names:
            # Flat layout: whatever else is in the step directory belongs to it (crashed retries).
            await self._delete_keys(
                [i.key for i in await self.engine.retrying("list", lambda: self.backend.list(step_dir + "/"))
                 if i.key != tomb]
            )
        await self._delete_keys([tomb])
        log.info("deleted checkpoint %s (%d objects)", where, len(keys))

    async def _delete_keys(self, keys: Iterable[str]) -> None:
        sem = asyncio.Semaphore(self.engine.concurrency * 2)

        async def one(key: str) -> None:
            async with sem:
                try:
                    await self.engine.retrying(f"delete {key!r}", lambda: self.backend.delete(key))
                except FileNotFoundError:
                    pass

        await asyncio.gather(*(one(k) for k in keys))

    async def sweep(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """Delete objects that no committed manifest names and that are older than the grace period.

        Also finishes interrupted deletions (tombstoned checkpoints) and removes the temporary
        files of writes that were killed (:meth:`Backend.sweep_temporaries`). Returns the keys
        and temporary names deleted (or that would be, with ``dry_run``).
        """
        now = time.time()
        # First: a directory holding only a dead write's temporary can then go with its objects.
        temporaries = await self.engine.retrying(
            f"sweep temporaries of {self.url}",
            lambda: self.backend.sweep_temporaries(grace_seconds, dry_run=dry_run),
        )
        keep: set[str] = set()
        for step in await self.committed_steps():
            m = await self.read_manifest(str(step))
            keep.update(m.objects)
            keep.add(join_key(str(step), MANIFEST_NAME))
        if await self.is_committed(""):
            m = await self.read_manifest("")
            keep.update(m.objects)
            keep.add(MANIFEST_NAME)
        tombstoned = [s for s in await self.step_dirs() if await self._exists(join_key(str(s), TOMBSTONE_NAME))]
        if not dry_run:
            for s in tombstoned:
                await self.delete(str(s))
        doomed = [
            info.key
            for info in await self.engine.retrying(f"list {self.url}", lambda: self.backend.list(""))
            if info.key not in keep and now - info.mtime >= grace_seconds and not _foreign(info.key)
        ]
        if not dry_run:
            await self._delete_keys(doomed)
        return doomed + temporaries

    async def close(self) -> None:
        self.engine.close()
        await self.backend.close()


def _default_naming(backend: Backend) -> Naming:
    caps = backend.capabilities
    if caps.hashed_names:
        return HashedNaming()
    if caps.dir_fanout > 0:
        return FanoutNaming(caps.dir_fanout)
    return FlatNaming()


def _foreign(key: str) -> bool:
    """Keys that another tool owns under the same root (Orbax metadata, DCP files): never swept."""
    first = key.split("/", 1)[0]
    if first.isdigit() or (first.startswith("h") and all(c in "0123456789abcdef" for c in first[1:])):
        return False
    return True
