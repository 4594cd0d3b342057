"""Where an Orbax item's ckptio checkpoint lives, and the save/restore/sweep that run there.

Two layouts:

* **in the item directory** (default, ``storage=None``): the ckptio store is
  rooted at Orbax's item directory (``<root>/<step>/<item>/``): manifest and
  objects are inside it, so Orbax's atomic rename commits them with the step
  and Orbax's retention (``rmtree`` of the step) removes every byte.
* **external** (``storage="gs://bucket/run1"``, typically with hashed
  naming): objects and manifest live in ``<storage>/<item>/``, as the ckptio
  checkpoint of the Orbax step (``<storage>/<item>/h3f/<step>/...``,
  manifest at ``<storage>/<item>/<step>/``), so saves spread over hashed key
  ranges. The item directory holds only a small pointer file
  (:data:`POINTER_NAME`). Orbax deletes only the step directory, so the
  adapter deletes the external checkpoint itself: through the deleter
  that :func:`ckptio.orbax.retention.attach` installs (at once), and by the
  handler after each save (the checkpoints of steps Orbax no longer points
  to) and on close (any Orbax manager). The handler's orphan sweep of crashed
  saves' objects lists the whole storage root, so it runs at the first save,
  then at most once per ``sweep_interval_seconds``, and on close.

Everything here runs inside Orbax's commit futures (a thread with its own
event loop, after the directories exist) or on Orbax's restore path; the
ckptio engine runs on its own IO loop thread, so we block on it (``run_sync``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import jax
from etils import epath

from ckptio.coord.distributed import Coordinator, JaxCoordinator, SingleProcess, broadcast_from_root
from ckptio.engine import EngineConfig, gather_or_cancel, run_sync
from ckptio.engine.layout import Naming
from ckptio.errors import CheckpointNotFoundError, SaveFailedError
from ckptio.manifest import Manifest
from ckptio.orbax._tree import META_KEY
from ckptio.saving.job import start_save
from ckptio.saving.options import SaveOptions
from ckptio.store import CheckpointStore, StoreOptions
from ckptio.store.orbax_steps import POINTER_FORMAT, POINTER_NAME, final_name
from ckptio.store.orbax_steps import pointer_at as _pointer_at

__all__ = [
    "POINTER_NAME",
    "Location",
    "StorageConfig",
    "coordinator_for",
    "delete_external",
    "final_name",
    "locate_for_restore",
    "locate_for_save",
    "orbax_root_of",
    "orbax_root_of_manifest",
    "read_manifest",
    "read_pointer",
    "step_of",
    "sweep_external",
    "url_of",
    "write_and_commit",
]

log = logging.getLogger("ckptio.orbax")



@dataclasses.dataclass(frozen=True)
class StorageConfig:
    """Where and how the handler stores data (picklable; every field optional)."""

    #: Root URL of external storage; None keeps the data in Orbax's item directory.
    url: str | None = None
    naming: Naming | None = None
    engine_config: EngineConfig | None = None
    backend_options: dict[str, Any] | None = None
    #: The orphan sweep leaves uncommitted objects younger than this alone (saves in flight elsewhere).
    sweep_grace_seconds: float = 3600.0
    #: A handler runs the orphan sweep (a listing of every object under the storage root) at its
    #: first save, then at most once per this many seconds, and on close; every save still deletes
    #: the checkpoints of steps Orbax's retention removed. Sweeping each save cost a full listing
    #: per save on GCS, O(steps x objects), for objects that only become deletable after
    #: ``sweep_grace_seconds`` anyway.
    sweep_interval_seconds: float = 600.0
    #: How the handler's saves run: writer, tiling, switch interval (:class:`ckptio.saving.options.SaveOptions`).
    save_options: SaveOptions | None = None

    @property
    def device_snapshot(self) -> str:
        """Where a jax array's snapshot is taken (``SaveOptions.device_snapshot``)."""
        return self.save_options.device_snapshot if self.save_options is not None else "auto"

    def store_options(self, url: str) -> StoreOptions:
        """The options of the store at ``url`` (this config's naming, engine and backend options)."""
        return StoreOptions(url, engine_config=self.engine_config, naming=self.naming,
                            backend_options=self.backend_options)

    def store(self, url: str) -> CheckpointStore:
        """The store at ``url``, opened with :meth:`store_options`."""
        return CheckpointStore(self.store_options(url))


def url_of(path: Any) -> str:
    """A ckptio URL for an Orbax path (epath, PathAwaitingCreation, str): a local path or ``gs://...``."""
    path = getattr(path, "path", path)  # PathAwaitingCreation: its logical path
    return os.fspath(path).rstrip("/")


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def step_of(item_dir: Any) -> int:
    """The Orbax step an item directory belongs to (tmp directories included)."""
    name = epath.Path(url_of(item_dir)).parent.name
    try:
        import orbax.checkpoint as ocp

        return int(ocp.path.step.step_from_checkpoint_name(name))
    except ValueError:
        # A custom step name format: any stable non-negative number names the checkpoint.
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "big")


@dataclasses.dataclass(frozen=True)
class Location:
    """A ckptio checkpoint: its store's root URL and step (None: the root itself)."""

    url: str
    step: int | None
    #: External storage root (without the item) when the checkpoint is outside the item directory.
    storage: str | None = None
    item: str = ""

    @property
    def step_dir(self) -> str:
        return "" if self.step is None else str(self.step)


def orbax_root_of(item_dir: Any) -> str:
    """The Orbax root (the CheckpointManager's directory) above an item directory, absolute."""
    root = url_of(epath.Path(url_of(item_dir)).parent.parent)
    return root if "://" in root else os.path.abspath(root)


def orbax_root_of_manifest(manifest: Manifest) -> str | None:
    """The Orbax root a checkpoint was saved for (recorded in its manifest), if any."""
    meta = manifest.metadata.get(META_KEY) if isinstance(manifest.metadata, dict) else None
    root = meta.get("orbax_root") if isinstance(meta, dict) else None
    return root if isinstance(root, str) else None


def _owner_of(store: CheckpointStore, step_dir: str) -> str | None:
    """The Orbax root that the committed checkpoint ``step_dir`` of ``store`` was saved for.

    Reads the root manifest alone (validated, and bound to ``step_dir``): it holds the
    metadata. A multi-host checkpoint's fragments are not read -- ownership does not depend
    on them, and a damaged fragment must not pin a checkpoint Orbax has let go of forever.
    """
    return orbax_root_of_manifest(run_sync(store.read_manifest(step_dir, shards=False)))


def locate_for_save(item_dir: Any, config: StorageConfig) -> Location:
    if config.url is None:
        return Location(url_of(item_dir), None)
    # Orbax saves into temporary item directories: name the data by the final item name.
    item = final_name(epath.Path(url_of(item_dir)).name)
    return Location(_join(config.url, item), step_of(item_dir), config.url, item)


def read_pointer(item_dir: Any) -> dict[str, Any] | None:
    """The item directory's pointer to external storage, or None if its data is inside it."""
    store = CheckpointStore(url_of(item_dir))
    try:
        return run_sync(_pointer_at(store, "", f"{url_of(item_dir)}/{POINTER_NAME}"))
    finally:
        run_sync(store.close())


def _write_pointer(item_dir: Any, loc: Location) -> None:
    doc = {
        "format": POINTER_FORMAT,
        "version": 1,
        "storage": loc.storage,
        "item": loc.item,
        "step": loc.step,
    }
    store = CheckpointStore(url_of(item_dir))
    try:
        data = memoryview(json.dumps(doc).encode())
        run_sync(store.io.write(POINTER_NAME, [data]))
        run_sync(store.io.sync())
    finally:
        run_sync(store.close())


def locate_for_restore(item_dir: Any, config: StorageConfig) -> Location:
    """Follow the pointer if there is one; the handler's configured storage wins over the pointer's
    (so a checkpoint whose bucket moved can still be read)."""
    ptr = read_pointer(item_dir)
    if ptr is None:
        return Location(url_of(item_dir), None)
    storage = config.url or ptr["storage"]
    return Location(_join(storage, ptr["item"]), ptr["step"], storage, ptr["item"])


def coordinator_for(item_dir: Any, tag: str) -> Coordinator:
    """A coordinator for one save, created on the caller's thread (same order on every host).

    Each save gets its own key prefix (Orbax's operation id, the directory,
    ``tag``): concurrent saves of several items never share a gather counter,
    so their gathers cannot cross even when their threads run in any order.
    """
    if jax.process_count() == 1:
        return SingleProcess()
    from orbax.checkpoint._src.futures import synchronization

    op = synchronization.OperationIdGenerator.get_current_operation_id()
    digest = hashlib.blake2b(f"{url_of(item_dir)}\0{tag}".encode(), digest_size=8).hexdigest()
    return JaxCoordinator(prefix=f"ckptio/orbax/{op}/{digest}")


def _prepare_external(item_dir: Any, loc: Location, store: CheckpointStore, coord: Coordinator) -> None:
    """Coordinator: write the pointer, clear a stale checkpoint of the step; then every host goes on.

    The pointer comes before the data: an external checkpoint is then always
    referenced while its Orbax step directory exists (the sweep relies on it).
    """
    verdict: dict[str, Any] = {"ok": True}
    failure: BaseException | None = None
    if coord.rank == 0:
        try:
            stale = run_sync(store.is_committed(loc.step_dir))
            if stale:
                owner = _owner_of(store, loc.step_dir)
                if owner != orbax_root_of(item_dir):  # checked before a pointer could name it
                    raise FileExistsError(
                        f"{store.where(loc.step_dir)} already holds step {loc.step} of the Orbax directory "
                        f"{owner!r}: give each run (each Orbax directory) its own storage root"
                    )
            _write_pointer(item_dir, loc)
            if stale:
                # Left by a save whose Orbax step never finalised (a crash between the two commits).
                log.warning("%s: replacing a stale checkpoint of step %s", loc.url, loc.step)
                run_sync(store.delete(loc.step_dir))
        except Exception as e:  # every host must still join the gather below, or the others hang
            verdict, failure = {"ok": False, "error": f"{type(e).__name__}: {e}"}, e
    if coord.size > 1:
        # Also a barrier: no host looks for an existing checkpoint before the stale one is gone.
        verdict = broadcast_from_root(coord, verdict)  # O(1) bytes for the others, whatever H
    if not verdict["ok"]:
        raise failure or SaveFailedError(
            f"{loc.url}: preparing step {loc.step} failed on host 0: {verdict['error']}"
        )


def write_and_commit(
    item_dir: Any,
    tree: Any,
    metadata: dict[str, Any],
    config: StorageConfig,
    coord: Coordinator,
    loc: Location | None = None,
) -> None:
    """Write this host's shards and (coordinator) commit; blocks until committed on every host."""
    loc = loc or locate_for_save(item_dir, config)
    store = config.store(loc.url)
    try:
        if loc.storage is not None:
            _prepare_external(item_dir, loc, store, coord)
        handle = start_save(store, loc.step, tree, metadata=metadata, coordinator=coord, copy=False,
                            options=config.save_options)
        handle.result()
    finally:
        run_sync(store.close())


def read_manifest(loc: Location, config: StorageConfig) -> tuple[CheckpointStore, Manifest]:
    """Open ``loc``'s store and read its manifest (the caller closes the store)."""
    store = config.store(loc.url)
    try:
        return store, run_sync(store.read_manifest(loc.step_dir))
    except BaseException:
        run_sync(store.close())
        raise


def delete_external(item_dir: Any, config: StorageConfig | None = None) -> bool:
    """Delete the external checkpoint an item directory points to; False if it has none."""
    ptr = read_pointer(item_dir)
    if ptr is None:
        return False
    loc = locate_for_restore(item_dir, config or StorageConfig())
    store = (config or StorageConfig()).store(loc.url)
    try:
        try:
            owner = _owner_of(store, loc.step_dir)
        except CheckpointNotFoundError:
            owner = orbax_root_of(item_dir)  # uncommitted or half-deleted: finishing is safe
        if owner != orbax_root_of(item_dir):
            # Not this run's data (storage shared by mistake, or this Orbax directory was moved).
            log.warning("%s: step %s belongs to %r; not deleting it", loc.url, loc.step, owner)
            return False
        run_sync(store.delete(loc.step_dir))
    finally:
        run_sync(store.close())
    return True


def _referenced_steps(root: epath.Path, item: str) -> set[int]:
    """Steps of ``item`` that some directory under the Orbax root (tmp ones included) points to.

    Raises on any pointer it cannot read: the sweep must not delete data because of an IO error.
    Pointers are read through one store at the root, all at once: a store opened per pointer
    (a backend, thread pools, a mount lookup) cost ~5 ms per step kept, in every save's finalize.
    """
    item_dirs = []
    for step_dir in root.iterdir():
        try:
            if not step_dir.is_dir():
                continue
            # The step's item directory may still carry Orbax's tmp suffix (a save being finalised).
            item_dirs += [f"{step_dir.name}/{d.name}" for d in step_dir.iterdir()
                          if final_name(d.name) == item and d.is_dir()]
        except FileNotFoundError:
            continue  # Orbax deleted the step meanwhile (background deletion)
    root_url = url_of(root)
    store = CheckpointStore(root_url)

    try:
        # A malformed pointer raises (keep everything until someone looks); the other reads are
        # cancelled and awaited first, so none is still running when the store closes.
        pointers = run_sync(gather_or_cancel(
            (_pointer_at(store, d, f"{root_url}/{d}/{POINTER_NAME}") for d in item_dirs),
            limit=store.engine.concurrency,
        ))
    finally:
        run_sync(store.close())
    return {p["step"] for p in pointers if p is not None}


def sweep_external(root: Any, item: str, config: StorageConfig, *, orphans: bool = True) -> list[int]:
    """Delete external checkpoints of ``item`` that no directory under the Orbax ``root`` points to.

    Orbax's retention removed their step directories (and pointers); this
    removes their objects. With ``orphans``, also collects uncommitted objects
    older than the grace period (crashed saves), which lists every object under
    the storage root. Returns the steps deleted.
    """
    if config.url is None:
        return []
    root_url = url_of(root) if "://" in url_of(root) else os.path.abspath(url_of(root))
    referenced = _referenced_steps(epath.Path(root_url), item)
    store = config.store(_join(config.url, item))
    doomed = []
    try:
        # One listing of step directories, then a manifest read for each step Orbax no longer
        # points to (usually the one its retention just removed): not two stats of every step kept.
        for s in run_sync(store.step_dirs()):
            if s in referenced or not run_sync(store.is_committed(str(s))):
                continue  # uncommitted: a save in flight, or a crashed one (the orphan sweep's)
            owner = _owner_of(store, str(s))
            if owner != root_url:  # another run's checkpoint in a shared storage root: not ours to judge
                log.debug("%s/%s: step %s belongs to %r, not %r", config.url, item, s, owner, root_url)
                continue
            run_sync(store.delete(str(s)))
            doomed.append(s)
        if orphans:
            run_sync(store.sweep(config.sweep_grace_seconds))
    finally:
        run_sync(store.close())
    if doomed:
        log.info(
            "%s/%s: swept checkpoints of steps %s (their Orbax steps are gone)", config.url, item, doomed
        )
    return doomed
