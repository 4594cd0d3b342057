"""Every shard row gathered from columnar fragments checked at once, as array operations.

A reader that takes 256 arrays' rows from its own fragment checked them item
by item (thirty array calls each: most of a same-layout restore's load). Here
the checks run once over all rows, each row against its own item's rank,
shape and dtype; a fault still names the first item (in the root's order)
with a bad row, and the first check that row fails, as the per-item checks did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.limits import MAX_DIM
from ckptio.manifest.model import ArrayItem

__all__ = ["check_rows"]


#: Rows checked at a time: the checks' temporaries stay a few MB at a million rows.
_CHUNK = 1 << 16


def check_rows(cols: dict[str, Any], items: Sequence[ArrayItem], names: Sequence[str], block_size: int,
               where: str) -> None:
    """ManifestError unless every row of ``cols`` (gathered and in item order, ``item`` indexing
    ``items``) lies inside its array with its rank, has a tile that fits, and has extents holding
    exactly its bytes with one checksum per block. Adds ``cols["bs"]``: each extent's block size."""
    item, width = cols["item"], cols["width"]
    ext = cols["extents"]
    cols["bs"] = np.where(ext[:, 5] > 0, ext[:, 5], block_size)
    facts = _Facts(items, width)
    for a in range(0, len(item), _CHUNK):
        bad = _bad(cols, facts, a, min(a + _CHUNK, len(item)))
        any_bad = bad[0] | bad[1] | bad[2] | bad[3]
        if any_bad.any():
            # Rows are in item order: this is the first bad item; which check it fails first
            # is asked of all its rows, as when each item was checked on its own.
            k = int(item[a + int(np.flatnonzero(any_bad)[0])])
            lo, hi = np.searchsorted(item, [k, k + 1]).tolist()
            first = next(i for i, b in enumerate(_bad(cols, facts, lo, hi)) if b.any())
            shape_k = list(items[k].shape)
            why = [f"a shard's rank differs from the array's {len(shape_k)}",
                   f"a shard lies outside the array shape {shape_k}", "a shard's tile does not fit its shape",
                   "a shard's extents do not hold exactly its bytes with one checksum per block"][first]
            raise ManifestError(f"{where}: item {names[k]!r}: {why}")


class _Facts:
    """Per item: its rank, its shape padded with 1 to ``width``, its dtype's size."""

    def __init__(self, items: Sequence[ArrayItem], width: int) -> None:
        self.rank = np.array([len(it.shape) for it in items], np.int64)
        self.limit = np.ones((len(items), width), np.int64)
        self.size = np.array([it.dtype.itemsize for it in items], np.int64)
        for k, it in enumerate(items):
            self.limit[k, : len(it.shape)] = it.shape


def _bad(cols: dict[str, Any], facts: _Facts, a: int, b: int) -> list[np.ndarray]:
    """For rows ``[a, b)``: which fail each check, in the order the checks are named.

    Dimension by dimension over whole columns: numpy's reductions along a short row axis cost
    ~4x the element-wise work (a batch of a column-block restore checks ~50 k rows, 20 batches
    a restore). A dimension beyond a row's array's rank (padded) is masked per column, and only
    from the chunk's lowest rank on: below it no row is padded (the common case: none is)."""
    width, item, boxes = cols["width"], cols["item"][a:b], cols["boxes"][a:b]
    n = b - a
    rank, lim = facts.rank[item], facts.limit[item]
    low = int(rank.min()) if n else width
    wrong_rank, outside = np.zeros(n, bool), np.zeros(n, bool)
    untiled, fits = np.ones(n, bool), np.ones(n, bool)
    nbytes = facts.size[item]
    for d in range(width):
        o, s, t = boxes[:, d], boxes[:, width + d], boxes[:, 2 * width + d]
        out_d = (o < 0) | (s < 0) | (o > lim[:, d] - s)
        untiled_d = t == -1
        fits_d = (t >= 1) & (t <= np.maximum(s, 1))
        if d >= low:
            pad = rank <= d
            wrong_rank |= pad & ((o != 0) | (s != 1) | (t != -1))
            out_d &= ~pad
            untiled_d |= pad
            fits_d |= pad
            s = np.where(pad, 1, s)
        outside |= out_d
        untiled &= untiled_d
        fits &= fits_d
        nbytes = nbytes * s
    return [wrong_rank, outside, ~(untiled | fits), _bad_extents(cols, a, b, nbytes)]


def _bad_extents(cols: dict[str, Any], a: int, b: int, nbytes: np.ndarray) -> np.ndarray:
    """Per row of ``[a, b)``: whether its extents fail to tile its ``nbytes`` bytes in order,
    each inside the limits with one checksum per block."""
    ecount, efirst = cols["ecount"][a:b], cols["efirst"][a : b + 1]
    e0, e1 = int(efirst[0]), int(efirst[-1])
    _obj, at, so, length, ncrc, block = cols["extents"][e0:e1].T
    bs = cols["bs"][e0:e1]
    ends = np.concatenate([[0], np.cumsum(length)])
    start = ends[efirst[:-1] - e0]  # the bytes of the chunk's extents before each row's first
    covered = ends[:-1] - np.repeat(start, ecount)  # each extent's offset within its row's bytes
    bad = ((length < 1) | (at < 0) | (at > MAX_DIM) | (block < 0) | (so != covered)
           | (ncrc != -(-length // bs)))
    per_row = np.bincount(np.repeat(np.arange(len(ecount)), ecount), weights=bad, minlength=len(ecount)) > 0
    return per_row | (ends[efirst[1:] - e0] - start != nbytes)
