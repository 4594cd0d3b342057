"""A host's part of a checkpoint, committed in a host-local store by a record and a fence, without the manifest.

In a host-local tier (:mod:`ckptio.tiers`) host 0 commits the job's manifest; every other host holds
only its own objects, and needs only its own part (issue #33: receiving the whole manifest is
O(hosts) per host per save). Such a host commits its part by

1. its objects (written by the save),
2. its *record* ``<step>/ckptio.held.<checkpoint id>.h<host>`` (:func:`ckptio.manifest.names.held_key`): the
   checkpoint id, the host, the number of hosts, a fence id, and each own object's key and size --
   the bytes its extents need, as a manifest's least size (the object may be longer) --
   (``extra``: what the caller adds, e.g. extents),
3. the fence ``<step>/ckptio.fence.<fence id>`` claimed "commit": the commit point.

The same protocol as a manifest's commit (:mod:`ckptio.store.fence`): after its record is in, the
committer claims "revoked" if a deleter revoked one of its objects' writers, else "commit", and
checks its record is still there; a deleter, after revoking the writers of what it deletes, reads
the records again and claims each unclaimed fence "revoked" (:meth:`Parts.settle`): whichever claim
lands first decides, so a committer paused at any point can never make deleted objects count.

A record *stands* when it validates, is bound to its key and step, and its fence says "commit". A
step with a standing record and no tombstone counts as committed (:meth:`Catalog.is_committed` in a
host-local store). Deletion of such a step: tombstone, the record's objects, the record, the fence,
the tombstone (:mod:`ckptio.store.deletion`); gc keeps what a standing record names, its fence and
itself, and takes a record whose fence does not stand (:mod:`ckptio.store.gc`). A record that
cannot be read protects nothing by itself, but gc leaves its step alone (it may name a commit).

Version 1 records (written beside a manifest, naming its fence, without sizes) are read too: in
their step the manifest is the commit, and their fence is the manifest's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import Any

from ckptio.backends.base import ObjectInfo, join_key
from ckptio.engine import gather_or_cancel
from ckptio.errors import IntegrityError, SaveRevokedError
from ckptio.manifest import TOMBSTONE_NAME
from ckptio.manifest.names import fence_key, held_key, parse_held, step_of_key
from ckptio.store.context import StoreContext
from ckptio.store.fence import COMMIT, REVOKED, Fences

__all__ = ["PART_FORMAT", "PartRecord", "Parts", "part_from_json"]

log = logging.getLogger("ckptio.store")

PART_FORMAT = "ckptio.held"


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """One host's part of checkpoint ``checkpoint_id`` at ``step``, as its record says.

    ``sizes``: the bytes each object must have at least (None for a version 1 record, which has
    none); ``extra``: the caller's fields (e.g. extents), carried as they are.
    """

    step: int
    checkpoint_id: str
    host: int
    fence: str
    num_hosts: int
    objects: list[str]
    sizes: list[int] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return held_key(str(self.step), self.checkpoint_id, self.host)

    def to_json(self) -> bytes:
        """The record's bytes (version 2)."""
        doc = {**self.extra, "format": PART_FORMAT, "version": 2, "step": self.step,
               "checkpoint_id": self.checkpoint_id, "host": self.host, "fence": self.fence,
               "num_hosts": self.num_hosts, "objects": self.objects, "sizes": self.sizes}
        return json.dumps(doc).encode()


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def part_from_json(data: bytes, key: str) -> PartRecord:
    """The record stored at ``key``; ValueError naming the key when it is damaged or not bound to its key.

    Bound: its step, checkpoint id and host are its key's, and each object it names lies in its step.
    """
    name = parse_held(key)
    if name is None:
        raise ValueError(f"{key!r} is not a commit record's key")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"commit record {key!r} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT or doc.get("version") not in (1, 2):
        raise ValueError(f"commit record {key!r} is not a {PART_FORMAT} record of version 1 or 2")
    objects, sizes = doc.get("objects"), doc.get("sizes")
    ok = (doc.get("step") == int(name.step_dir) and doc.get("host") == name.host
          and doc.get("checkpoint_id") == name.checkpoint_id and _is_int(doc.get("num_hosts"), 1)
          and isinstance(doc.get("fence"), str) and doc["fence"]
          and isinstance(objects, list) and all(isinstance(k, str) and step_of_key(k) == name.step_dir
                                                for k in objects))
    if ok and doc["version"] == 2:
        ok = isinstance(sizes, list) and len(sizes) == len(objects) and all(_is_int(s) for s in sizes)
    if not ok:
        raise ValueError(f"commit record {key!r} does not match its name, its step, or its own fields")
    extra = {k: v for k, v in doc.items() if k not in (
        "format", "version", "step", "checkpoint_id", "host", "fence", "num_hosts", "objects", "sizes")}
    return PartRecord(doc["step"], doc["checkpoint_id"], doc["host"], doc["fence"], doc["num_hosts"],
                      objects, sizes if doc["version"] == 2 else None, extra)


class Parts:
    """The commit records of one host-local store: committing a part, and which parts stand."""

    def __init__(self, ctx: StoreContext, fences: Fences) -> None:
        self.ctx = ctx
        self.fences = fences

    async def read(self, step_dir: str, listing: Iterable[ObjectInfo] | None = None
                   ) -> tuple[list[PartRecord], list[str]]:
        """The records in ``step_dir`` (listed now, or taken from ``listing``) that validate, and the
        keys of those that do not (logged). A record gone since the listing is simply absent."""
        if listing is None:
            try:
                listing = await self.ctx.io.list(step_dir + "/")
            except FileNotFoundError:
                return [], []
        keys = sorted(i.key for i in listing if (n := parse_held(i.key)) is not None and n.step_dir == step_dir)
        found = await gather_or_cancel(self._read_one(k) for k in keys)
        good = [r for r in found if isinstance(r, PartRecord)]
        bad = [k for k, r in zip(keys, found) if isinstance(r, str)]
        return good, bad

    async def _read_one(self, key: str) -> PartRecord | str | None:
        try:
            return part_from_json(bytes(await self.ctx.io.read(key)), key)
        except FileNotFoundError:
            return None
        except ValueError as e:
            log.warning("%s: %s", self.ctx.url, e)
            return key

    async def stands(self, step_dir: str, record: PartRecord) -> bool:
        """True if ``record``'s fence says "commit" (read only: nothing claimed)."""
        try:
            return await self.fences.outcome(step_dir, record.fence) == COMMIT
        except IntegrityError as e:
            log.warning("%s: %s", self.ctx.url, e)
            return False

    async def standing(self, step_dir: str, listing: Iterable[ObjectInfo] | None = None) -> list[PartRecord]:
        """The records of ``step_dir`` that stand (validate, and their fence says "commit")."""
        records, _bad = await self.read(step_dir, listing)
        flags = await gather_or_cancel(self.stands(step_dir, r) for r in records)
        return [r for r, ok in zip(records, flags) if ok]

    async def settle(self, step_dir: str, record: PartRecord) -> bool:
        """As a deleter, before taking ``record``'s objects: True if its commit stands; an unclaimed fence
        is claimed "revoked" first, so a committer paused before its claim can never make them count."""
        outcome = await self.fences.outcome(step_dir, record.fence)
        if outcome is None:
            outcome = await self.fences.claim(step_dir, record.fence, REVOKED)
        return outcome == COMMIT

    async def commit(self, record: PartRecord) -> None:
        """Commit this host's part: check its objects (each there with at least its size), write the record,
        claim its fence. FileNotFoundError / IntegrityError for a missing or short object, FileExistsError
        while the step is being deleted, SaveRevokedError if a deleter revoked one of its writers."""
        ctx, step_dir = self.ctx, str(record.step)
        where = ctx.where(step_dir)
        sizes = record.sizes if record.sizes is not None else [None] * len(record.objects)
        if len(sizes) != len(record.objects) or any(step_of_key(k) != step_dir for k in record.objects):
            raise ValueError(f"commit record of {where}: its objects and sizes do not match, or an object "
                             "lies outside the step")
        infos = await gather_or_cancel(ctx.io.stat(k) for k in record.objects)
        for info, size in zip(infos, sizes):
            if size is not None and info.size < size:
                raise IntegrityError(f"{info.key}: {info.size} bytes, its record needs {size}", key=info.key)
        if await ctx.exists(join_key(step_dir, TOMBSTONE_NAME)):
            raise FileExistsError(f"{where} is being deleted: this host's part is not committed")
        data = record.to_json()
        await ctx.io.write(record.key, [memoryview(data)])
        revoked = await self.fences.revoked(step_dir) & ctx.writers_of(record.objects)
        stood = await self.fences.claim(step_dir, record.fence, REVOKED if revoked else COMMIT)
        if stood == COMMIT and await self._still_ours(record.key, data):
            return
        if stood == COMMIT:  # deleted with its step before our claim landed: the fence names nothing
            await ctx.delete_keys([fence_key(step_dir, record.fence)])
        elif await self._still_ours(record.key, data):  # never counts (its fence says revoked): out of the way
            await ctx.delete_keys([record.key])
        raise SaveRevokedError(f"commit of this host's part of {where} rolled back: a deleter revoked "
                               "its save or took its record meanwhile")

    async def _still_ours(self, key: str, data: bytes) -> bool:
        try:
            return bytes(await self.ctx.io.read(key)) == data
        except FileNotFoundError:
            return False
