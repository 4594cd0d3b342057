"""Overlap arithmetic between saved slices and target slices, as array operations.

A restore asks for target regions (any sharding, not necessarily the saved
one). Each array item's shards are a columnar table
(:class:`ckptio.manifest.ShardTable`): the shards meeting a region are found
with two bisections and a mask, and every overlap becomes *segments* -- a
span of a saved shard's byte stream (a run of rows of the shard, or of one of
its tiles) -- computed for all overlaps at once. Segments are cut by the
extents holding them and rounded out to the checksum blocks of those extents:
blocks are the unit that can be verified, so every byte is verified before
it is copied anywhere.

* Where a region and a saved shard share their inner dimensions (untiled),
  the bytes go straight into the destination; only partial blocks at the ends
  pass through a small scratch buffer.
* Everything else (a column block of row-saved shards, tiles) is read into
  scratch and copied out once verified. Those reads are coalesced: pieces
  adjacent in one object, from any shard of any array planned together
  (:func:`plan_regions`), become one read of at most about
  ``RUN_BYTES`` (2 MiB) into one scratch buffer with many copies out. So the
  requests and the Python steps of planning grow with object runs, not
  shards; the bytes read are exactly those of the pieces (nothing between
  them), and scratch is bounded per read.

Scratch (ckptio.engine.scratch) gets its memory when its read starts and gives it
back once copied out. This module finds the segments; :mod:`ckptio.restoring.reshard_reads`
turns them into read requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptio.engine import ReadRequest
from ckptio.engine.tiling import tiles_meeting
from ckptio.manifest import ArrayItem, Box, ShardRecord, ShardTable, overlap, table_of
from ckptio.restoring.reshard_reads import SCRATCH_ROWS_BYTES, Region, Want, requests_for

__all__ = ["Region", "coverage_gaps", "geometry_key", "overlap", "plan_region", "plan_regions", "shard_grid", "shards_meeting"]

#: Segments planned at once: bounds planning memory (~200 bytes a segment) at a million overlaps.
_BATCH_SEGMENTS = 1 << 17
_I64 = np.int64


def shard_grid(item: ArrayItem) -> tuple[int, ...]:
    """The coarsest regular grid whose cells each lie inside one saved shard: per dimension, the
    gcd of every shard boundary and the array's length (at least 1)."""
    t = table_of(item)
    out = []
    for d, n in enumerate(item.shape):
        g = np.gcd.reduce(np.concatenate([[n], t.offsets[:, d], t.offsets[:, d] + t.shape[:, d]]).astype(_I64))
        out.append(max(int(g), 1))
    return tuple(out)


def shards_meeting(
    item: ArrayItem, off: tuple[int, ...], shape: tuple[int, ...]
) -> list[tuple[ShardRecord, Box]]:
    """The saved shards of ``item`` that overlap the box ``(off, shape)``, each with that overlap
    (``(offsets, shape)`` in array coordinates), in shard order. For tools that want objects;
    planning uses the table."""
    rows, lo, hi = table_of(item).meeting(off, shape)
    return [(item.shards[r], (tuple(a), tuple(b - a for a, b in zip(a, b))))
            for r, a, b in zip(rows.tolist(), lo.tolist(), hi.tolist())]


def coverage_gaps(item: ArrayItem, region_off: tuple[int, ...], region_shape: tuple[int, ...]) -> int:
    """Elements of the region that no saved shard covers (shards never overlap each other)."""
    _rows, lo, hi = table_of(item).meeting(region_off, region_shape)
    covered = int(np.prod(hi - lo, axis=1, dtype=_I64).sum()) if len(lo) else 0
    return math.prod(region_shape) - covered


def plan_region(
    name: str, item: ArrayItem, region: Region, objects: list[str], block_size: int
) -> list[ReadRequest]:
    """Read requests that fill ``region.dest`` from the saved shards of ``item``."""
    return plan_regions([(name, item, region)], objects, block_size)


def plan_regions(
    wants: Sequence[tuple[str, ArrayItem, Region]], objects: list[str], block_size: int
) -> list[ReadRequest]:
    """Read requests that fill every ``(name, item, region)`` of ``wants`` (one manifest's
    ``objects`` and ``block_size``); scattered pieces adjacent in one object, across all of them,
    are read together."""
    reqs: list[ReadRequest] = []
    segs = _Segments()
    ws: list[Want] = []
    # Arrays of one layout (every parameter and its optimizer states) asking for the same box
    # have the same segments: found once per layout, box and item size, repeated for the others.
    planned: dict[tuple[Any, ...], int] = {}
    for name, item, region in wants:
        if not region.dest.size:
            continue
        w = Want(name, item, region, table_of(item))
        ws.append(w)
        key = geometry_key(w.table, region.offsets, region.dest.shape, item.dtype.itemsize)
        like = planned.get(key)
        if like is None:
            planned[key] = len(ws) - 1
            mark = segs.mark()
            _add_segments(segs, len(ws) - 1, w)
            segs.remember(len(ws) - 1, mark)
        else:
            segs.repeat(like, len(ws) - 1)
            w.g_off, w.b_shape = list(ws[like].g_off), list(ws[like].b_shape)
        if segs.size >= _BATCH_SEGMENTS:
            # Regions come in the order their arrays were saved (and packed): a batch of them
            # still coalesces into one read per object run, with bounded planning memory.
            reqs += _plan_batch(segs, ws, objects, block_size)
            segs, ws, planned = _Segments(), [], {}
    return reqs + _plan_batch(segs, ws, objects, block_size)


def geometry_key(t: ShardTable, off: Sequence[int], shape: Sequence[int], itemsize: int) -> tuple[Any, ...]:
    """What the segments of the box ``(off, shape)`` over table ``t`` depend on: its shards'
    boxes and tiles (not their extents), the box and the item size. Equal keys, equal segments."""
    return (itemsize, tuple(off), tuple(shape), *t.geometry())


def _plan_batch(segs: _Segments, ws: list[Want], objects: list[str], block_size: int) -> list[ReadRequest]:
    """The reads of regions ``ws`` (their segments ``segs``)."""
    if not ws or not (segs.w or segs.one):
        return []
    for w in ws:  # one block table per region (planning appended a group per call)
        if len(w.g_off) > 1:
            w.g_off, w.b_shape = [np.concatenate(w.g_off)], [np.concatenate(w.b_shape)]
    return requests_for(segs.columns(), ws, objects, block_size)


class _Segments:
    """Segment columns, gathered per region: which region and shard, bytes ``[lo, hi)`` of the
    shard's stream, whether they go straight to the destination (at byte ``d0``), and for the
    others the block (``blk``: index into the region's ``g_off``) and its rows ``[r0, r1)``."""

    NAMES = ("w", "row", "lo", "hi", "direct", "d0", "blk", "r0", "r1")

    def __init__(self) -> None:
        self.w: list[np.ndarray] = []
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in self.NAMES}
        self.one: list[tuple[int, int, int, int]] = []
        self.size = 0
        #: Per region planned here: its span ``(parts from, one from, parts to, one to)``.
        self.spans: dict[int, tuple[int, int, int, int]] = {}

    def mark(self) -> tuple[int, int]:
        """Where the next region's segments will start (see :meth:`remember`)."""
        return len(self.w), len(self.one)

    def remember(self, w: int, mark: tuple[int, int]) -> None:
        """Region ``w``'s segments are those added since ``mark``: :meth:`repeat` can copy them."""
        self.spans[w] = (*mark, len(self.w), len(self.one))

    def repeat(self, like: int, w: int) -> None:
        """Region ``w`` has the segments of region ``like`` (same layout, box and item size)."""
        p0, o0, p1, o1 = self.spans[like]
        for k in range(p0, p1):
            n = len(self.w[k])
            self.w.append(np.full(n, w, _I64))
            for name in self.NAMES[1:]:
                self.parts[name].append(self.parts[name][k])
            self.size += n
        for _like, lo, hi, d0 in self.one[o0:o1]:
            self.add_one(w, lo, hi, d0)

    def add(self, w: int, **cols: Any) -> None:
        k = len(cols["row"])
        if not k:
            return
        self.size += k
        self.w.append(np.full(k, w, _I64))
        for n in self.NAMES[1:]:
            v = cols.get(n, 0)
            self.parts[n].append(v if isinstance(v, np.ndarray) else np.full(k, v, _I64))

    def add_one(self, w: int, lo: int, hi: int, d0: int) -> None:
        """One straight segment of shard 0 of region ``w``, in plain integers (no array calls)."""
        self.one.append((w, lo, hi, d0))
        self.size += 1

    def columns(self) -> dict[str, np.ndarray]:
        if self.one:
            w, lo, hi, d0 = (np.array(c, _I64) for c in zip(*self.one))
            self.one = []
            self.w.append(w)
            zero = np.zeros(len(w), _I64)
            for n, v in (("row", zero), ("lo", lo), ("hi", hi), ("direct", zero + 1), ("d0", d0), ("blk", zero),
                         ("r0", zero), ("r1", zero)):
                self.parts[n].append(v)
        out = {n: np.concatenate(p).astype(_I64, copy=False) for n, p in self.parts.items() if n != "w"}
        out["w"] = np.concatenate(self.w)
        return out


def _add_segments(segs: _Segments, wi: int, w: Want) -> None:
    """The segments of every saved shard meeting region ``w``: straight runs of rows, C-order
    shards' row runs through scratch (at most ``SCRATCH_ROWS_BYTES`` each), and tiles."""
    t, region = w.table, w.region
    if t.n == 1 and _one_shard(segs, wi, w):
        return
    shape = np.asarray(region.dest.shape, _I64)
    rows, lo, hi = t.meeting(region.offsets, region.dest.shape)
    if not len(rows):
        return
    isz = w.item.dtype.itemsize
    ndim = t.ndim
    if ndim == 0:
        segs.add(wi, row=rows, lo=0, hi=isz, direct=1, d0=0)
        return
    s_off, s_shape = t.offsets[rows], t.shape[rows]
    tiled = t.tiled[rows]
    inner = ((s_shape[:, 1:] == hi[:, 1:] - lo[:, 1:]) & (hi[:, 1:] - lo[:, 1:] == shape[1:])).all(axis=1)
    row_bytes = np.prod(s_shape[:, 1:], axis=1, dtype=_I64) * isz
    first, last = lo[:, 0] - s_off[:, 0], hi[:, 0] - s_off[:, 0]
    d = ~tiled & inner
    segs.add(wi, row=rows[d], lo=first[d] * row_bytes[d], hi=last[d] * row_bytes[d], direct=1,
             d0=(lo[d, 0] - region.offsets[0]) * row_bytes[d])
    c = ~tiled & ~inner
    if c.any():
        _add_row_runs(segs, wi, w, rows[c], s_off[c], s_shape[c], first[c], last[c], row_bytes[c], 0)
    for k in np.flatnonzero(tiled).tolist():
        _add_tiles(segs, wi, w, int(rows[k]), lo[k], hi[k], isz)


def _one_shard(segs: _Segments, wi: int, w: Want) -> bool:
    """The commonest region of all (a host's own rows of an array it saved alone, or a whole small
    array) in plain integers: an untiled shard whose rows it wants whole. False: not that case."""
    t, region = w.table, w.region
    off, sh, shape = t.offsets[0].tolist(), t.shape[0].tolist(), region.dest.shape
    if t.tile[0, 0] >= 0 if sh else False:
        return False
    if sh and (sh[1:] != list(shape[1:]) or off[1:] != list(region.offsets[1:])):
        return False
    r0 = max(off[0], region.offsets[0]) if sh else 0
    r1 = min(off[0] + sh[0], region.offsets[0] + shape[0]) if sh else 1
    if r1 <= r0 or 0 in sh:
        return True  # the region misses the shard: nothing to read from it
    row = math.prod(sh[1:]) * w.item.dtype.itemsize
    a = r0 - off[0] if sh else 0
    segs.add_one(wi, a * row, (a + r1 - r0) * row, ((r0 - region.offsets[0]) * row) if sh else 0)
    return True


def _add_row_runs(segs: _Segments, wi: int, w: Want, rows: np.ndarray, g_off: np.ndarray, b_shape: np.ndarray,
                  first: np.ndarray, last: np.ndarray, row_bytes: np.ndarray, base: np.ndarray | int) -> None:
    """Rows ``[first, last)`` of blocks (``g_off``/``b_shape``; stream byte ``base`` of their
    shard ``rows``) through scratch, in runs of at most ``SCRATCH_ROWS_BYTES``."""
    per = np.maximum(1, SCRATCH_ROWS_BYTES // np.maximum(row_bytes, 1))
    runs = -(-(last - first) // per)
    rep = np.repeat(np.arange(len(rows)), runs)
    j = np.arange(len(rep)) - np.repeat(np.cumsum(runs) - runs, runs)
    r0 = first[rep] + j * per[rep]
    r1 = np.minimum(last[rep], r0 + per[rep])
    blk0 = sum(len(g) for g in w.g_off)
    w.g_off.append(g_off)
    w.b_shape.append(b_shape)
    base = np.broadcast_to(np.asarray(base, _I64), (len(rows),))
    segs.add(wi, row=rows[rep], lo=base[rep] + r0 * row_bytes[rep], hi=base[rep] + r1 * row_bytes[rep], direct=0,
             blk=blk0 + rep, r0=r0, r1=r1)


def _add_tiles(segs: _Segments, wi: int, w: Want, row: int, lo: np.ndarray, hi: np.ndarray, isz: int) -> None:
    """The tiles of tiled shard ``row`` that meet its overlap ``[lo, hi)``: of each, the rows
    the overlap touches (a tile is C order inside)."""
    t = w.table
    s_off, tile = t.offsets[row], t.tile[row]
    tiles = tiles_meeting(tuple(t.shape[row].tolist()), tuple(tile.tolist()), tuple((lo - s_off).tolist()),
                          tuple((hi - lo).tolist()))
    b_off = np.array([b for b, _s, _p in tiles], _I64) + s_off
    b_shape = np.array([s for _b, s, _p in tiles], _I64)
    pos = np.array([p for _b, _s, p in tiles], _I64) * isz
    first = np.maximum(lo[0], b_off[:, 0]) - b_off[:, 0]
    last = np.minimum(hi[0], b_off[:, 0] + b_shape[:, 0]) - b_off[:, 0]
    row_bytes = np.prod(b_shape[:, 1:], axis=1, dtype=_I64) * isz
    _add_row_runs(segs, wi, w, np.full(len(tiles), row, _I64), b_off, b_shape, first, last, row_bytes, pos)
