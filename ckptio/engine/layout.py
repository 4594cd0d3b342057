"""Object packing and naming, and a save's layout options.

Options: :class:`LayoutOptions` holds the layout choices a save makes (tiling),
which are neither engine knobs nor storage facts.

Packing: the shards a host owns become objects of about ``object_size``
bytes -- small shards coalesced into one object (few requests, few files),
huge ones cut into several (parallel IO, bounded requests).

Checksum blocks: a shard's extents are checksummed in blocks of
:func:`extent_block` bytes -- the save's block size for big shards, smaller for
small ones (at least :data:`MIN_BLOCKS_PER_SHARD` blocks a shard, floor
:data:`MIN_BLOCK`), so that reading part of a small shard (a job that doubles its
hosts reads half of each) rounds out by a few KiB, not by a whole block.

Naming: on POSIX a flat directory per checkpoint; on object stores a
hashed first component right under the root, *before* the step::

    flat:    <step_dir>/<save_id>.h00003-00012
    hashed:  h3f/<step_dir>/<save_id>.h00003-00012

Object stores index keys lexicographically and split hot ranges slowly, so
every save spreads its objects over the same ``16**chars`` ranges that
earlier saves already warmed up. The component is a hash of the checkpoint
plus a round-robin over hosts and objects, so the spread is even by
construction (not only in expectation). The leading ``h`` keeps it from ever
looking like a step number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ckptio.backends.base import LayoutDefaults, join_key
from ckptio.engine.tiling import TileCopy, tile_boxes
from ckptio.state.leaves import LeafPack, StagedArray
from ckptio.system.bufferpool import StagingPool
from ckptio.system.bytes import address

#: Unaligned memory is laid out in step with the file (:func:`direct_offset`) from this many bytes on:
#: under it, the padding (up to a page) costs more than the bounce copy it saves.
DIRECT_MIN = 1 << 16
#: Write buffers of lazy (tiled) objects, reused across objects and saves: fresh memory costs
#: page faults at a third of copy speed. Bounded: a few objects' worth in flight.
_SCRATCH = StagingPool(max_bytes=512 << 20)
_ROUND = 1 << 20

__all__ = ["DIRECT_MIN", "MIN_BLOCK", "MIN_BLOCKS_PER_SHARD", "FanoutNaming", "FlatNaming", "HashedNaming", "LayoutOptions", "Naming",
           "ObjectPlan", "Piece", "PlannedExtent", "direct_offset", "extent_block", "pack", "pieces_of"]

#: A shard is checksummed in at least this many blocks (unless :data:`MIN_BLOCK` stops it): a
#: read of part of it rounds out by less than one block in 32 at each cut end, so the half of
#: a shard that a job twice as large reads costs at most 1/16 more than it needs.
MIN_BLOCKS_PER_SHARD = 32
#: The smallest block: a page (an aligned extent's blocks stay aligned for direct IO), and at
#: crc32c's ~9 GiB/s plus a call each, still about 4 GB/s of checksums a thread.
MIN_BLOCK = 4 << 10
#: A whole array up to this size keeps one block: it is always read whole, in bulk, verified by
#: one checksum per array (``ckptio.restoring.packed``).
_WHOLE_ONE_BLOCK = 1 << 20


def extent_block(shard_bytes: int, whole: bool, block_size: int) -> int:
    """The checksum block size for the extents of a shard of ``shard_bytes`` bytes (``whole``: the
    whole array) in a save whose block size is ``block_size``; 0 where that is ``block_size``
    itself (big shards: their manifest rows, checksum count and CPU are as before).

    A multiple of :data:`MIN_BLOCK`, at most ``shard_bytes / MIN_BLOCKS_PER_SHARD`` (or
    :data:`MIN_BLOCK` for a shard of fewer than 32 pages).
    """
    if whole and shard_bytes <= _WHOLE_ONE_BLOCK:
        return 0
    block = max(MIN_BLOCK, shard_bytes // MIN_BLOCKS_PER_SHARD // MIN_BLOCK * MIN_BLOCK)
    # A shard of one block either way (a page or less) keeps the manifest's row as it was.
    return 0 if block >= block_size or block >= shard_bytes else block


Fill = Callable[[memoryview], None]


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """How a save lays its shards out in objects (picklable). ``None``: the backend's default.

    Its public spelling is ``SaveOptions(tile_bytes=...)``, which a save maps here once
    (``ckptio.saving.options.SaveOptions.layout``).
    """

    #: Shards of 2+ dimensions larger than two tiles are stored as tiles of about this many
    #: bytes (ckptio.engine.tiling), so a restore onto another sharding reads only the tiles it
    #: meets; 0 keeps every shard in plain C order. None: the backend's
    #: ``layout_defaults.tile_bytes`` (tiled on shared storage, C order on a local disk).
    tile_bytes: int | None = None

    def tile_bytes_for(self, defaults: LayoutDefaults) -> int:
        """The tile size of a save onto storage whose layout defaults are ``defaults``: never above one object."""
        tile_bytes = defaults.tile_bytes if self.tile_bytes is None else self.tile_bytes
        return min(tile_bytes, defaults.object_size)


@dataclasses.dataclass(slots=True)
class Piece:
    """Bytes of one staged shard: ``item`` and shard number, its bytes from ``shard_offset``
    (a whole shard, or one tile of a tiled shard: each tile becomes an extent of its own).

    A piece is either ``data`` itself or, with ``fill``, ``length`` bytes that ``fill`` writes
    into a buffer when the object is about to be written (a tile cut out of a staged shard,
    off the training step's path).
    """

    item: str
    shard: int
    data: memoryview | None  # 1-D unsigned bytes
    shard_offset: int = 0
    fill: Fill | None = None
    length: int = -1
    #: A pack of small arrays (staging.LeafPack): each member's end offset. Checksummed per
    #: member, never split across objects.
    cuts: list[int] | None = None
    #: The piece starts at a multiple of this in its object (a pack: its dtype's alignment, so
    #: that every member, back to back with others of its dtype, is aligned for it).
    align: int = 1
    #: Its shard's checksum block size (:func:`extent_block`); 0: the save's.
    block: int = 0
    #: Its blocks' checksums where staging already computed them (``ckptio.dcp._stagedsums``);
    #: None: the engine computes them as it writes.
    sums: list[int] | None = None

    def __post_init__(self) -> None:
        if self.length < 0:
            assert self.data is not None, "a piece without data needs a length and a fill"
            self.length = self.data.nbytes


def pieces_of(
    staged: dict[str, Any], packs: Sequence[LeafPack] = (), block_size: int = 0,
) -> tuple[list[Piece], dict[tuple[str, int], np.ndarray]]:
    """Every staged shard as byte pieces (one per tile of a tiled shard; one per pack, numbered
    -1, -2, ...), and each shard's or pack's buffer (to fill before its objects are written).

    ``staged`` maps item names to :class:`~ckptio.state.leaves.StagedArray` (anything else has no bytes).
    ``block_size``: the save's checksum block size, which small shards' pieces refine
    (:func:`extent_block`); 0 keeps it for every piece.
    """
    out, arrays = [], {}
    for k, lp in enumerate(packs):
        out.append(Piece("", -1 - k, memoryview(lp.buffer), cuts=lp.ends, align=lp.arrays[0].dtype.alignment))
        arrays[("", -1 - k)] = lp.buffer
    for name, item in staged.items():
        if isinstance(item, StagedArray):
            for i, (_offs, shape, data) in enumerate(item.shards):
                tile = item.tile_of(i)
                size = item.dtype.itemsize
                nbytes = math.prod(shape) * size
                block = extent_block(nbytes, tuple(shape) == tuple(item.shape), block_size) if block_size else 0
                if tile is None:
                    out.append(Piece(name, i, memoryview(data.reshape(-1).view(np.uint8)), block=block))
                else:
                    for offs, sizes, pos in tile_boxes(shape, tile):
                        # The tile is cut out of the staged C-order shard when its object is written.
                        fill = TileCopy(data, offs, sizes)
                        out.append(Piece(name, i, None, pos * size, fill, math.prod(sizes) * size, block=block))
                arrays[(name, i)] = data
    return out, arrays


@dataclasses.dataclass(slots=True)
class PlannedExtent:
    item: str
    shard: int
    shard_offset: int
    offset: int  # within the object
    data: memoryview | None  # None until a lazy extent is filled (ObjectPlan.materialize)
    length: int = -1
    fill: Fill | None = None
    cuts: list[int] | None = None  # see Piece.cuts
    block: int = 0  # see Piece.block
    sums: list[int] | None = None  # see Piece.sums

    def __post_init__(self) -> None:
        if self.length < 0:
            assert self.data is not None
            self.length = self.data.nbytes


_ZEROS = memoryview(bytes(1 << 16))  # padding source; alignments up to 64 KiB


@dataclasses.dataclass(slots=True)
class ObjectPlan:
    key: str
    extents: list[PlannedExtent]
    _scratch: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        last = self.extents[-1]
        return last.offset + last.length

    @property
    def lazy(self) -> bool:
        return any(e.fill is not None for e in self.extents)

    def materialize(self) -> None:
        """Fill the lazy extents into one buffer of their own (run in a writer thread)."""
        lazy = [e for e in self.extents if e.fill is not None]
        need = sum(e.length for e in lazy)
        self._scratch = _SCRATCH.take(-(-need // _ROUND) * _ROUND)  # sizes rounded up: more reuse
        buf = memoryview(self._scratch)
        pos = 0
        for e in lazy:
            view = buf[pos : pos + e.length]
            assert e.fill is not None
            e.fill(view)
            e.data = view
            pos += e.length

    def release(self) -> None:
        """Drop the lazy extents' buffer once the object is written."""
        for e in self.extents:
            if e.fill is not None:
                e.data = None
        if self._scratch is not None:
            _SCRATCH.give_back([self._scratch])
            self._scratch = None

    @property
    def buffers(self) -> list[memoryview]:
        """The object's bytes in order: each extent, after zero padding up to its offset."""
        out, pos = [], 0
        for e in self.extents:
            if e.offset > pos:
                out.append(_ZEROS[: e.offset - pos])
            assert e.data is not None, "materialize() a lazy plan before writing it"
            out.append(e.data)
            pos = e.offset + e.length
        return out


class Naming:
    """How an object of a save is named; a strategy per backend."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        raise NotImplementedError

    def prefixes(self) -> list[str]:
        """Top-level components that hold objects outside step directories (for sweeps)."""
        return []


@dataclasses.dataclass(frozen=True)
class FlatNaming(Naming):
    """All of a checkpoint's objects in its own directory (POSIX)."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(step_dir, f"{save_id}.h{host:05d}-{n:05d}")


@dataclasses.dataclass(frozen=True)
class FanoutNaming(Naming):
    """A checkpoint's objects spread over ``fanout`` sub-directories (parallel file systems,
    where one huge directory serialises metadata operations)."""

    fanout: int = 16

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(step_dir, f"d{(n * num_hosts + host) % self.fanout:03d}", f"{save_id}.h{host:05d}-{n:05d}")


@dataclasses.dataclass(frozen=True)
class HashedNaming(Naming):
    """A hashed component first, then the step (object stores)."""

    chars: int = 2

    def component(self, step_dir: str, host: int, num_hosts: int, n: int) -> str:
        slots = 16**self.chars
        seed = int.from_bytes(hashlib.blake2b(step_dir.encode(), digest_size=8).digest(), "big")
        # Global object number interleaves hosts, so all hosts together fill every slot evenly.
        slot = (seed + n * num_hosts + host) % slots
        return f"h{slot:0{self.chars}x}"

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(self.component(step_dir, host, num_hosts, n), step_dir, f"{save_id}.h{host:05d}-{n:05d}")

    def prefixes(self) -> list[str]:
        return [f"h{i:0{self.chars}x}" for i in range(16**self.chars)]


def direct_offset(size: int, data: memoryview | None, align: int) -> int:
    """The first offset from ``size`` where ``data`` can be written with direct IO as it lies in memory.

    That is the first one congruent to ``data``'s address modulo ``align``: from its first
    ``align``-aligned byte on, memory and file are aligned together, so only the partial
    blocks at either end pass through a bounce buffer. ckptio's own buffers are aligned
    (an aligned offset); a sync ``dcp.save`` hands over torch's tensors as they are, 64
    bytes past a page, whose bytes would otherwise all be copied once more (issue 35).
    Unaligned ``data`` under :data:`DIRECT_MIN` bytes takes the aligned offset, as before.
    """
    phase = address(data) % align if data is not None and data.nbytes >= DIRECT_MIN else 0
    return size + (phase - size) % align


def pack(
    pieces: Iterable[Piece],
    *,
    object_size: int,
    key_for: Callable[[int], str],
    split_align: int = 1 << 20,
    align: int = 1,
    in_place: bool = True,
) -> list[ObjectPlan]:
    """Pack pieces into objects of about ``object_size`` bytes, in order.

    A piece larger than ``object_size`` is cut at multiples of ``split_align``
    into objects of its own; smaller ones are appended to the current object
    until it would pass the target. ``key_for(n)`` names object ``n``. With
    ``align > 1`` (direct IO), every extent of at least ``align`` bytes starts
    at an offset congruent to its memory's address modulo ``align`` (zero
    padding before it; see :func:`direct_offset`), so it can be written and
    read without a bounce copy. ``in_place=False``: the writer copies the bytes into aligned
    memory first (the writer process's shared memory), so large extents start aligned.
    """
    if align > len(_ZEROS):
        raise ValueError(f"alignment {align} exceeds {len(_ZEROS)}")
    step = max(split_align, object_size - object_size % split_align)
    plans: list[ObjectPlan] = []
    current: list[PlannedExtent] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            plans.append(ObjectPlan(key_for(len(plans)), current))
            current, size = [], 0

    for p in pieces:
        n = p.length
        if n == 0:
            continue
        if n > object_size:
            if p.data is None or p.cuts is not None:
                raise ValueError(f"a lazy or packed piece of {n} bytes exceeds the object size {object_size}")
            close()
            for start in range(0, n, step):
                chunk = p.data[start : start + step]
                at = direct_offset(0, chunk if in_place else None, align) if align > 1 else 0
                plans.append(ObjectPlan(key_for(len(plans)), [PlannedExtent(p.item, p.shard, p.shard_offset + start, at,
                                                                            chunk, block=p.block)]))
            continue
        if size and size + n > object_size:
            close()
        if align > 1 and n >= align:
            size = direct_offset(size, p.data if in_place else None, align)  # small pieces stay packed tight
        elif size % p.align:
            size += p.align - size % p.align
        current.append(PlannedExtent(p.item, p.shard, p.shard_offset, size, p.data, n, p.fill, p.cuts, p.block, p.sums))
        size += n
    close()
    return plans
