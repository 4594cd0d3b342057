"""O_DIRECT bounce buffers, shared by every local backend of the process.

O_DIRECT takes only aligned memory at aligned offsets, so caller bytes out of step
with the file (jax CPU arrays are 64-byte aligned; DCP and Orbax hand over the
caller's arrays as they are) are gathered into an aligned bounce buffer before each
write: all of a view laid out anywhere, only the partial pages at either end of one
laid out in step with its memory (``ckptio.engine.layout.direct_offset``). Such a buffer is worth
keeping: faulting its pages in costs more than the copy into it (issue 17).

They used to be kept per backend and per write thread, as shared (shmem) mappings.
But the Orbax handler and ``ckptio.dcp.Writer`` open a store, and so a backend with
its own threads, for every save: each save faulted 8 fresh 8 MiB shmem buffers in and
unmapped them again. On a 512 MiB ckptio-orbax save that was ~20 % of the save's CPU
(perf: ``shmem_fault``, ``__munmap``, ``shmem_evict_inode``), on top of the copy itself.
So the buffers live here, process-wide: a write takes one for as long as it runs and
gives it back; at most :data:`KEEP` free ones are kept (one per write thread of a
default backend), in private anonymous memory (cheaper to fault in than shmem), in huge
pages where the kernel grants them: from 4 KiB pages each O_DIRECT request carried ~1 MiB, and
an in-process JAX save (its arrays all bounced) of 256 MiB, alternated with the raw O_DIRECT
write in one process, reached 0.74-0.83x of it; from huge pages, 0.92-0.94x (issue 35).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ckptio.system import fresh_pages
from ckptio.system.freelists import FreeLists

__all__ = ["BOUNCE_BYTES", "KEEP", "BouncePool", "BOUNCE"]

#: Bytes per bounce buffer: one O_DIRECT request's worth.
BOUNCE_BYTES = 8 << 20
#: Free buffers kept for the next write (LocalConfig's default write threads): 64 MiB at most.
KEEP = 8


class BouncePool:
    """Page-aligned buffers of ``size`` bytes, lent one per write and reused; thread-safe.

    ``allocated`` and ``lent`` count the buffers made and lent so far (tests, benchmarks).
    """

    def __init__(self, size: int = BOUNCE_BYTES, keep: int = KEEP) -> None:
        self.size = size
        self.keep = keep
        self._free: FreeLists[int, memoryview] = FreeLists(max_bytes=keep * size)

    @property
    def allocated(self) -> int:
        return self._free.misses

    @property
    def lent(self) -> int:
        return self._free.hits + self._free.misses

    @contextlib.contextmanager
    def lend(self) -> Iterator[memoryview]:
        """A buffer of :attr:`size` bytes for the duration of the block, then back to the pool."""
        buf = self._free.take(self.size)
        if buf is None:
            buf = memoryview(fresh_pages(self.size, huge=True))
        try:
            yield buf
        finally:
            self._free.give(self.size, buf, self.size)

    def free_bytes(self) -> int:
        """Bytes held in free buffers (what the pool keeps between writes)."""
        return self._free.held_bytes()

    def clear(self) -> None:
        """Drop the free buffers (those lent now are kept when they come back, up to ``keep``)."""
        self._free.clear()


#: The pool every local backend's direct writes use.
BOUNCE = BouncePool()
