"""The store of one root URL: a façade over its services, built from one :class:`StoreOptions`.

Each concern has its module: :mod:`~ckptio.store.catalog` (which steps exist and
count), :mod:`~ckptio.store.manifests` (reading them, checked and cached),
:mod:`~ckptio.store.objects` (are a manifest's objects there),
:mod:`~ckptio.store.intents` (saves in flight), :mod:`~ckptio.store.commit`,
:mod:`~ckptio.store.deletion` and :mod:`~ckptio.store.gc`; fencing is
:mod:`ckptio.store.fence`. This class only composes them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Iterable
from typing import Any

from ckptio.backends import Backend
from ckptio.backends.base import ObjectInfo
from ckptio.engine import Engine, EngineConfig
from ckptio.engine.layout import Naming
from ckptio.manifest import Manifest
from ckptio.store.catalog import Catalog, StepStatus
from ckptio.store.commit import Commits
from ckptio.store.context import StoreContext
from ckptio.store.deletion import Deletion
from ckptio.store.fence import Fences
from ckptio.store.gc import Collector, SweepReport
from ckptio.store.intents import Intents
from ckptio.store.manifests import Manifests
from ckptio.store.objects import Objects
from ckptio.store.options import DEFAULT_LEASE_S, StoreOptions
from ckptio.store.parts import Parts
from ckptio.store.resave import Resaves
from ckptio.store.transaction import WriteTransaction

__all__ = ["CheckpointStore"]


class CheckpointStore:
    """A root URL with its backend, engine and naming strategy (see :class:`StoreOptions`).

    ``CheckpointStore(url, backend=..., ...)`` or ``CheckpointStore(StoreOptions(...))``.
    A variant (a host-local tier, another root) is a new store: :meth:`derive`, :meth:`sibling`.
    Each method's full contract is documented on its service (``store.catalog``, ``.manifests``,
    ``.objects``, ``.intents``, ``.commits``, ``.deletion``, ``.gc``; fences: ``.fences``).
    """

    def __init__(
        self, url: str | os.PathLike[str] | StoreOptions, *, backend: Backend | None = None,
        engine_config: EngineConfig | None = None, naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None, host_local: bool = False, engine: Engine | None = None,
    ) -> None:
        if isinstance(url, StoreOptions):
            self.options = url
        else:
            self.options = StoreOptions(os.fspath(url), backend, engine_config, naming, backend_options,
                                        host_local, engine)
        ctx = self._ctx = StoreContext(self.options)
        self.fences = Fences(ctx.io, ctx.concurrency)
        manifests = self.manifests = Manifests(ctx, self.fences)
        objects = self.objects = Objects(ctx)
        intents = self.intents = Intents(ctx)
        self.parts = Parts(ctx, self.fences)
        deletion = self.deletion = Deletion(ctx, manifests, intents, self.fences, self.parts)
        self.catalog = Catalog(ctx, manifests, objects, intents, self.parts)
        self.commits = Commits(ctx, manifests, objects, self.fences, deletion)
        self.gc = Collector(ctx, manifests, intents, self.fences, deletion)
        self.resaves = Resaves(ctx, manifests, intents, self.commits, self.gc)

    # -- what the store is built from ---------------------------------------

    url = property(lambda self: self._ctx.url, doc="The root URL (no trailing slash).")
    engine = property(lambda self: self._ctx.engine, doc="The engine that moves this store's data.")
    naming = property(lambda self: self._ctx.naming, doc="How this store names a save's objects.")
    reopenable = property(lambda self: self._ctx.reopenable, doc="Opened from its URL: another process can.")
    backend_options = property(lambda self: self._ctx.backend_options, doc="The options the backend opens with.")
    host_local = property(lambda self: self._ctx.host_local, doc="Each host sees only its own objects here.")

    @property
    def backend(self) -> Backend:
        """The backend as opened (or handed in); the store's own calls go through it, retried."""
        return self._ctx.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._ctx.backend = backend

    @property
    def io(self) -> Backend:
        """The backend with each call retried (RetryableError, the engine's policy): what callers
        outside the engine use, so that no call is wrapped in a retry loop of its own."""
        return self._ctx.io

    @property
    def lease_s(self) -> float:
        """How long this store's saves' intents stay live without a heartbeat."""
        return self._ctx.lease_s

    @lease_s.setter
    def lease_s(self, seconds: float) -> None:
        self._ctx.lease_s = float(seconds)

    def derive(self, **changes: Any) -> CheckpointStore:
        """A new store from these options with ``changes`` (``dataclasses.replace``); it opens its own backend
        unless ``backend`` is among the options."""
        return CheckpointStore(dataclasses.replace(self.options, **changes))

    def sibling(self, url: str | os.PathLike[str]) -> CheckpointStore:
        """A store of another root opened with this store's backend options (nothing else carried)."""
        return CheckpointStore(StoreOptions(os.fspath(url), backend_options=self.options.backend_options or None))

    def where(self, step_dir: str) -> str:
        """A human-readable URL of a step directory, for error messages."""
        return self._ctx.where(step_dir)

    async def exists(self, key: str) -> bool:
        """True if ``key`` exists under the root (a stat, retried)."""
        return await self._ctx.exists(key)

    async def delete_keys(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` as they are (a bounded number at a time; a key already gone is fine).

        No ownership check: the caller proves each key is its own to delete (see :meth:`delete`).
        """
        await self._ctx.delete_keys(keys)

    # -- finding checkpoints (ckptio.store.catalog) -----------------------------

    async def is_committed(self, step_dir: str) -> bool:
        """A manifest is present and no deletion is under way (the manifest is not validated)."""
        return await self.catalog.is_committed(step_dir)

    async def step_dirs(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending."""
        return await self.catalog.step_dirs()

    async def committed_steps(self) -> list[int]:
        """Steps with a manifest and no tombstone, ascending: two stats a step (:mod:`~ckptio.store.catalog`)."""
        return await self.catalog.committed_steps()

    async def standing_steps(self) -> list[int]:
        """Steps whose commit stands (fences read), ascending; a damaged manifest still counts."""
        return await self.catalog.standing_steps()

    async def status(self, step_dir: str) -> StepStatus:
        """What ``step_dir`` holds (see :class:`StepStatus`); never raises for a bad manifest."""
        return await self.catalog.status(step_dir, self)

    async def intact_steps(
        self, newest: int | None = None, among: Iterable[int] | None = None, *, whole: bool = False
    ) -> list[int]:
        """Committed steps whose manifest validates, ascending; damaged ones are logged and left out."""
        return sorted(await self.catalog.intact_roots(newest, among, whole=whole))

    async def intact_roots(
        self, newest: int | None = None, among: Iterable[int] | None = None, *, whole: bool = False
    ) -> dict[int, Manifest]:
        """:meth:`intact_steps`, each with its validated root manifest (format 2: no fragment read)."""
        return await self.catalog.intact_roots(newest, among, whole=whole)

    async def resolve(self, step: int | None) -> str:
        """The step directory to restore: ``step``'s, or the newest intact committed one.

        With no step, a checkpoint saved directly at the root wins; else the
        newest committed step whose manifest validates (a damaged newer one is
        logged by name and skipped). CheckpointNotFoundError names the URL.
        """
        return (await self.catalog.resolve_manifest(step, shards=False))[0]

    async def resolve_manifest(
        self, step: int | None, skip: Iterable[int] = (), *, shards: bool = True
    ) -> tuple[str, Manifest]:
        """The step directory to restore (``step``'s, or the latest) and its manifest."""
        return await self.catalog.resolve_manifest(step, skip, shards=shards)

    # -- manifests and objects (ckptio.store.manifests, .objects) ------------------

    async def read_manifest(self, step_dir: str, *, shards: bool = True) -> Manifest:
        """The validated manifest of a committed checkpoint (fragments loaded unless ``shards=False``)."""
        return await self.manifests.read_manifest(step_dir, shards=shards)

    async def load_fragments(self, step_dir: str, root: Manifest, wanted: Any) -> Manifest:
        """A format-2 root with the shards that meet ``wanted`` (item -> boxes; None: all) loaded."""
        return await self.manifests.load_fragments(step_dir, root, wanted)

    async def load_fragment_numbers(self, step_dir: str, root: Manifest, numbers: list[int],
                                    names: Collection[str] | None = None) -> Manifest:
        """A format-2 root with the shards of its fragments ``numbers`` (items ``names``) loaded."""
        return await self.manifests.load_fragment_numbers(step_dir, root, numbers, names)

    async def object_sizes(self, keys: Iterable[str]) -> dict[str, int]:
        """Sizes of ``keys`` that exist (absent ones are left out): a listing per directory."""
        return await self.objects.object_sizes(keys)

    async def check_whole(self, step_dir: str, manifest: Manifest) -> None:
        """IntegrityError unless every key ``manifest`` names is there with its size (listings, no reads)."""
        await self.objects.check_whole(step_dir, manifest)

    async def check_objects(self, manifest: Manifest, where: str, listed: dict[str, dict[str, int]] | None = None
                            ) -> None:
        """FileNotFoundError unless every object ``manifest`` names exists, at least as long as its extents need
        (``listed``: listings kept between calls, see :meth:`~ckptio.store.objects.Objects.object_sizes`)."""
        await self.objects.check_objects(manifest, where, listed)

    # -- saves in flight (ckptio.store.intents) ---------------------------------------

    async def announce(
        self, step_dir: str, save_id: str, host: int = 0, lease_s: float = DEFAULT_LEASE_S,
        covers: Iterable[str] = (),
    ) -> None:
        """Write (or refresh) a save's intent: from now on its objects are spared by every deleter.

        ``covers``: further save ids whose objects this writer produces or keeps (a copy keeps
        the source's object names; a DCP save's ranks share one id).
        """
        await self.intents.announce(step_dir, save_id, host, lease_s, covers)

    async def retire(self, step_dir: str, save_id: str) -> None:
        """Remove a save's intent (after its commit, or its failure)."""
        await self.intents.retire(step_dir, save_id)

    def begin_save(self, step_dir: str, save_id: str | None = None, *, host: int = 0, covers: Iterable[str] = (),
                   prepare: bool = True) -> WriteTransaction:
        """A write transaction of ``step_dir``, begun: the step prepared (unless ``prepare=False``), the
        intent announced and kept fresh from a thread (:mod:`ckptio.store.transaction`)."""
        return WriteTransaction(self, step_dir, save_id, host=host, covers=covers).begin(prepare=prepare)

    async def begin_save_async(self, step_dir: str, save_id: str | None = None, *, host: int = 0,
                               covers: Iterable[str] = (), prepare: bool = True) -> WriteTransaction:
        """:meth:`begin_save` on the IO loop (the heartbeat is a task of it)."""
        return await WriteTransaction(self, step_dir, save_id, host=host, covers=covers).begin_async(prepare=prepare)

    async def live_saves(self, step_dir: str, listing: list[ObjectInfo] | None = None) -> set[str]:
        """Save ids with a live intent in ``step_dir`` (heartbeat younger than its lease)."""
        return await self.intents.live_saves(step_dir, listing)

    # -- commit, deletion, sweep (ckptio.store.commit, .deletion, .gc) -----------------

    async def commit(self, step_dir: str, manifest: Manifest, data: bytes | None = None) -> None:
        """Write the manifest once, atomically, after checking its objects; fenced (:mod:`ckptio.store.fence`)."""
        await self.commits.commit(step_dir, manifest, data)

    async def prepare_save(self, step_dir: str, *, defer: bool = False) -> bool:
        """Before a save of ``step_dir``: finish an interrupted deletion there; refuse a committed step;
        settle a dead save's unconfirmed commit (as gc). A commit whose save may be alive raises
        StepBusyError, or with ``defer`` returns True: commit only after :meth:`wait_step_free`
        (:mod:`ckptio.store.resave`)."""
        return await self.resaves.prepare(step_dir, defer=defer)

    async def step_is_clear(self, step_dir: str) -> bool:
        """True if ``step_dir`` holds neither a tombstone nor a manifest: :meth:`prepare_save` has
        nothing to do there (both looked up at once)."""
        return await self.commits.step_is_clear(step_dir)

    async def wait_step_free(self, step_dir: str, deadline: float) -> None:
        """Wait until no unconfirmed commit is in the way of committing ``step_dir`` (settling a dead
        one), until ``deadline`` (``time.time()``): FileExistsError if it committed, else StepBusyError."""
        await self.resaves.wait_free(step_dir, deadline)

    async def commit_stands(self, step_dir: str) -> bool:
        """True if ``step_dir`` holds a commit that stands (an unconfirmed one does not)."""
        return await self.resaves.commit_stands(step_dir)

    async def delete(self, step_dir: str) -> None:
        """Delete a checkpoint: tombstone, objects, dead attempts, manifest, tombstone (crash-safe order).

        Deletes only keys of ``step_dir``'s own layout that :mod:`ckptio.manifest.names` (or this
        store's naming) proves are ckptio's, never an object of a live save, and never
        anything a manifest lists outside the step (a copied step directory).
        """
        await self.deletion.delete(step_dir)

    async def sweep(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> SweepReport:
        """Delete what crashed saves left: ckptio's objects that no manifest that counts names."""
        return await self.gc.sweep(grace_seconds, dry_run=dry_run)

    async def sweep_step(self, step: int, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> SweepReport:
        """:meth:`sweep` for one step only, never listing the root nor touching another step."""
        return await self.gc.sweep_step(step, grace_seconds, dry_run=dry_run)

    async def close(self) -> None:
        """Stop the engine's threads and close the backend."""
        self.engine.close()
        await self.backend.close()
