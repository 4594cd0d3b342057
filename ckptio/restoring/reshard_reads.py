"""From segments of saved shards to read requests: the second half of :mod:`ckptio.restoring.reshard`.

:mod:`ckptio.restoring.reshard` finds, for every target region, the *segments* it needs
(spans of saved shards' byte streams) as columns; :func:`requests_for` cuts
them by the extents holding them, rounds them out to checksum blocks and
makes the read requests: straight into the destination where the bytes are
contiguous there (partial end blocks through scratch), else coalesced runs
through bounded scratch with one copy-out each. Every byte is verified
against its checksum blocks before anything is copied out of scratch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ckptio.backends.base import ByteRange
from ckptio.engine import ReadRequest
from ckptio.engine.scratch import Scratch, ScratchSlice
from ckptio.manifest import ArrayItem, ShardTable
from ckptio.system import unique

__all__ = ["SCRATCH_ROWS_BYTES", "Region", "Want", "requests_for"]

#: The most bytes one read through scratch holds (rows of a C-order shard, a run of pieces).
SCRATCH_ROWS_BYTES = 32 << 20
#: Pieces back to back in one object are read together up to about this many bytes: enough that
#: a million small pieces make a few thousand reads, small enough that a read's scratch (and what
#: a read-once round holds for it) stays small beside what a host restores.
RUN_BYTES = 2 << 20
_I64 = np.int64


@dataclasses.dataclass(slots=True)
class Region:
    """A target slice of an array and the C-contiguous host buffer that receives it."""

    offsets: tuple[int, ...]
    dest: np.ndarray  # shape is the region's shape


@dataclasses.dataclass(slots=True)
class Want:
    """One region being planned, and the blocks (a shard, or one of its tiles) its scattered
    segments copy out of: ``g_off``/``b_shape`` per block, in array coordinates."""

    name: str
    item: ArrayItem
    region: Region
    table: ShardTable
    g_off: list[np.ndarray] = dataclasses.field(default_factory=list)
    b_shape: list[np.ndarray] = dataclasses.field(default_factory=list)


def requests_for(seg: dict[str, np.ndarray], ws: list[Want], objects: list[str],
                 block_size: int) -> list[ReadRequest]:
    """The read requests of segments ``seg`` (columns ``w`` (index into ``ws``), ``row``,
    ``lo``/``hi`` (bytes of the shard's stream), ``direct``, ``d0``, ``blk``, ``r0``/``r1``)."""
    ext = _Extents(ws)
    pieces = _pieces(seg, ext, block_size)
    direct = seg["direct"][pieces["seg"]] == 1
    return (_direct_requests(pieces, np.flatnonzero(direct), seg, ext, ws, objects)
            + _scattered_requests(pieces, np.flatnonzero(~direct), seg, ext, ws, objects))


class _Extents:
    """The extent columns of every region's table, end to end (``base``: where each region's
    rows, extents and checksums start), so pieces are cut for all regions in one pass."""

    def __init__(self, ws: list[Want]) -> None:
        tabs = [w.table for w in ws]
        ns = np.array([t.n for t in tabs], _I64)
        ms = np.array([t.object.size for t in tabs], _I64)
        self.row_base = np.concatenate([[0], np.cumsum(ns)])
        # Tables of one loaded manifest share one checksum array (ShardTable): each distinct
        # array is joined once, and every table's crc0 is moved by where its array landed.
        crc_at: dict[int, int] = {}
        shared: list[np.ndarray] = []
        for t in tabs:
            if id(t.crcs) not in crc_at:
                crc_at[id(t.crcs)] = sum(len(c) for c in shared)
                shared.append(t.crcs)
        # Each table's ``first`` (n + 1 entries) end to end, moved by where its extents land;
        # whole columns at once, not three array calls a table (256 tables a batch).
        firsts = np.concatenate([t.first for t in tabs])
        own = np.ones(len(firsts), bool)
        own[np.cumsum(ns + 1) - 1] = False  # each table's closing entry
        self.first = firsts[own] + np.repeat(np.cumsum(ms) - ms, ns)
        self.count = np.diff(firsts)[own[:-1]]
        cat = np.concatenate
        self.object, self.offset = cat([t.object for t in tabs]), cat([t.offset for t in tabs])
        self.shard_offset, self.length = cat([t.shard_offset for t in tabs]), cat([t.length for t in tabs])
        self.block = cat([t.block for t in tabs])
        self.crc0 = cat([t.crc0 for t in tabs]) + np.repeat(np.array([crc_at[id(t.crcs)] for t in tabs], _I64), ms)
        self.crcs = shared[0] if len(shared) == 1 else cat(shared)


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
                     ws: list[Want], objects: list[str]) -> list[ReadRequest]:
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
    object with one block size, cut after about ``RUN_BYTES`` (scratch stays bounded)."""
    k = len(obj)
    brk = np.ones(k, bool)
    brk[1:] = (obj[1:] != obj[:-1]) | (start[1:] != end[:-1]) | (bs[1:] != bs[:-1])
    group = np.cumsum(brk) - 1
    length = end - start
    before = np.cumsum(length) - length
    sub = (before - before[brk][group]) // RUN_BYTES
    cut = brk.copy()
    cut[1:] |= sub[1:] != sub[:-1]
    return np.flatnonzero(cut)


def _scattered_requests(p: dict[str, np.ndarray], sel: np.ndarray, seg: dict[str, np.ndarray], ext: _Extents,
                        ws: list[Want], objects: list[str]) -> list[ReadRequest]:
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
        run = _Run(n, checks, i, j, ws, place)
        reqs.append(ReadRequest(objects[obj], ByteRange(base, base + n), [ScratchSlice(run, 0, n)],
                                run, [run], bs))  # type: ignore[arg-type]
    return reqs


class _Run(Scratch, Sequence[tuple[int, int, list[int], str]]):
    """One coalesced read through scratch: its scratch (``nbytes``), its checks (``(offset in
    the read, length, block crcs, item)`` per piece) and, called once they passed, its copy-out.
    The checks stay columns until the read asks for them: a column block of a million shards
    must not cost a million tuples and lists at planning, only at reading, read by read. One
    object serves as the request's scratch, ``checks`` and ``after`` (57 k reads at 4096 x 256:
    each object and closure a read costs is planning time, and again when it is dropped)."""

    __slots__ = ("_cols", "_i", "_j", "_list", "_place", "_ws")

    def __init__(self, nbytes: int, cols: tuple[np.ndarray, ...], i: int, j: int, ws: list[Want],
                 place: np.ndarray) -> None:
        Scratch.__init__(self, nbytes)
        #: Columns ``(at, length, k0, k1, names, crcs)`` of a batch; this read's rows are ``[i, j)``
        #: of them and of ``place`` (per piece: region, block, rows, where its bytes start, length).
        self._cols: tuple[np.ndarray, ...] | None = cols
        self._i, self._j = i, j
        self._list: list[tuple[int, int, list[int], str]] = []
        self._ws, self._place = ws, place

    def __call__(self) -> None:
        """Copy each piece out of the verified scratch into place, then give the scratch back."""
        buf = self.array()
        ws = self._ws
        for wi, blk, r0, r1, at, n in self._place[self._i : self._j].tolist():
            _place(ws[wi], blk, r0, r1, buf[at : at + n])
        self.release()

    def _made(self) -> list[tuple[int, int, list[int], str]]:
        held = self._cols
        if held is not None:  # a benign race: two threads make equal lists
            (at, length, k0, k1, names, crcs), i, j = held, self._i, self._j
            k0, k1 = k0[i:j], k1[i:j]
            lo = int(k0.min())
            flat = crcs[lo : int(k1.max())].tolist()
            self._list = list(zip(at[i:j].tolist(), length[i:j].tolist(),
                                  [flat[a:b] for a, b in zip((k0 - lo).tolist(), (k1 - lo).tolist())],
                                  names[i:j].tolist()))
            self._cols = None
        return self._list

    def __len__(self) -> int:
        return self._j - self._i

    def __getitem__(self, i: Any) -> Any:
        return self._made()[i]

    def __iter__(self) -> Iterator[tuple[int, int, list[int], str]]:
        return iter(self._made())


def _run_checks(p: dict[str, np.ndarray], sel: np.ndarray, at: np.ndarray, wi: np.ndarray, ext: _Extents,
                ws: list[Want]) -> tuple[np.ndarray, ...]:
    """Per piece ``sel`` (of region ``wi``, at ``at`` in its read): its check's columns (see
    :class:`_Run`)."""
    ra, rb, bs = p["ra"][sel], p["rb"][sel], p["bs"][sel]
    k0 = p["c0"][sel] + (ra - p["so"][sel]) // bs
    k1 = k0 + -(-(rb - ra) // bs)
    return at, rb - ra, k0, k1, np.array([w.name for w in ws], dtype=object)[wi], ext.crcs


def _place(w: Want, blk: int, r0: int, r1: int, raw: np.ndarray) -> None:
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


def _block(w: Want, blk: int) -> tuple[list[int], list[int]]:
    return w.g_off[0][blk].tolist(), w.b_shape[0][blk].tolist()


def _split_segments(p: dict[str, np.ndarray], sel: np.ndarray, seg: dict[str, np.ndarray], ext: _Extents,
                    ws: list[Want], objects: list[str]) -> list[ReadRequest]:
    """Segments whose bytes span extents (a shard larger than an object): one scratch per
    segment, each extent's piece read into its part, copied out once all are in."""
    reqs: list[ReadRequest] = []
    for s in unique(p["seg"][sel]).tolist():
        mine = sel[p["seg"][sel] == s]
        wi, blk, r0, r1, lo, hi = (int(seg[k][s]) for k in ("w", "blk", "r0", "r1", "lo", "hi"))
        w = ws[wi]
        base = int(p["ra"][mine].min())
        scratch = Scratch(int(p["rb"][mine].max()) - base)
        part = [ReadRequest(objects[obj], ByteRange(at + ra - so, at + rb - so), [scratch.slice(ra - base, rb - base)],
                            [_checks(ext.crcs, w.name, ra, rb, so, bs, c0, 0)], [], bs)
                for obj, at, ra, rb, so, bs, c0 in zip(*(p[k][mine].tolist()
                                                         for k in ("obj", "at", "ra", "rb", "so", "bs", "c0")))]

        def copy_out(w: Want = w, scratch: Scratch = scratch, blk: int = blk, r0: int = r0, r1: int = r1,
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
