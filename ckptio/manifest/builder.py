"""One builder of manifest records, for every writer: a save's hosts, the coordinator, DCP, converters.

A host's **record** is its part of the manifest: ``{"ok": True, "objects":
[keys], "items": {name: item JSON | compact row}, "packs"?: [tables]}``,
object numbers local to the host. :func:`host_record` builds it from plain
data (what was staged, planned and written; see the protocols below: the
builder sits under staging, layout and the engine and imports none of
them); :func:`merged_doc` merges every host's record into one document in the
lowest version that expresses it, and :func:`merge_records` validates that
document as any reader would. :func:`expanded` gives a record's compact rows
as full items (what format-2 fragments hold), and :class:`ObjectNumbers`
numbers objects for writers that name them by key (DCP). Item JSON itself
comes from :mod:`.itemjson`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from ckptio.errors import ManifestError, SaveFailedError
from ckptio.manifest.codec import decode
from ckptio.manifest.formats import version_for
from ckptio.manifest.hoststate import StagedHostState, has_host_states, merge_host_state
from ckptio.manifest.itemjson import (
    array_json, dtype_code, item_row, item_to_json, row_object, shard_json, table_doc,
)
from ckptio.manifest.model import Manifest, ValueItem
from ckptio.state.dtypes import encode_dtype

__all__ = [
    "PACKED",
    "ObjectNumbers",
    "expanded",
    "host_record",
    "merge_records",
    "merged_doc",
    "validated",
]

#: A staged item's place when the item itself is in a pack (see :func:`host_record`).
PACKED: Any = object()


class PlannedExtent(Protocol):
    """Part of a shard (or a whole pack: ``cuts`` set, ``shard`` = -1 - pack number) in an object."""

    item: str
    shard: int
    shard_offset: int
    offset: int
    length: int
    cuts: list[int] | None
    #: Its own checksum block size, or 0: the save's (the manifest's ``block_size``).
    block: int


class PlannedObject(Protocol):
    """An object as planned: its key and its extents, in order."""

    key: str
    extents: Sequence[PlannedExtent]


class WrittenObject(Protocol):
    """An object as written: the block checksums of each of its extents, in order."""

    crcs: Sequence[list[int]]


class Pack(Protocol):
    """Small whole arrays of one dtype and origin, back to back (``ends``: each member's end)."""

    names: list[str]
    arrays: list[np.ndarray]
    origin: str
    ends: list[int]


class StagedArray(Protocol):
    """An array as a host staged it: its shards' ``(offsets, shape, data)`` and tiles."""

    dtype: np.dtype
    shape: tuple[int, ...]
    scalar: bool
    origin: str
    shards: list[tuple[tuple[int, ...], tuple[int, ...], Any]]

    def tile_of(self, i: int) -> tuple[int, ...] | None: ...


def _pack_items(items: dict[str, Any], pack: Pack, n: int, at: int, crcs: list[int], rank: int) -> None:
    """The items of a pack written at offset ``at`` of object ``n`` (``crcs``: one per member), as
    compact rows (:func:`~.itemjson.item_row`)."""
    start = 0
    dtype = dtype_code(pack.arrays[0].dtype)
    origin = pack.origin
    for name, arr, end, crc in zip(pack.names, pack.arrays, pack.ends, crcs):
        items[name] = item_row(dtype, list(arr.shape), n, at + start, [crc], rank, origin)
        start = end


def _pack_table(pack: Pack, n: int, at: int, crcs: list[int], rank: int) -> dict[str, Any]:
    """The format-5 table of a pack written at offset ``at`` of object ``n``."""
    return table_doc(dtype_code(pack.arrays[0].dtype), n, at, pack.names, [list(a.shape) for a in pack.arrays],
                     pack.ends, crcs, rank, pack.origin, [])


def expanded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its compact rows as full item objects (what fragments are built from)."""
    items = {name: row_object(it) if type(it) is list else it for name, it in record["items"].items()}
    return {**record, "items": items}


def _array_record(item: StagedArray, extents: dict[tuple[str, int], list[list[Any]]], name: str,
                  rank: int) -> dict[str, Any]:
    shards = [shard_json(list(o), list(s), rank, sorted(extents.get((name, i), []), key=lambda x: x[2]),
                         item.tile_of(i))
              for i, (o, s, _d) in enumerate(item.shards)]
    return array_json(encode_dtype(item.dtype), list(item.shape), item.scalar, item.origin, shards)


def host_record(
    staged: dict[str, Any], plans: Sequence[PlannedObject], written: Sequence[WrittenObject], rank: int,
    include_values: bool, packs: Sequence[Pack] = (), tables: bool = False,
) -> dict[str, Any]:
    """This host's part of the manifest, with object numbers local to the host.

    ``staged``: each item's :class:`StagedArray`, :class:`~.model.ValueItem`,
    :class:`~.hoststate.StagedHostState` or :data:`PACKED`.
    Its packs' members are compact rows among the items or, with ``tables`` (format 5; a
    single-host save, whose record is the whole manifest), one table per pack.
    """
    extents: dict[tuple[str, int], list[list[Any]]] = {}
    packed: dict[str, Any] = {}
    pack_tables: list[dict[str, Any]] = []
    for n, (plan, w) in enumerate(zip(plans, written)):
        for e, crcs in zip(plan.extents, w.crcs):
            if e.cuts is None:
                row = [n, e.offset, e.shard_offset, e.length, crcs]
                if e.block:  # a block of its own (format 6); none: the manifest's
                    row.append(e.block)
                extents.setdefault((e.item, e.shard), []).append(row)
            elif tables:
                pack_tables.append(_pack_table(packs[-1 - e.shard], n, e.offset, crcs, rank))
            else:
                _pack_items(packed, packs[-1 - e.shard], n, e.offset, crcs, rank)
    items: dict[str, Any] = {}
    for name, item in staged.items():
        if item is PACKED:
            if not tables:
                items[name] = packed[name]
        elif isinstance(item, StagedHostState):  # every host's own: in every host's record
            items[name] = item.record()
        elif not isinstance(item, ValueItem):
            items[name] = _array_record(item, extents, name, rank)
        elif include_values:
            items[name] = item_to_json(item, name)
    record = {"ok": True, "objects": [p.key for p in plans], "items": items}
    if pack_tables:
        record["packs"] = pack_tables
    return record


def merge_records(records: list[dict[str, Any]], head: dict[str, Any], where: str) -> Manifest:
    """The coordinator's manifest from every host's record (validated like any manifest read)."""
    return validated(merged_doc(records, head, where), where)


def validated(doc: dict[str, Any], where: str) -> Manifest:
    """``doc`` read back as any reader would (which also checks that every array's shards tile it)."""
    try:
        return decode(doc, where)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: the merged manifest is invalid: {e}") from e


class ObjectNumbers:
    """Objects numbered in order of first mention, for writers that name extents by object key."""

    def __init__(self) -> None:
        self.objects: list[str] = []
        self._numbers: dict[str, int] = {}

    def extents(self, extents: Iterable[tuple[Any, ...]]) -> list[list[Any]]:
        """``(key, offset, shard_offset, length, crcs[, block])`` tuples as the manifest's extent rows
        (``block``: the extent's own checksum block size, carried through as the row's 6th element)."""
        out = []
        for key, offset, shard_offset, length, crcs, *block in extents:
            n = self._numbers.get(key)
            if n is None:
                n = self._numbers[key] = len(self.objects)
                self.objects.append(key)
            out.append([n, offset, shard_offset, length, list(crcs), *block])
        return out


def merged_doc(records: list[dict[str, Any]], head: dict[str, Any], where: str) -> dict[str, Any]:
    """Every host's record in one manifest document, in the lowest version that expresses it (rows, tiles,
    pack tables: only a single host's record has those)."""
    objects: list[str] = []
    items: dict[str, Any] = {}
    tables: list[dict[str, Any]] = []
    # Boxes already in each array item, kept across hosts: rebuilding them per host made
    # merging quadratic in the host count (1024 hosts x 8 shards per array).
    boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for host, rec in enumerate(records):
        base = len(objects)
        objects.extend(rec["objects"])
        for table in rec.get("packs", ()):  # only a single host's record has tables
            table["object"] += base
            tables.append(table)
        for name, it in rec["items"].items():
            if type(it) is list:  # a compact row: a whole array in one extent
                it[2] += base
                if items.setdefault(name, it) is it:
                    continue
                it = row_object(it)  # the same item from two hosts: compared in full below
            elif it["kind"] == "array":
                for s in it["shards"]:
                    for e in s["extents"]:
                        e[0] += base
            elif it["kind"] == "per_host":
                merge_host_state(items, name, it, where)
                continue
            mine = items.get(name)
            if mine is None:
                items[name] = it
                if it["kind"] == "array":
                    boxes[name] = {(tuple(s["offsets"]), tuple(s["shape"])) for s in it["shards"]}
                continue
            if type(mine) is list and it["kind"] == "array" and not it["shards"]:
                if (it["dtype"], it["shape"]) != (mine[0], mine[1]):  # another host's view of a host-0 array
                    raise SaveFailedError(f"{where}: item {name!r} differs between hosts (dtype, shape or kind)")
                continue
            if type(mine) is list:
                mine = items[name] = row_object(mine)
                boxes[name] = {(tuple(s["offsets"]), tuple(s["shape"])) for s in mine["shards"]}
            if it["kind"] != mine["kind"] or (it["kind"] == "array" and (it["dtype"], it["shape"]) != (mine["dtype"], mine["shape"])):
                raise SaveFailedError(f"{where}: item {name!r} differs between hosts (dtype, shape or kind)")
            if it["kind"] == "array":
                seen = boxes[name]
                for s in it["shards"]:  # a replica another host already wrote is left out
                    box = (tuple(s["offsets"]), tuple(s["shape"]))
                    if box not in seen:
                        seen.add(box)
                        mine["shards"].append(s)
    tiled = rows = blocks = False
    for name, it in items.items():
        if type(it) is list:
            rows = True
            continue
        if it["kind"] == "array" and not it["shards"] and math.prod(it["shape"]):
            raise SaveFailedError(
                f"{where}: item {name!r} has no shard on any host. Plain arrays count as replicated and are "
                "written by host 0 only; an array that only some hosts hold must be a ckptio.Sharded"
            )
        if it["kind"] == "array":
            tiled = tiled or any("tile" in sh for sh in it["shards"])
            blocks = blocks or any(len(e) > 5 for sh in it["shards"] for e in sh["extents"])
    version = version_for(tiles=tiled, rows=rows, packs=bool(tables), blocks=blocks,
                          host_states=has_host_states(items.values()))
    if tables:
        return {**head, "version": version, "objects": objects, "items": items, "packs": tables}
    return {**head, "version": version, "objects": objects, "items": items}
