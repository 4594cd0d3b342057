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
import itertools
import zlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ckptio.backends.base import check_key
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest.codec.arrays import array_item
from ckptio.manifest.codec.columns import COLUMNS_FRAGMENT_VERSION, Columns, decode_columns, from_columns
from ckptio.manifest.codec.gather import Gather
from ckptio.manifest.codec.sections import (
    SECTIONS_FRAGMENT_VERSION, Head, index_range, names_digest, parse_head, parse_index, take_sections,
    take_whole,
)
from ckptio.manifest.codec.single import head_fields
from ckptio.manifest.codec.wholes import take_wholes
from ckptio.manifest.formats import HEADS_VERSION, HOST_REFS_VERSION, HOST_STATES_VERSION
from ckptio.manifest.geometry import check_table
from ckptio.manifest.hoststate import host_state_item
from ckptio.manifest.limits import U32, check_int
from ckptio.manifest.model import ArrayItem, FragmentRef, Manifest, ValueItem
from ckptio.manifest.names import step_of_key
from ckptio.manifest.refs import decode_refs
from ckptio.manifest.sealing import unseal
from ckptio.manifest.values import decode_value
from ckptio.system import jsonio as _json
from ckptio.system.checksum import crc32c

__all__ = ["FRAGMENT_FORMAT", "FragmentLoader", "load_fragments", "root_from_doc"]

#: The ``format`` of a fragment document.
FRAGMENT_FORMAT = "ckptio-fragment"
#: Index entries lying this close behind a head are read with it, in one request.
_GAP = 256
#: Whole version-4 fragments taken at once: enough that the array calls' fixed cost is spread
#: thin, few enough that their index arrays (one int64 per checksum) stay a few MB.
WHOLES = 32


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
                                     check_int(f.get("host", 0), "fragment host", where), *_head_of(f, doc, where)))
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
    # A multi-host incremental save's root names the older steps its fragments reference (format 9, bases
    # only: each host keeps its own digests).
    if doc.get("bases") is not None and doc["version"] < HOST_REFS_VERSION:
        raise ManifestError(f"{where}: 'bases' in a root needs format {HOST_REFS_VERSION}, the document says {doc['version']}")
    bases = decode_refs(doc, doc["version"], where).get("bases")
    return Manifest(block_size=block_size, items=items, objects=[], fragments=fragments, complete=False,
                    bases=bases, **head_fields(doc, items, where))


def _head_of(f: dict[str, Any], doc: dict[str, Any], where: str) -> tuple[int | None, int | None]:
    """A fragment reference's head length and crc32c (format 10), or none."""
    if "head_size" not in f and "head_crc32c" not in f:
        return None, None
    if doc["version"] < HEADS_VERSION:
        raise ManifestError(f"{where}: fragment {f['key']!r} has a head, which needs format {HEADS_VERSION}")
    size = check_int(f.get("head_size"), "fragment head size", where, lo=1, hi=f["size"])
    return size, check_int(f.get("head_crc32c"), "fragment head crc32c", where, hi=U32 - 1)


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
        array_names = [n for n, it in manifest.items.items() if isinstance(it, ArrayItem)]
        self.gather = Gather(array_names, names, expect)
        self.last: Columns | None = None  # the columnar fragment added last (the next shares its item index)
        # Version-4 fragments number their sections as the root lists its arrays.
        self.array_names, self.digest = array_names, names_digest(array_names)
        self.wanted = None if names is None else sorted(i for i, n in enumerate(array_names) if n in names)
        self.heads: dict[int, tuple[Head, int, np.ndarray]] = {}  # ranged reads: head, first entry, entries
        self.last_key: tuple[np.ndarray, np.ndarray] | None = None  # the last v4 fragment's sections and rows

    def ranged(self) -> bool:
        """Whether to read fragments by range (head, index entries, sections): a reader wanting few
        of the arrays of fragments that all have heads. One wanting many reads them whole."""
        refs = self.manifest.fragments or []
        return (self.wanted is not None and len(self.wanted) * 4 <= len(self.array_names)
                and all(r.head_size is not None for r in refs))

    def head_ranges(self, f: int) -> list[tuple[int, int]]:
        """The byte ranges to read first of fragment ``f`` (see :meth:`ranged`): its head, then the
        index entries of the wanted arrays (one range when they lie close behind the head)."""
        size = self.manifest.fragments[f].head_size  # type: ignore[index]
        assert size is not None and self.wanted is not None
        if not self.wanted:
            return [(0, size)]
        lo, hi = index_range(size, self.wanted[0], self.wanted[-1])
        return [(0, hi)] if lo - size <= _GAP else [(0, size), (lo, hi)]

    def section_ranges(self, f: int, parts: list[bytes]) -> list[tuple[int, int]]:
        """Fragment ``f``'s head and index entries (as :meth:`head_ranges` read them), checked; the
        byte ranges of the wanted arrays' sections (adjacent ones joined)."""
        ref = self.manifest.fragments[f]  # type: ignore[index]
        here = f"{self.where}: fragment {ref.key!r}"
        data = b"".join(parts)
        assert ref.head_size is not None and ref.head_crc32c is not None and self.wanted is not None
        head = self._head(parse_head(data, ref.head_size, ref.head_crc32c, here, ref.key), here)
        first = self.wanted[0] if self.wanted else 0
        lo, hi = index_range(ref.head_size, first, self.wanted[-1]) if self.wanted else (0, 0)
        raw = data[ref.head_size:] if len(parts) == 1 else parts[1]
        index = parse_index(raw[len(raw) - (hi - lo):] if hi > lo else b"", first, head, ref.size, here)
        self.heads[f] = (head, first, index)
        return self.section_ranges_of(index, first)

    def add_sections(self, f: int, blobs: list[bytes]) -> None:
        """Fragment ``f``'s sections, read as :meth:`section_ranges` said, checked and added."""
        head, first, index = self.heads.pop(f)
        ref = self.manifest.fragments[f]  # type: ignore[index]
        here = f"{self.where}: fragment {ref.key!r}"
        data = {}
        for blob, (start, _end) in zip(blobs, self.section_ranges_of(index, first)):
            view = memoryview(blob)
            for i in self.wanted or []:
                off, n = index[i - first, :2].tolist()
                if n and start <= off < start + len(blob):
                    data[i] = view[off - start : off - start + n]
        numbers, rows, cols = take_sections(data, index, first, head, here, ref.key)
        self._add4(f, head, numbers, rows, cols, here)

    def add(self, f: int, data: bytes) -> None:
        """Fragment number ``f``'s bytes, checked against the root's record of it."""
        ref = self.manifest.fragments[f]  # type: ignore[index]
        here = f"{self.where}: fragment {ref.key!r}"
        if ref.head_size is not None:
            _check_whole(ref, data, here)
            head = self._head(parse_head(data, ref.head_size, ref.head_crc32c or 0, here, ref.key), here)
            self._add4(f, head, *take_whole(data, head, self.wanted, here), here)
            return
        doc = _fragment_doc(self.manifest, ref, data, here)
        base = len(self.objects)
        self.objects += _fragment_objects(doc, here, self.step_dir, self.manifest.bases or ())
        if doc.get("version") == COLUMNS_FRAGMENT_VERSION:
            self.last = decode_columns(doc, here, self.last, keep=self.names, arrays=self.arrays)
            self.gather.add(f, base, self.last)
        else:
            _rows_v2(self.manifest, f, doc, base, here, self.shards, self.owners, few=self.few, names=self.names)
        if self.last is not None and self.shards:
            raise ManifestError(f"{self.where}: its fragments mix versions 2 and {COLUMNS_FRAGMENT_VERSION}")

    def add_batch(self, fs: Sequence[int], datas: Mapping[int, bytes]) -> None:
        """Fragments ``fs`` (``datas``: their bytes), as :meth:`add` of each in turn would add
        them. Whole version-4 fragments are checked and taken :data:`WHOLES` at once
        (:func:`.wholes.take_wholes`); where that finds a fault, or the fragments are of other
        versions, each is added alone, so that the fault is reported as :meth:`add` reports it."""
        last_taken = False
        for i in range(0, len(fs), WHOLES):
            last_taken = self._add_wholes(fs[i : i + WHOLES], datas)
        if last_taken:  # what add would leave as the fragment added last (the next shares its item index)
            f = fs[-1]
            ref = self.manifest.fragments[f]  # type: ignore[index]
            here = f"{self.where}: fragment {ref.key!r}"
            head = parse_head(datas[f], ref.head_size or 0, ref.head_crc32c or 0, here, ref.key)
            c = self._columns4(head, *take_whole(datas[f], head, self.wanted, here), here)
            c.take()
            self.last = c

    def _add_wholes(self, fs: Sequence[int], datas: Mapping[int, bytes]) -> bool:
        """Fragments ``fs`` added (see :meth:`add_batch`); whether they were taken at once."""
        heads = self._whole_heads(fs, datas) if len(fs) > 1 and not self.shards else None
        got = heads and take_wholes([datas[f] for f in fs], heads, self.wanted, [len(h.objects) for h in heads])
        if not got or not heads:
            for f in fs:
                self.add(f, datas[f])
            return False
        bases = list(itertools.accumulate((len(h.objects) for h in heads), initial=len(self.objects)))[:-1]
        self.gather.add_wholes(fs, bases, got, heads[0].width)
        for h in heads:
            self.objects += h.objects
        return True

    def _whole_heads(self, fs: Sequence[int], datas: Mapping[int, bytes]) -> list[Head] | None:
        """The heads of whole version-4 fragments ``fs``, each checked as :meth:`add` checks it;
        None if any is not one, or fails a check."""
        heads = []
        for f in fs:
            ref = self.manifest.fragments[f]  # type: ignore[index]
            if ref.head_size is None:
                return None
            here = f"{self.where}: fragment {ref.key!r}"
            try:
                _check_whole(ref, datas[f], here)
                heads.append(self._head(parse_head(datas[f], ref.head_size, ref.head_crc32c or 0, here, ref.key), here))
            except (ManifestError, IntegrityError):
                return None
        return heads

    def section_ranges_of(self, index: np.ndarray, first: int) -> list[tuple[int, int]]:
        """The joined section ranges of the wanted arrays in ``index`` (entries from ``first``)."""
        out: list[tuple[int, int]] = []
        for i in self.wanted or []:
            off, n = index[i - first, :2].tolist()
            if n:
                out[-1:] = [(out[-1][0], off + n)] if out and out[-1][1] == off else [*out[-1:], (off, off + n)]
        return out

    def _head(self, head: Head, here: str) -> Head:
        """``head``, refused unless it belongs to this root: its step, and its arrays in the root's order."""
        if head.step != self.manifest.step:
            raise ManifestError(f"{here}: not a fragment of step {self.manifest.step}")
        if head.items != len(self.array_names) or head.digest != self.digest:
            raise ManifestError(f"{here}: its arrays are not the root's arrays, in the root's order")
        _check_objects(head.objects, here, self.step_dir, self.manifest.bases or ())
        return head

    def _add4(self, f: int, head: Head, numbers: Sequence[int], rows: Sequence[int],
              cols: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], here: str) -> None:
        """A version-4 fragment's sections ``numbers`` (``rows`` each), as columns, into the gather."""
        c = self._columns4(head, numbers, rows, cols, here)
        base = len(self.objects)
        self.objects += head.objects
        self.gather.add(f, base, c)
        if self.shards:
            raise ManifestError(f"{self.where}: its fragments mix versions 2 and {SECTIONS_FRAGMENT_VERSION}")
        self.last = c

    def _columns4(self, head: Head, numbers: Sequence[int], rows: Sequence[int],
                  cols: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], here: str) -> Columns:
        """A version-4 fragment's sections ``numbers`` (``rows`` each) as :class:`Columns`, sharing
        the item index of the fragment before when their layout is the same."""
        key = np.asarray(numbers, np.int64), np.asarray(rows, np.int64)
        last = self.last
        if last is not None and self.last_key is not None and all(map(np.array_equal, key, self.last_key)):
            counts, starts = last.counts, last.starts  # shared: the gather works out each layout's item index once
        else:
            counts = dict(zip([self.array_names[i] for i in key[0].tolist()], key[1].tolist()))
            starts = dict(zip(counts, itertools.accumulate(counts.values(), initial=0)))
        self.last_key = key
        return Columns(here, head.width, len(head.objects), starts, counts, len(cols[0]), len(cols[2]), len(cols[3]),
                       "", counts, starts, len(cols[0]), cols)

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
    _check_whole(ref, data, here)
    try:
        doc = _json.loads(unseal(data, here))
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{here}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FRAGMENT_FORMAT or doc.get("step") != manifest.step:
        raise ManifestError(f"{here}: not a fragment of step {manifest.step}")
    return doc


def _check_whole(ref: FragmentRef, data: bytes, here: str) -> None:
    if len(data) != ref.size or crc32c(data) != ref.crc32c:
        raise IntegrityError(f"{here} does not match the checksum the root manifest records", key=ref.key)


def _fragment_objects(doc: dict[str, Any], here: str, step_dir: str, bases: Collection[str] = ()) -> list[str]:
    return _check_objects(doc["objects"], here, step_dir, bases)


def _check_objects(keys: Any, here: str, step_dir: str, bases: Collection[str] = ()) -> list[str]:
    """``keys``, refused unless each lies in ``step_dir`` or in one of the root's ``bases`` (a host's
    references to older steps' objects: an incremental save's)."""
    if not isinstance(keys, list):
        raise ManifestError(f"{here}: 'objects' must be a list")
    for key in keys:
        try:
            check_key(key)
        except (ValueError, TypeError) as e:
            raise ManifestError(f"{here}: bad object key: {e}") from e
        there = step_of_key(key)
        if there != step_dir and (there is None or there not in bases):
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
