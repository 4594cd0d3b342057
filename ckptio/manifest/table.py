"""Columnar shard tables: an array item's shards as numpy columns, so planning is array operations.

At 4096 hosts an array has thousands of shards and a host's target meets
many of them (a column block of row-saved shards meets them all): one
Python object per shard and per overlap was the cost of a resharded restore.
A :class:`ShardTable` holds one array item's shards as int64 columns (boxes,
hosts, tiles) and its extents as flat columns (which shard, object, offset,
shard offset, length, first checksum, checksum count, block size) over one
flat uint32 array of block checksums. Row ``i`` of a table is shard ``i`` of
the item it was made from, so the :class:`~.model.ShardRecord` view and the
table always agree.

:func:`table_of` gives an item's table (made once, kept on the item);
:meth:`ShardTable.meeting` finds the shards meeting a box with two
bisections and a mask; :meth:`ShardTable.records` is the object view for the
tools that want objects.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ckptio.manifest.model import ArrayItem, Extent, ShardRecord

__all__ = ["ShardList", "ShardTable", "box_key", "table_of"]

_I64 = np.int64


@dataclasses.dataclass(slots=True, eq=False)
class ShardTable:
    """One array item's shards as columns (``n`` shards of rank ``ndim``, ``m`` extents).

    Shard columns: ``offsets``/``shape`` ``(n, ndim)``, ``host`` ``(n,)``, ``tile`` ``(n, ndim)``
    (-1 where a shard is not tiled), ``first`` ``(n + 1,)``: shard ``i``'s extents are rows
    ``first[i]:first[i + 1]`` of the extent columns. Extent columns ``(m,)``: ``object``,
    ``offset`` (in the object), ``shard_offset``, ``length``, ``crc0`` (its first checksum in
    ``crcs``), ``ncrc``, ``block`` (its checksum block size, as :attr:`Extent.block`; 0 would mean the manifest's). Extents of a
    shard are in shard-offset order and tile its bytes.

    ``crcs`` may hold more than this table's checksums: the tables of a manifest read from
    columnar fragments share one array of every checksum loaded. Index it by ``crc0`` and
    ``ncrc``; never walk it whole.
    """

    offsets: np.ndarray
    shape: np.ndarray
    host: np.ndarray
    tile: np.ndarray
    first: np.ndarray
    object: np.ndarray
    offset: np.ndarray
    shard_offset: np.ndarray
    length: np.ndarray
    crc0: np.ndarray
    ncrc: np.ndarray
    block: np.ndarray
    crcs: np.ndarray
    #: (dimension, row order along it, sorted starts, longest shard along it): made on first use.
    _index: tuple[int, np.ndarray, np.ndarray, int] | None = None
    #: The boxes and tiles as a key (see :meth:`geometry`): made on first use, or given.
    _geometry: tuple[Any, ...] | None = None

    @property
    def n(self) -> int:
        return len(self.host)

    @property
    def ndim(self) -> int:
        return self.offsets.shape[1]

    @property
    def tiled(self) -> np.ndarray:
        """Per shard: whether its bytes are its tiles in stream order."""
        return self.tile[:, 0] >= 0 if self.ndim else np.zeros(self.n, bool)

    @classmethod
    def from_records(cls, shards: Sequence[ShardRecord], ndim: int) -> ShardTable:
        """The table of ``shards`` (row ``i`` is ``shards[i]``)."""
        n = len(shards)
        boxes = np.array([(*s.offsets, *s.shape) for s in shards], _I64).reshape(n, 2 * ndim)
        tile = np.array([s.tile if s.tile is not None else (-1,) * ndim for s in shards], _I64).reshape(n, ndim)
        counts = np.fromiter((len(s.extents) for s in shards), _I64, n)
        exts = list(itertools.chain.from_iterable(s.extents for s in shards))
        cols = np.array([(e.object, e.offset, e.shard_offset, e.length, len(e.crcs), e.block) for e in exts],
                        _I64).reshape(len(exts), 6)
        crcs = np.fromiter(itertools.chain.from_iterable(e.crcs for e in exts), np.uint32)
        ncrc = cols[:, 4]
        return cls(boxes[:, :ndim], boxes[:, ndim:], np.array([s.host for s in shards], _I64), tile,
                   np.concatenate([[0], np.cumsum(counts)]).astype(_I64), cols[:, 0], cols[:, 1], cols[:, 2],
                   cols[:, 3], np.cumsum(ncrc) - ncrc, ncrc, cols[:, 5], crcs)

    def records(self) -> list[ShardRecord]:
        """The shards as :class:`ShardRecord` objects (for tools that want objects)."""
        # This table's checksums only, back to back (``crcs`` may be shared, see the class).
        ncrc = self.ncrc.astype(_I64)
        mine = self.crcs[np.repeat(self.crc0 - (np.cumsum(ncrc) - ncrc), ncrc) + np.arange(int(ncrc.sum()))].tolist()
        ends = np.cumsum(ncrc).tolist()
        exts = [Extent(o, a, so, ln, mine[c - k : c], b) for o, a, so, ln, c, k, b in zip(
            self.object.tolist(), self.offset.tolist(), self.shard_offset.tolist(), self.length.tolist(),
            ends, ncrc.tolist(), self.block.tolist())]
        first = self.first.tolist()
        return [ShardRecord(tuple(off), tuple(sh), h, exts[a:b], tuple(t) if t and t[0] >= 0 else None)
                for off, sh, h, t, a, b in zip(self.offsets.tolist(), self.shape.tolist(), self.host.tolist(),
                                               self.tile.tolist(), first, first[1:])]

    def geometry(self) -> tuple[Any, ...]:
        """The shards' boxes and tiles as a key for "same layout" (equal keys: equal boxes and
        tiles, see :func:`box_key`): a batched restore asks it of every table twice a batch, so
        it is made once. A table made from gathered rows is given its own, made from those rows."""
        if self._geometry is None:
            # A benign race: equal results.
            self._geometry = box_key(np.concatenate([self.offsets, self.shape, self.tile], axis=1), self.ndim)
        return self._geometry

    def _sorted(self) -> tuple[int, np.ndarray, np.ndarray, int]:
        # Along the dimension that separates the shards best, shards reaching into a box start
        # at most ``longest`` before it: two bisections bound the candidates.
        if self._index is None:
            # About how many distinct positions each dimension has (its span over its longest
            # shard): O(n), where counting them exactly took a sort per dimension.
            spans = np.ptp(self.offsets, axis=0) // np.maximum(self.shape.max(axis=0), 1)
            dim = int(np.argmax(spans))
            order = np.argsort(self.offsets[:, dim], kind="stable")
            longest = int(self.shape[:, dim].max()) if self.n else 0
            self._index = (dim, order, self.offsets[order, dim], longest)  # a benign race: equal results
        return self._index

    def meeting(self, off: Sequence[int], shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shards meeting the box ``(off, shape)``: ``(rows, lo, hi)``, rows ascending, each
        with its overlap ``[lo, hi)`` in array coordinates (``(k, ndim)``)."""
        if self.ndim == 0:
            rows = np.arange(self.n, dtype=_I64)
            return rows, np.zeros((self.n, 0), _I64), np.zeros((self.n, 0), _I64)
        box_lo = np.asarray(off, _I64)
        box_hi = box_lo + np.asarray(shape, _I64)
        if self.n <= 8:
            rows = np.arange(self.n, dtype=_I64)
        else:
            dim, order, starts, longest = self._sorted()
            a = np.searchsorted(starts, box_lo[dim] - longest, "right")
            b = np.searchsorted(starts, box_hi[dim], "left")
            rows = np.sort(order[a:b])
        lo = np.maximum(self.offsets[rows], box_lo)
        hi = np.minimum(self.offsets[rows] + self.shape[rows], box_hi)
        meets = (hi > lo).all(axis=1)
        return rows[meets], lo[meets], hi[meets]


class ShardList(Sequence[ShardRecord]):
    """An item's shards as :class:`ShardRecord` s, made from its table on first use (an item
    read from a columnar fragment: planning never asks for them)."""

    __slots__ = ("_records", "table")

    def __init__(self, table: ShardTable) -> None:
        self.table = table
        self._records: list[ShardRecord] | None = None

    def _list(self) -> list[ShardRecord]:
        if self._records is None:
            self._records = self.table.records()  # a benign race: equal lists
        return self._records

    def __len__(self) -> int:
        return self.table.n

    def __getitem__(self, i: Any) -> Any:
        return self._list()[i]

    def __iter__(self) -> Iterator[ShardRecord]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._list())


def box_key(boxes: np.ndarray, ndim: int) -> tuple[int, int, bytes]:
    """The :meth:`ShardTable.geometry` key of shards of rank ``ndim`` whose rows of ``boxes``
    are ``(offsets, shape, tile)`` (``(n, 3 * ndim)``): one form whatever made the table, so that
    a table gathered from columnar fragments and one parsed from records meet in the planner's
    caches. The count and rank make equal keys mean equal tables even where the bytes are empty."""
    return (len(boxes), ndim, np.ascontiguousarray(boxes, _I64).tobytes())


def table_of(item: ArrayItem) -> ShardTable:
    """``item``'s shard table: the one it came with, else made from its shards once and kept."""
    table = item.table
    if table is None:
        table = item.table = ShardTable.from_records(item.shards, len(item.shape))  # a benign race
    return table
