"""Box geometry of a manifest: overlaps, and checks that shards tile an array exactly once.

A box is ``(offsets, shape)``. Readers and the commit use these to refuse a
manifest whose shards leave holes or overlap (a restore would return garbage
or an ambiguous value): :func:`check_tiling` for the shards of one array,
:func:`check_table` / :func:`without_replicas` for a format-2 locator (every
shard's box as one int64 table, ``[fragment, offsets..., shape...]`` per row).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.model import Box, ShardRecord
from ckptio.system import unique_rows

__all__ = ["check_table", "check_tiling", "first_overlap", "overlap", "without_replicas"]


def overlap(
    a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes as ``(offsets, shape)``, or None if they do not meet."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def check_tiling(shards: list[ShardRecord], shape: tuple[int, ...], where: str) -> None:
    """Shards must cover the array exactly once, or a restore would return holes or ambiguity.

    Every shard lies inside the array (checked by the caller), so equal volumes and
    no two overlapping shards mean an exact tiling.
    """
    total = sum(s.size for s in shards)
    if total != math.prod(shape):
        raise ManifestError(
            f"{where}: the shards hold {total} of the array's {math.prod(shape)} elements (missing or overlapping slices)"
        )
    pair = first_overlap([(s.offsets, s.shape) for s in shards if s.size])
    if pair is not None:
        raise ManifestError(f"{where}: shards {pair[0]} and {pair[1]} overlap")


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (``(offsets, shape)``, none empty) that overlap, or None.

    Thousands of shards per array are normal at scale (8192 for a parameter
    sharded over 1024 hosts x 8 devices), so this is not pairwise. In a
    dimension whose distinct intervals are disjoint, boxes with different
    intervals cannot meet, and boxes with the same interval meet exactly when
    they do in the other dimensions: so the boxes are split into those groups
    and each group is checked on the remaining dimensions. A grid (any mesh
    sharding) resolves completely that way, one dictionary pass per dimension;
    only a group whose remaining dimensions all have overlapping intervals is
    swept, along the dimension with the most distinct intervals, comparing the
    boxes whose intervals there overlap.
    """
    if len(boxes) < 2:
        return None
    return _overlap_in(boxes, list(range(len(boxes[0][0]))))


def _overlap_in(boxes: list[Box], dims: list[int]) -> tuple[Box, Box] | None:
    """first_overlap for boxes known to coincide in every dimension not in ``dims``."""
    if not dims:
        return boxes[0], boxes[1]  # identical boxes
    for k in dims:
        groups: dict[tuple[int, int], list[Box]] = {}
        for box in boxes:
            groups.setdefault((box[0][k], box[0][k] + box[1][k]), []).append(box)
        spans = sorted(groups)
        if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)):
            rest = [d for d in dims if d != k]
            for group in groups.values():
                if len(group) > 1 and (found := _overlap_in(group, rest)) is not None:
                    return found
            return None
    if len(dims) == 2:  # any 2-D tiling (pinwheels included) in O(n log n)
        return _sweep_2d(boxes, dims[0], dims[1])
    return _sweep(boxes, max(dims, key=lambda d: len({(b[0][d], b[1][d]) for b in boxes})))


def _sweep_2d(boxes: list[Box], k: int, j: int) -> tuple[Box, Box] | None:
    """Boxes that coincide outside dimensions ``k`` and ``j``: sweep along ``k`` keeping the active
    intervals along ``j`` sorted and disjoint, so each insertion is checked against its two neighbours."""
    events: list[tuple[int, int, int]] = []  # (position along k, 0 = leaves / 1 = enters, box number)
    for i, b in enumerate(boxes):
        events.append((b[0][k], 1, i))
        events.append((b[0][k] + b[1][k], 0, i))
    events.sort()
    starts: list[int] = []  # sorted starts along j of the active boxes
    owner: dict[int, int] = {}  # start -> box number
    for _pos, enters, i in events:
        lo = boxes[i][0][j]
        if not enters:
            if owner.get(lo) == i:
                del starts[bisect.bisect_left(starts, lo)]
                del owner[lo]
            continue
        hi = lo + boxes[i][1][j]
        at = bisect.bisect_left(starts, lo)
        if at < len(starts) and starts[at] < hi:
            return boxes[owner[starts[at]]], boxes[i]
        if at > 0:
            prev = owner[starts[at - 1]]
            if boxes[prev][0][j] + boxes[prev][1][j] > lo:
                return boxes[prev], boxes[i]
        starts.insert(at, lo)
        owner[lo] = i
    return None


def _sweep(boxes: list[Box], k: int) -> tuple[Box, Box] | None:
    active: list[tuple[int, int, Box]] = []  # heap of (end along k, tie-breaker, box)
    for i, box in enumerate(sorted(boxes, key=lambda b: b[0][k])):
        start = box[0][k]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if overlap(*other, *box) is not None:
                return other, box
        heapq.heappush(active, (start + box[1][k], i, box))
    return None


def without_replicas(table: np.ndarray, shape: list[int], n_fragments: int, where: str) -> np.ndarray:
    """``table`` without replicas (the same box from two hosts: the first is kept), checked to tile the array.

    A grid (every mesh sharding) is checked with a few vectorised passes: per dimension its
    distinct intervals must be disjoint, and no two boxes in the same cell; anything else
    goes through :func:`first_overlap`.
    """
    ndim = len(shape)
    if len(table) > 1:
        _u, first = np.unique(table[:, 1:], axis=0, return_index=True)
        if len(first) < len(table):
            table = table[np.sort(first)]
    check_table(table, shape, n_fragments, where, exact=False)
    live = table[np.prod(table[:, 1 + ndim :], axis=1) > 0] if ndim else table
    if len(live) < 2:
        return table
    # Distinct boxes whose intervals, per dimension, are equal or disjoint cannot overlap.
    grid = True
    for d in range(ndim):
        spans = unique_rows(live[:, [1 + d, 1 + ndim + d]])
        if (spans[:-1, 0] + spans[:-1, 1] > spans[1:, 0]).any():
            grid = False
            break
    if grid:
        exact = sum(math.prod(r) for r in live[:, 1 + ndim :].tolist())
        if exact != math.prod(shape):
            raise ManifestError(f"{where}: the shards hold {exact} of the array's {math.prod(shape)} elements")
        return table
    check_table(table, shape, n_fragments, where, exact=True)
    return table


def check_table(table: np.ndarray, shape: list[int] | tuple[int, ...], n_fragments: int, where: str,
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
