"""Format 2, read: a root manifest and the per-host fragments it names.

The root (``ckptio.manifest.json``) holds the tree, value items, each array's
dtype and shape, the fragments (key, size, crc32c) and, per array, a
*locator*: the boxes of its shards with the fragment holding each, as a
compressed int64 table shared by every array with the same layout.
:func:`root_from_doc` reads a root into a :class:`~ckptio.manifest.model.Manifest`
with no shards yet (``complete=False``); :func:`load_fragments` adds the
shards and objects of the fragments read. Which fragments to read is the
question of :mod:`ckptio.manifest.lazy`; writing is :mod:`ckptio.manifest.fragments`.
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ckptio.backends.base import check_key

from ... import _json
from ...checksum import crc32c
from ...errors import IntegrityError, ManifestError
from ...names import step_of_key
from ..formats import HOST_STATES_VERSION
from ..geometry import check_table
from ..hoststate import host_state_item
from ..limits import U32, check_int
from ..model import ArrayItem, FragmentRef, Manifest, ValueItem
from ..seal import unseal
from ..values import decode_value
from .arrays import array_item
from .columns import COLUMNS_FRAGMENT_VERSION, Columns, decode_columns, from_columns
from .gather import Gather
from .single import head_fields

__all__ = ["FRAGMENT_FORMAT", "FragmentLoader", "load_fragments", "root_from_doc"]

#: The ``format`` of a fragment document.
FRAGMENT_FORMAT = "ckptio-fragment"


def root_from_doc(doc: dict[str, Any], where: str) -> Manifest:
    """A format-2 root as a Manifest with no shards yet (``complete=False``); see :func:`load_fragments`."""
    block_size = check_int(doc["block_size"], "block_size", where, lo=1)
    raw_frags = doc["fragments"]
    if not isinstance(raw_frags, list):
        raise ManifestError(f"{where}: 'fragments' must be a list")
    fragments = []
    for f in raw_frags:
        try:
            check_key(f["key"])
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"{where}: bad fragment reference {str(f)[:100]!r}: {e}") from e
        fragments.append(FragmentRef(f["key"], check_int(f["size"], "fragment size", where),
                                     check_int(f["crc32c"], "fragment crc32c", where, hi=U32 - 1),
                                     check_int(f.get("host", 0), "fragment host", where)))
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
        if raw.get("kind") == "per_host" and doc["version"] >= HOST_STATES_VERSION:
            items[name] = host_state_item(raw, here)
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
            check_table(item.locator, item.shape, len(fragments), here, exact=False)
            checked.add((lid, item.shape))
        items[name] = item
    return Manifest(block_size=block_size, items=items, objects=[], fragments=fragments, complete=False,
                    **head_fields(doc, items, where))


def load_fragments(manifest: Manifest, datas: Mapping[int, bytes], step_dir: str, where: str,
                   *, complete: bool, names: Collection[str] | None = None) -> Manifest:
    """``manifest`` (a format-2 root) with the shards and objects of the fragments in ``datas``.

    Each fragment must be the exact bytes the root recorded (size and crc32c), bound to the
    root's step, and hold the boxes the root's locators assign to it. Columnar fragments
    (version 3, :mod:`.columns`) become each item's :class:`~ckptio.manifest.table.ShardTable`
    straight from their columns; version-2 fragments' rows are read one by one. ``names``: the
    array items to give shards (None: all); the others keep none. (:class:`FragmentLoader`
    takes the fragments one at a time, so a reader of thousands holds few of them at once.)
    """
    if manifest.complete:  # every shard already at hand (format 1, or all fragments read)
        return manifest
    loader = FragmentLoader(manifest, step_dir, where, complete=complete, names=names, few=len(datas) <= 8,
                            expect=len(datas))
    for f in sorted(datas):
        loader.add(f, datas[f])
    return loader.done()


class FragmentLoader:
    """Reads a format-2 root's fragments one at a time (:meth:`add`, in fragment order), then
    makes the manifest with their shards (:meth:`done`; see :func:`load_fragments`).

    A columnar fragment is decompressed as it is added and only the rows of the items ``names``
    lists are copied into the loader's columns (:class:`~.gather.Gather`; ``expect``: how many
    fragments will be added, if known), so its bytes can be dropped at once: a host that wants
    one array of a checkpoint of 4096 fragments holds one fragment's bytes and that array's
    rows, not every fragment."""

    def __init__(self, manifest: Manifest, step_dir: str, where: str, *, complete: bool,
                 names: Collection[str] | None, few: bool, expect: int | None = None) -> None:
        assert manifest.fragments is not None and not manifest.complete
        self.manifest, self.step_dir, self.where = manifest, step_dir, where
        self.complete, self.names, self.few = complete, names, few
        self.arrays = {n for n, it in manifest.items.items() if isinstance(it, ArrayItem)}
        self.objects: list[str] = []
        self.shards: dict[str, list[Any]] = {}
        self.owners: dict[str, dict[tuple[int, ...], int]] = {}  # per item: box -> the fragment the root assigns it
        self.gather = Gather([n for n, it in manifest.items.items() if isinstance(it, ArrayItem)], names, expect)
        self.last: Columns | None = None  # the columnar fragment added last (the next shares its item index)

    def add(self, f: int, data: bytes) -> None:
        """Fragment number ``f``'s bytes, checked against the root's record of it."""
        ref = self.manifest.fragments[f]  # type: ignore[index]
        here = f"{self.where}: fragment {ref.key!r}"
        doc = _fragment_doc(self.manifest, ref, data, here)
        base = len(self.objects)
        self.objects += _fragment_objects(doc, here, self.step_dir)
        if doc.get("version") == COLUMNS_FRAGMENT_VERSION:
            self.last = decode_columns(doc, here, self.last, keep=self.names, arrays=self.arrays)
            self.gather.add(f, base, self.last)
        else:
            _rows_v2(self.manifest, f, doc, base, here, self.shards, self.owners, few=self.few, names=self.names)
        if self.last is not None and self.shards:
            raise ManifestError(f"{self.where}: its fragments mix versions 2 and {COLUMNS_FRAGMENT_VERSION}")

    def done(self) -> Manifest:
        """The manifest with the shards of every fragment added."""
        manifest, where, objects = self.manifest, self.where, self.objects
        built = (from_columns(manifest, self.gather.done(), where, complete=self.complete)
                 if self.last is not None else {})
        items: dict[str, ArrayItem | ValueItem] = {}
        for name, item in manifest.items.items():
            if not isinstance(item, ArrayItem):
                items[name] = item
                continue
            full = built.get(name)
            if full is None:
                raw = {"dtype": None, "shape": list(item.shape),
                       "shards": self.shards.get(name, []), "scalar": item.scalar, "origin": item.origin}
                full = array_item(raw, f"{where}: item {name!r}", len(objects), manifest.block_size,
                                  tiling=self.complete, dtype=item.dtype)
            full.locator = item.locator
            items[name] = full
        return dataclasses.replace(manifest, items=items, objects=objects, complete=self.complete)


def _fragment_doc(manifest: Manifest, ref: FragmentRef, data: bytes, here: str) -> dict[str, Any]:
    """A fragment's document, checked against the root's record of it and bound to its step."""
    if len(data) != ref.size or crc32c(data) != ref.crc32c:
        raise IntegrityError(f"{here} does not match the checksum the root manifest records", key=ref.key)
    try:
        doc = _json.loads(unseal(data, here))
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{here}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FRAGMENT_FORMAT or doc.get("step") != manifest.step:
        raise ManifestError(f"{here}: not a fragment of step {manifest.step}")
    return doc


def _fragment_objects(doc: dict[str, Any], here: str, step_dir: str) -> list[str]:
    keys = doc["objects"]
    if not isinstance(keys, list):
        raise ManifestError(f"{here}: 'objects' must be a list")
    for key in keys:
        try:
            check_key(key)
        except (ValueError, TypeError) as e:
            raise ManifestError(f"{here}: bad object key: {e}") from e
        if step_of_key(key) != step_dir:
            raise ManifestError(f"{here}: object {key!r} lies outside this checkpoint's step")
    return keys


def _rows_v2(manifest: Manifest, f: int, doc: dict[str, Any], base: int, here: str, shards: dict[str, list[Any]],
             owners: dict[str, dict[tuple[int, ...], int]], *, few: bool, names: Collection[str] | None) -> None:
    """A version-2 fragment's shard rows (JSON lists) into ``shards``, as item JSON."""
    n_objects = len(doc["objects"])
    host = manifest.fragments[f].host  # type: ignore[index]
    for name, rows in doc["items"].items():
        item = manifest.items.get(name)
        if not isinstance(item, ArrayItem) or item.locator is None:
            raise ManifestError(f"{here}: names item {name!r} that the root does not hold as an array")
        if names is not None and name not in names:
            continue
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
            shards.setdefault(name, []).append({"offsets": offsets, "shape": shape, "host": host, "extents": [
                [e[0] + base if isinstance(e[0], int) and 0 <= e[0] < n_objects else -1, *e[1:]]
                for e in extents], "tile": row[3] if len(row) == 4 else None})
