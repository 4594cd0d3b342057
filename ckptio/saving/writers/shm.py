"""Shared-memory staging for the sidecar writer (ckptio.saving.writers.sidecar): a :class:`StagingPool` whose
buffers another process can map.

Buffers are carved out of anonymous ``memfd_create`` files ("slabs"): they
have no name in ``/dev/shm``, so nothing can leak past the processes that map
them, and a slab's descriptor is handed to the sidecar over its socket.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

from ckptio.system import HUGE_PAGE, address, ask_huge_pages, collapse_shared
from ckptio.system.bufferpool import StagingPool

__all__ = ["ShmStagingPool", "close_shared_pool", "forget_shared_pool", "shared_pool"]

_SLAB = 64 << 20  # the smallest shared-memory file: few descriptors, one per 64 MiB of staging
_BIG = 64 << 10  # buffers this large start on a page (O_DIRECT writes them without a bounce)
_SMALL_ALIGN = 64
_HUGE = 4 * HUGE_PAGE  # buffers this large start on a 2 MiB boundary (under a quarter of one left unused)
#: Slab ids are unique in the process, across pools: a sidecar maps each id once.
_slab_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class _Slab:
    id: int
    fd: int
    size: int
    mm: mmap.mmap
    addr: int
    used: int = 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class ShmStagingPool(StagingPool):
    """A :class:`StagingPool` whose buffers live in shared memory another process can map.

    Buffers are carved out of memfd slabs of at least 64 MiB (large buffers page-aligned,
    small ones 64-byte aligned) and reused by size like any pool's; slab memory is
    returned only by :meth:`close`. :meth:`locate` tells which slab and offset a buffer
    (or a view into one) lives at.
    """

    def __init__(self, slab_bytes: int = _SLAB) -> None:
        super().__init__(None)
        self.slab_bytes = slab_bytes
        self._slabs: list[_Slab] = []  # by address
        self._starts: list[int] = []
        self._current: _Slab | None = None
        self._alloc_lock = threading.Lock()

    def _allocate(self, nbytes: int) -> np.ndarray:
        if nbytes == 0:
            return np.empty(0, np.uint8)
        # Large buffers start on a huge page of their slab, so that settle() can move all of them.
        align = HUGE_PAGE if nbytes >= _HUGE else mmap.PAGESIZE if nbytes >= _BIG else _SMALL_ALIGN
        with self._alloc_lock:
            slab = self._current
            if slab is None or _round_up(slab.used, align) + nbytes > slab.size:
                slab = self._new_slab(max(self.slab_bytes, _round_up(nbytes, mmap.PAGESIZE)))
            start = _round_up(slab.used, align)
            slab.used = start + nbytes
            cur = self._current
            if cur is None or slab.size - slab.used > cur.size - cur.used:
                self._current = slab  # small buffers go where the most room is left
            return np.frombuffer(slab.mm, np.uint8, count=nbytes, offset=start)

    def _new_slab(self, size: int) -> _Slab:
        fd = os.memfd_create(f"ckptio-stage-{os.getpid()}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
            # Where the host's shmem THP policy says "advise", the first touch gets huge pages;
            # elsewhere (this VM says "never") settle() moves the buffers into them after their save.
            ask_huge_pages(mm)
        except BaseException:
            os.close(fd)
            raise
        slab = _Slab(next(_slab_ids), fd, size, mm, address(memoryview(mm)))
        i = bisect.bisect(self._starts, slab.addr)
        self._slabs.insert(i, slab)
        self._starts.insert(i, slab.addr)
        return slab

    def settle(self, new: Sequence[np.ndarray]) -> int:
        """As :meth:`StagingPool.settle`, through each slab's file (``collapse_shared``): the
        writer process's O_DIRECT writes from these buffers then go out in 4 MiB requests."""
        done = 0
        for b in new:
            if b.nbytes < HUGE_PAGE:
                continue
            with self._alloc_lock:  # a descriptor of our own: close() may close the slab's meanwhile
                found = self._find(address(memoryview(b)), b.nbytes)
                if found is None:
                    continue
                slab, offset = found
                fd = os.dup(slab.fd)
            try:
                done += collapse_shared(fd, offset, b.nbytes)
            finally:
                os.close(fd)
        return done

    def slabs(self) -> list[tuple[int, int, int]]:
        """``(id, fd, size)`` of every slab, for handing them to another process."""
        with self._alloc_lock:
            return [(s.id, s.fd, s.size) for s in self._slabs]

    def locate(self, view: memoryview) -> tuple[int, int] | None:
        """``(slab id, offset)`` of a C-contiguous buffer lying wholly in one slab, else None."""
        if not view.nbytes:
            return None
        with self._alloc_lock:
            found = self._find(address(view), view.nbytes)
        return None if found is None else (found[0].id, found[1])

    def _find(self, addr: int, nbytes: int) -> tuple[_Slab, int] | None:
        """The slab holding ``nbytes`` at ``addr`` whole, and their offset in it (lock held)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            s = self._slabs[i]
            if addr + nbytes <= s.addr + s.size:
                return s, addr - s.addr
        return None

    def close(self) -> None:
        """Forget every buffer and close the slabs' descriptors (the memory goes with the last view)."""
        self.clear()
        with self._alloc_lock:
            for s in self._slabs:
                os.close(s.fd)
            self._slabs, self._starts, self._current = [], [], None


_pool: ShmStagingPool | None = None
_pool_lock = threading.Lock()


def shared_pool() -> ShmStagingPool:
    """This process's shared-memory staging pool (made on first use; freed by :func:`shutdown`)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ShmStagingPool()
        return _pool


def close_shared_pool() -> None:
    """Close this process's pool (its memory goes with the last view into it)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def forget_shared_pool() -> None:
    """After a fork: the child does not own the parent's pool."""
    global _pool
    _pool = None
