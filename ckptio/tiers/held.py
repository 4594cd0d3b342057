"""A host's commit record in its fast tier: what it holds of a committed step, without the job's manifest.

At a restart every host scans what it holds (:func:`ckptio.tiers.peer.holdings`). Read from the
manifest, that is a parse of every host's shards per step (87 MB at 4096 hosts x 128 shards,
seconds per step) to learn three things about this host's own part: the checkpoint id, the
number of hosts, and which objects are its own. So once a step is committed in its fast tier,
each host writes them down in ``<step>/ckptio.held.<checkpoint id>.h<host>`` (:mod:`ckptio.names`),
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
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ..copy import object_writers
from ..manifest import Manifest
from ..names import fence_key, held_key, parse_held
from ..store import CheckpointStore

__all__ = ["HELD_FORMAT", "OwnPart", "read_held", "write_held"]

log = logging.getLogger("ckptio.tiers")

HELD_FORMAT = "ckptio.held"


class OwnPart:
    """One host's part of a committed checkpoint, as its record says."""

    __slots__ = ("checkpoint_id", "num_hosts", "objects")

    def __init__(self, checkpoint_id: str, num_hosts: int, objects: list[str]) -> None:
        self.checkpoint_id, self.num_hosts, self.objects = checkpoint_id, num_hosts, objects


def own_object_keys(manifest: Manifest, rank: int) -> list[str]:
    """The keys of the objects ``rank`` wrote, in the manifest's order."""
    return [manifest.objects[i] for i, w in enumerate(object_writers(manifest)) if w == rank]


async def write_held(store: CheckpointStore, step: int, manifest: Manifest, rank: int) -> None:
    """Record that ``manifest``'s checkpoint stands committed in this host's ``store`` at ``step``.

    Call it only after the commit stood here. Replaced whole (a re-run after a crash writes the
    same bytes).
    """
    step_dir = str(step)
    doc = {"format": HELD_FORMAT, "version": 1, "step": step, "checkpoint_id": manifest.checkpoint_id,
           "host": rank, "fence": manifest.fence, "num_hosts": manifest.num_hosts, "objects": own_object_keys(manifest, rank)}
    await store.io.write(held_key(step_dir, manifest.checkpoint_id, rank), [memoryview(json.dumps(doc).encode())])


async def read_held(store: CheckpointStore, step: int, rank: int) -> OwnPart | None:
    """This host's part of ``step`` as its record says, once its own objects are all there.

    None when the record cannot be trusted (absent, unreadable, not exactly one for this host, its
    fields disagree with its name, or its commit's fence is not in the step): the caller then reads
    the manifest. FileNotFoundError when
    the record is sound but one of its objects is gone (the step is not held).
    """
    step_dir = str(step)
    try:
        infos = await store.io.list(f"{step_dir}/")
    except FileNotFoundError:
        return None
    listed = {i.key for i in infos}
    names = [(i.key, n) for i in infos if (n := parse_held(i.key)) is not None and n.step_dir == step_dir
             and n.host == rank]
    if len(names) != 1:
        return None
    key, name = names[0]
    try:
        doc: dict[str, Any] = json.loads(await store.io.read(key))
        ok = (doc.get("format") == HELD_FORMAT and doc.get("step") == step and doc.get("host") == rank
              and doc.get("checkpoint_id") == name.checkpoint_id and isinstance(doc.get("num_hosts"), int)
              and isinstance(doc.get("objects"), list) and all(isinstance(k, str) for k in doc["objects"])
              and isinstance(doc.get("fence"), str) and fence_key(step_dir, doc["fence"]) in listed)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        log.warning("%s: unreadable commit record %s, reading the manifest instead: %r", store.url, key, e)
        return None
    if not ok:
        log.warning("%s: commit record %s does not match its name or its step's fence, reading the manifest instead",
                    store.url, key)
        return None
    await asyncio.gather(*(store.io.stat(k) for k in doc["objects"]))
    return OwnPart(name.checkpoint_id, doc["num_hosts"], doc["objects"])
