"""Copy a committed checkpoint between two stores, object by object, committing last.

Every object is read from the source with its extents' block checksums
checked (bytes that do not match are never written), written under the
destination's naming (a hashed prefix on object stores, flat on POSIX), and
only when every object is durable is the destination's manifest created
(create-if-absent). A reader of the destination therefore never sees a
partial checkpoint, whatever moment a copy dies at.

A copy is resumable: an object already at the destination under its key
with the right size is kept, not rewritten. That is safe because writes are
atomic per object (backend contract) and keys carry the save's unique id, so
such an object can only be a complete write of the same bytes by an earlier
attempt.

:func:`copy_checkpoint` is the whole copy in one process (``ckptio cp``).
The tiered manager splits it: every host runs :func:`copy_objects` for the
objects it holds, then one coordinator commits :func:`rekey`'s manifest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection, Iterable, Sequence

from ckptio.backends.base import ByteRange, join_key
from ckptio.engine import ByteBudget, Progress, ReadRequest, gather_or_cancel
from ckptio.engine.layout import HashedNaming
from ckptio.manifest import ArrayItem, Manifest
from ckptio.manifest.names import parse_object, step_of_key
from ckptio.store import CheckpointStore
from ckptio.store.companions import carried, companions_of, without_others, write_companions
from ckptio.store.transaction import new_id

__all__ = ["CopyStats", "StoredExtent", "copy_checkpoint", "copy_keys", "copy_objects", "object_extents", "object_writers",
           "rekey", "rekey_one", "stored_extents", "verified_reads"]

log = logging.getLogger("ckptio.copy")


@dataclasses.dataclass
class CopyStats:
    """What one copy did: objects written, objects kept (already there), bytes written."""

    written: int = 0
    kept: int = 0
    bytes: int = 0

    def add(self, other: CopyStats) -> None:
        self.written += other.written
        self.kept += other.kept
        self.bytes += other.bytes


#: An extent as :func:`object_extents` gives it: ``(offset, length, block crcs, item, block size)``.
StoredExtent = tuple[int, int, list[int], str, int]


def object_extents(manifest: Manifest) -> list[list[StoredExtent]]:
    """For each object, the extents stored in it as ``(offset, length, block crcs, item, block)``
    (``block``: the size the crcs were taken over, the extent's own or the manifest's)."""
    out: list[list[StoredExtent]] = [[] for _ in manifest.objects]
    for name, item in manifest.items.items():
        if isinstance(item, ArrayItem):
            for shard in item.shards:
                for e in shard.extents:
                    out[e.object].append((e.offset, e.length, e.crcs, name, e.block))
    return out


def stored_extents(rows: Iterable[Sequence[object]]) -> list[StoredExtent]:
    """Extents as a commit record carries them (JSON rows ``[offset, length, crcs, item, block]``,
    :func:`ckptio.tiers.held.part_records`) as :data:`StoredExtent`."""
    return [(int(r[0]), int(r[1]), [int(c) for c in r[2]], str(r[3]), int(r[4])) for r in rows]  # type: ignore[call-overload,union-attr]


def verified_reads(key: str, buf: memoryview, extents: list[StoredExtent]) -> list[ReadRequest]:
    """Requests that read all of object ``key`` into ``buf``, checking every extent against its
    crcs: one request, or one per run of extents that share a block size (a request verifies
    with one block size; format 6 gives small shards small blocks of their own)."""
    ordered = sorted(extents)
    cuts = [0] + [e[0] for prev, e in zip(ordered, ordered[1:]) if e[4] != prev[4]] + [buf.nbytes]
    reqs, i = [], 0
    for lo, hi in zip(cuts, cuts[1:]):
        checks = []
        while i < len(ordered) and ordered[i][0] < hi:
            off, n, crcs, item, _block = ordered[i]
            checks.append((off - lo, n, crcs, item))
            i += 1
        block = ordered[i - 1][4] if checks else 1
        reqs.append(ReadRequest(key, ByteRange(lo, hi), [buf[lo:hi]], checks, block_size=block))
    return reqs


def object_writers(manifest: Manifest) -> list[int | None]:
    """The host that wrote each object (from its shards), or None for an object no shard refers to.

    Objects are packed per host, so one object never mixes hosts' shards.
    """
    out: list[int | None] = [None] * len(manifest.objects)
    for item in manifest.items.values():
        if isinstance(item, ArrayItem):
            for shard in item.shards:
                for e in shard.extents:
                    out[e.object] = shard.host
    return out


def _logical_key(key: str, step_dir: str) -> str:
    """``key`` without a leading hashed component (``h3f/100/x`` -> ``100/x``)."""
    first, sep, rest = key.partition("/")
    hashed = len(first) > 1 and first[0] == "h" and all(c in "0123456789abcdef" for c in first[1:])
    if sep and hashed and (not step_dir or rest.startswith(step_dir + "/")):
        return rest
    return key


def rekey(manifest: Manifest, step_dir: str, dst: CheckpointStore, dst_step_dir: str | None = None) -> Manifest:
    """``manifest`` with its object keys renamed for ``dst``'s naming (same order, same checkpoint id;
    the step of ``dst_step_dir`` when copied to another step), every one in the copy's own step:
    an incremental step's references to older steps are copied in, the copy has no ``bases``.

    Deterministic, so every host of a distributed copy computes the same keys
    on its own. On a hashed destination the i-th object gets the i-th slot
    after the step's seed: the spread is even by construction.
    """
    dst_dir = step_dir if dst_step_dir is None else dst_step_dir
    bases = frozenset(manifest.bases or {})
    keys = [rekey_one(key, i, step_dir, dst, dst_dir, bases) for i, key in enumerate(manifest.objects)]
    if len(set(keys)) != len(keys):
        raise ValueError(f"rekeying {dst.where(dst_dir)} maps two objects to one key")
    # A copy to another step directory is that step's checkpoint (same id: still the same bytes).
    step = int(dst_dir) if dst_dir != step_dir and dst_dir.isdigit() else manifest.step
    # Written whole (format 1), under a fence of its own (the destination's commit picks one).
    return dataclasses.replace(manifest, objects=keys, step=step, fragments=None, fence=None, bases=None)


def rekey_one(
    key: str, index: int, step_dir: str, dst: CheckpointStore, dst_step_dir: str | None = None,
    bases: Collection[str] = (),
) -> str:
    """The key :func:`rekey` gives object ``key``, the ``index``-th of its manifest, in ``dst``: a host
    that knows only its own objects and their indices (its commit record) names them as the whole
    manifest's copy does. A key of one of ``bases`` (an incremental step's reference to an older
    step's object) comes into the copy's own step: the copy is self-contained, and no pin of the
    destination would hold it in another step."""
    dst_dir = step_dir if dst_step_dir is None else dst_step_dir
    own = step_of_key(key)
    src_dir = own if own in bases and own != step_dir else step_dir
    logical = _logical_key(key, src_dir)
    if src_dir != dst_dir and src_dir and logical.startswith(src_dir + "/"):
        logical = join_key(dst_dir, logical[len(src_dir) + 1 :])
    if isinstance(dst.naming, HashedNaming):
        logical = join_key(dst.naming.component(dst_dir, index, 1, 0), logical)
    return logical


def _renamed_writers(manifest: Manifest, revoked: set[str]) -> Manifest:
    """``manifest`` with the objects of ``revoked`` save ids under a fresh save id.

    A destination that revoked a save id (an earlier copy of it was paused past its lease
    and gc took its objects) never lets a commit name that id again (ckptio.store.fence); this copy
    writes those objects afresh under a new one.
    """
    fresh = {sid: new_id() for sid in revoked}
    keys = []
    for key in manifest.objects:
        head, _, last = key.rpartition("/")
        sid, dot, rest = last.partition(".")
        keys.append(join_key(head, fresh[sid] + dot + rest) if sid in fresh else key)
    return dataclasses.replace(manifest, objects=keys)


async def copy_objects(
    src: CheckpointStore,
    dst: CheckpointStore,
    manifest: Manifest,
    dst_manifest: Manifest,
    indices: Iterable[int] | None = None,
    *,
    progress: Progress | None = None,
) -> CopyStats:
    """Copy objects ``indices`` (default: all) of ``manifest`` from ``src`` to ``dst_manifest``'s keys.

    Each object's extents are checked against their block checksums as it is
    read (a mismatch raises IntegrityError and nothing of that object is
    written). An object no extent refers to is copied unchecked, whole.
    Does not commit; ends with ``dst.backend.sync()`` so that a commit
    after it covers durable objects.
    """
    extents = object_extents(manifest)
    wanted = range(len(manifest.objects)) if indices is None else sorted(set(indices))
    return await copy_keys(src, dst, [(manifest.objects[i], dst_manifest.objects[i], extents[i]) for i in wanted],
                           progress=progress)


async def copy_keys(
    src: CheckpointStore,
    dst: CheckpointStore,
    objects: Sequence[tuple[str, str, list[StoredExtent]]],
    *,
    progress: Progress | None = None,
) -> CopyStats:
    """Copy each ``(key, dst_key, extents)`` of ``objects`` from ``src`` to ``dst``, as :func:`copy_objects`
    does (what a host copies by its commit record, without the manifest)."""
    # Bytes held between read and write are bounded by both engines' budgets and slots.
    slots = asyncio.Semaphore(max(1, min(src.engine.concurrency, dst.engine.concurrency)))
    budget = ByteBudget(min(src.engine.config.byte_budget, dst.engine.config.byte_budget))
    stats = CopyStats()

    async def one(key: str, dst_key: str, extents: list[StoredExtent]) -> None:
        if extents:
            size = max(e[0] + e[1] for e in extents)
        else:
            size = (await src.io.stat(key)).size
        async with slots:
            try:  # resuming: keep a complete earlier write (atomic per object, unique key)
                have = await dst.io.stat(dst_key)
                if have.size == size:
                    stats.kept += 1
                    return
            except FileNotFoundError:
                pass
            held = await budget.acquire(size)
            try:
                buf = bytearray(size)
                view = memoryview(buf)
                for req in verified_reads(key, view, extents) if size else ():
                    await src.engine.read_one(req)
                await dst.io.write(dst_key, [view])
            finally:
                await budget.release(held)
        stats.written += 1
        stats.bytes += size
        if progress:
            progress("written", size)

    await gather_or_cancel(one(*o) for o in objects)
    await dst.io.sync()
    return stats


async def copy_checkpoint(
    src: CheckpointStore,
    dst: CheckpointStore,
    step_dir: str,
    *,
    dst_step_dir: str | None = None,
    progress: Progress | None = None,
) -> tuple[Manifest, CopyStats]:
    """Copy the committed checkpoint ``step_dir`` of ``src`` to ``dst`` and commit it there last.

    Returns the destination's manifest and what was copied. If ``dst``
    already holds the same checkpoint (same checkpoint id) nothing is
    copied; a different checkpoint there raises FileExistsError.
    """
    where_to = dst_step_dir if dst_step_dir is not None else step_dir
    manifest = await src.read_manifest(step_dir)
    if await dst.is_committed(where_to):
        there = await dst.read_manifest(where_to)
        if there.checkpoint_id == manifest.checkpoint_id:  # a copy that died before its companions ends here
            recorded = {e["name"] for e in companions_of(there)}
            todo = await carried(src, step_dir, manifest, dst, where_to, there)
            await write_companions(dst, where_to, {n: b for n, b in todo.items() if n in recorded})
            return there, CopyStats()
        raise FileExistsError(
            f"{dst.where(where_to)} holds another checkpoint ({there.checkpoint_id}, not {manifest.checkpoint_id})"
        )
    out = rekey(manifest, step_dir, dst, where_to)
    # The copy keeps the source's object names: its intent covers their save ids, so a gc of the
    # destination spares them (a resumed copy's earlier objects included) until the commit.
    writers = {n.save_id for k in out.objects if (n := parse_object(k)) is not None}
    revoked = await dst.fences.revoked(where_to) & writers
    if revoked:
        log.warning("%s: save ids %s were revoked there; copying their objects under a new id",
                    dst.where(where_to), sorted(revoked))
        out = _renamed_writers(out, revoked)
        writers = {n.save_id for k in out.objects if (n := parse_object(k)) is not None}
    # DCP's .metadata for stock torch goes with the objects when its paths still name them.
    companions = await carried(src, step_dir, manifest, dst, where_to, out)
    out = without_others(out, companions)
    async with await dst.begin_save_async(where_to, covers=writers, prepare=False) as tx:
        stats = await copy_objects(src, dst, manifest, out, progress=progress)
        try:
            await tx.commit_async(out)
        except FileExistsError:  # a concurrent copy of the same checkpoint won the commit
            there = await dst.read_manifest(where_to)
            if there.checkpoint_id != manifest.checkpoint_id:
                raise
        await write_companions(dst, where_to, companions)  # after the commit, as the Writer does
    log.info("copied %s -> %s: committed (%d objects written, %d kept)",
             src.where(step_dir), dst.where(where_to), stats.written, stats.kept)
    return out, stats
