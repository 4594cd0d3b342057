"""The planner of ckptio.reshard before columnar shard tables (issue 32), kept ONLY as a test oracle.

tests/test_planner_*.py check that the vectorised planner reads the byte ranges this one read (or
fewer) and restores the same bytes. Not part of the library.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ckptio.backends.base import ByteRange

from ckptio.engine import ReadRequest
from ckptio.manifest import ArrayItem, Box, Extent, ShardRecord, overlap  # noqa: F401
from ckptio.scratch import Scratch, ScratchSlice
from ckptio.reshard_reads import _after_all, _copier
from ckptio.tiling import tiles_meeting

__all__ = ["Region", "coverage_gaps", "overlap", "plan_region", "shard_grid", "shards_meeting"]

_SCRATCH_ROWS_BYTES = 32 << 20
_INDEXES: dict[int, tuple[ArrayItem, "_ShardIndex"]] = {}


@dataclasses.dataclass(slots=True)
class Region:
    """A target slice of an array and the C-contiguous host buffer that receives it."""

    offsets: tuple[int, ...]
    dest: np.ndarray  # shape is the region's shape


def shard_grid(item: ArrayItem) -> tuple[int, ...]:
    """The coarsest regular grid whose cells each lie inside one saved shard: per dimension, the
    gcd of every shard boundary and the array's length (at least 1)."""
    shape = []
    for d, n in enumerate(item.shape):
        g = n
        for s in item.shards:
            g = math.gcd(g, s.offsets[d], s.offsets[d] + s.shape[d])
        shape.append(max(g, 1))
    return tuple(shape)


class _ShardIndex:
    """The shards of one array sorted along the dimension that separates them best.

    A restore, a verify pass or a zarr read plans one region at a time, and an
    array at scale has thousands of shards (8192 for 1024 hosts x 8 devices):
    scanning them all for every region made planning quadratic. Shards start
    within ``max_len`` before a region's start along ``dim`` if they reach into
    it, so two bisections bound the candidates.
    """

    __slots__ = ("dim", "max_len", "shards", "starts")

    def __init__(self, shards: list[ShardRecord]) -> None:
        ndim = len(shards[0].offsets) if shards else 0
        self.dim = max(range(ndim), key=lambda d: len({s.offsets[d] for s in shards})) if ndim else -1
        self.shards = sorted(shards, key=lambda s: s.offsets[self.dim]) if ndim else list(shards)
        self.starts = [s.offsets[self.dim] for s in self.shards] if ndim else []
        self.max_len = max((s.shape[self.dim] for s in self.shards), default=0) if ndim else 0

    def candidates(self, off: tuple[int, ...], shape: tuple[int, ...]) -> list[ShardRecord]:
        if self.dim < 0:
            return self.shards
        lo = bisect.bisect_right(self.starts, off[self.dim] - self.max_len)
        hi = bisect.bisect_left(self.starts, off[self.dim] + shape[self.dim])
        return self.shards[lo:hi]


def shards_meeting(
    item: ArrayItem, off: tuple[int, ...], shape: tuple[int, ...]
) -> list[tuple[ShardRecord, Box]]:
    """The saved shards of ``item`` that overlap the box ``(off, shape)``, each with that overlap
    (``(offsets, shape)`` in array coordinates), in index order."""
    if len(item.shards) == 1:  # most items of a large state: no index to build
        o = overlap(item.shards[0].offsets, item.shards[0].shape, off, shape)
        return [] if o is None else [(item.shards[0], o)]
    index = _INDEXES.get(id(item))
    if index is None or index[0] is not item:
        index = _INDEXES[id(item)] = (item, _ShardIndex(item.shards))
    out = []
    for s in index[1].candidates(off, shape):
        o = overlap(s.offsets, s.shape, off, shape)
        if o is not None:
            out.append((s, o))
    return out


def coverage_gaps(item: ArrayItem, region_off: tuple[int, ...], region_shape: tuple[int, ...]) -> int:
    """Elements of the region that no saved shard covers (shards never overlap each other)."""
    covered = sum(math.prod(o_shape) for _, (_, o_shape) in shards_meeting(item, region_off, region_shape))
    return math.prod(region_shape) - covered


def _pieces(shard: ShardRecord, lo: int, hi: int, bs: int) -> list[tuple[Extent, int, int, int, int]]:
    """Cut shard bytes ``[lo, hi)`` by extent: ``(extent, lo, hi, block_lo, block_hi)`` in shard coordinates.

    ``block_lo``/``block_hi`` round ``lo``/``hi`` out to the extent's checksum blocks.
    """
    out = []
    for e in shard.extents:
        a, b = max(lo, e.shard_offset), min(hi, e.shard_offset + e.length)
        if a >= b:
            continue
        ra = e.shard_offset + (a - e.shard_offset) // bs * bs
        rb = min(e.shard_offset + e.length, e.shard_offset + -(-(b - e.shard_offset) // bs) * bs)
        out.append((e, a, b, ra, rb))
    return out


def _check(e: Extent, ra: int, rb: int, bs: int, at: int, item: str) -> tuple[int, int, list[int], str]:
    first = (ra - e.shard_offset) // bs
    last = -(-(rb - e.shard_offset) // bs)
    return (at, rb - ra, e.crcs[first:last], item)


def _request(
    objects: list[str], e: Extent, ra: int, rb: int, bs: int, buffers: list[memoryview | ScratchSlice], checks: list,
    after: list,
) -> ReadRequest:
    start = e.offset + (ra - e.shard_offset)
    return ReadRequest(objects[e.object], ByteRange(start, start + rb - ra), buffers, checks, after, bs)


def plan_region(
    name: str, item: ArrayItem, region: Region, objects: list[str], block_size: int
) -> list[ReadRequest]:
    """Read requests that fill ``region.dest`` from the saved shards of ``item``."""
    shape = tuple(region.dest.shape)
    itemsize = item.dtype.itemsize
    dest_bytes = region.dest.reshape(-1).view(np.uint8) if region.dest.size else None
    reqs: list[ReadRequest] = []
    if dest_bytes is None:
        return reqs
    for shard, (o_off, o_shape) in shards_meeting(item, region.offsets, shape):
        ndim = len(shape)
        inner_same = ndim == 0 or (shard.shape[1:] == o_shape[1:] == shape[1:])
        if shard.tile is None and inner_same:
            row_bytes = (math.prod(shard.shape[1:]) if ndim else 1) * itemsize
            r0 = o_off[0] - shard.offsets[0] if ndim else 0
            nrows = o_shape[0] if ndim else 1
            d0 = (o_off[0] - region.offsets[0]) * row_bytes if ndim else 0
            reqs += _direct(name, shard, r0 * row_bytes, (r0 + nrows) * row_bytes, dest_bytes, d0, objects, block_size)
        else:
            reqs += _scattered(name, item, shard, region, o_off, o_shape, objects, block_size)
    return reqs


def _direct(
    name: str, shard: ShardRecord, lo: int, hi: int, dest: np.ndarray, d0: int, objects: list[str], bs: int
) -> list[ReadRequest]:
    """Shard bytes ``[lo, hi)`` go to ``dest[d0:]``; only partial end blocks use scratch."""
    reqs = []
    for e, a, b, ra, rb in _pieces(shard, lo, hi, bs):
        at = d0 + (a - lo)
        # Aligned middle: whole blocks read straight into the destination.
        ma = e.shard_offset + -(-(a - e.shard_offset) // bs) * bs
        mb = b if b == e.shard_offset + e.length else e.shard_offset + (b - e.shard_offset) // bs * bs
        if ma < mb:
            view = memoryview(dest[at + (ma - a) : at + (mb - a)])
            reqs.append(_request(objects, e, ma, mb, bs, [view], [_check(e, ma, mb, bs, 0, name)], []))
        partial = [(ra, ma), (mb, rb)] if ma < mb else [(ra, rb)]
        for sa, sb in partial:  # partial blocks at either end: through scratch
            if sa >= sb:
                continue
            scratch = Scratch(sb - sa)
            ca, cb = max(a, sa), min(b, sb)
            copy = _copier(dest, at + (ca - a), scratch, ca - sa, cb - ca)
            reqs.append(_request(objects, e, sa, sb, bs, [scratch.slice(0, sb - sa)], [_check(e, sa, sb, bs, 0, name)],
                                 [copy]))
    return reqs


def _through_scratch(
    name: str, shard: ShardRecord, lo: int, hi: int, objects: list[str], bs: int,
    place: Callable[[np.ndarray], None],
) -> list[ReadRequest]:
    """Read shard bytes ``[lo, hi)`` (rounded out to checksum blocks) into a scratch buffer of
    their own (ckptio.scratch: memory from the read's start until the copy-out); once every
    piece is in and verified, ``place`` gets those bytes to copy out."""
    pieces = _pieces(shard, lo, hi, bs)
    base = pieces[0][3]
    scratch = Scratch(pieces[-1][4] - base)
    reqs = [
        _request(objects, e, ra, rb, bs, [scratch.slice(ra - base, rb - base)], [_check(e, ra, rb, bs, 0, name)], [])
        for e, _a, _b, ra, rb in pieces
    ]

    def copy_out() -> None:
        place(scratch.array()[lo - base : hi - base])
        scratch.release()

    reqs[-1].after.append(_after_all(len(reqs), copy_out, reqs))
    return reqs


def _scattered(
    name: str,
    item: ArrayItem,
    shard: ShardRecord,
    region: Region,
    o_off: tuple[int, ...],
    o_shape: tuple[int, ...],
    objects: list[str],
    bs: int,
) -> list[ReadRequest]:
    """The overlap ``(o_off, o_shape)`` of ``shard`` through scratch, block by block of its
    stream: each tile it meets of a tiled shard, or the whole of a C-order one. Of each block,
    the rows the overlap touches (a block is C order inside), in runs of at most
    ``_SCRATCH_ROWS_BYTES``, are read and verified, then their part copied into place."""
    isz = item.dtype.itemsize
    rel = tuple(o - s for o, s in zip(o_off, shard.offsets))
    blocks = ([((0,) * len(shard.shape), shard.shape, 0)] if shard.tile is None
              else tiles_meeting(shard.shape, shard.tile, rel, o_shape))
    reqs: list[ReadRequest] = []
    for b_off, b_shape, pos in blocks:
        g_off = tuple(s + b for s, b in zip(shard.offsets, b_off))
        part = overlap(g_off, b_shape, o_off, o_shape)
        assert part is not None
        row = math.prod(b_shape[1:]) * isz
        first = part[0][0] - g_off[0]
        last = first + part[1][0]
        src = (slice(None),) + tuple(slice(p - g, p - g + n) for p, g, n in zip(part[0][1:], g_off[1:], part[1][1:]))
        inner = tuple(slice(p - r, p - r + n) for p, r, n in zip(part[0][1:], region.offsets[1:], part[1][1:]))
        rows_per = max(1, _SCRATCH_ROWS_BYTES // max(row, 1))
        for r0 in range(first, last, rows_per):
            r1 = min(last, r0 + rows_per)
            d0 = g_off[0] + r0 - region.offsets[0]
            dst = (slice(d0, d0 + r1 - r0), *inner)
            reqs += _through_scratch(name, shard, pos * isz + r0 * row, pos * isz + r1 * row, objects, bs,
                                     _placer(region.dest, dst, item.dtype, (r1 - r0, *b_shape[1:]), src))
    return reqs


def _placer(
    dest: np.ndarray, dst: tuple[slice, ...], dtype: np.dtype, shape: tuple[int, ...], src: tuple[slice, ...]
) -> Callable[[np.ndarray], None]:
    """Copies ``src`` of the bytes it is given (viewed as ``dtype[shape]``) to ``dest[dst]``."""

    def place(raw: np.ndarray) -> None:
        dest[dst] = raw.view(dtype).reshape(shape)[src]

    return place
