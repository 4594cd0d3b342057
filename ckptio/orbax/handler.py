"""The Orbax ``AsyncCheckpointHandler`` that stores a pytree item with ckptio.

>>> mngr.save(step, args=ckptio.orbax.Save(state))
>>> state = mngr.restore(step, args=ckptio.orbax.Restore(abstract_state))

``async_save`` only stages (device -> host for the shards this host owns,
copies of numpy leaves) and returns one commit future; all storage IO runs
inside that future, after Orbax has created the directories. Each host
writes only its own shards (one replica of each); the gather of per-host
records and the commit by process 0 go through ``jax.distributed``'s
key-value store (:class:`ckptio.coord.distributed.JaxCoordinator`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from ckptio.engine import EngineConfig, run_sync
from ckptio.engine.layout import Naming
from ckptio.orbax._io import (
    StorageConfig, coordinator_for, final_name, locate_for_restore, locate_for_save, orbax_root_of,
    read_manifest, sweep_external, url_of, write_and_commit,
)
from ckptio.orbax._metadata import leaf_metadata, tree_metadata_of
from ckptio.orbax._tree import META_KEY, check_tree, plan_restore, stage_tree
from ckptio.restoring import restore_checkpoint
from ckptio.saving.options import SaveOptions
from ckptio.saving.writers import sidecar
from ckptio.state.tree import unflatten

__all__ = ["CkptioCheckpointHandler", "Restore", "Save", "handler_registry"]

log = logging.getLogger("ckptio.orbax")


class CkptioCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores one pytree item through ckptio.

    Args:
        storage: root URL for the data (``gs://bucket/run1``, ``mem://x``);
            None (the default, and what Orbax's global registration gets)
            keeps everything inside Orbax's item directory.
        naming: object naming strategy (e.g. :class:`ckptio.engine.layout.HashedNaming`);
            default: the backend's.
        engine_config, backend_options: passed to ckptio's store.
        save_options: how saves run (writer, tiling: :class:`ckptio.saving.options.SaveOptions`).
        sweep_grace_seconds: uncommitted objects younger than this survive the orphan sweep.
        sweep_interval_seconds: the orphan sweep (a listing of the whole storage root) runs at
            the first save, then at most this often, and on close (see :class:`StorageConfig`).
    """

    def __init__(
        self,
        storage: str | None = None,
        *,
        naming: Naming | None = None,
        engine_config: EngineConfig | None = None,
        backend_options: dict[str, Any] | None = None,
        sweep_grace_seconds: float = 3600.0,
        sweep_interval_seconds: float = 600.0,
        save_options: SaveOptions | None = None,
    ) -> None:
        self._config = StorageConfig(storage, naming, engine_config, backend_options, sweep_grace_seconds,
                                     sweep_interval_seconds, save_options)
        # A writer process, if asked for, is up before the first save.
        sidecar.prestart((save_options or SaveOptions()).writer_name())
        # (Orbax root, item) pairs this handler finalised: swept once more on close, after
        # Orbax's last retention pass, which runs after our finalize.
        self._swept: set[tuple[str, str]] = set()
        self._orphans_swept_at: dict[tuple[str, str], float] = {}  # monotonic time of the last orphan sweep
        self._lock = threading.Lock()

    @property
    def config(self) -> StorageConfig:
        return self._config

    # -- save ------------------------------------------------------------

    async def async_save(self, directory: epath.Path, args: Save) -> list[ocp.future.Future]:
        """Stage now; return the commit future that writes and commits."""
        staged = stage_tree(args.item, self._config.device_snapshot)
        # The Orbax root owns the checkpoint: sweeps of a shared storage root leave others' alone.
        metadata: dict[str, Any] = {META_KEY: {**staged.meta, "orbax_root": orbax_root_of(directory)}}
        if args.metadata:
            metadata["user"] = args.metadata
        # Created here, on the caller's thread, so every host derives the same gather keys.
        coord = coordinator_for(directory, "handler")
        loc = locate_for_save(directory, self._config)  # logical only: the directory may not exist yet
        config = self._config

        async def commit() -> None:
            path = directory
            if hasattr(path, "await_creation"):  # a PathAwaitingCreation
                path = await path.await_creation()
            # Blocking is fine: this coroutine owns its thread and event loop.
            write_and_commit(path, staged.tree, metadata, config, coord, loc)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="ckptio_save")]

    def save(self, directory: epath.Path, args: Save) -> None:
        """Save and wait until committed on every host."""

        async def run() -> None:
            for f in await self.async_save(directory, args):
                f.result()

        _run_sync(run())

    def finalize(self, directory: epath.Path) -> None:
        """Primary host, before Orbax commits the step: sweep external checkpoints of deleted steps."""
        if self._config.url is None:
            return
        path = epath.Path(url_of(directory))
        key = (url_of(path.parent.parent), final_name(path.name))
        now = time.monotonic()
        with self._lock:
            self._swept.add(key)
            last = self._orphans_swept_at.get(key)
            orphans = last is None or now - last >= self._config.sweep_interval_seconds
            if orphans:
                self._orphans_swept_at[key] = now
        self._sweep(*key, orphans=orphans)

    def _sweep(self, root: str, item: str, *, orphans: bool = True) -> None:
        try:
            sweep_external(root, item, self._config, orphans=orphans)
        except Exception as e:  # never fail a save over garbage collection; the next sweep retries
            log.warning("ckptio.orbax: sweeping %s for item %r failed: %r", root, item, e)
            if orphans:
                with self._lock:
                    self._orphans_swept_at.pop((root, item), None)  # due again at the next save

    def close(self) -> None:
        with self._lock:
            pending, self._swept = list(self._swept), set()
        for root, item in pending:
            self._sweep(root, item)

    # -- restore ---------------------------------------------------------

    def restore(self, directory: epath.Path, args: Restore | None = None) -> Any:
        """Restore the item; with an abstract state, onto its shardings (only addressable slices are read)."""
        loc = locate_for_restore(directory, self._config)
        store, manifest = read_manifest(loc, self._config)
        try:
            item, strict = (args.item, args.strict) if args is not None else (None, True)
            plan = plan_restore(manifest, item, strict)
            restored = restore_checkpoint(store, manifest, loc.step_dir, plan.target)
            return plan.finish(restored)
        finally:
            run_sync(store.close())

    def metadata(self, directory: epath.Path) -> Any:
        """What Orbax's ``StandardCheckpointHandler.metadata`` returns: a ``TreeMetadata``.

        ``.tree`` holds an ``ArrayMetadata`` per array (shape, dtype, storage
        metadata with the saved shards' ``write_shape``; no sharding: the
        ``Save`` handler records no topology), ``ScalarMetadata`` /
        ``StringMetadata`` for Python numbers and strings, and other values
        (bytes, None) as saved; ``.custom_metadata`` is ``Save(metadata=...)``.
        It indexes like the tree (``meta["params"]["w"].shape``) and can be
        passed back as a ``Restore`` target.
        """
        loc = locate_for_restore(directory, self._config)
        store, manifest = read_manifest(loc, self._config)
        run_sync(store.close())
        user = manifest.metadata.get("user") if isinstance(manifest.metadata, dict) else None
        tree = unflatten(manifest.tree, lambda name: leaf_metadata(name, manifest.items[name], directory))
        return tree_metadata_of(tree, user)


def _run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, even where an event loop is running."""
    try:
        from orbax.checkpoint._src import asyncio_utils  # handles a running loop (notebooks, nested)

        return asyncio_utils.run_sync(coro)
    except ImportError:  # pragma: no cover - a later Orbax moved it
        import asyncio

        return asyncio.run(coro)


@ocp.args.register_with_handler(CkptioCheckpointHandler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """Save ``item`` (any jax pytree) with ckptio; ``metadata`` is JSON kept in the manifest."""

    item: Any
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_tree(self.item)  # fail here, before Orbax starts a save it cannot clean up


@ocp.args.register_with_handler(CkptioCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Restore onto ``item``'s structure and shardings (``jax.ShapeDtypeStruct`` leaves); None: as saved.

    ``item`` may also be what :meth:`CkptioCheckpointHandler.metadata` returned
    (a ``TreeMetadata``, or its ``.tree``), as Orbax's ``StandardRestore``
    takes it. ``strict`` (as Orbax's): False lets an array whose target shape
    differs from the saved one, in size only, be padded with zeros or
    truncated at the end of each dimension; True (the default) raises.
    """

    item: Any = None
    strict: bool = True

    def __post_init__(self) -> None:
        tree = getattr(self.item, "tree", None)
        if tree is not None and hasattr(self.item, "custom_metadata"):  # an Orbax TreeMetadata
            self.item = tree


def handler_registry(
    storage: str | None = None, *, item: str | None = None, **options: Any
) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """An Orbax handler registry whose ckptio items use a handler configured with ``storage``.

    ``item`` None applies it to every item saved with :class:`Save`; other
    args types (``JsonSave``...) still find their globally registered handlers.
    """
    h = CkptioCheckpointHandler(storage, **options)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(item, Save, h)
    registry.add(item, Restore, h)
    return registry
