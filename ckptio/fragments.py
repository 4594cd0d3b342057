"""Manifest format 2: a small root manifest and one sealed fragment per host.

At thousands of hosts a single manifest naming every shard (format 1) grows
to 100 MB, and every host parsed all of it to find its own few hundred
shards. Format 2 splits it:

* each host writes its **fragment** (``<step>/ckptio.fragment.<save id>``,
  sealed JSON like a manifest): its objects and, per array item, its shards
  with their extents and block checksums;
* the coordinator commits the **root** (``ckptio.manifest.json``, still the
  single commit point, written last): the tree, value items, each array's
  dtype and shape, the fragments (key, size, crc32c) and, per array, a
  *locator* -- the boxes of its shards with the fragment holding each, as a
  compressed int64 table shared by every array with the same layout.

A restore reads the root, asks the locators which fragments hold shards
meeting its target boxes, and reads only those (checked against the crc32c
the root records). Tools that need everything (verify, cp, inspect) load
every fragment into the same in-memory :class:`~ckptio.manifest.Manifest`
as format 1.

What a host sends the coordinator is its fragment's reference and its
shards' boxes: no extents, no checksums.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ckptio.backends.base import check_key, join_key

from . import _json
from .checksum import crc32c
from .errors import IntegrityError, ManifestError
from .manifest import (
    FORMAT,
    TILED_VERSION,
    ArrayItem,
    Manifest,
    ValueItem,
    array_item,
    decode_value,
    first_overlap,
    head_fields,
    seal,
    unseal,
)
from .names import step_of_key

__all__ = ["FRAGMENT_PREFIX", "FragmentRef", "build_root", "fragment_doc", "fragment_key", "load_fragments",
           "root_from_doc", "summary_of"]

FRAGMENT_PREFIX = "ckptio.fragment."
_FRAGMENT_FORMAT = "ckptio-fragment"


@dataclasses.dataclass(frozen=True, slots=True)
class FragmentRef:
    """Where one host's fragment is and what its bytes must be."""

    key: str
    size: int
    crc32c: int
    host: int


def fragment_key(step_dir: str, save_id: str) -> str:
    return join_key(step_dir, FRAGMENT_PREFIX + save_id)


# -- a host's side --------------------------------------------------------------------------------

def fragment_doc(record: Mapping[str, Any], step: int | None, save_id: str, host: int) -> bytes:
    """A host's fragment, sealed, from its format-1 record (``save._host_record``)."""
    items = {name: [[s["offsets"], s["shape"], s["extents"], *([s["tile"]] if "tile" in s else [])]
                    for s in it["shards"]]
             for name, it in record["items"].items() if it["kind"] == "array" and it["shards"]}
    return seal({"format": _FRAGMENT_FORMAT, "version": 2, "step": step, "save_id": save_id, "host": host,
                 "objects": record["objects"], "items": items})


_META_KEYS = ("kind", "dtype", "shape", "scalar", "origin")


def summary_of(record: Mapping[str, Any], ref: FragmentRef | None, *, coordinator: bool) -> dict[str, Any]:
    """What a host sends the coordinator: its fragment's reference and its shards' boxes, compactly.

    Every host flattens the same tree, so array items come in the same order everywhere: a host
    sends a digest of their names, dtypes and shapes (rank 0 also the list itself and the value
    items), how many boxes each array has here, and all boxes as one int64 table padded to the
    largest rank (offset 0, length 1 in the missing dimensions). About 35 bytes per shard.
    """
    meta = [[name, *(it[k] for k in _META_KEYS)] for name, it in record["items"].items() if it["kind"] == "array"]
    width = max((len(m[3]) for m in meta), default=0)
    rows = [[*s["offsets"], *[0] * (width - len(s["offsets"])), *s["shape"], *[1] * (width - len(s["shape"]))]
            for it in record["items"].values() if it["kind"] == "array" for s in it["shards"]]
    table = np.array(rows, dtype=np.int64).reshape(-1, 2 * width)
    doc: dict[str, Any] = {
        "ok": True, "fragment": dataclasses.asdict(ref) if ref is not None else None, "meta_digest": _digest(meta),
        "counts": [len(it["shards"]) for it in record["items"].values() if it["kind"] == "array"],
        "width": width, "boxes": base64.b64encode(zlib.compress(table.tobytes(), 1)).decode(),
        "values": {n: it for n, it in record["items"].items() if it["kind"] != "array"},
        "tiled": any("tile" in s for it in record["items"].values() if it["kind"] == "array" for s in it["shards"]),
    }
    if coordinator:
        doc["meta"] = meta
    return doc


def _digest(meta: Any) -> str:
    return hashlib.blake2b(json.dumps(meta, separators=(",", ":")).encode(), digest_size=16).hexdigest()


# -- the coordinator's side -----------------------------------------------------------------------

def build_root(summaries: list[dict[str, Any]], head: dict[str, Any], where: str) -> dict[str, Any]:
    """The root manifest document from every host's summary; ManifestError if the shards do not tile.

    Vectorised over hosts: a job of 4096 hosts x 256 shards is a million boxes.
    """
    meta = summaries[0]["meta"]
    for rank, s in enumerate(summaries):
        if s["meta_digest"] != summaries[0]["meta_digest"]:
            theirs = s.get("meta")
            diff = None if theirs is None else [m[0] for m, o in zip(meta, theirs) if m != o][:3]
            raise ManifestError(f"{where}: host {rank}'s arrays differ from host 0's (names, dtypes or shapes)"
                                + (f": {diff}" if theirs is not None else ""))
    fragments = [s["fragment"] for s in summaries if s["fragment"] is not None]
    width = summaries[0]["width"]
    n_items = len(meta)
    tables, item_ids, frag_ids = [], [], []
    f = 0
    for s in summaries:
        counts = np.asarray(s["counts"], dtype=np.int64)
        if len(counts) != n_items:
            raise ManifestError(f"{where}: a host's summary does not list every array")
        table = np.frombuffer(zlib.decompress(base64.b64decode(s["boxes"])), dtype=np.int64).reshape(-1, 2 * width)
        if len(table) != counts.sum():
            raise ManifestError(f"{where}: a host's summary holds {len(table)} boxes, its counts say {counts.sum()}")
        if len(table):
            tables.append(table)
            item_ids.append(np.repeat(np.arange(n_items), counts))
            frag_ids.append(np.full(len(table), f if s["fragment"] is not None else -1, dtype=np.int64))
        f += s["fragment"] is not None
    boxes = np.concatenate(tables) if tables else np.zeros((0, 2 * width), np.int64)
    ids = np.concatenate(item_ids) if item_ids else np.zeros(0, np.int64)
    frags = np.concatenate(frag_ids) if frag_ids else np.zeros(0, np.int64)
    order = np.argsort(ids, kind="stable")
    bounds = np.searchsorted(ids[order], np.arange(n_items + 1))
    items: dict[str, Any] = dict(summaries[0]["values"])
    locators: dict[str, str] = {}
    by_content: dict[bytes, str] = {}
    for k, (name, *fields) in enumerate(meta):
        it = dict(zip(_META_KEYS, fields))
        ndim = len(it["shape"])
        sel = order[bounds[k] : bounds[k + 1]]
        rows = boxes[sel]
        table = np.column_stack([frags[sel], rows[:, :ndim], rows[:, width : width + ndim]]).astype(np.int64)
        table = _tiled(table, it["shape"], len(fragments), f"{where}: item {name!r}")
        raw = table.tobytes()
        digest = hashlib.blake2b(raw + bytes([ndim]), digest_size=16).digest()
        lid = by_content.get(digest)
        if lid is None:
            lid = by_content[digest] = str(len(locators))
            locators[lid] = base64.b64encode(zlib.compress(raw, 6)).decode()
        items[name] = {**it, "locator": lid}
    version = TILED_VERSION if any(s.get("tiled") for s in summaries) else 2
    return {**head, "format": FORMAT, "version": version, "items": items, "locators": locators, "fragments": fragments,
            "objects": []}


def _tiled(table: np.ndarray, shape: list[int], n_fragments: int, where: str) -> np.ndarray:
    """``table`` without replicas (the same box from two hosts: the first is kept), checked to tile the array.

    A grid (every mesh sharding) is checked with a few vectorised passes: per dimension its
    distinct intervals must be disjoint, and no two boxes in the same cell; anything else
    goes through :func:`ckptio.manifest.first_overlap`.
    """
    ndim = len(shape)
    if len(table) > 1:
        _u, first = np.unique(table[:, 1:], axis=0, return_index=True)
        if len(first) < len(table):
            table = table[np.sort(first)]
    _check_table(table, shape, n_fragments, where, exact=False)
    live = table[np.prod(table[:, 1 + ndim :], axis=1) > 0] if ndim else table
    if len(live) < 2:
        return table
    # Distinct boxes whose intervals, per dimension, are equal or disjoint cannot overlap.
    grid = True
    for d in range(ndim):
        spans = np.unique(live[:, [1 + d, 1 + ndim + d]], axis=0)
        if (spans[:-1, 0] + spans[:-1, 1] > spans[1:, 0]).any():
            grid = False
            break
    if grid:
        exact = sum(math.prod(r) for r in live[:, 1 + ndim :].tolist())
        if exact != math.prod(shape):
            raise ManifestError(f"{where}: the shards hold {exact} of the array's {math.prod(shape)} elements")
        return table
    _check_table(table, shape, n_fragments, where, exact=True)
    return table


def _check_table(table: np.ndarray, shape: list[int] | tuple[int, ...], n_fragments: int, where: str,
                 *, exact: bool) -> None:
    """Locator rows lie inside the array, name real fragments, and add up to its volume.

    With ``exact`` (at commit, where every box is at hand anyway) no two boxes
    overlap either; a reader checks volumes in floating point only and relies on
    the per-region coverage check of every restore.
    """
    ndim = len(shape)
    if table.size:
        frags, offs, sizes = table[:, 0], table[:, 1 : 1 + ndim], table[:, 1 + ndim :]
        if frags.min() < 0 or frags.max() >= n_fragments:
            raise ManifestError(f"{where}: a shard names a fragment that does not exist")
        # ``offs > shape - sizes``, not ``offs + sizes > shape``: a huge offset must not wrap around int64.
        if (offs < 0).any() or (sizes < 0).any() or (ndim and (offs > np.asarray(shape) - sizes).any()):
            raise ManifestError(f"{where}: a shard lies outside the array shape {list(shape)}")
        volume = float(np.prod(sizes.astype(np.float64), axis=1).sum())
    else:
        volume = 0.0
    want = float(math.prod(shape))
    if abs(volume - want) > 1e-9 * max(want, 1.0):
        raise ManifestError(f"{where}: the shards hold {volume:.0f} of the array's {want:.0f} elements")
    if exact and len(table) > 1:
        boxes = [(tuple(r[1 : 1 + ndim].tolist()), tuple(r[1 + ndim :].tolist())) for r in table
                 if math.prod(r[1 + ndim :].tolist())]
        if sum(math.prod(b[1]) for b in boxes) != math.prod(shape):
            raise ManifestError(f"{where}: the shards do not cover the array exactly")
        pair = first_overlap(boxes)
        if pair is not None:
            raise ManifestError(f"{where}: shards {pair[0]} and {pair[1]} overlap")


# -- reading --------------------------------------------------------------------------------------

def root_from_doc(doc: dict[str, Any], where: str) -> Manifest:
    """A format-2 root as a Manifest with no shards yet (``complete=False``); see :func:`load_fragments`."""
    from .manifest import _int  # noqa: PLC0415 -- one validator of integers for both formats

    block_size = _int(doc["block_size"], "block_size", where, lo=1)
    raw_frags = doc["fragments"]
    if not isinstance(raw_frags, list):
        raise ManifestError(f"{where}: 'fragments' must be a list")
    fragments = []
    for f in raw_frags:
        try:
            check_key(f["key"])
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"{where}: bad fragment reference {str(f)[:100]!r}: {e}") from e
        fragments.append(FragmentRef(f["key"], _int(f["size"], "fragment size", where),
                                     _int(f["crc32c"], "fragment crc32c", where, hi=(1 << 32) - 1),
                                     _int(f.get("host", 0), "fragment host", where)))
    locators = doc["locators"]
    if not isinstance(locators, dict):
        raise ManifestError(f"{where}: 'locators' must be a JSON object")
    tables: dict[tuple[str, int], np.ndarray] = {}
    checked: set[tuple[str, tuple[int, ...]]] = set()
    items: dict[str, ArrayItem | ValueItem] = {}
    for name, raw in doc["items"].items():
        here = f"{where}: item {name!r}"
        if not isinstance(raw, dict):
            raise ManifestError(f"{here}: not a JSON object")
        if raw.get("kind") == "value":
            items[name] = ValueItem(decode_value(raw, here))
            continue
        if raw.get("kind") != "array":
            raise ManifestError(f"{here}: unknown kind {raw.get('kind')!r}")
        item = array_item({**raw, "shards": []}, here, 0, block_size, tiling=False)
        ndim = len(item.shape)
        lid = raw.get("locator")
        if (lid, ndim) not in tables:
            if not isinstance(lid, str) or lid not in locators:
                raise ManifestError(f"{here}: unknown locator {lid!r}")
            try:
                data = zlib.decompress(base64.b64decode(locators[lid], validate=True))
            except (ValueError, zlib.error) as e:
                raise ManifestError(f"{here}: locator {lid!r} is not readable: {e}") from e
            if len(data) % (8 * (1 + 2 * ndim)):
                raise ManifestError(f"{here}: locator {lid!r} does not match the array's rank")
            tables[(lid, ndim)] = np.frombuffer(data, dtype=np.int64).reshape(-1, 1 + 2 * ndim)
        item.locator = tables[(lid, ndim)]
        if (lid, item.shape) not in checked:  # arrays sharing a layout share the check
            _check_table(item.locator, item.shape, len(fragments), here, exact=False)
            checked.add((lid, item.shape))
        items[name] = item
    return Manifest(block_size=block_size, items=items, objects=[], fragments=fragments, complete=False,
                    **head_fields(doc, items, where))


Boxes = Mapping[str, Iterable[tuple[tuple[int, ...], tuple[int, ...]]]]


def fragments_for(manifest: Manifest, wanted: Boxes | None) -> list[int]:
    """Fragment numbers holding shards that meet ``wanted`` (item -> target boxes); all with None."""
    if wanted is None:
        return list(range(len(manifest.fragments or [])))
    out: set[int] = set()
    asked: set[tuple[int, tuple[Any, ...]]] = set()  # arrays sharing a layout and target boxes: asked once
    for name, boxes in wanted.items():
        item = manifest.items.get(name)
        if not isinstance(item, ArrayItem) or item.locator is None or not len(item.locator):
            continue
        boxes = [(tuple(o), tuple(sh)) for o, sh in boxes]
        key = (id(item.locator), tuple(boxes))
        if key in asked:
            continue
        asked.add(key)
        table, ndim = item.locator, len(item.shape)
        offs, sizes = table[:, 1 : 1 + ndim], table[:, 1 + ndim :]
        for off, shape in boxes:
            lo, hi = np.asarray(off, np.int64), np.asarray(off, np.int64) + np.asarray(shape, np.int64)
            meets = ((offs < hi) & (offs + sizes > lo)).all(axis=1) & (sizes > 0).all(axis=1) if ndim else \
                np.ones(len(table), bool)
            out.update(table[meets, 0].tolist())
    return sorted(out)


def load_fragments(manifest: Manifest, datas: Mapping[int, bytes], step_dir: str, where: str,
                   *, complete: bool) -> Manifest:
    """``manifest`` (a format-2 root) with the shards and objects of the fragments in ``datas``.

    Each fragment must be the exact bytes the root recorded (size and crc32c), bound to the
    root's step, and hold the boxes the root's locators assign to it.
    """
    assert manifest.fragments is not None
    objects: list[str] = []
    shards: dict[str, list[Any]] = {}
    owners: dict[str, dict[tuple[int, ...], int]] = {}  # per item: box -> the fragment the root assigns it
    few = len(datas) <= 8
    for f in sorted(datas):
        ref, data = manifest.fragments[f], datas[f]
        here = f"{where}: fragment {ref.key!r}"
        if len(data) != ref.size or crc32c(data) != ref.crc32c:
            raise IntegrityError(f"{here} does not match the checksum the root manifest records", key=ref.key)
        try:
            doc = _json.loads(unseal(data, here))
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"{here}: not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != _FRAGMENT_FORMAT or doc.get("step") != manifest.step:
            raise ManifestError(f"{here}: not a fragment of step {manifest.step}")
        base = len(objects)
        for key in doc["objects"]:
            try:
                check_key(key)
            except (ValueError, TypeError) as e:
                raise ManifestError(f"{here}: bad object key: {e}") from e
            if step_of_key(key) != step_dir:
                raise ManifestError(f"{here}: object {key!r} lies outside this checkpoint's step")
            objects.append(key)
        for name, rows in doc["items"].items():
            item = manifest.items.get(name)
            if not isinstance(item, ArrayItem) or item.locator is None:
                raise ManifestError(f"{here}: names item {name!r} that the root does not hold as an array")
            if few:  # a host reading its own fragment: its rows only, not every host's
                mine = {tuple(r) for r in item.locator[item.locator[:, 0] == f, 1:].tolist()}
                owned = (lambda box, mine=mine: box in mine)
            else:
                owner = owners.get(name)
                if owner is None:
                    owner = owners[name] = {tuple(r[1:]): r[0] for r in item.locator.tolist()}
                owned = (lambda box, owner=owner, f=f: owner.get(box) == f)
            for row in rows:
                if not isinstance(row, list) or len(row) not in (3, 4):
                    raise ManifestError(f"{here}: malformed shard row of item {name!r}")
                offsets, shape, extents = row[:3]
                if not owned((*offsets, *shape)):
                    continue  # a replica the root assigns to another fragment
                shards.setdefault(name, []).append({"offsets": offsets, "shape": shape, "host": ref.host, "extents": [
                    [e[0] + base if isinstance(e[0], int) and 0 <= e[0] < len(doc["objects"]) else -1, *e[1:]]
                    for e in extents], "tile": row[3] if len(row) == 4 else None})
    items: dict[str, ArrayItem | ValueItem] = {}
    for name, item in manifest.items.items():
        if not isinstance(item, ArrayItem):
            items[name] = item
            continue
        raw = {"dtype": None, "shape": list(item.shape),
               "shards": shards.get(name, []), "scalar": item.scalar, "origin": item.origin}
        full = array_item(raw, f"{where}: item {name!r}", len(objects), manifest.block_size,
                          tiling=complete, dtype=item.dtype)
        full.locator = item.locator
        items[name] = full
    return dataclasses.replace(manifest, items=items, objects=objects, complete=complete)
