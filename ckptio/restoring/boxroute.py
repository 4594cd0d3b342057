"""Logical-box exchange, the plan: which host sends which boxes of which array to which host.

A restore on another topology (rows restored as columns, one array wanted
whole, replicas) has many hosts needing bytes that one saved host wrote.
Reading them from storage on every host that needs them costs H× the
storage bandwidth, and reading every fragment to find them costs every host
the whole job's metadata. Here (ByteCheckpoint's design, NSDI '25) a host
reads the root and only the fragments it is *responsible* for, and sends the
*logical boxes* other hosts need out of those fragments' shards:

* **responsibility**: fragment ``f`` of the saved job is sent by restore host
  ``f % H`` (:func:`responsible`): its own fragment when the job keeps its size
  or grows, also those of saved hosts that no longer exist when it shrinks;
* **every host's target, without an all-gather**: a :class:`TargetTable`
  holds every host's target boxes of one array as columns. Every host builds
  it from a description it already has (a regular grid of blocks and the
  host of each block, :meth:`TargetTable.grid`; a jax ``NamedSharding``
  knows every device's index and process); only an irregular target needs
  the boxes all-gathered (:func:`gathered`);
* **the pieces**: a sender intersects its fragments' shards with every
  host's target boxes (:func:`outgoing`), a receiver intersects its own
  target boxes with the root's locators (the boxes of every shard and the
  fragment holding it: no fragment read, :func:`incoming`). Both list the
  pieces of a (sender, receiver) pair in one canonical order (array, then
  the piece's box), so a message is raw bytes, no headers, and both sides
  know its length before it is sent.

Everything is array operations over columns: a sender's cost grows with its
own shards times the hosts their boxes meet, a receiver's with the shards its
own boxes meet, never with the job's metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptio.manifest import ArrayItem, Box, table_of
from ckptio.system import unique_rows

__all__ = ["Pieces", "TargetTable", "apart", "gathered", "incoming", "meet", "outgoing", "responsible", "sender_of"]

_I64 = np.int64


@dataclasses.dataclass(frozen=True, eq=False)
class TargetTable:
    """Every host's target boxes of one array: row ``i`` is the box ``(offsets[i], shape[i])``
    that host ``host[i]`` restores. A host's rows never repeat a box (a box it holds twice, two
    devices of one replica, is one row)."""

    host: np.ndarray  # (k,)
    offsets: np.ndarray  # (k, ndim)
    shape: np.ndarray  # (k, ndim)
    # Each host's boxes, once asked: one table serves every array of a layout (hundreds of arrays
    # ask for the same host's boxes). The columns are never changed after construction.
    _of_host: dict[int, tuple[Box, ...]] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def grid(cls, shape: Sequence[int], block: Sequence[int], hosts: np.ndarray) -> TargetTable:
        """A regular grid of ``block`` cells over an array of ``shape`` (the last cell of a
        dimension may be short), as jax's ``NamedSharding`` and DCP's even chunking make.
        ``hosts``: the hosts restoring each cell, an int array of the grid's shape plus one
        axis of replicas (-1 pads: fewer replicas of some cell)."""
        ndim = len(shape)
        counts = [-(-n // b) if b else 1 for n, b in zip(shape, block)]
        hosts = np.asarray(hosts, _I64)
        if hosts.shape[:ndim] != tuple(counts) or hosts.ndim != ndim + 1:
            raise ValueError(f"a grid of {block} over {list(shape)} has {counts} cells; hosts has shape "
                             f"{list(hosts.shape)} (cells + one axis of replicas)")
        cells = np.indices(counts, _I64).reshape(ndim, -1).T if ndim else np.zeros((1, 0), _I64)
        b, n = np.asarray(block, _I64), np.asarray(shape, _I64)
        offs = cells * b
        sizes = np.minimum(b, n - offs)
        reps = hosts.reshape(len(cells), -1)
        cell, rep = np.nonzero(reps >= 0)
        return cls.from_columns(reps[cell, rep], offs[cell], sizes[cell])

    @classmethod
    def from_sharding(cls, sharding: Any, shape: Sequence[int]) -> TargetTable:
        """From a jax ``Sharding`` of an array of ``shape``: every process holds it whole (every
        device's index, and the process of each device), so nothing is gathered."""
        ndim = len(shape)
        rows = [(dev.process_index, *(sl.indices(n)[0] for sl, n in zip(index, shape)),
                 *(len(range(*sl.indices(n))) for sl, n in zip(index, shape)))
                for dev, index in sharding.devices_indices_map(tuple(shape)).items()]
        cols = np.array(rows, _I64).reshape(len(rows), 1 + 2 * ndim)
        return cls.from_columns(cols[:, 0], cols[:, 1 : 1 + ndim], cols[:, 1 + ndim :])

    @classmethod
    def from_boxes(cls, per_host: Mapping[int, Sequence[Box]], ndim: int) -> TargetTable:
        """From each host's boxes, listed (what an all-gather of an irregular target brings)."""
        rows = [(h, *off, *sh) for h, boxes in sorted(per_host.items()) for off, sh in boxes]
        cols = np.array(rows, _I64).reshape(len(rows), 1 + 2 * ndim)
        return cls.from_columns(cols[:, 0], cols[:, 1 : 1 + ndim], cols[:, 1 + ndim :])

    @classmethod
    def from_columns(cls, host: np.ndarray, offsets: np.ndarray, shape: np.ndarray) -> TargetTable:
        """From columns; repeated ``(host, box)`` rows become one."""
        ndim = offsets.shape[1] if offsets.ndim == 2 else 0
        cols = np.column_stack([host, offsets, shape]).astype(_I64).reshape(len(host), 1 + 2 * ndim)
        if len(cols) > 1:  # np.unique(cols, axis=0), its order too, without its structured-dtype sort
            cols = cols[np.lexsort(cols.T[::-1])]
            cols = cols[np.r_[True, (cols[1:] != cols[:-1]).any(axis=1)]]
        return cls(cols[:, 0].copy(), cols[:, 1 : 1 + ndim].copy(), cols[:, 1 + ndim :].copy())

    @property
    def ndim(self) -> int:
        return self.offsets.shape[1]

    def of_host(self, host: int) -> list[Box]:
        """Host ``host``'s boxes."""
        boxes = self._of_host.get(host)
        if boxes is None:
            rows = np.flatnonzero(self.host == host)
            boxes = self._of_host[host] = tuple(
                (tuple(o), tuple(s)) for o, s in zip(self.offsets[rows].tolist(), self.shape[rows].tolist()))
        return list(boxes)


def gathered(coord: Any, mine: Mapping[str, Sequence[Box]], ndims: Mapping[str, int]) -> dict[str, TargetTable]:
    """Every host's target tables from an all-gather of each host's own boxes (``coord``: an
    :class:`~ckptio.coord.distributed.AllGatherCoordinator`): the fallback for a target that no
    description every host holds can say (O(hosts x arrays) on every host; a grid is O(1) sent)."""
    everyone = coord.all_gather({n: [[list(o), list(s)] for o, s in b] for n, b in mine.items()})
    names = sorted({n for per in everyone for n in per})
    return {n: TargetTable.from_boxes({h: [(tuple(o), tuple(s)) for o, s in per.get(n, [])]
                                       for h, per in enumerate(everyone)}, ndims[n]) for n in names}


def apart(items: Mapping[str, Any], targets: Mapping[str, TargetTable]) -> set[str]:
    """The arrays of ``targets`` that every host can restore by reading its own target from
    storage with no stored byte read by two hosts (beyond a checksum block at a cut): no box is
    wanted by two hosts, and every box either is a stored shard of a root's ``items`` or, with
    every stored shard, spans whole rows (only the first axis cut). For those the exchange moves
    nothing another host could not read itself as cheaply: same layout, N -> N/2, N -> 2N.

    Decided from the root and the tables alone, so every host decides alike with no collective."""
    memo: dict[tuple[int, tuple[int, ...]], _Facts] = {}  # arrays of one shape share a table: once each
    # Arrays sharing a locator, a shape and a table (a layer's weights and their optimizer state): once.
    said: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any, bool]] = {}
    out = set()
    for n, tt in targets.items():
        item = items.get(n)
        if not isinstance(item, ArrayItem):
            continue
        if item.locator is None:
            yes = _apart(item, tt, memo)
        else:
            key = (id(item.locator), id(tt), tuple(item.shape))
            got = said.get(key)
            if got is None or got[0] is not item.locator or got[1] is not tt:  # ids of live objects only
                got = said[key] = (item.locator, tt, _apart(item, tt, memo))
            yes = got[2]
        if yes:
            out.add(n)
    return out


@dataclasses.dataclass
class _Facts:
    """What :func:`apart` needs of one target table (of arrays of one trailing shape)."""

    table: TargetTable  # held, so that its id stays its own while memoised
    boxes: np.ndarray  # the non-empty boxes: (k, 2 * ndim) offsets then shape
    slabs: bool | None  # whole rows that do not overlap (True), overlap (False), not whole rows (None)


def _facts(tt: TargetTable, full: np.ndarray) -> _Facts:
    keep = np.prod(tt.shape, axis=1, dtype=_I64) > 0
    off, shape = tt.offsets[keep], tt.shape[keep]
    slabs = None
    if len(off) and off.shape[1] and (off[:, 1:] == 0).all() and (shape[:, 1:] == full).all():
        order = np.argsort(off[:, 0], kind="stable")
        start, end = off[order, 0], off[order, 0] + shape[order, 0]
        slabs = bool((start[1:] >= end[:-1]).all())
    return _Facts(tt, np.concatenate([off, shape], axis=1), slabs)


def _apart(item: ArrayItem, tt: TargetTable, memo: dict[tuple[int, tuple[int, ...]], _Facts]) -> bool:
    ndim = len(item.shape)
    key = (id(tt), tuple(item.shape[1:]))
    facts = memo.get(key)
    if facts is None or facts.table is not tt:
        facts = memo[key] = _facts(tt, np.asarray(item.shape[1:], _I64))
    boxes = facts.boxes
    if len(boxes) <= 1:
        return True  # one host reads it, or nobody: nothing to share
    if not ndim:
        return False  # a scalar several hosts want: replicated
    if item.locator is not None:
        stored = item.locator[:, 1:]
    else:
        t = table_of(item)
        stored = np.concatenate([t.offsets, t.shape], axis=1)
    if facts.slabs is not None and (stored[:, 1:ndim] == 0).all() and (stored[:, ndim + 1 :] == boxes[0, ndim + 1 :]).all():
        # Row slabs of rows saved: each a contiguous run of the stored shards it meets; apart if
        # no two overlap (replicas would).
        return facts.slabs
    # Else apart only if every box is a whole stored shard (stored shards do not overlap) and no
    # box is on two hosts. The first box alone, then a hash of each, rule most targets out cheaply.
    if not (stored == boxes[0]).all(axis=1).any() or not np.isin(_hashed(boxes), _hashed(stored)).all():
        return False
    if len(unique_rows(boxes)) < len(boxes):
        return False  # one box on several hosts: replicas
    stored = unique_rows(stored)
    return len(unique_rows(np.concatenate([stored, boxes]))) == len(stored)


def _hashed(rows: np.ndarray) -> np.ndarray:
    """One int64 per row (collisions possible: only a filter)."""
    mult = (np.arange(rows.shape[1], dtype=_I64) * 2 + 1) * _I64(0x9E3779B97F4A7C15 - (1 << 64))
    with np.errstate(over="ignore"):
        return (rows * mult).sum(axis=1, dtype=_I64)


def responsible(fragments: int, hosts: int, rank: int) -> list[int]:
    """The fragments restore host ``rank`` of ``hosts`` reads and sends: ``f`` with ``f % hosts == rank``."""
    return list(range(rank, fragments, hosts))


def sender_of(fragment: np.ndarray, hosts: int) -> np.ndarray:
    """The restore host that sends the shards of each ``fragment``."""
    return np.asarray(fragment, _I64) % hosts


@dataclasses.dataclass
class Pieces:
    """The logical boxes of one array moved between hosts, as columns in canonical order
    (``src``, ``dst``, then the box's ``lo`` and ``hi`` in array coordinates): what both ends of
    a message list alike. ``ref``: per piece, the row it came from on this side (a sender: the
    row of its loaded shard table; a receiver: the row of its :class:`TargetTable`). ``s0``/``sn``:
    the first row and the rows of the stored shard it comes from (both ends know them), so both
    can cut the pieces by the same bands of each shard (:meth:`band`)."""

    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ref: np.ndarray
    s0: np.ndarray
    sn: np.ndarray

    def nbytes(self, itemsize: int) -> np.ndarray:
        """Per piece, its bytes."""
        return np.prod(self.hi - self.lo, axis=1, dtype=_I64) * itemsize

    def __len__(self) -> int:
        return len(self.src)

    def take(self, keep: np.ndarray) -> Pieces:
        """The pieces ``keep`` selects (a mask or indices), in order."""
        return Pieces(self.src[keep], self.dst[keep], self.lo[keep], self.hi[keep], self.ref[keep], self.s0[keep],
                      self.sn[keep])

    def band(self, k: int, bands: int) -> Pieces:
        """The pieces cut to band ``k`` of ``bands`` of the rows of their stored shard (row band
        ``[s0 + sn*k//bands, s0 + sn*(k+1)//bands)``), those left non-empty, in order: what one
        round of an exchange moves, the same on both ends."""
        if bands == 1 or not self.lo.shape[1]:
            return self if k == 0 else self.take(np.zeros(len(self), bool))
        a, b = self.s0 + self.sn * k // bands, self.s0 + self.sn * (k + 1) // bands
        lo, hi = self.lo.copy(), self.hi.copy()
        lo[:, 0], hi[:, 0] = np.maximum(lo[:, 0], a), np.minimum(hi[:, 0], b)
        keep = lo[:, 0] < hi[:, 0]
        out = self.take(keep)
        out.lo, out.hi = lo[keep], hi[keep]
        return out


def meet(a_off: np.ndarray, a_shape: np.ndarray, b_off: np.ndarray, b_shape: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every non-empty overlap of a box of ``a`` with a box of ``b``: ``(ia, ib, lo, hi)``, by
    row of ``a`` then of ``b`` (the smaller side's order first). Loops
    over the smaller side, vectorised over the larger."""
    ndim = a_off.shape[1]
    swap = len(a_off) > len(b_off)
    if swap:
        a_off, a_shape, b_off, b_shape = b_off, b_shape, a_off, a_shape
    b_hi = b_off + b_shape
    ia, ib, los, his = [], [], [], []
    for i in range(len(a_off)):
        lo = np.maximum(b_off, a_off[i])
        hi = np.minimum(b_hi, a_off[i] + a_shape[i])
        meets = np.flatnonzero((hi > lo).all(axis=1)) if ndim else np.arange(len(b_off))
        ia.append(np.full(len(meets), i, _I64))
        ib.append(meets)
        los.append(lo[meets])
        his.append(hi[meets])
    if not ia:
        empty = np.zeros(0, _I64)
        return empty, empty, np.zeros((0, ndim), _I64), np.zeros((0, ndim), _I64)
    out_a, out_b = np.concatenate(ia), np.concatenate(ib)
    lo, hi = np.concatenate(los, axis=0), np.concatenate(his, axis=0)
    return (out_b, out_a, lo, hi) if swap else (out_a, out_b, lo, hi)


def _sorted(src: np.ndarray, dst: np.ndarray, lo: np.ndarray, hi: np.ndarray, ref: np.ndarray,
            s_off: np.ndarray, s_shape: np.ndarray) -> Pieces:
    keys = [*hi.T[::-1], *lo.T[::-1], dst, src]  # np.lexsort: the last key is the primary one
    order = np.lexsort(keys) if len(src) else np.zeros(0, _I64)
    ndim = lo.shape[1]
    s0 = s_off[:, 0] if ndim else np.zeros(len(src), _I64)
    sn = s_shape[:, 0] if ndim else np.ones(len(src), _I64)
    return Pieces(src[order], dst[order], lo[order], hi[order], ref[order], s0[order], sn[order])


def outgoing(items: Mapping[str, Any], targets: Mapping[str, TargetTable], rank: int) -> dict[str, Pieces]:
    """Per array of ``targets``, the pieces host ``rank`` sends: its loaded shards (``items`` of a
    manifest holding exactly the fragments it is responsible for,
    :meth:`CheckpointStore.load_fragment_numbers`) intersected with every host's target boxes.
    ``ref``: the shard's row in ``table_of(item)``."""
    out: dict[str, Pieces] = {}
    for name, tt in targets.items():
        item = items[name]
        if not isinstance(item, ArrayItem) or not item.shards:
            continue
        t = table_of(item)
        rows, ib, lo, hi = meet(t.offsets, t.shape, tt.offsets, tt.shape)
        if len(rows):
            out[name] = _sorted(np.full(len(rows), rank, _I64), tt.host[ib], lo, hi, rows, t.offsets[rows],
                                t.shape[rows])
    return out


def incoming(items: Mapping[str, Any], targets: Mapping[str, TargetTable], rank: int, hosts: int
             ) -> dict[str, Pieces]:
    """Per array of ``targets``, the pieces host ``rank`` (of ``hosts``) receives: its own target
    boxes intersected with the boxes of every saved shard the locators of a root's ``items`` list
    (no fragment read). ``ref``: the target box's row in ``targets[name]``. Arrays sharing a locator and
    target boxes are intersected once."""
    out: dict[str, Pieces] = {}
    done: dict[tuple[int, bytes], Pieces] = {}
    for name, tt in targets.items():
        item = items[name]
        mine = np.flatnonzero(tt.host == rank)
        if not isinstance(item, ArrayItem) or not len(mine) or item.locator is None:
            continue
        key = (id(item.locator), tt.offsets[mine].tobytes() + tt.shape[mine].tobytes() + mine.tobytes())
        got = done.get(key)
        if got is None:
            loc, ndim = item.locator, len(item.shape)
            rows, ib, lo, hi = meet(loc[:, 1 : 1 + ndim], loc[:, 1 + ndim :], tt.offsets[mine], tt.shape[mine])
            got = done[key] = _sorted(sender_of(loc[rows, 0], hosts), np.full(len(rows), rank, _I64), lo, hi,
                                      mine[ib], loc[rows, 1 : 1 + ndim], loc[rows, 1 + ndim :])
        if len(got):
            out[name] = got
    return out
