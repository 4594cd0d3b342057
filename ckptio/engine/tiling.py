"""Tiled shards: a large 2-D+ shard stored as a grid of small C-order tiles.

A shard stored in C order can only be read by whole rows: a restore onto a
different sharding that wants a column block of row-saved shards (tensor
parallel after data parallel, a new mesh) reads every row whole, 16x the
bytes for a 1/16 column block. Stored as tiles, the same request reads only
the tiles it meets (Orbax/tensorstore get the same effect from zarr chunks).

The byte stream of a tiled shard is its tiles in C order over the tile grid,
each tile's elements in C order; edge tiles are smaller (no padding). The
writer makes each tile an extent of its own, so checksum blocks start at
tile boundaries and a tile is verifiable on its own. Staging stays a plain
copy: the writer cuts each object's tiles out of the staged shard in a
background thread just before it writes the object, so the training step
never waits for the strided copy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["DEFAULT_TILE_BYTES", "TileCopy", "tile_boxes", "tile_for", "tiles_meeting"]

#: Tiles of about 1 MiB (what shared-storage backends declare in ``Capabilities.tile_bytes``): a
#: column block of a row-saved shard reads at most one tile width too much on either side, and a
#: tile is still one efficient request.
DEFAULT_TILE_BYTES = 1 << 20

Shape = tuple[int, ...]


def tile_for(shape: Sequence[int], itemsize: int, tile_bytes: int) -> Shape | None:
    """The tile shape for a shard, or None to keep it in plain C order.

    Only shards of 2+ dimensions can be asked for column blocks, and only
    those larger than two tiles gain anything. The tile halves the currently largest dimension until it holds
    at most ``tile_bytes`` (ties go to the innermost): close to square, so row
    and column blocks alike read little beyond what they ask for.
    """
    if tile_bytes <= 0 or len(shape) < 2 or math.prod(shape) * itemsize <= 2 * tile_bytes:
        return None
    tile = list(shape)
    limit = max(1, tile_bytes // itemsize)
    while math.prod(tile) > limit:
        d = max(range(len(tile)), key=lambda i: (tile[i], i))
        if tile[d] == 1:
            break
        tile[d] = -(-tile[d] // 2)
    if tile[1:] == list(shape[1:]):
        return None  # tiles of whole rows: plain C order already reads any row range alone
    return tuple(tile)


def _grid(shape: Shape, tile: Shape) -> Shape:
    return tuple(-(-n // t) for n, t in zip(shape, tile))


def tile_boxes(shape: Shape, tile: Shape) -> Iterator[tuple[Shape, Shape, int]]:
    """Every tile of a shard in stream order: ``(offsets, shape, byte offset in elements)``."""
    pos = 0
    for idx in itertools.product(*(range(g) for g in _grid(shape, tile))):
        offs = tuple(i * t for i, t in zip(idx, tile))
        sizes = tuple(min(t, n - o) for t, n, o in zip(tile, shape, offs))
        yield offs, sizes, pos
        pos += math.prod(sizes)


def _start(shape: Shape, tile: Shape, idx: Sequence[int]) -> int:
    """The element offset of tile ``idx`` in the stream (tiles before it, in C order over the grid).

    The tiles before ``idx`` are, for each dimension ``d``, those that agree with ``idx`` before
    ``d`` and come earlier in ``d``: full tiles ``idx[d] * tile[d]`` long in ``d``, as wide as
    ``idx``'s own tiles before ``d`` and as the whole shard after it.
    """
    total = 0
    before = 1
    for d in range(len(shape)):
        after = math.prod(shape[d + 1 :])
        total += before * idx[d] * tile[d] * after
        before *= min(tile[d], shape[d] - idx[d] * tile[d])
    return total


def tiles_meeting(
    shape: Shape, tile: Shape, off: Sequence[int], size: Sequence[int]
) -> list[tuple[Shape, Shape, int]]:
    """The tiles that meet the box ``(off, size)`` (shard coordinates), in stream order:
    ``(tile offsets, tile shape, element offset in the stream)``."""
    ranges = [range(o // t, -(-(o + n) // t)) for o, n, t in zip(off, size, tile)]
    out = []
    for idx in itertools.product(*ranges):
        offs = tuple(i * t for i, t in zip(idx, tile))
        sizes = tuple(min(t, n - o) for t, n, o in zip(tile, shape, offs))
        out.append((offs, sizes, _start(shape, tile, idx)))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class TileCopy:
    """Copies one tile (the box ``offs`` + ``sizes``) of a staged C-order shard into the buffer
    the writer hands it.

    A value, not a closure, so that a writer in another process (ckptio.saving.writers.sidecar) can be told
    which shard and box to cut instead of being handed code.
    """

    shard: np.ndarray
    offs: Shape
    sizes: Shape

    def __call__(self, dest: memoryview) -> None:
        box = tuple(slice(o, o + n) for o, n in zip(self.offs, self.sizes))
        np.copyto(np.asarray(dest).view(self.shard.dtype).reshape(self.sizes), self.shard[box], casting="no")
