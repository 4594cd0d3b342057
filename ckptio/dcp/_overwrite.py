"""Replacing a step-less DCP checkpoint in place (``Writer(path, overwrite=True)``, DCP's default).

In DCP the path is the checkpoint, and a second save to it replaces the
first. ckptio does that without a moment in which the path holds no
restorable checkpoint:

1. the new save's objects are written under a new save id, announced by
   its intent (so no gc takes them while in flight) -- the old checkpoint
   is untouched and still the one readers get;
2. :func:`replace` checks the new manifest like ``CheckpointStore.commit``
   (bound to its place, every object present with its size), then writes
   it over the old one with ``Backend.write``, which replaces a whole object
   atomically (POSIX: temporary file + rename; GCS: one object upload) --
   readers see the old checkpoint or the new one, never neither;
3. only then are the old manifest's objects deleted, and only those that
   :func:`ckptio.manifest.names.parse_object` proves are ckptio's objects of this
   checkpoint's own step layout, that no live intent covers, and that the
   new manifest does not name.

A crash after step 2 leaves the new checkpoint committed and the old
objects as orphans: ckptio names that no manifest lists, whose save's
intent is gone -- exactly what ``ckptio gc`` proves and collects. A crash
before step 2 leaves the old checkpoint committed and the new objects under
a (soon stale) intent, again collected by gc. Two writers replacing one
path at once: the last manifest written wins, as with DCP's
``FileSystemWriter``; the loser's objects become orphans; neither deletes
the winner's objects (each deletes only the objects of the manifest its own
write replaced).

A reader still reading the old checkpoint when step 3 runs gets a
``FileNotFoundError`` naming the object, never wrong bytes (object names are
unique per save).

ckptio never deletes files it cannot prove are its own: a directory holding
a stock DCP checkpoint (``.metadata``) is refused rather than shadowed (a
stock reader would go on reading the old one).
"""

from __future__ import annotations

import logging

from ckptio.backends.base import join_key
from ckptio.engine import gather_or_cancel
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.manifest.names import fence_key, parse_object
from ckptio.store import CheckpointStore, check_binding
from ckptio.store.companions import create_companion, delete_companions, is_companion

__all__ = ["STOCK_METADATA", "existing", "refuse_stock", "replace", "write_companion"]

log = logging.getLogger("ckptio.dcp")

#: The file that makes a stock DCP (FileSystemWriter) checkpoint exist.
STOCK_METADATA = ".metadata"


async def _exists(store: CheckpointStore, key: str) -> bool:
    try:
        await store.io.stat(key)
        return True
    except FileNotFoundError:
        return False


async def existing(store: CheckpointStore, step_dir: str) -> str:
    """Before a save of ``step_dir``: what is committed there -- ``"ckptio"``, ``"stock"`` (DCP's) or ``""``.

    Finishes an interrupted deletion first (as ``CheckpointStore.prepare_save``).
    A stock DCP checkpoint may be neither deleted nor shadowed: see :func:`refuse_stock`.
    """
    manifest, tomb, stock = await gather_or_cancel([
        _exists(store, join_key(step_dir, MANIFEST_NAME)),
        _exists(store, join_key(step_dir, TOMBSTONE_NAME)),
        _exists(store, join_key(step_dir, STOCK_METADATA)),
    ])
    if stock and not (manifest and await _ours(store, step_dir)):
        return "stock"
    if tomb:
        await store.prepare_save(step_dir)  # finishes the deletion; the step is then empty
        return ""
    return "ckptio" if manifest else ""


async def _ours(store: CheckpointStore, step_dir: str) -> bool:
    """Whether ``step_dir``'s ``.metadata`` is the one its ckptio manifest records (not a stock save over it)."""
    old = await _old_manifest(store, step_dir)
    return old is not None and await is_companion(store, step_dir, old, STOCK_METADATA)


async def write_companion(store: CheckpointStore, step_dir: str, data: bytes, *, over: bool = False) -> bool:
    """Write DCP's ``.metadata`` for stock torch (after the manifest committed); atomic, as every object write.

    ``over``: replace the file there (:func:`replace`: the old checkpoint's, whose manifest was just
    written over); else create it only where no such file is (:func:`ckptio.store.companions.create_companion`:
    a writer paused after its commit must not overwrite the file of a checkpoint saved there since).
    False (logged) if it failed: the checkpoint is committed all the same (ckptio restores it), only stock
    torch cannot read it; failing the save would tell the caller it did not happen.
    """
    try:
        if not over:
            return await create_companion(store, step_dir, STOCK_METADATA, data)
        await store.io.write(join_key(step_dir, STOCK_METADATA), [memoryview(data)])
    except Exception as e:  # noqa: BLE001 -- committed already
        log.warning("%s: committed, but writing %s for stock torch failed (ckptio reads it; torch cannot): %r",
                    store.where(step_dir), STOCK_METADATA, e)
        return False
    return True


def refuse_stock(where: str) -> FileExistsError:
    """The error for a save over a stock DCP checkpoint (which ckptio may neither delete nor shadow)."""
    return FileExistsError(
        f"{where} holds a stock DCP checkpoint ({STOCK_METADATA}); ckptio deletes only files it wrote, and "
        "torch's FileSystemReader would go on reading that one: save elsewhere or remove it first "
        "(ckptio.dcp.Reader reads it where it is)"
    )


async def _old_manifest(store: CheckpointStore, step_dir: str) -> Manifest | None:
    """The manifest about to be replaced, if it is intact (a damaged one proves nothing: delete nothing by it)."""
    key = join_key(step_dir, MANIFEST_NAME)
    where = store.where(step_dir)
    try:
        data = await store.io.read(key)
        old = Manifest.from_json(data, f"{where}/{MANIFEST_NAME}")
        check_binding(old, step_dir, where)
        old = await store.load_fragments(step_dir, old, None)  # every shard (a format-2 root's are in fragments)
    except FileNotFoundError:
        return None
    except (ManifestError, IntegrityError, RecursionError) as e:
        log.warning("%s: the manifest being replaced is damaged (%s); its objects are left to gc", where, e)
        return None
    return old


async def replace(store: CheckpointStore, step_dir: str, manifest: Manifest, companion: bytes | None = None
                  ) -> list[str]:
    """Commit ``manifest`` over whatever ``step_dir`` holds; then delete the replaced checkpoint's objects.

    Checks as ``CheckpointStore.commit`` does (binding; every object there
    with its size) before the write. Returns the keys deleted. A failure to
    delete is logged, not raised: the new checkpoint is committed, and what
    is left are orphans gc proves. ``companion``: the new ``.metadata`` for
    stock torch, written over the old one after the manifest and before the
    old objects go; without one, the old checkpoint's own ``.metadata`` (if
    its manifest proves it) is deleted before the new manifest is written,
    so torch never reads one naming deleted objects.
    """
    where = store.where(step_dir)
    check_binding(manifest, step_dir, where)
    if not store.host_local:
        await store.check_objects(manifest, f"commit of {where}")
    if await _exists(store, join_key(step_dir, TOMBSTONE_NAME)):
        # Someone is deleting this checkpoint now: a manifest written under its tombstone would be deleted
        # with it (while our objects survived as orphans), so the save fails loudly instead.
        raise FileExistsError(f"checkpoint {where} is being deleted; not replacing it (save again)")
    old = await _old_manifest(store, step_dir)
    if old is not None and companion is None:
        await delete_companions(store, step_dir, old, where)
    key = join_key(step_dir, MANIFEST_NAME)
    data = memoryview(manifest.to_json())
    await store.io.write(key, [data])
    written = companion is not None and await write_companion(store, step_dir, companion, over=True)
    if companion is not None and not written and old is not None:
        await delete_companions(store, step_dir, old, where)  # torch must not read the old one once its objects go
    if old is None:
        return []
    try:
        return await _delete_replaced(store, step_dir, old, manifest)
    except Exception as e:  # noqa: BLE001 -- committed already; leftovers are provable orphans for gc
        log.warning("%s: replaced, but deleting the old checkpoint's objects failed (gc collects them): %r", where, e)
        return []


async def _delete_replaced(store: CheckpointStore, step_dir: str, old: Manifest, new: Manifest) -> list[str]:
    """Delete ``old``'s objects (and fragments) that are provably ckptio's, of this step, of no live save,
    not named by ``new``."""
    keep = set(new.keys())
    live = await store.live_saves(step_dir)
    doomed = []
    for k in old.keys():  # objects, and a format-2 checkpoint's fragments
        name = parse_object(k)
        if k in keep or name is None or name.step_dir != step_dir or name.save_id in live:
            continue
        doomed.append(k)
    if old.fence and old.fence != new.fence:  # the replaced commit's fence went with it
        doomed.append(fence_key(step_dir, old.fence))
    await store.delete_keys(doomed)  # bounded, a missing key is fine
    if doomed:
        log.info("%s: replaced; deleted the old checkpoint's %d objects", store.where(step_dir), len(doomed))
    return doomed
