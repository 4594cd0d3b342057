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

from ...errors import ManifestError
from ..limits import MAX_DIM
from ..model import ArrayItem

__all__ = ["check_rows"]


def check_rows(cols: dict[str, Any], items: Sequence[ArrayItem], names: Sequence[str], block_size: int,
               where: str) -> None:
    """ManifestError unless every row of ``cols`` (gathered and in item order, ``item`` indexing
    ``items``) lies inside its array with its rank, has a tile that fits, and has extents holding
    exactly its bytes with one checksum per block. Adds ``cols["bs"]``: each extent's block size."""
    item, width = cols["item"], cols["width"]
    ext = cols["extents"]
    cols["bs"] = np.where(ext[:, 5] > 0, ext[:, 5], block_size)
    if not len(item):
        return
    rank = np.array([len(it.shape) for it in items], np.int64)
    limit = np.ones((len(items), width), np.int64)
    size = np.array([it.dtype.itemsize for it in items], np.int64)
    for k, it in enumerate(items):
        limit[k, : len(it.shape)] = it.shape
    boxes = cols["boxes"]
    offs, shape, tile = boxes[:, :width], boxes[:, width : 2 * width], boxes[:, 2 * width : 3 * width]
    pad = np.arange(width) >= rank[item][:, None]  # dimensions beyond the row's array's rank
    bad = [
        (((offs != 0) | (shape != 1) | (tile != -1)) & pad).any(axis=1),
        (((offs < 0) | (shape < 0) | (offs > limit[item] - shape)) & ~pad).any(axis=1),
        ~(((tile == -1) | pad).all(axis=1) | (((tile >= 1) & (tile <= np.maximum(shape, 1))) | pad).all(axis=1)),
        _bad_extents(cols, np.prod(np.where(pad, 1, shape), axis=1, dtype=np.int64) * size[item]),
    ]
    any_bad = bad[0] | bad[1] | bad[2] | bad[3]
    if not any_bad.any():
        return
    k = int(item[np.flatnonzero(any_bad)].min())
    mine = item == k
    first = next(i for i, b in enumerate(bad) if b[mine].any())
    shape_k = list(items[k].shape)
    why = [f"a shard's rank differs from the array's {len(shape_k)}",
           f"a shard lies outside the array shape {shape_k}", "a shard's tile does not fit its shape",
           "a shard's extents do not hold exactly its bytes with one checksum per block"][first]
    raise ManifestError(f"{where}: item {names[k]!r}: {why}")


def _bad_extents(cols: dict[str, Any], nbytes: np.ndarray) -> np.ndarray:
    """Per row: whether its extents fail to tile its ``nbytes`` bytes in order, each inside the
    limits with one checksum per block."""
    ecount, efirst, bs = cols["ecount"], cols["efirst"], cols["bs"]
    obj, at, so, length, ncrc, block = cols["extents"].T
    ends = np.concatenate([[0], np.cumsum(length)])
    start = ends[efirst[:-1]]  # the bytes of all extents before each row's first
    covered = ends[:-1] - np.repeat(start, ecount)  # each extent's offset within its row's bytes
    bad = ((length < 1) | (at < 0) | (at > MAX_DIM) | (block < 0) | (so != covered)
           | (ncrc != -(-length // bs)))
    per_row = np.bincount(np.repeat(np.arange(len(ecount)), ecount), weights=bad, minlength=len(ecount)) > 0
    return per_row | (ends[efirst[1:]] - start != nbytes)
