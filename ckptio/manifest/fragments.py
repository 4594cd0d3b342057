"""Manifest format 2, written: a small root manifest and one sealed fragment per host.

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
as format 1. Reading is :mod:`ckptio.manifest.codec.split` and :mod:`ckptio.manifest.lazy`.

What a host sends the coordinator is its fragment's reference and its
shards' boxes: no extents, no checksums.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptio.backends.base import join_key
from ckptio.errors import ManifestError
from ckptio.manifest.codec.columns import COLUMNS_FRAGMENT_VERSION, encode_columns
from ckptio.manifest.codec.sections import SECTIONS_FRAGMENT_VERSION, encode_sections, head_size_of
from ckptio.manifest.codec.split import FRAGMENT_FORMAT
from ckptio.manifest.formats import FORMAT, version_for
from ckptio.manifest.geometry import without_replicas
from ckptio.manifest.hoststate import has_host_states, merge_host_state
from ckptio.manifest.model import FragmentRef
from ckptio.manifest.sealing import seal
from ckptio.system.checksum import crc32c

__all__ = ["FRAGMENT_PREFIX", "FRAGMENT_VERSION", "build_root", "fragment_doc", "fragment_key", "fragment_ref",
           "summary_of"]

FRAGMENT_PREFIX = "ckptio.fragment."


def fragment_key(step_dir: str, save_id: str) -> str:
    return join_key(step_dir, FRAGMENT_PREFIX + save_id)


# -- a host's side --------------------------------------------------------------------------------

#: The version of the fragments this ckptio writes (3: :mod:`.codec.columns`, 4: :mod:`.codec.sections`).
FRAGMENT_VERSION = SECTIONS_FRAGMENT_VERSION


def fragment_doc(record: Mapping[str, Any], step: int | None, save_id: str, host: int) -> bytes:
    """A host's fragment from its format-1 record (``save._host_record``): a head and one binary
    section per array item (fragment version 4, :mod:`.codec.sections`), so that a reader wanting
    few arrays reads only their sections; with :data:`FRAGMENT_VERSION` 3, sealed JSON with its
    shards as columns (:mod:`.codec.columns`). Its reference: :func:`fragment_ref`."""
    if FRAGMENT_VERSION == SECTIONS_FRAGMENT_VERSION:
        items = [(name, it["shards"]) for name, it in record["items"].items() if it["kind"] == "array"]
        return encode_sections(step, record["objects"], items)[0]
    items = [(name, it["shards"]) for name, it in record["items"].items() if it["kind"] == "array" and it["shards"]]
    return seal({"format": FRAGMENT_FORMAT, "version": COLUMNS_FRAGMENT_VERSION, "step": step, "save_id": save_id,
                 "host": host, "objects": record["objects"], **encode_columns(items)})


def fragment_ref(key: str, data: bytes, host: int) -> FragmentRef:
    """The root's reference to fragment ``data`` stored at ``key``: its size and crc32c and, for a
    version-4 fragment, its head's."""
    head = head_size_of(data)
    return FragmentRef(key, len(data), crc32c(data), host, head, None if head is None else crc32c(data[:head]))


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
    # len(rows), not -1: a state with no arrays at all (only values) has width 0
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 2 * width)
    doc: dict[str, Any] = {
        "ok": True, "fragment": _ref_doc(ref), "meta_digest": _digest(meta),
        "counts": [len(it["shards"]) for it in record["items"].values() if it["kind"] == "array"],
        "width": width, "boxes": base64.b64encode(zlib.compress(table.tobytes(), 1)).decode(),
        "values": {n: it for n, it in record["items"].items() if it["kind"] != "array"},
        "tiled": any("tile" in s for it in record["items"].values() if it["kind"] == "array" for s in it["shards"]),
        # An extent with a checksum block of its own (a 6th element) makes the root format 6.
        "blocks": any(len(e) > 5 for it in record["items"].values() if it["kind"] == "array"
                      for s in it["shards"] for e in s["extents"]),
    }
    if coordinator:
        doc["meta"] = meta
    return doc


def _ref_doc(ref: FragmentRef | None) -> dict[str, Any] | None:
    """A fragment reference as the root records it (no head fields for a fragment without a head)."""
    return None if ref is None else {k: v for k, v in dataclasses.asdict(ref).items() if v is not None}


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
        table = np.frombuffer(zlib.decompress(base64.b64decode(s["boxes"])), dtype=np.int64)
        table = table.reshape(len(table) // (2 * width) if width else 0, 2 * width)
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
    items: dict[str, Any] = {n: it for n, it in summaries[0]["values"].items() if it["kind"] != "per_host"}
    for s in summaries:  # every host sends its own per-host states (each host's own, no one else's)
        for n, it in s["values"].items():
            if it["kind"] == "per_host":
                merge_host_state(items, n, it, where)
    locators: dict[str, str] = {}
    by_content: dict[bytes, str] = {}
    for k, (name, *fields) in enumerate(meta):
        it = dict(zip(_META_KEYS, fields))
        ndim = len(it["shape"])
        sel = order[bounds[k] : bounds[k + 1]]
        rows = boxes[sel]
        table = np.column_stack([frags[sel], rows[:, :ndim], rows[:, width : width + ndim]]).astype(np.int64)
        table = without_replicas(table, it["shape"], len(fragments), f"{where}: item {name!r}")
        raw = table.tobytes()
        digest = hashlib.blake2b(raw + bytes([ndim]), digest_size=16).digest()
        lid = by_content.get(digest)
        if lid is None:
            lid = by_content[digest] = str(len(locators))
            locators[lid] = base64.b64encode(zlib.compress(raw, 6)).decode()
        items[name] = {**it, "locator": lid}
    version = version_for(fragments=True, columns=True, tiles=any(s.get("tiled") for s in summaries),
                          blocks=any(s.get("blocks") for s in summaries), host_states=has_host_states(items.values()),
                          heads=any("head_size" in f for f in fragments))
    return {**head, "format": FORMAT, "version": version, "items": items, "locators": locators, "fragments": fragments,
            "objects": []}
