"""Shared-memory staging for the sidecar writer (ckptio.sidecar): a :class:`StagingPool` whose
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

import numpy as np

from ckptio._system import address, ask_huge_pages

from .staging import StagingPool

__all__ = ["ShmStagingPool", "close_shared_pool", "forget_shared_pool", "shared_pool"]

_SLAB = 64 << 20  # the smallest shared-memory file: few descriptors, one per 64 MiB of staging
_BIG = 64 << 10  # buffers this large start on a page (O_DIRECT writes them without a bounce)
_SMALL_ALIGN = 64
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

    huge_pages = False  # memfd slabs: shared memory, which MADV_COLLAPSE leaves to shmem's own THP policy

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
        align = mmap.PAGESIZE if nbytes >= _BIG else _SMALL_ALIGN
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
            # Shared memory gets huge pages only where the host's shmem THP policy allows; this VM
            # says "never". From them the writer process's O_DIRECT requests carry 4 MiB, not ~1 MiB:
            # a 256 MiB JAX save reached 0.89-0.92x the raw write with shmem THP on, 0.82-0.84x off.
            ask_huge_pages(mm)
        except BaseException:
            os.close(fd)
            raise
        slab = _Slab(next(_slab_ids), fd, size, mm, address(memoryview(mm)))
        i = bisect.bisect(self._starts, slab.addr)
        self._slabs.insert(i, slab)
        self._starts.insert(i, slab.addr)
        return slab

    def slabs(self) -> list[tuple[int, int, int]]:
        """``(id, fd, size)`` of every slab, for handing them to another process."""
        with self._alloc_lock:
            return [(s.id, s.fd, s.size) for s in self._slabs]

    def locate(self, view: memoryview) -> tuple[int, int] | None:
        """``(slab id, offset)`` of a C-contiguous buffer lying wholly in one slab, else None."""
        if not view.nbytes:
            return None
        a = address(view)
        with self._alloc_lock:
            i = bisect.bisect_right(self._starts, a) - 1
            if i >= 0:
                s = self._slabs[i]
                if a + view.nbytes <= s.addr + s.size:
                    return s.id, a - s.addr
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
