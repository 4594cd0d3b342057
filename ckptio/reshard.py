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
from collections.abc import Callable, Sequence

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
    pieces = _pieces(segs.columns(), ws, block_size)
    return _direct_requests(pieces, ws, objects) + _scattered_requests(pieces, ws, objects)


class _Segments:
    """Segment columns, gathered per region: which region and shard, bytes ``[lo, hi)`` of the
    shard's stream, whether they go straight to the destination (at byte ``d0``), and for the
    others the block (``blk``: index into the region's ``g_off``) and its rows ``[r0, r1)``."""

    NAMES = ("w", "row", "lo", "hi", "direct", "d0", "blk", "r0", "r1")

    def __init__(self) -> None:
        self.w: list[np.ndarray] = []
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in self.NAMES}

    def add(self, w: int, **cols: np.ndarray) -> None:
        k = len(cols["row"])
        if not k:
            return
        self.w.append(np.full(k, w, _I64))
        for n in self.NAMES[1:]:
            self.parts[n].append(np.broadcast_to(np.asarray(cols.get(n, 0), _I64), (k,)))

    def columns(self) -> dict[str, np.ndarray]:
        out = {n: np.concatenate(p) for n, p in self.parts.items() if n != "w"}
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


def _pieces(seg: dict[str, np.ndarray], ws: list[_Want], block_size: int) -> dict[str, np.ndarray]:
    """Segments cut by the extents holding them: per piece, its segment (``seg``), ``a``/``b``
    (its bytes, shard coordinates), ``ra``/``rb`` (rounded out to checksum blocks), the extent's
    ``so``/``obj``/``at`` (shard offset, object, offset in it), ``bs`` and its checksums
    ``c0``/``c1`` (indices into its table's crcs), and how many pieces its segment has."""
    cols: dict[str, list[np.ndarray]] = {}
    bounds = np.searchsorted(seg["w"], np.arange(len(ws) + 1)).tolist()  # segments come region by region
    for wi, w in enumerate(ws):
        mine = np.arange(bounds[wi], bounds[wi + 1])
        if not len(mine):
            continue
        t = w.table
        rows = seg["row"][mine]
        e0, e1 = t.first[rows], t.first[rows + 1]
        rep = np.repeat(np.arange(len(mine)), e1 - e0)
        e = e0[rep] + (np.arange(len(rep)) - np.repeat(np.cumsum(e1 - e0) - (e1 - e0), e1 - e0))
        so, ln = t.shard_offset[e], t.length[e]
        a = np.maximum(seg["lo"][mine][rep], so)
        b = np.minimum(seg["hi"][mine][rep], so + ln)
        keep = a < b
        e, a, b, so, ln, rep = e[keep], a[keep], b[keep], so[keep], ln[keep], rep[keep]
        bs = np.where(t.block[e] > 0, t.block[e], block_size)
        ra = so + (a - so) // bs * bs
        rb = np.minimum(so + ln, so + -(-(b - so) // bs) * bs)
        part = {"seg": mine[rep], "a": a, "b": b, "ra": ra, "rb": rb, "so": so, "end": so + ln, "bs": bs,
                "obj": t.object[e], "at": t.offset[e], "c0": t.crc0[e], "c1": t.crc0[e] + t.ncrc[e]}
        for k, v in part.items():
            cols.setdefault(k, []).append(v)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    out["count"] = np.bincount(out["seg"], minlength=len(seg["w"]))[out["seg"]]
    out.update({f"seg_{k}": v[out["seg"]] for k, v in seg.items()})
    return out


def _checks(w: _Want, a: int, b: int, so: int, bs: int, c0: int, at: int) -> tuple[int, int, list[int], str]:
    """The check of piece bytes ``[a, b)`` (block aligned within their extent, shard offset
    ``so``, first checksum ``c0``) at ``at`` in its request."""
    k0 = c0 + (a - so) // bs
    return (at, b - a, w.table.crc_list()[k0 : k0 + -(-(b - a) // bs)], w.name)


def _direct_requests(p: dict[str, np.ndarray], ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Straight pieces: whole blocks read into the destination, partial blocks at either end
    through scratch. One Python step per piece: a host's own rows are few pieces."""
    reqs: list[ReadRequest] = []
    sel = np.flatnonzero(p["seg_direct"] == 1)
    if not len(sel):
        return reqs
    a, b, so, end, bs = (p[k][sel] for k in ("a", "b", "so", "end", "bs"))
    ma = so + -(-(a - so) // bs) * bs
    mb = np.where(b == end, b, so + (b - so) // bs * bs)
    dest_at = p["seg_d0"][sel] + (a - p["seg_lo"][sel])
    fields = (p["seg_w"][sel], a, b, p["ra"][sel], p["rb"][sel], ma, mb, so, bs, p["obj"][sel], p["at"][sel],
              p["c0"][sel], dest_at)
    for wi, a, b, ra, rb, ma, mb, so, bs, obj, at, c0, d in zip(*(f.tolist() for f in fields)):
        w = ws[wi]
        dest = w.region.dest.reshape(-1).view(np.uint8)
        key = objects[obj]
        if ma < mb:
            view = memoryview(dest[d + (ma - a) : d + (mb - a)])
            reqs.append(ReadRequest(key, ByteRange(at + ma - so, at + mb - so), [view],
                                    [_checks(w, ma, mb, so, bs, c0, 0)], [], bs))
        for sa, sb in ([(ra, ma), (mb, rb)] if ma < mb else [(ra, rb)]):
            if sa >= sb:
                continue
            scratch = Scratch(sb - sa)
            ca, cb = max(a, sa), min(b, sb)
            reqs.append(ReadRequest(key, ByteRange(at + sa - so, at + sb - so), [scratch.slice(0, sb - sa)],
                                    [_checks(w, sa, sb, so, bs, c0, 0)],
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


def _scattered_requests(p: dict[str, np.ndarray], ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Pieces copied out of scratch: those of single-piece segments coalesced into runs (one read
    and one scratch each, every piece checked, then all copied out); a segment spanning extents
    gets a scratch of its own, copied out once all its pieces are in."""
    sel = np.flatnonzero(p["seg_direct"] == 0)
    if not len(sel):
        return []
    start = p["at"][sel] + (p["ra"][sel] - p["so"][sel])
    end = start + (p["rb"][sel] - p["ra"][sel])
    single = p["count"][sel] == 1
    reqs = _split_segments(p, sel[~single], ws, objects)
    sel, start, end = sel[single], start[single], end[single]
    if not len(sel):
        return reqs
    order = np.lexsort((start, p["obj"][sel]))
    sel, start, end = sel[order], start[order], end[order]
    cuts = _runs(p["obj"][sel], start, end, p["bs"][sel])
    run_of = np.repeat(np.arange(len(cuts)), np.diff(np.append(cuts, len(sel))))
    at = start - start[cuts][run_of]  # each piece's place in its run's scratch
    checks = _run_checks(p, sel, at, ws)
    # What a copy-out needs per piece: region, block, rows, and where its bytes start in the run.
    place = np.stack([p["seg_w"][sel], p["seg_blk"][sel], p["seg_r0"][sel], p["seg_r1"][sel],
                      at + (p["a"][sel] - p["ra"][sel]), p["b"][sel] - p["a"][sel]], axis=1)
    ends = np.append(cuts[1:], len(sel))
    fields = zip(cuts.tolist(), ends.tolist(), start[cuts].tolist(), (end[ends - 1] - start[cuts]).tolist(),
                 p["obj"][sel][cuts].tolist(), p["bs"][sel][cuts].tolist())
    for i, j, base, n, obj, bs in fields:
        scratch = Scratch(n)
        reqs.append(ReadRequest(objects[obj], ByteRange(base, base + n), [scratch.slice(0, n)], checks[i:j],
                                [_run_copier(ws, scratch, place[i:j])], bs))
    return reqs


def _run_checks(p: dict[str, np.ndarray], sel: np.ndarray, at: np.ndarray,
                ws: list[_Want]) -> list[tuple[int, int, list[int], str]]:
    """The check of each piece ``sel`` (at ``at`` in its request), made as columns: a million
    pieces of a column block must not cost a Python call each."""
    crc_at = np.cumsum([0] + [w.table.crcs.size for w in ws])
    flat = np.concatenate([w.table.crcs for w in ws]).tolist()
    wi = p["seg_w"][sel]
    ra, rb, bs = p["ra"][sel], p["rb"][sel], p["bs"][sel]
    k0 = crc_at[wi] + p["c0"][sel] + (ra - p["so"][sel]) // bs
    k1 = k0 + -(-(rb - ra) // bs)
    crcs = [flat[a:b] for a, b in zip(k0.tolist(), k1.tolist())]
    names = np.array([w.name for w in ws], dtype=object)[wi].tolist()
    return list(zip(at.tolist(), (rb - ra).tolist(), crcs, names))


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


def _split_segments(p: dict[str, np.ndarray], sel: np.ndarray, ws: list[_Want], objects: list[str]) -> list[ReadRequest]:
    """Segments whose bytes span extents (a shard larger than an object): one scratch per
    segment, each extent's piece read into its part, copied out once all are in."""
    reqs: list[ReadRequest] = []
    for s in np.unique(p["seg"][sel]).tolist():
        mine = sel[p["seg"][sel] == s]
        wi, blk, r0, r1 = (int(p[k][mine[0]]) for k in ("seg_w", "seg_blk", "seg_r0", "seg_r1"))
        w = ws[wi]
        base = int(p["ra"][mine].min())
        scratch = Scratch(int(p["rb"][mine].max()) - base)
        part = [ReadRequest(objects[obj], ByteRange(at + ra - so, at + rb - so), [scratch.slice(ra - base, rb - base)],
                            [_checks(w, ra, rb, so, bs, c0, 0)], [], bs)
                for obj, at, ra, rb, so, bs, c0 in zip(*(p[k][mine].tolist()
                                                         for k in ("obj", "at", "ra", "rb", "so", "bs", "c0")))]
        lo, hi = int(p["seg_lo"][mine[0]]), int(p["seg_hi"][mine[0]])

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
