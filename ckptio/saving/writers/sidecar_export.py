"""A save's bytes put where the writer process (:mod:`ckptio.saving.writers.sidecar`) can read them.

Extents staged in shared-memory slabs already are only located. Plain extents elsewhere (JAX
arrays, which are staged without a copy; ``copy=False`` saves) are located in this process's
memory where the writer process can read it (:mod:`ckptio.saving.writers.remoteread`). The rest (those, where
it cannot; tiles still to be cut from their shards) are copied into slabs by the trainer's
background thread, object by object, with a copy that releases the GIL, within a byte budget,
and those copies are reused as the writer process reports objects written.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ckptio.engine.layout import ObjectPlan
from ckptio.engine.tiling import TileCopy
from ckptio.saving.writers.shm import ShmStagingPool
from ckptio.system import address, copy_bytes

__all__ = ["EXPORT_OBJECTS", "Export"]

#: Copies in flight per save, in objects (:class:`Export`); also what the pool keeps after a JAX
#: save: 2 x 64 MiB held 129 MiB after 256 MiB and 1 GiB saves against 257 MiB with 4, at no
#: measured loss (issue 35).
EXPORT_OBJECTS = 2


class Export:
    """Puts every extent of a save into shared memory: copies what is not there already.

    Copies (JAX arrays, ``copy=False`` saves) are bounded to ``budget`` bytes in flight:
    an object's copies go back to the pool once the sidecar reports it written, so a
    JAX state needs a few objects' worth of shared memory, not a copy of itself.
    """

    def __init__(self, pool: ShmStagingPool, budget: int, remote: bool = False) -> None:
        self.pool = pool
        #: The writer process reads bytes outside shared memory straight from this process
        #: (ckptio.saving.writers.remoteread): a plain extent's bytes are located, not copied.
        self.remote = remote
        self.budget = max(1, budget)
        self.held = 0
        self.over = False  # the save ended (failed): nobody waits for the budget any more
        self._cond = threading.Condition()
        self._users: dict[int, tuple[np.ndarray, set[int]]] = {}  # id(buffer) -> buffer, objects using it
        self._by_object: dict[int, set[int]] = {}
        self._shards: dict[int, tuple[np.ndarray, int, tuple[int, int]]] = {}  # id(shard) -> shard, buffer, place
        self.new: list[np.ndarray] = []  # buffers the pool made for this save's copies (settle())

    def _need(self, plan: ObjectPlan) -> int:
        """Bytes ``plan``'s extents will be copied into (0 for bytes already in shared memory)."""
        need = 0
        for e in plan.extents:
            if isinstance(e.fill, TileCopy):
                shard = e.fill.shard
                if id(shard) not in self._shards and self.pool.locate(_bytes_of(shard)) is None:
                    need += shard.nbytes
            elif e.fill is not None or (e.data is not None and self._copied(e.data)):
                need += e.length
        return need

    def _copy_into_slab(self, n: int, fill: Any, user: int) -> tuple[int, tuple[int, int]]:
        """Copy ``n`` bytes (``fill`` writes them) into a pool buffer, page-aligned as the layout expects
        (``pack(in_place=False)`` put large pieces at aligned offsets); its id and its slab location."""
        buf, fresh = self.pool.obtain(n)
        if fresh:
            self.new.append(buf)
        fill(memoryview(buf))
        with self._cond:
            self._users[id(buf)] = (buf, {user})
            self._by_object.setdefault(user, set()).add(id(buf))
        loc = self.pool.locate(memoryview(buf))
        assert loc is not None
        return id(buf), loc

    def _copied(self, view: memoryview) -> bool:
        """Whether a plain extent over ``view`` is copied into a slab (not in one, not read remotely)."""
        return self.pool.locate(view) is None and not self._readable(view)

    def _readable(self, view: memoryview) -> bool:
        return self.remote and view.c_contiguous and view.nbytes > 0

    def _source(self, view: memoryview, user: int) -> tuple[Any, ...]:
        """Where the writer process finds a plain extent's bytes: ``("shm", slab, offset)`` (copied
        there first if need be) or ``("mem", address)`` in this process."""
        loc = self.pool.locate(view)
        if loc is None and self._readable(view):
            return ("mem", address(view))
        return ("shm", *(loc or self._place(view, user)))

    def _place(self, view: memoryview, user: int) -> tuple[int, int]:
        # copy_bytes releases the GIL for anything but small copies. Not checksummed on the way
        # (ckptio.system.checksum.copy_summed): this runs beside the training step, and a checksum per
        # chunk is a GIL round trip each -- a pinned JAX save took 2.2x as long and cost the step
        # 1.04-1.05x against 1.02-1.03x (issue 35). The writer process checksums these bytes.
        return self._copy_into_slab(view.nbytes, lambda dst: copy_bytes(dst, view), user)[1]

    def describe(self, i: int, plan: ObjectPlan) -> list[tuple[Any, ...]]:
        """``(item, shard, shard_offset, offset, length, source, cuts, block, sums)`` per extent of object ``i``
        (``sums``: its block checksums where staging computed them, else None)."""
        need = self._need(plan)
        with self._cond:  # a copy larger than the budget waits until nothing else is held
            self._cond.wait_for(lambda: self.over or not need or not self.held or self.held + need <= self.budget)
            self.held += need
        out = []
        for e in plan.extents:
            src: tuple[Any, ...]
            if isinstance(e.fill, TileCopy):
                shard = e.fill.shard
                known = self._shards.get(id(shard))
                if known is None:  # the shard's reference keeps its id from being reused meanwhile
                    view = _bytes_of(shard)
                    loc = self.pool.locate(view)
                    bid = -1
                    if loc is None:
                        bid, loc = self._copy_into_slab(view.nbytes, lambda dst, v=view: copy_bytes(dst, v), i)
                    known = self._shards[id(shard)] = (shard, bid, loc)
                elif known[1] in self._users:
                    with self._cond:
                        self._users[known[1]][1].add(i)
                        self._by_object.setdefault(i, set()).add(known[1])
                slab, off = known[2]
                src = ("tile", slab, off, shard.dtype.itemsize, shard.shape, e.fill.offs, e.fill.sizes)
            elif e.fill is not None:  # some other lazy extent: fill it here, straight into a slab
                src = ("shm", *self._copy_into_slab(e.length, e.fill, i)[1])
            else:
                assert e.data is not None
                src = self._source(e.data, i)
            out.append((e.item, e.shard, e.shard_offset, e.offset, e.length, src, e.cuts, e.block, e.sums))
        return out

    def written(self, i: int) -> None:
        """Object ``i`` is written: the copies no other object still needs go back to the pool."""
        freed = []
        with self._cond:
            for bid in self._by_object.pop(i, ()):
                buf, users = self._users[bid]
                users.discard(i)
                if not users:
                    del self._users[bid]
                    freed.append(buf)
            self._shards = {k: v for k, v in self._shards.items() if v[1] < 0 or v[1] in self._users}
            self.held -= sum(b.nbytes for b in freed)
            self._cond.notify_all()
        self.pool.give_back(freed)

    def abandon(self) -> None:
        """The save has ended (its reply came, or the sidecar died): stop waiting for the budget."""
        with self._cond:
            self.over = True
            self._cond.notify_all()

    def settle(self) -> None:
        """Once the save is written: the buffers the pool made for it move into huge pages
        (:meth:`ShmStagingPool.settle`), for the saves that reuse them."""
        new, self.new = self.new, []
        self.pool.settle(new)

    def release(self) -> None:
        """Give back every copy still held (the save is over, written or not)."""
        with self._cond:
            bufs = [b for b, _u in self._users.values()]
            self._users, self._by_object, self._shards, self.held = {}, {}, {}, 0
            self._cond.notify_all()
        self.pool.give_back(bufs)


def _bytes_of(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))
