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
  ``_SCRATCH_ROWS_BYTES`` into one scratch buffer with many copies out. So the
  requests and the Python steps of planning grow with object runs, not
  shards; the bytes read are exactly those of the pieces (nothing between
  them), and scratch is bounded per read.

Scratch (ckptio.scratch) gets its memory when its read starts and gives it
back once copied out.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ckptio.backends.base import ByteRange

from .engine import ReadRequest
from .manifest import ArrayItem, Box, ShardRecord, ShardTable, overlap, table_of
from .scratch import Scratch
from .tiling import tiles_meeting

__all__ = ["Region", "coverage_gaps", "overlap", "plan_region", "plan_regions", "shard_grid", "shards_meeting"]

_SCRATCH_ROWS_BYTES = 32 << 20
_I64 = np.int64


@dataclasses.dataclass(slots=True)
class Region:
    """A target slice of an array and the C-contiguous host buffer that receives it."""

    offsets: tuple[int, ...]
    dest: np.ndarray  # shape is the region's shape


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


@dataclasses.dataclass(slots=True)
class _Want:
    """One region being planned, and the blocks (a shard, or one of its tiles) its scattered
    segments copy out of: ``g_off``/``b_shape`` per block, in array coordinates."""

    name: str
    item: ArrayItem
    region: Region
    table: ShardTable
    g_off: list[np.ndarray] = dataclasses.field(default_factory=list)
    b_shape: list[np.ndarray] = dataclasses.field(default_factory=list)


def plan_regions(
    wants: Sequence[tuple[str, ArrayItem, Region]], objects: list[str], block_size: int
) -> list[ReadRequest]:
    """Read requests that fill every ``(name, item, region)`` of ``wants`` (one manifest's
    ``objects`` and ``block_size``); scattered pieces adjacent in one object, across all of them,
    are read together."""
    segs = _Segments()
    ws: list[_Want] = []
    for name, item, region in wants:
        if not region.dest.size:
            continue
        w = _Want(name, item, region, table_of(item))
        ws.append(w)
        _add_segments(segs, len(ws) - 1, w)
    if not ws or not segs.w:
        return []
    for w in ws:  # one block table per region (planning appended a group per call)
        if len(w.g_off) > 1:
            w.g_off, w.b_shape = [np.concatenate(w.g_off)], [np.concatenate(w.b_shape)]
    seg = segs.columns()
    ext = _Extents(ws)
    pieces = _pieces(seg, ext, block_size)
    direct = seg["direct"][pieces["seg"]] == 1
    return (_direct_requests(pieces, np.flatnonzero(direct), seg, ext, ws, objects)
            + _scattered_requests(pieces, np.flatnonzero(~direct), seg, ext, ws, objects))


class _Segments:
    """Segment columns, gathered per region: which region and shard, bytes ``[lo, hi)`` of the
    shard's stream, whether they go straight to the destination (at byte ``d0``), and for the
    others the block (``blk``: index into the region's ``g_off``) and its rows ``[r0, r1)``."""

    NAMES = ("w", "row", "lo", "hi", "direct", "d0", "blk", "r0", "r1")

    def __init__(self) -> None:
        self.w: list[np.ndarray] = []
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in self.NAMES}

    def add(self, w: int, **cols: Any) -> None:
        k = len(cols["row"])
        if not k:
            return
        self.w.append(np.full(k, w, _I64))
        for n in self.NAMES[1:]:
            v = cols.get(n, 0)
            self.parts[n].append(v if isinstance(v, np.ndarray) else np.full(k, v, _I64))

    def columns(self) -> dict[str, np.ndarray]:
        out = {n: np.concatenate(p).astype(_I64, copy=False) for n, p in self.parts.items() if n != "w"}
        out["w"] = np.concatenate(self.w)
        return out


def _add_segments(segs: _Segments, wi: int, w: _Want) -> None:
    """The segments of every saved shard meeting region ``w``: straight runs of rows, C-order
    shards' row runs through scratch (at most ``_SCRATCH_ROWS_BYTES`` each), and tiles."""
    t, region = w.table, w.region
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


def _add_row_runs(segs: _Segments, wi: int, w: _Want, rows: np.ndarray, g_off: np.ndarray, b_shape: np.ndarray,
                  first: np.ndarray, last: np.ndarray, row_bytes: np.ndarray, base: np.ndarray | int) -> None:
    """Rows ``[first, last)`` of blocks (``g_off``/``b_shape``; stream byte ``base`` of their
    shard ``rows``) through scratch, in runs of at most ``_SCRATCH_ROWS_BYTES``."""
    per = np.maximum(1, _SCRATCH_ROWS_BYTES // np.maximum(row_bytes, 1))
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


def _add_tiles(segs: _Segments, wi: int, w: _Want, row: int, lo: np.ndarray, hi: np.ndarray, isz: int) -> None:
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


class _Extents:
    """The extent columns of every region's table, end to end (``base``: where each region's
    rows, extents and checksums start), so pieces are cut for all regions in one pass."""

    def __init__(self, ws: list[_Want]) -> None:
        tabs = [w.table for w in ws]
        self.row_base = np.cumsum([0] + [t.n for t in tabs])
        ext_base = np.cumsum([0] + [t.object.size for t in tabs])
        crc_base = np.cumsum([0] + [t.crcs.size for t in tabs])
        self.first = np.concatenate([t.first[:-1] + b for t, b in zip(tabs, ext_base.tolist())])
        self.count = np.concatenate([np.diff(t.first) for t in tabs])
        cat = np.concatenate
        self.object, self.offset = cat([t.object for t in tabs]), cat([t.offset for t in tabs])
        self.shard_offset, self.length = cat([t.shard_offset for t in tabs]), cat([t.length for t in tabs])
        self.block = cat([t.block for t in tabs])
        self.crc0 = cat([t.crc0 + b for t, b in zip(tabs, crc_base.tolist())])
        self.crcs = cat([t.crcs for t in tabs])


def _pieces(seg: dict[str, np.ndarray], ext: _Extents, block_size: int) -> dict[str, np.ndarray]:
    """Segments cut by the extents holding them: per piece, its segment (``seg``), ``a``/``b``
    (its bytes, shard coordinates), ``ra``/``rb`` (rounded out to checksum blocks), the extent's
    ``so``/``end``/``obj``/``at`` (shard offsets, object, offset in it), ``bs`` and its first
    checksum ``c0`` (in ``ext.crcs``), and how many pieces its segment has (``count``)."""
    grow = ext.row_base[seg["w"]] + seg["row"]
    counts = ext.count[grow]
    rep = np.repeat(np.arange(len(grow)), counts)
    e = np.repeat(ext.first[grow] - (np.cumsum(counts) - counts), counts) + np.arange(len(rep))
    so, ln = ext.shard_offset[e], ext.length[e]
    a = np.maximum(seg["lo"][rep], so)
    b = np.minimum(seg["hi"][rep], so + ln)
    keep = a < b
    e, a, b, so, ln, rep = e[keep], a[keep], b[keep], so[keep], ln[keep], rep[keep]
    bs = np.where(ext.block[e] > 0, ext.block[e], block_size)
    ra = so + (a - so) // bs * bs
    rb = np.minimum(so + ln, so + -(-(b - so) // bs) * bs)
    return {"seg": rep, "a": a, "b": b, "ra": ra, "rb": rb, "so": so, "end": so + ln, "bs": bs,
            "obj": ext.object[e], "at": ext.offset[e], "c0": ext.crc0[e],
            "count": np.bincount(rep, minlength=len(grow))[rep]}


def _checks(crcs: np.ndarray, name: str, a: int, b: int, so: int, bs: int, c0: int,
            at: int) -> tuple[int, int, list[int], str]:
    """The check of piece bytes ``[a, b)`` (block aligned within their extent, shard offset
    ``so``, first checksum ``c0`` in ``crcs``) at ``at`` in its request."""
    k0 = c0 + (a - so) // bs
    return (at, b - a, crcs[k0 : k0 + -(-(b - a) // bs)].tolist(), name)


def _direct_requests(p: dict[str, np.ndarray], sel: np.ndarray, seg: dict[str, np.ndarray], ext: _Extents,
                     ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Straight pieces ``sel``: whole blocks read into the destination, partial blocks at either
    end through scratch. One Python step per piece: a host's own rows are few pieces."""
    reqs: list[ReadRequest] = []
    if not len(sel):
        return reqs
    a, b, so, end, bs = (p[k][sel] for k in ("a", "b", "so", "end", "bs"))
    ma = so + -(-(a - so) // bs) * bs
    mb = np.where(b == end, b, so + (b - so) // bs * bs)
    s = p["seg"][sel]
    dest_at = seg["d0"][s] + (a - seg["lo"][s])
    fields = (seg["w"][s], a, b, p["ra"][sel], p["rb"][sel], ma, mb, so, bs, p["obj"][sel], p["at"][sel],
              p["c0"][sel], dest_at)
    dests = [w.region.dest.reshape(-1).view(np.uint8) for w in ws]
    for wi, a, b, ra, rb, ma, mb, so, bs, obj, at, c0, d in zip(*(f.tolist() for f in fields)):
        name, dest, key = ws[wi].name, dests[wi], objects[obj]
        if ma < mb:
            view = memoryview(dest[d + (ma - a) : d + (mb - a)])
            reqs.append(ReadRequest(key, ByteRange(at + ma - so, at + mb - so), [view],
                                    [_checks(ext.crcs, name, ma, mb, so, bs, c0, 0)], [], bs))
        for sa, sb in ([(ra, ma), (mb, rb)] if ma < mb else [(ra, rb)]):
            if sa >= sb:
                continue
            scratch = Scratch(sb - sa)
            ca, cb = max(a, sa), min(b, sb)
            reqs.append(ReadRequest(key, ByteRange(at + sa - so, at + sb - so), [scratch.slice(0, sb - sa)],
                                    [_checks(ext.crcs, name, sa, sb, so, bs, c0, 0)],
                                    [_copier(dest, d + (ca - a), scratch, ca - sa, cb - ca)], bs))
    return reqs


def _copier(dest: np.ndarray, d: int, src: Scratch, s: int, n: int) -> Callable[[], None]:
    def copy() -> None:
        dest[d : d + n] = src.array()[s : s + n]
        src.release()

    return copy


def _runs(obj: np.ndarray, start: np.ndarray, end: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """Run starts over pieces sorted by (object, start): a run is pieces back to back in one
    object with one block size, cut after about ``_SCRATCH_ROWS_BYTES`` (scratch stays bounded)."""
    k = len(obj)
    brk = np.ones(k, bool)
    brk[1:] = (obj[1:] != obj[:-1]) | (start[1:] != end[:-1]) | (bs[1:] != bs[:-1])
    group = np.cumsum(brk) - 1
    length = end - start
    before = np.cumsum(length) - length
    sub = (before - before[brk][group]) // _SCRATCH_ROWS_BYTES
    cut = brk.copy()
    cut[1:] |= sub[1:] != sub[:-1]
    return np.flatnonzero(cut)


def _scattered_requests(p: dict[str, np.ndarray], sel: np.ndarray, seg: dict[str, np.ndarray], ext: _Extents,
                        ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Pieces ``sel`` copied out of scratch: those of single-piece segments coalesced into runs
    (one read and one scratch each, every piece checked, then all copied out); a segment spanning
    extents gets a scratch of its own, copied out once all its pieces are in."""
    if not len(sel):
        return []
    single = p["count"][sel] == 1
    reqs = _split_segments(p, sel[~single], seg, ext, ws, objects)
    sel = sel[single]
    if not len(sel):
        return reqs
    start = p["at"][sel] + (p["ra"][sel] - p["so"][sel])
    order = np.lexsort((start, p["obj"][sel]))
    sel, start = sel[order], start[order]
    end = start + (p["rb"][sel] - p["ra"][sel])
    cuts = _runs(p["obj"][sel], start, end, p["bs"][sel])
    run_of = np.repeat(np.arange(len(cuts)), np.diff(np.append(cuts, len(sel))))
    at = start - start[cuts][run_of]  # each piece's place in its run's scratch
    s = p["seg"][sel]
    checks = _run_checks(p, sel, at, seg["w"][s], ext, ws)
    # What a copy-out needs per piece: region, block, rows, and where its bytes start in the run.
    place = np.stack([seg["w"][s], seg["blk"][s], seg["r0"][s], seg["r1"][s],
                      at + (p["a"][sel] - p["ra"][sel]), p["b"][sel] - p["a"][sel]], axis=1)
    ends = np.append(cuts[1:], len(sel))
    fields = zip(cuts.tolist(), ends.tolist(), start[cuts].tolist(), (end[ends - 1] - start[cuts]).tolist(),
                 p["obj"][sel][cuts].tolist(), p["bs"][sel][cuts].tolist())
    for i, j, base, n, obj, bs in fields:
        scratch = Scratch(n)
        mine = _Checks(*(c[i:j] for c in checks[:5]), checks[5])
        reqs.append(ReadRequest(objects[obj], ByteRange(base, base + n), [scratch.slice(0, n)],
                                mine, [_run_copier(ws, scratch, place[i:j])], bs))  # type: ignore[arg-type]
    return reqs


class _Checks(Sequence[tuple[int, int, list[int], str]]):
    """The checks of one coalesced read (``(offset in the read, length, block crcs, item)`` per
    piece), kept as columns until the read asks for them: a column block of a million shards
    must not cost a million tuples and lists at planning, only at reading, read by read."""

    __slots__ = ("_cols", "_list")

    def __init__(self, at: np.ndarray, length: np.ndarray, k0: np.ndarray, k1: np.ndarray, names: np.ndarray,
                 crcs: np.ndarray) -> None:
        self._cols: tuple[np.ndarray, ...] | None = (at, length, k0, k1, names, crcs)
        self._list: list[tuple[int, int, list[int], str]] = []

    def _made(self) -> list[tuple[int, int, list[int], str]]:
        cols = self._cols
        if cols is not None:  # a benign race: two threads make equal lists
            at, length, k0, k1, names, crcs = cols
            lo = int(k0.min())
            flat = crcs[lo : int(k1.max())].tolist()
            self._list = list(zip(at.tolist(), length.tolist(),
                                  [flat[a:b] for a, b in zip((k0 - lo).tolist(), (k1 - lo).tolist())], names.tolist()))
            self._cols = None
        return self._list

    def __len__(self) -> int:
        return len(self._cols[0]) if self._cols is not None else len(self._list)

    def __getitem__(self, i: Any) -> Any:
        return self._made()[i]

    def __iter__(self) -> Iterator[tuple[int, int, list[int], str]]:
        return iter(self._made())


def _run_checks(p: dict[str, np.ndarray], sel: np.ndarray, at: np.ndarray, wi: np.ndarray, ext: _Extents,
                ws: list[_Want]) -> tuple[np.ndarray, ...]:
    """Per piece ``sel`` (of region ``wi``, at ``at`` in its read): its check's columns (see
    :class:`_Checks`)."""
    ra, rb, bs = p["ra"][sel], p["rb"][sel], p["bs"][sel]
    k0 = p["c0"][sel] + (ra - p["so"][sel]) // bs
    k1 = k0 + -(-(rb - ra) // bs)
    return at, rb - ra, k0, k1, np.array([w.name for w in ws], dtype=object)[wi], ext.crcs


def _place(w: _Want, blk: int, r0: int, r1: int, raw: np.ndarray) -> None:
    """Copy rows ``[r0, r1)`` of block ``blk`` of region ``w`` (``raw``: their bytes) into place."""
    g_off, b_shape = _block(w, blk)
    off, dest = w.region.offsets, w.region.dest
    src: list[slice] = [slice(None)]
    dst = [slice(g_off[0] + r0 - off[0], g_off[0] + r1 - off[0])]
    for d in range(1, len(g_off)):
        lo, hi = max(g_off[d], off[d]), min(g_off[d] + b_shape[d], off[d] + dest.shape[d])
        src.append(slice(lo - g_off[d], hi - g_off[d]))
        dst.append(slice(lo - off[d], hi - off[d]))
    dest[tuple(dst)] = raw.view(w.item.dtype).reshape((r1 - r0, *b_shape[1:]))[tuple(src)]


def _block(w: _Want, blk: int) -> tuple[list[int], list[int]]:
    return w.g_off[0][blk].tolist(), w.b_shape[0][blk].tolist()


def _run_copier(ws: list[_Want], scratch: Scratch, rows: np.ndarray) -> Callable[[], None]:
    def copy_out() -> None:
        buf = scratch.array()
        for wi, blk, r0, r1, at, n in rows.tolist():
            _place(ws[wi], blk, r0, r1, buf[at : at + n])
        scratch.release()

    return copy_out


def _split_segments(p: dict[str, np.ndarray], sel: np.ndarray, seg: dict[str, np.ndarray], ext: _Extents,
                    ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Segments whose bytes span extents (a shard larger than an object): one scratch per
    segment, each extent's piece read into its part, copied out once all are in."""
    reqs: list[ReadRequest] = []
    for s in np.unique(p["seg"][sel]).tolist():
        mine = sel[p["seg"][sel] == s]
        wi, blk, r0, r1, lo, hi = (int(seg[k][s]) for k in ("w", "blk", "r0", "r1", "lo", "hi"))
        w = ws[wi]
        base = int(p["ra"][mine].min())
        scratch = Scratch(int(p["rb"][mine].max()) - base)
        part = [ReadRequest(objects[obj], ByteRange(at + ra - so, at + rb - so), [scratch.slice(ra - base, rb - base)],
                            [_checks(ext.crcs, w.name, ra, rb, so, bs, c0, 0)], [], bs)
                for obj, at, ra, rb, so, bs, c0 in zip(*(p[k][mine].tolist()
                                                         for k in ("obj", "at", "ra", "rb", "so", "bs", "c0")))]

        def copy_out(w: _Want = w, scratch: Scratch = scratch, blk: int = blk, r0: int = r0, r1: int = r1,
                     lo: int = lo, hi: int = hi, base: int = base) -> None:
            _place(w, blk, r0, r1, scratch.array()[lo - base : hi - base])
            scratch.release()

        part[-1].after.append(_after_all(len(part), copy_out, part))
        reqs += part
    return reqs


def _after_all(n: int, fn: Callable[[], None], reqs: list[ReadRequest]) -> Callable[[], None]:
    """Run ``fn`` once all ``n`` requests are done (each request's ``after`` counts down)."""
    lock = threading.Lock()
    left = [n]

    def done() -> None:
        with lock:
            left[0] -= 1
            fire = left[0] == 0
        if fire:
            fn()

    for r in reqs[:-1]:
        r.after.append(done)
    return done
