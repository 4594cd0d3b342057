"""A host's commit record in its fast tier: what it holds of a committed step, without the job's manifest.

At a restart every host scans what it holds (:func:`ckptio.tiers.peer.holdings`). Read from the
manifest, that is a parse of every host's shards per step (87 MB at 4096 hosts x 128 shards,
seconds per step) to learn three things about this host's own part: the checkpoint id, the
number of hosts, and which objects are its own. So once a step is committed in its fast tier,
each host writes them down in ``<step>/ckptio.held.<checkpoint id>.h<host>`` (:mod:`ckptio.manifest.names`),
a few hundred bytes, and the scan reads that.

Why a record can be trusted without the manifest it vouches for:

* it is written only after the commit stood on this host (the manifest is in, its fence says
  "commit"), and it names that commit's checkpoint id;
* it is deleted with its step, before the manifest (:class:`ckptio.store.deletion.Deletion`), so
  no record outlives its commit and speaks for a later checkpoint of the same step;
* gc takes a record only when its step's standing manifest is not the checkpoint it names;
* it names its commit's fence, and is trusted only while that fence is in its step: a record
  written late by a process paused past a deletion and a re-save of the same step (whose objects
  have the same names) names a fence that went with the old checkpoint.

A record that is absent, damaged, or not alone for this host in its step is no proof of
anything: the scan then reads the manifest, as before (and a torn write costs only that).

Version 2 (:class:`ckptio.store.parts.PartRecord`) also carries each own object's size and extents:
everything a host needs of its own part without the manifest, and what lets the store count a
standing record as a commit of the host's part on its own (:mod:`ckptio.store.parts`, #33).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ckptio.engine import gather_or_cancel
from ckptio.manage.copying import object_extents, object_writers
from ckptio.manifest import Manifest
from ckptio.manifest.names import parse_held
from ckptio.store import CheckpointStore, manifest_object_sizes
from ckptio.store.parts import PART_FORMAT, PartRecord

__all__ = ["HELD_FORMAT", "OwnPart", "own_part_record", "part_records", "read_held", "write_held"]

log = logging.getLogger("ckptio.tiers")

HELD_FORMAT = PART_FORMAT


class OwnPart:
    """One host's part of a committed checkpoint, as its record says."""

    __slots__ = ("checkpoint_id", "num_hosts", "objects")

    def __init__(self, checkpoint_id: str, num_hosts: int, objects: list[str]) -> None:
        self.checkpoint_id, self.num_hosts, self.objects = checkpoint_id, num_hosts, objects


def own_object_keys(manifest: Manifest, rank: int) -> list[str]:
    """The keys of the objects ``rank`` wrote, in the manifest's order."""
    return [manifest.objects[i] for i, w in enumerate(object_writers(manifest)) if w == rank]


def own_part_record(manifest: Manifest, rank: int, fence: str) -> PartRecord:
    """``rank``'s part of ``manifest`` as a record (version 2): see :func:`part_records`."""
    return part_records(manifest, fence, [rank])[rank]


def part_records(manifest: Manifest, fence: str, ranks: Iterable[int] | None = None) -> dict[int, PartRecord]:
    """Each host's part of ``manifest`` as a record (version 2), in one pass over the manifest: its objects in
    the manifest's order, each with the bytes its extents need, its extents ``[offset, length, crcs, item,
    block]`` and its index in the manifest (a copy to a hashed store names an object by it:
    :func:`ckptio.manage.copying.rekey`). ``ranks``: only those hosts' (default: every host's, ``num_hosts``)."""
    extents = object_extents(manifest)
    sizes = manifest_object_sizes(manifest)
    wanted = range(manifest.num_hosts) if ranks is None else ranks
    mine: dict[int, list[int]] = {r: [] for r in wanted}
    for i, w in enumerate(object_writers(manifest)):
        if w is not None and w in mine:
            mine[w].append(i)
    step = manifest.step if manifest.step is not None else -1
    out = {}
    for r, idx in mine.items():
        keys = [manifest.objects[i] for i in idx]
        out[r] = PartRecord(step, manifest.checkpoint_id, r, fence, manifest.num_hosts, keys, [sizes[k] for k in keys],
                            {"extents": [[list(e) for e in extents[i]] for i in idx], "indices": idx})
    return out


async def write_held(store: CheckpointStore, step: int, manifest: Manifest, rank: int) -> None:
    """Record that ``manifest``'s checkpoint stands committed in this host's ``store`` at ``step``.

    Call it only after the commit stood here (the record names that commit's fence). Replaced whole
    (a re-run after a crash writes the same bytes).
    """
    record = own_part_record(manifest, rank, manifest.fence or "")
    await store.io.write(record.key, [memoryview(record.to_json())])


async def read_held(store: CheckpointStore, step: int, rank: int) -> OwnPart | None:
    """This host's part of ``step`` as its record says, once its own objects are all there.

    None when no record can be trusted (absent, unreadable, its fields disagree with its name, or not
    exactly one of this host's records has a fence that says "commit"): the caller then reads the
    manifest (a non-coordinator has none: the step is then not held). FileNotFoundError when the
    record is sound but one of its objects is gone: the step is not held.
    """
    step_dir = str(step)
    try:
        infos = await store.io.list(f"{step_dir}/")
    except FileNotFoundError:
        return None
    mine = [i for i in infos if (n := parse_held(i.key)) is not None and n.step_dir == step_dir and n.host == rank]
    records, bad = await store.parts.read(step_dir, mine)
    if bad or not records:
        return None
    # A record whose fence does not stand (one written late by a writer paused past a deletion and a
    # re-save of the step) speaks for nothing; the one that stands is this host's commit.
    flags = await gather_or_cancel(store.parts.stands(step_dir, r) for r in records)
    standing = [r for r, ok in zip(records, flags) if ok]
    if len(standing) != 1:
        log.warning("%s: %d of this host's commit records in step %s stand, reading the manifest instead",
                    store.url, len(standing), step_dir)
        return None
    (record,) = standing
    # Each object there, as the manifest's scan checks (a restore checks every byte it reads).
    await gather_or_cancel(store.io.stat(k) for k in record.objects)
    return OwnPart(record.checkpoint_id, record.num_hosts, record.objects)
