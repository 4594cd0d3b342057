"""The host buffers a save stages into, kept for reuse from one save to the next.

:class:`StagingPool` hands out page-aligned buffers by size and takes them back once
their objects are written; :func:`aligned_empty` makes a new one. A pool's large buffers
end up in huge pages (:meth:`StagingPool.settle`, after the save that made them), since
they are filled and written again at every save (``ckptio.system.pages.collapse``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from ckptio.system import HUGE_PAGE, collapse, fresh_pages
from ckptio.system.freelists import FreeLists

__all__ = ["PROCESS_POOL_BYTES", "StagingPool", "aligned_empty", "process_pool"]

#: What :func:`process_pool` keeps between saves at most: a save up to this size reuses all its
#: staging memory the next time, a larger one the first this-many bytes of it.
PROCESS_POOL_BYTES = 1 << 30


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer, page-aligned when large (anonymous mmap): direct IO
    then moves it without a bounce copy. Small buffers come from numpy's allocator.

    Large ones are *private* mappings (``fresh_pages``): ``mmap.mmap(-1, n)``'s default is
    a shared one, i.e. shmem, whose first touch -- a first save's whole staging copy --
    costs the most per page (backends/_pages.py). Below ``FRESH_MIN`` a mapping of its own
    is not worth it."""
    return fresh_pages(nbytes)


class StagingPool:
    """Host buffers reused across saves, so staging copies into already-touched memory.

    Fresh memory costs page faults (~2.5 GiB/s here) where touched memory
    copies at ~7.7 GiB/s: reusing buffers is most of the stall.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        # By size; None: keep everything given back.
        self._free: FreeLists[int, np.ndarray] = FreeLists(max_bytes)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``: one given back earlier, else a new one."""
        return self.obtain(nbytes)[0]

    def obtain(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """As :meth:`take`, and whether the buffer is new (its pages not yet touched)."""
        buf = self._free.take(nbytes)
        return (buf, False) if buf is not None else (self._allocate(nbytes), True)

    def _allocate(self, nbytes: int) -> np.ndarray:
        """A new buffer (a shared-memory pool, ckptio.saving.writers.sidecar, allocates elsewhere)."""
        return aligned_empty(nbytes)

    def has(self, nbytes: int) -> bool:
        """Whether a :meth:`take` of ``nbytes`` would reuse a buffer now."""
        return self._free.has(nbytes)

    def give_back(self, buffers: Sequence[np.ndarray]) -> None:
        """Keep ``buffers`` for later takes (within the bound; the rest go)."""
        for b in buffers:
            self._free.give(b.nbytes, b, b.nbytes)

    def settle(self, new: Sequence[np.ndarray]) -> int:
        """Move ``new`` -- buffers this pool made for a save that is now written -- into huge
        pages, for every later save that reuses them; the bytes moved. Contents are kept, and a
        buffer some other save has taken meanwhile stays valid (``collapse``)."""
        return collapse([b for b in new if b.nbytes >= HUGE_PAGE])

    def clear(self) -> None:
        self._free.clear()


_process_pool: StagingPool | None = None
_process_pool_lock = threading.Lock()


def process_pool() -> StagingPool:
    """This process's pool for saves made without one (``ckptio.save(..., pool=None)`` staging in
    this process), holding at most :data:`PROCESS_POOL_BYTES` between saves.

    Without it every such save stages into fresh memory and pays a page fault per 4 KiB page:
    a 256 MiB save took 174 ms of CPU and 70,624 minor faults against 67 ms and 19 with a pool
    (a 16 MiB one 25 against 15 ms), and the faults are in the staging the caller waits for.
    The writer process keeps its own shared-memory pool the same way (:mod:`ckptio.saving.writers.shm`), and a
    :class:`~ckptio.CheckpointManager` its own. ``process_pool().clear()`` lets the memory go;
    ``pool=StagingPool(max_bytes=0)`` keeps nothing for a save.
    """
    global _process_pool
    with _process_pool_lock:
        if _process_pool is None:
            _process_pool = StagingPool(max_bytes=PROCESS_POOL_BYTES)
        return _process_pool


def _forget_after_fork() -> None:
    # A forked child (a data-loader worker) starts with no pool of its own: the parent's buffers are
    # copy-on-write views it never saves from, and another thread may have held the lock at the fork.
    global _process_pool, _process_pool_lock
    _process_pool, _process_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
