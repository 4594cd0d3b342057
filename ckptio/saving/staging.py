"""Stage: turn a state's leaves into shards in host memory the save owns.

This is the only part of a save that the training step waits for. Mutable
arrays (numpy, torch) are copied into reusable host buffers; immutable ones
already on the host (JAX CPU arrays) are referenced without a copy. Only one
replica of each shard is staged: plain numpy leaves are treated as
replicated across hosts and written by host 0; JAX arrays write the shards
whose ``replica_id`` is 0; :class:`Sharded` leaves write the pieces given.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ckptio.engine.tiling import tile_for
from ckptio.errors import UnsupportedLeafError
from ckptio.manifest import ValueItem, encode_value
from ckptio.manifest.builder import PACKED
from ckptio.manifest.hoststate import StagedHostState, staged_host_state
from ckptio.state.dtypes import check_dtype
from ckptio.state.leaves import (
    LeafPack, Sharded, StagedArray, index_to_box, is_jax_array, is_torch_tensor, plain_cpu_tensor,
    torch_to_numpy,
)
from ckptio.state.perhost import is_per_host_leaf, state_of
from ckptio.system import POPULATE_MIN, populate
from ckptio.system.bufferpool import StagingPool, aligned_empty

__all__ = ["PACK_MAX_BYTES", "LeafPacker", "StagingArea", "stage_leaf", "stage_leaves"]


class StagingArea:
    """The host buffers one save owns, and the copies that fill them.

    Copies are registered while a save is planned and run afterwards, object
    by object, so each object's write can start as soon as its own bytes are
    staged instead of after the whole state.
    """

    def __init__(self, pool: StagingPool | None) -> None:
        self.pool = pool
        self.owned: list[np.ndarray] = []
        self.fresh: list[np.ndarray] = []  # new buffers not yet prefaulted
        self.new: list[np.ndarray] = []  # new buffers from the pool, not yet settled (StagingPool.settle)
        self._pending: dict[int, tuple[np.ndarray, Any]] = {}
        #: Device arrays whose bytes this area copies to the host (``id`` -> freed once they are there).
        self._devices: dict[int, bool] = {}

    def snapshot(self, arr: Any) -> np.ndarray:
        """A buffer of ``arr``'s shape and dtype that :meth:`fill` will copy ``arr`` into."""
        buf = self._buffer(arr.nbytes)
        dtype = np.dtype(arr.dtype)
        out = buf.view(dtype).reshape(arr.shape) if arr.nbytes else np.empty(arr.shape, dtype)
        self._pending[id(out)] = (out, arr)
        return out

    def from_device(self, arr: Any, *, owned: bool) -> np.ndarray:
        """A buffer that :meth:`fill` will copy the device array ``arr`` into (the device-to-host copy
        runs then, off the training step's path); ``owned``: ``arr`` is this save's own snapshot,
        deleted (its device memory freed) once its bytes are on the host."""
        self._devices[id(arr)] = owned
        return self.snapshot(arr)

    def prefetch(self, out: np.ndarray) -> None:
        """Start the device-to-host transfer of the copy pending into ``out`` (if it comes from a device)."""
        job = self._pending.get(id(out))
        if job is not None and id(job[1]) in self._devices:
            try:
                job[1].copy_to_host_async()
            except (AttributeError, RuntimeError):  # a deleted or CPU array: the copy itself says why
                pass

    def on_device(self, out: np.ndarray) -> bool:
        """True if the copy pending into ``out`` comes from a device (a background fill's to run)."""
        job = self._pending.get(id(out))
        return job is not None and id(job[1]) in self._devices

    def pack(self, arrays: list[np.ndarray], nbytes: int) -> np.ndarray:
        """A uint8 buffer that :meth:`fill` will copy ``arrays`` into, back to back."""
        buf = self._buffer(nbytes)
        self._pending[id(buf)] = (buf, arrays)
        return buf

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A buffer this save owns until :meth:`release`."""
        buf, fresh = self.pool.obtain(nbytes) if self.pool is not None else (aligned_empty(nbytes), True)
        self.owned.append(buf)
        if fresh and nbytes >= POPULATE_MIN:
            self.fresh.append(buf)
            if self.pool is not None:
                self.new.append(buf)
        return buf

    def prefault(self) -> threading.Thread | None:
        """Fault in the pages of this save's new buffers on a helper thread, in the order they
        were taken, while the caller copies into them.

        A first save stages into memory never touched: measured here, its stall was mostly
        page faults (1.1-3.7 s for 1 GiB against ~0.2 s once the pool's buffers are reused).
        The faults then run on another core ahead of the copy instead of inside it: a first
        save's stall of 1 GiB went from 0.99-1.44 s (shared mappings, no prefault) to
        0.82-0.98 s (private) to 0.58-0.64 s (private, prefaulted). Safe
        whatever the timing: populating never changes a byte (backends/_pages.py), and the
        thread keeps its buffers alive however early the save releases them. Returns the
        thread (nobody needs to wait for it), or None when there was nothing new.
        """
        if not self.fresh:
            return None
        views = [memoryview(b) for b in self.fresh]
        self.fresh = []
        thread = threading.Thread(target=populate, args=(views,), name="ckptio-prefault", daemon=True)
        thread.start()
        return thread

    def fill(self, out: np.ndarray) -> None:
        """Run the copy into ``out`` if it has not run yet."""
        job = self.take(out)
        if job is not None:
            self.run(job)

    def take(self, out: np.ndarray) -> tuple[np.ndarray, np.ndarray | list[np.ndarray]] | None:
        """The copy still pending into ``out`` as ``(dest, source)``, now the caller's to run."""
        return self._pending.pop(id(out), None)

    def run(self, job: tuple[np.ndarray, Any]) -> None:
        """Run a copy :meth:`take` handed out."""
        dest, src = job
        if isinstance(src, list):  # a pack (one dtype): one call for all its members, in C order
            np.concatenate(src, axis=None, out=dest.view(src[0].dtype), casting="no")
            return
        host, device = self.to_host(src)
        np.copyto(dest, host, casting="no")
        self.done_with(device)

    def to_host(self, src: Any) -> tuple[np.ndarray, Any]:
        """``src``'s bytes on the host, and the device array they came from (None: a host array)."""
        if id(src) not in self._devices:
            return src, None
        return np.asarray(src), src  # the device-to-host copy (jax keeps the host copy with the array)

    def done_with(self, device: Any) -> None:
        """Once a device array's bytes are staged: a snapshot of this save's own is deleted (device memory back)."""
        if device is not None and self._devices.pop(id(device), False):
            device.delete()

    def source_of(self, out: np.ndarray) -> np.ndarray:
        """The array :meth:`fill` will copy into ``out`` (``out`` itself when no copy is pending, or
        when it comes from a device: the staged copy is the host's own)."""
        job = self._pending.get(id(out))
        if job is None or isinstance(job[1], list) or id(job[1]) in self._devices:
            return out
        return job[1]  # type: ignore[no-any-return]

    def forget(self, outs: Sequence[np.ndarray]) -> None:
        """Never fill ``outs`` (an incremental save's unchanged items): their buffers go back untouched."""
        addrs = {o.ctypes.data for o in outs if self._pending.pop(id(o), None) is not None and o.nbytes}
        gone = {id(b) for b in self.owned if b.nbytes and b.ctypes.data in addrs}
        unused = [b for b in self.owned if id(b) in gone]
        self.owned, self.fresh = ([b for b in bs if id(b) not in gone] for bs in (self.owned, self.fresh))
        if self.pool is not None:
            self.pool.give_back(unused)

    def fill_all(self) -> None:
        for out, _src in list(self._pending.values()):
            self.fill(out)

    def release(self) -> None:
        """Give the buffers back to the pool (once their objects are written); a snapshot never staged
        (the save failed first) gives its device memory back too."""
        for _out, src in self._pending.values():
            self.done_with(src if id(src) in self._devices else None)
        if self.pool is not None:
            self.pool.give_back(self.owned)
        self.owned = []

    def settle(self) -> None:
        """Once the save is committed: the pool moves the buffers it made for this save into huge
        pages, for the saves that reuse them (:meth:`StagingPool.settle`)."""
        new, self.new = self.new, []
        if self.pool is not None and new:
            self.pool.settle(new)


#: Arrays up to this size (and at most one checksum block) are staged packed (:class:`LeafPack`).
PACK_MAX_BYTES = 256 << 10


class _OpenPack:
    """The members of a pack being collected."""

    __slots__ = ("arrays", "ends", "names", "size")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrays: list[np.ndarray] = []
        self.ends: list[int] = []
        self.size = 0

    def add(self, name: str, arr: np.ndarray) -> None:
        self.names.append(name)
        self.arrays.append(arr)
        self.size += arr.nbytes
        self.ends.append(self.size)


class LeafPacker:
    """Collects the small leaves of a state into :class:`LeafPack` s of at most ``max_pack`` bytes,
    one open pack per (dtype, origin)."""

    def __init__(self, area: StagingArea, max_leaf: int, max_pack: int) -> None:
        self.area = area
        self.max_leaf = max_leaf
        self.max_pack = max(max_pack, max_leaf)
        self.packs: list[LeafPack] = []
        self._open: dict[tuple[np.dtype, str], _OpenPack] = {}
        self._bad: set[np.dtype] = set()  # dtypes ckptio cannot save: staged alone, to raise there
        jax = sys.modules.get("jax")
        # A fully replicated jax array is whole on this host only in a single-process job.
        self._jax_ok = jax is not None and jax.process_count() == 1

    def take_many(self, names: Sequence[str], leaves: Sequence[Any]) -> list[int]:
        """Pack what :meth:`take` would; the indices of the leaves left to stage alone.

        The loop over plain numpy leaves is this method's own: at 100k leaves a call
        per leaf is a visible part of the training step's stall.
        """
        if not self._open:
            rest = self._bulk(names, leaves)
            if rest is not None:
                return rest
        rest: list[int] = []
        opened = self._open
        limit = self.max_leaf
        ndarray = np.ndarray
        for i, leaf in enumerate(leaves):
            if type(leaf) is ndarray:
                n = leaf.nbytes
                if 0 < n <= limit:
                    pack = opened.get((leaf.dtype, "numpy"))
                    if pack is not None and pack.size + n <= self.max_pack:
                        pack.add(names[i], leaf)
                        continue
            if not self.take(names[i], leaf):
                rest.append(i)
        return rest

    def _bulk(self, names: Sequence[str], leaves: Sequence[Any]) -> list[int] | None:
        """Pack a state of numpy arrays only with array operations, per dtype (at 100k leaves the
        per-leaf loop is most of the step's stall); the indices left to stage alone, or None
        (having packed nothing) if some leaf is not a numpy array."""
        ndarray = np.ndarray
        for leaf in leaves:
            if type(leaf) is not ndarray:
                return None
        dtypes = [leaf.dtype for leaf in leaves]
        sizes = np.array([leaf.nbytes for leaf in leaves], np.int64)
        small = (sizes > 0) & (sizes <= self.max_leaf)
        kinds = {dt: k for k, dt in enumerate(dict.fromkeys(dtypes))}
        codes = np.fromiter(map(kinds.__getitem__, dtypes), np.int64, len(leaves)) if len(kinds) > 1 else None
        taken = np.zeros(len(leaves), bool)
        for dtype, k in kinds.items():
            try:
                check_dtype(dtype, "")
            except TypeError:
                continue  # stage_leaf raises the error that names the leaf
            mask = small if codes is None else small & (codes == k)
            members = np.flatnonzero(mask)
            if members.size:
                self._pack_run(members, sizes[members], names, leaves)
                taken |= mask
        return np.flatnonzero(~taken).tolist()

    def _pack_run(self, members: np.ndarray, sizes: np.ndarray, names: Sequence[str], leaves: Sequence[Any]) -> None:
        """Pack ``leaves[members]`` (of one dtype, in order) greedily into packs of at most ``max_pack``."""
        cum = np.cumsum(sizes)
        start, base = 0, 0
        while start < len(members):  # as take: a pack closes before the member that overflows it
            stop = max(int(np.searchsorted(cum, base + self.max_pack, "right")), start + 1)
            chosen = members[start:stop].tolist()
            ends = (cum[start:stop] - base).tolist()
            arrays = [leaves[i] for i in chosen]
            self.packs.append(LeafPack([names[i] for i in chosen], arrays, "numpy", ends, self.area.pack(arrays, ends[-1])))
            start, base = stop, int(cum[stop - 1])

    def take(self, name: str, leaf: Any) -> bool:
        """Pack ``leaf`` if it is a small whole array this host writes; False: stage it alone."""
        if type(leaf) is np.ndarray:
            arr, origin = leaf, "numpy"
        elif plain_cpu_tensor(leaf):
            arr, origin = torch_to_numpy(leaf.detach()), "torch"
        elif (self._jax_ok and is_jax_array(leaf) and leaf.is_fully_replicated
              and 0 < math.prod(leaf.shape) * leaf.dtype.itemsize <= self.max_leaf):
            arr, origin = np.asarray(leaf), "jax"  # a host view on CPU; copied into the pack below
        else:
            return False
        n = arr.nbytes
        if not 0 < n <= self.max_leaf or arr.dtype in self._bad:
            return False
        key = (arr.dtype, origin)
        pack = self._open.get(key)
        if pack is None:
            try:
                check_dtype(arr.dtype, name)
            except TypeError:
                self._bad.add(arr.dtype)
                return False  # stage_leaf raises the error that names it
            pack = self._open[key] = _OpenPack()
        elif pack.size + n > self.max_pack:
            self._close(key)
            pack = self._open[key] = _OpenPack()
        pack.add(name, arr)
        return True

    def _close(self, key: tuple[np.dtype, str]) -> None:
        pack = self._open.pop(key)
        buf = self.area.pack(pack.arrays, pack.size)
        self.packs.append(LeafPack(pack.names, pack.arrays, key[1], pack.ends, buf))

    def finish(self) -> list[LeafPack]:
        """Every pack, the widest dtypes first: written back to back in that order, each pack of
        a power-of-two itemsize then starts aligned for it with no padding before it."""
        for key in list(self._open):
            self._close(key)
        self.packs.sort(key=lambda p: -p.arrays[0].dtype.itemsize)
        return self.packs


def stage_leaf(
    where: str,
    leaf: Any,
    *,
    host: int,
    area: StagingArea | None,
    tile_bytes: int = 0,
    device: Any = None,
) -> StagedArray | ValueItem | StagedHostState:
    """Stage one leaf (``where`` is its pytree path, used in errors).

    Mutable arrays get a snapshot buffer in ``area`` (filled later by
    ``area.fill``); with ``area=None`` they are referenced as they are.
    Each shard's tile shape at ``tile_bytes`` (:func:`ckptio.engine.tiling.tile_for`)
    is recorded for the writer. ``device`` (:class:`ckptio.saving.devicecopy.DeviceStaging`) stages
    jax arrays' shards; without one they cross to the host now.
    """
    tiles: list[tuple[int, ...] | None] = []

    def own(arr: np.ndarray, area: StagingArea | None) -> np.ndarray:
        tiles.append(tile_for(arr.shape, arr.dtype.itemsize, tile_bytes))
        return area.snapshot(arr) if area is not None else np.ascontiguousarray(arr)

    if isinstance(leaf, Sharded):
        check_dtype(leaf.dtype, where)
        shards = []
        for index, data in leaf.pieces:
            offs, sizes = index_to_box(index, leaf.shape, where)
            arr = data if is_jax_array(data) else np.asarray(data)
            if tuple(arr.shape) != sizes or np.dtype(arr.dtype) != leaf.dtype:
                raise ValueError(f"{where}: piece {index!r} holds {np.dtype(arr.dtype)}{list(arr.shape)}, "
                                 f"expected {leaf.dtype}{list(sizes)}")
            if is_jax_array(arr):  # a device piece (the Orbax adapter's snapshots): as a jax array's shard
                arr, area_ = (device.stage(arr) if device is not None else np.asarray(arr)), None
            else:
                area_ = area
            shards.append((offs, sizes, own(arr, area_)))
        return StagedArray(leaf.dtype, leaf.shape, False, "sharded", shards, tiles)
    if is_jax_array(leaf):
        shards = []
        for s in leaf.addressable_shards:
            if s.replica_id != 0:
                continue
            offs, sizes = index_to_box(s.index, leaf.shape)
            # A device copy whose bytes cross later, or (JAX arrays are immutable) a host copy or view now.
            data = device.stage(s.data) if device is not None else np.asarray(s.data)
            shards.append((offs, sizes, own(data, None)))
        return StagedArray(np.dtype(leaf.dtype), tuple(leaf.shape), False, "jax", shards, tiles)
    origin = "numpy"
    if is_torch_tensor(leaf):
        if type(leaf).__name__ == "DTensor":
            raise UnsupportedLeafError(f"{where}: DTensor leaves go through ckptio.dcp (torch.distributed.checkpoint)")
        t = leaf.detach()
        moved = t.device.type != "cpu"
        leaf = torch_to_numpy(t.cpu() if moved else t.contiguous() if not t.is_contiguous() else t)
        if moved:  # .cpu() already made a private copy
            area = None
        origin = "torch"
    scalar = isinstance(leaf, np.generic)
    if isinstance(leaf, (np.ndarray, np.generic)):
        arr = np.asarray(leaf)
        try:
            check_dtype(arr.dtype, where)
        except TypeError as e:
            raise UnsupportedLeafError(str(e)) from None
        shards = []
        if host == 0:
            shards.append(((0,) * arr.ndim, tuple(arr.shape), own(arr, area)))
        return StagedArray(arr.dtype, tuple(arr.shape), scalar, origin, shards, tiles)
    if is_per_host_leaf(leaf):  # snapshotted now, as JSON: the iterator moves on after the step returns
        return staged_host_state(where, state_of(leaf), host)
    try:
        encode_value(leaf, where)
    except TypeError:
        raise UnsupportedLeafError(
            f"{where}: cannot save a leaf of type {type(leaf).__module__}.{type(leaf).__qualname__}; "
            "ckptio stores arrays (numpy, jax, torch, ckptio.Sharded, typed PRNG keys), int, float, bool, str, "
            "bytes and None, in dicts, lists, tuples, NamedTuples and jax-registered pytree nodes -- never pickle"
        ) from None
    return ValueItem(leaf)


def stage_leaves(
    names: Sequence[str], values: Sequence[Any], rank: int, area: StagingArea | None, tile_bytes: int = 0,
    packer: LeafPacker | None = None, placeholders: bool = True, device: Any = None,
) -> tuple[dict[str, Any], list[LeafPack]]:
    """Stage a flattened state's leaves (``names``, ``values``) for host ``rank``: every leaf
    checked, snapshot buffers in ``area`` allocated, not yet filled (None: leaves referenced).

    With a ``packer``, the small whole arrays this host writes go into its packs instead, each
    holding its place in the staged items as PACKED with ``placeholders`` (a host of many lists
    its items in tree order, rows included).
    """
    staged: dict[str, Any] = {}
    if packer is None:
        rest: Iterable[int] = range(len(names))
    else:
        rest = packer.take_many(names, values)
        if placeholders:
            staged = dict.fromkeys(names, PACKED)
    for i in rest:
        name = names[i]
        staged[name] = stage_leaf(name or "<root>", values[i], host=rank, area=area, tile_bytes=tile_bytes, device=device)
    return staged, packer.finish() if packer is not None else []
