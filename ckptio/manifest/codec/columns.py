"""Format-2 fragments as columns (fragment version 3): a host's shards in one compressed block.

A version-2 fragment listed every shard as JSON rows: a reader parsed every
row of every item of every fragment it opened into Python lists, dicts and
then objects, ~100 us a shard. A version-3 fragment keeps its JSON small
(objects, item names with their shard counts, column sizes) and puts every
shard into one base64 block of zlib-compressed little-endian columns:

* ``boxes`` int64 ``(rows, 3 * width)``: offsets, shape, tile per shard, padded to the
  fragment's largest rank ``width`` (offset 0, length 1, tile -1 in the missing
  dimensions; tile -1 everywhere for an untiled shard);
* ``extent_counts`` int64 ``(rows,)``;
* ``extents`` int64 ``(extents, 6)``: object (in the fragment's list), offset, shard offset,
  length, checksum count, checksum block size (0: the manifest's);
* ``crcs`` uint32: every extent's block checksums, in order.

Rows are item by item, in the order the JSON names the items. A reader
decodes a fragment with one decompression and takes the rows of the items it
restores as array slices (:mod:`.split` checks them, as columns).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import zlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.codec.rowcheck import check_rows
from ckptio.manifest.geometry import check_tiling
from ckptio.manifest.limits import MAX_COUNT, MAX_NDIM, check_int
from ckptio.manifest.model import ArrayItem, Manifest
from ckptio.manifest.table import ShardList, ShardTable, box_key

__all__ = ["COLUMNS_FRAGMENT_VERSION", "Columns", "column_bytes", "decode_columns", "encode_columns", "from_columns"]

#: The ``version`` of a fragment document holding its shards as columns.
COLUMNS_FRAGMENT_VERSION = 3
_LE64, _LE32 = np.dtype("<i8"), np.dtype("<u4")


def encode_columns(items: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> dict[str, Any]:
    """The column fields of a fragment document from each array item's shards (host-record form:
    ``offsets``, ``shape``, ``extents`` ``[object, offset, shard_offset, length, crcs(, block)]``,
    optional ``tile``)."""
    width = max((len(s["shape"]) for _n, shards in items for s in shards), default=0)
    raw, n_ext, n_crc = column_bytes(items, width)
    return {"items": {name: len(shards) for name, shards in items}, "width": width, "extents": n_ext,
            "crcs": n_crc, "columns": base64.b64encode(zlib.compress(raw, 1)).decode()}


def column_bytes(items: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], width: int) -> tuple[bytes, int, int]:
    """The shards of ``items`` as the columns' raw bytes (boxes padded to rank ``width``), with
    their extent and checksum counts."""
    boxes, counts, extents, crcs = [], [], [], []
    for _name, shards in items:
        for s in shards:
            pad = width - len(s["shape"])
            tile = s.get("tile")
            boxes.append([*s["offsets"], *[0] * pad, *s["shape"], *[1] * pad,
                          *(tile if tile is not None else [-1] * len(s["shape"])), *[-1] * pad])
            counts.append(len(s["extents"]))
            for e in s["extents"]:
                extents.append([e[0], e[1], e[2], e[3], len(e[4]), e[5] if len(e) > 5 and e[5] else 0])
                crcs += e[4]
    raw = b"".join([np.array(boxes, _LE64).reshape(len(boxes), 3 * width).tobytes(),
                    np.array(counts, _LE64).tobytes(), np.array(extents, _LE64).reshape(-1, 6).tobytes(),
                    np.array(crcs, _LE32).tobytes()])
    return raw, len(extents), len(crcs)


@dataclasses.dataclass(slots=True)
class Columns:
    """A version-3 fragment's shards (see the module docstring), decompressed only when asked
    (:meth:`arrays`): a reader of thousands of fragments holds their compressed text, not their
    columns. ``starts[name]`` is the first row of an item, ``counts[name]`` its rows."""

    here: str
    width: int
    n_objects: int
    starts: dict[str, int]
    counts: dict[str, int]
    rows: int
    n_ext: int
    n_crc: int
    text: str
    #: The items and shard counts the document lists, their first rows and all its rows
    #: (``counts``, ``starts`` and ``rows`` may be fewer: those kept).
    listed: dict[str, int] = dataclasses.field(default_factory=dict)
    listed_starts: dict[str, int] = dataclasses.field(default_factory=dict)
    listed_rows: int = 0
    #: The kept rows' columns, decompressed when the fragment was decoded (``text`` then dropped).
    kept: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(boxes, extent_counts, extents, crcs)`` (read-only views of the decompressed bytes);
        ManifestError naming the fragment if they are not what its document says."""
        if self.kept is not None:
            return self.kept
        rows, width, n_ext, n_crc = self.rows, self.width, self.n_ext, self.n_crc
        sizes = [rows * 3 * width * 8, rows * 8, n_ext * 6 * 8, n_crc * 4]
        try:
            raw = zlib.decompress(base64.b64decode(self.text, validate=True))
        except (ValueError, zlib.error) as e:
            raise ManifestError(f"{self.here}: its shard columns are not readable: {e}") from e
        if len(raw) != sum(sizes):
            raise ManifestError(f"{self.here}: its shard columns do not hold the {rows} shards and {n_ext} "
                                "extents it names")
        at = list(itertools.accumulate(sizes, initial=0))  # plain ints: no array call per fragment
        boxes = np.frombuffer(raw, _LE64, rows * 3 * width, at[0]).reshape(rows, 3 * width)
        counts = np.frombuffer(raw, _LE64, rows, at[1])
        extents = np.frombuffer(raw, _LE64, n_ext * 6, at[2]).reshape(n_ext, 6)
        crcs = np.frombuffer(raw, _LE32, n_crc, at[3])
        if rows and (counts.min() < 0 or int(counts.sum()) != n_ext) or (n_ext and int(extents[:, 4].sum()) != n_crc):
            raise ManifestError(f"{self.here}: its extent or checksum counts do not add up")
        return boxes, counts, extents, crcs

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`arrays`, then forgotten: a reader copying thousands of fragments' columns into
        one set holds each fragment's own copy only until it is copied."""
        out = self.arrays()
        self.kept, self.text = None, ""
        return out


def decode_columns(doc: Mapping[str, Any], here: str, like: Columns | None = None, *,
                   keep: Collection[str] | None = None, arrays: Collection[str] | None = None) -> Columns:
    """The columns of a version-3 fragment document (``here`` names it in errors), their sizes
    checked, checked per item by the reader. ``like``: the fragment decoded before, whose item
    index is taken over when this one lists the same items and counts (every host of a job does).
    ``arrays``: the root's array items (an item the fragment lists beyond them is refused).

    ``keep`` None: the columns stay compressed until asked (:meth:`Columns.arrays`). Otherwise
    they are decompressed now and only the rows of the items ``keep`` names are kept: the
    document's text can then be dropped, and a reader of thousands of fragments that wants one
    array holds that array's rows only."""
    items = doc["items"]
    if not isinstance(items, dict):
        raise ManifestError(f"{here}: 'items' must be a JSON object")
    width = check_int(doc["width"], "width", here, hi=MAX_NDIM)
    n_ext = check_int(doc["extents"], "extent count", here, hi=MAX_COUNT)
    n_crc = check_int(doc["crcs"], "checksum count", here, hi=MAX_COUNT)
    if like is not None and like.listed == items:
        listed, lstarts, lrows, counts, starts = like.listed, like.listed_starts, like.listed_rows, like.counts, \
            like.starts
    else:
        listed = items
        values = list(items.values())
        if not set(map(type, values)) <= {int} or (values and not 0 <= min(values) <= max(values) <= MAX_COUNT):
            raise ManifestError(f"{here}: every item's shard count must be an integer in [0, {MAX_COUNT}]")
        unknown = [] if arrays is None else [n for n in items if n not in arrays]
        if unknown:
            raise ManifestError(f"{here}: names item {unknown[0]!r} that the root does not hold as an array")
        lstarts = dict(zip(items, itertools.accumulate(values, initial=0)))
        lrows = sum(values)
        counts = items if keep is None else {n: c for n, c in items.items() if n in keep}
        # The kept rows are numbered from 0, item after item.
        starts = lstarts if len(counts) == len(items) else dict(zip(counts, itertools.accumulate(counts.values(),
                                                                                                   initial=0)))
    text = doc["columns"]
    if not isinstance(text, str):
        raise ManifestError(f"{here}: its shard columns are not readable")
    cols = Columns(here, width, len(doc["objects"]), lstarts, counts, lrows, n_ext, n_crc, text, listed, lstarts,
                   lrows)
    if keep is None:
        return cols
    full = cols.arrays()
    if len(counts) == len(listed):
        cols.kept = full
    else:
        first = [lstarts[n] for n in counts]
        sizes = list(counts.values())
        if all(a + k == b for a, k, b in zip(first, sizes, first[1:])):  # one run of rows (one item, say)
            cols.kept = _take_run(full, first[0] if first else 0, (first[0] if first else 0) + sum(sizes))
        else:
            cols.kept = _take_rows(full, _ranges(np.array(first, np.int64), np.array(sizes, np.int64)))
        cols.starts = starts
        cols.rows, cols.n_ext, cols.n_crc = len(cols.kept[0]), len(cols.kept[2]), len(cols.kept[3])
    cols.text = ""
    return cols


def _take_run(arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], r0: int, r1: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_take_rows` of the rows ``[r0, r1)``: slices, a few array calls whatever the
    fragment holds (a host wanting one array of 4096 fragments takes one run of each)."""
    boxes, ecount, ext, crcs = arrays
    e0 = int(ecount[:r0].sum())
    e1 = e0 + int(ecount[r0:r1].sum())
    c0 = int(ext[:e0, 4].sum())
    c1 = c0 + int(ext[e0:e1, 4].sum())
    return boxes[r0:r1].copy(), ecount[r0:r1].copy(), ext[e0:e1].copy(), crcs[c0:c1].copy()


def _take_rows(arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``rows`` of a fragment's ``(boxes, extent_counts, extents, crcs)``, with their
    extents and checksums (copies)."""
    boxes, ecount, ext, crcs = arrays
    efirst = np.concatenate([[0], np.cumsum(ecount)])
    e = _ranges(efirst[rows], ecount[rows])
    cfirst = np.cumsum(ext[:, 4]) - ext[:, 4]
    return boxes[rows], ecount[rows], ext[e], crcs[_ranges(cfirst[e], ext[e, 4])]


def from_columns(manifest: Manifest, gathered: dict[str, Any], where: str, *, complete: bool) -> dict[str, ArrayItem]:
    """The array items of a format-2 ``manifest`` that the rows ``gathered`` from its columnar
    fragments (:class:`~.gather.Gather`, item indices into the manifest's array items) hold,
    each with its :class:`ShardTable` made from those rows (replicas the root assigns to another
    fragment dropped) and checked as columns: boxes inside the array, extents tiling each
    shard's bytes with one checksum per block, objects that exist; with ``complete``, shards
    tiling the array."""
    names = [n for n, it in manifest.items.items() if isinstance(it, ArrayItem)]
    cols = _by_item(gathered)
    width = cols["width"]
    cols["hosts"] = np.array([r.host for r in manifest.fragments or []], np.int64)
    order = np.arange(len(cols["item"]))
    bounds = np.searchsorted(cols["item"], np.arange(len(names) + 1)).tolist()
    items: list[ArrayItem] = [manifest.items[n] for n in names]  # type: ignore[misc]
    check_rows(cols, items, names, manifest.block_size, where)
    row_host = cols["hosts"][cols["frag"]]  # each row's host, looked up once for every table
    mine: dict[int, np.ndarray] = {}  # per locator: the rows it assigns the loaded fragments
    exact = _exactly_assigned(items, bounds, cols, width, mine)
    out: dict[str, ArrayItem] = {}
    for i, name in enumerate(names):
        if bounds[i] == bounds[i + 1]:
            continue
        item = items[i]
        here = f"{where}: item {name!r}"
        rows: np.ndarray | slice = slice(bounds[i], bounds[i + 1])  # every row owned: views of the columns
        if not exact[i]:
            owned = _owned(item, order[bounds[i] : bounds[i + 1]], cols, width, mine)
            rows = rows if len(owned) == bounds[i + 1] - bounds[i] else owned
        table = _table(item, rows, cols, width, row_host)
        full = ArrayItem(item.dtype, item.shape, ShardList(table), item.scalar, item.origin)  # type: ignore[arg-type]
        full.table = table
        if complete:
            check_tiling(full.shards, item.shape, here)  # type: ignore[arg-type]
        out[name] = full
    return out


def _by_item(cols: dict[str, Any]) -> dict[str, Any]:
    """``cols`` with rows (and their extents) in item order, so that each item's table is views of
    them; ``efirst``: each row's first extent; ``cfirst``: each extent's first crc in ``crcs``.

    The checksums stay where they are (fragment by fragment) and every item's table indexes
    them: a host planning a column block of every array of 4096 hosts holds 28 M checksums
    once, not twice plus a 28 M-entry index to reorder them."""
    ncrc = cols["extents"][:, 4]
    cfirst = np.cumsum(ncrc) - ncrc
    item = cols["item"]
    if len(item) > 1 and (item[1:] < item[:-1]).any():
        # Item numbers below 2**16 (any real root) sort as 16-bit keys: numpy's radix sort,
        # ~7x a stable sort of int64 at the ~50 k rows of a batch.
        small = item.min() >= 0 and item.max() < 1 << 16
        order = np.argsort(item.astype(np.uint16) if small else item, kind="stable")
        for k in ("item", "frag", "boxes"):
            cols[k] = cols[k][order]
        ecount = cols["ecount"]
        e = _ranges(np.concatenate([[0], np.cumsum(ecount)])[order], ecount[order])
        cols["ecount"] = ecount[order]
        cols["extents"], cfirst = cols["extents"][e], cfirst[e]
    cols["efirst"] = np.concatenate([[0], np.cumsum(cols["ecount"])])
    cols["cfirst"] = cfirst
    return cols


def _widened(boxes: np.ndarray, width: int, to: int) -> np.ndarray:
    """Boxes padded from rank ``width`` to ``to`` (offset 0, length 1, tile -1)."""
    n, pad = len(boxes), to - width
    return np.concatenate([boxes[:, :width], np.zeros((n, pad), np.int64), boxes[:, width : 2 * width],
                           np.ones((n, pad), np.int64), boxes[:, 2 * width :], np.full((n, pad), -1, np.int64)], axis=1)


def _assigned(item: ArrayItem, cols: dict[str, Any], assigned_to: dict[int, np.ndarray]) -> np.ndarray:
    """The rows ``(fragment, offsets, shape)`` that ``item``'s locator assigns the loaded
    fragments (``assigned_to``: per locator, filled here)."""
    loc = item.locator
    mine = assigned_to.get(id(loc))
    if mine is None:  # arrays of one layout share their locator: its rows are picked once
        loaded = cols["loaded"]
        mine = assigned_to[id(loc)] = loc if len(loaded) == len(cols["hosts"]) else loc[np.isin(loc[:, 0], loaded)]
    return mine


def _exactly_assigned(items: list[ArrayItem], bounds: list[int], cols: dict[str, Any], width: int,
                      assigned_to: dict[int, np.ndarray]) -> np.ndarray:
    """Per item: whether its rows (``[bounds[i], bounds[i + 1])``) are exactly the rows its
    locator assigns the loaded fragments, in the locator's order (:func:`_owned`'s common case),
    asked at once of every item sharing a locator (256 arrays of one layout: one comparison)."""
    exact = np.zeros(len(items), bool)
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if bounds[i] != bounds[i + 1]:
            groups.setdefault(id(item.locator), []).append(i)
    for ks in groups.values():
        mine, ndim = _assigned(items[ks[0]], cols, assigned_to), len(items[ks[0]].shape)
        same = [k for k in ks if bounds[k + 1] - bounds[k] == len(mine)]
        if not same or not len(mine):
            continue
        rows = (np.array([bounds[k] for k in same], np.int64)[:, None] + np.arange(len(mine))).ravel()
        keys = np.column_stack([cols["frag"][rows], cols["boxes"][rows, :ndim],
                                cols["boxes"][rows, width : width + ndim]]).reshape(len(same), len(mine), -1)
        exact[same] = (keys == mine[None]).all(axis=(1, 2))
    return exact


def _owned(item: ArrayItem, rows: np.ndarray, cols: dict[str, Any], width: int,
           assigned_to: dict[int, np.ndarray]) -> np.ndarray:
    """``rows`` without the replicas the root's locator assigns to another fragment
    (``assigned_to``: per locator, the rows it assigns the loaded fragments, filled here)."""
    ndim = len(item.shape)
    keys = np.column_stack([cols["frag"][rows], cols["boxes"][rows, :ndim], cols["boxes"][rows, width : width + ndim]])
    mine = _assigned(item, cols, assigned_to)
    # The common case: exactly the rows the root assigns these fragments, in the root's order
    # (fragment by fragment, each in its own order), or at least the same set of them.
    if len(mine) == len(keys) and (np.array_equal(keys, mine) or np.array_equal(
            keys[np.lexsort(keys.T[::-1])], mine[np.lexsort(mine.T[::-1])])):
        return rows
    assigned = set(map(tuple, mine.tolist()))
    return rows[np.fromiter((tuple(k) in assigned for k in keys.tolist()), bool, len(keys))]


def _table(item: ArrayItem, rows: np.ndarray | slice, cols: dict[str, Any], width: int,
           row_host: np.ndarray) -> ShardTable:
    """The shard table of ``rows`` (a slice: views of ``cols``), whose rows :func:`check_rows`
    checked; ``row_host``: every row's host."""
    ndim, boxes = len(item.shape), cols["boxes"][rows]
    offs, shape, tile = boxes[:, :ndim], boxes[:, width : width + ndim], boxes[:, 2 * width : 2 * width + ndim]
    if isinstance(rows, slice):  # views, and each row's first extent from efirst: 256 tables a batch
        ef = cols["efirst"][rows.start : rows.stop + 1]
        e: np.ndarray | slice = slice(int(ef[0]), int(ef[-1]))
        first = ef - ef[0]
    else:
        counts = cols["ecount"][rows]
        e = _ranges(cols["efirst"][rows], counts)
        first = np.concatenate([[0], np.cumsum(counts)])
    obj, at, so, length, ncrc, _block = cols["extents"][e].T
    # Every table shares the loaded checksums (see _by_item): crc0 indexes them.
    # Its geometry key (ShardTable.geometry) is its rows of boxes where they have its rank (no
    # padded dimension: the common case), contiguous here: one copy, not three strided ones
    # (every table, every batch of a batched restore, asks it).
    key = box_key(boxes if ndim == width else np.concatenate([offs, shape, tile], axis=1), ndim)
    return ShardTable(offs, shape, row_host[rows], tile, first,
                      obj, at, so, length, cols["cfirst"][e], ncrc, cols["bs"][e], cols["crcs"], _geometry=key)


def _ranges(starts: np.ndarray, counts: np.ndarray, dtype: type[np.signedinteger] = np.int64) -> np.ndarray:
    """The indices ``starts[i] + range(counts[i])`` for every ``i``, concatenated, as ``dtype``
    (int32 where every index fits: half the memory traffic of int64 at a million indices).

    Made as each range's start less the indices before it, repeated, plus one count up: a
    batch of fragments' checksums is ~1.4 M indices. Measured (numpy 2.4, thread_time, best of
    7), 4096 ranges of ~340: 4.3 ms in int64 as a running sum of steps did, 1.0 ms in int32
    where the running sum took 3.7 ms; 8192 ranges of 28: 0.3 ms, the running sum 0.7 ms."""
    if (counts < 0).any():  # refused as np.repeat refuses it
        raise ValueError(f"negative counts in {counts.tolist()[:8]}")
    s, c = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    out = np.repeat((s - (np.cumsum(c) - c)).astype(dtype), c)
    out += np.arange(len(out), dtype=dtype)
    return out
