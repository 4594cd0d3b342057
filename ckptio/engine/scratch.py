"""Scratch for reads that are copied out (resharding): memory only while it is needed, reused.

A resharded restore reads whole checksum blocks (a tile, a run of rows) and
copies the wanted part into place once the bytes are verified. Planning
creates every request up front, so scratch allocated at planning would all
be fresh memory: each page faulted in once per tile, which on this VM cost
about as much as reading the tile (issue 15; a tiled column block spent ~40 %
of its CPU in first touches of scratch and destination).

So a request names its scratch as :class:`ScratchSlice` buffers of a
:class:`Scratch`, which takes memory from a :class:`ScratchPool` only when
its read starts (:meth:`ScratchPool.resolve`, called by the engine) and gives
it back as soon as its copy-out ran (:meth:`Scratch.release`). A restore then
touches about (reads in flight x their size) of scratch, whatever its length;
the pool lives as long as one :meth:`ckptio.engine.core.Engine.read` call.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from ckptio.system.bufferpool import StagingPool

__all__ = ["Scratch", "ScratchPool", "ScratchSlice"]


class ScratchPool(StagingPool):
    """Free scratch buffers by size, for reuse by later reads: a :class:`StagingPool` (thread-safe:
    copy-outs give back from worker threads while the event loop takes) of numpy memory.

    It keeps at most ``keep_bytes`` free; the rest is freed at once, as without a pool: a run
    of large scratch (32 MiB row runs of a C-order shard) must not pile up in it.
    """

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        super().__init__(max_bytes=keep_bytes)

    def _allocate(self, nbytes: int) -> np.ndarray:
        # numpy's allocator, as scratch had before the pool: it is read into, never written
        # with direct IO, so a page-aligned mapping of its own would buy nothing.
        return np.empty(nbytes, np.uint8)

    def resolve(self, buffers: Sequence[memoryview | ScratchSlice]) -> list[memoryview]:
        """``buffers`` with every :class:`ScratchSlice` made a view of its scratch's memory
        (taken from this pool on first use)."""
        return [b.view(self) if isinstance(b, ScratchSlice) else b for b in buffers]


class Scratch:
    """``nbytes`` of scratch whose memory exists from its first read until :meth:`release`."""

    __slots__ = ("_buf", "_lock", "_pool", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf: np.ndarray | None = None
        self._pool: ScratchPool | None = None
        self._lock = threading.Lock()

    def slice(self, lo: int, hi: int) -> ScratchSlice:
        """Bytes ``[lo, hi)`` of this scratch, as a read request's buffer."""
        return ScratchSlice(self, lo, hi)

    def array(self) -> np.ndarray:
        """The memory (uint8); only between the first read into it and :meth:`release`."""
        if self._buf is None:
            raise RuntimeError("scratch read from before any read filled it, or after its release")
        return self._buf

    def _take(self, pool: ScratchPool) -> np.ndarray:
        with self._lock:  # two requests (one per extent) may share a scratch
            if self._buf is None:
                self._buf, self._pool = pool.take(self.nbytes), pool
            return self._buf

    def release(self) -> None:
        """Give the memory back for the next read (once copied out; a second call is a no-op)."""
        with self._lock:
            buf, pool, self._buf, self._pool = self._buf, self._pool, None, None
        if buf is not None and pool is not None:
            pool.give_back([buf])


@dataclasses.dataclass(frozen=True, slots=True)
class ScratchSlice:
    """A read request's buffer that is bytes ``[lo, hi)`` of ``scratch``, bound at read time."""

    scratch: Scratch
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def view(self, pool: ScratchPool) -> memoryview:
        return memoryview(self.scratch._take(pool)[self.lo : self.hi])
