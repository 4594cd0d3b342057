"""Buffers kept for reuse, by key: the one shape of ckptio's buffer pools.

Touched memory copies about three times as fast as fresh pages (~7.7 against ~2.5 GiB/s
here, issue 17), so every pool keeps the buffers given back for its next taker: the
staging pools (:class:`ckptio.system.bufferpool.StagingPool`, by size), DCP's host buffers
(:class:`ckptio.dcp.stager.HostBuffers`, by size and pinning) and the O_DIRECT bounce
buffers (:class:`ckptio.backends._bounce.BouncePool`, one size). They differ in their key,
in how a buffer comes back (a block's end, a give-back, a staged tensor's finalizer) and in
their bound; the free lists, their lock, their bound in bytes and their counts are
:class:`FreeLists`, in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["FreeLists"]

K = TypeVar("K", bound=Hashable)
B = TypeVar("B")


class FreeLists(Generic[K, B]):
    """Free buffers by key, taken and given back from any thread; at most ``max_bytes`` of them
    held (None: every buffer given back is kept).

    ``hits`` / ``misses``: the takes that found a free buffer, and those that found none (the
    taker then makes one): tests and benchmarks read them.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._free: dict[K, list[tuple[B, int]]] = {}
        self._lock = threading.Lock()
        self._held = 0
        self.hits = 0
        self.misses = 0

    def take(self, key: K) -> B | None:
        """A free buffer of ``key`` (no longer held here), or None: the caller makes one."""
        with self._lock:
            free = self._free.get(key)
            if not free:
                self.misses += 1
                return None
            buf, nbytes = free.pop()
            self._held -= nbytes
            self.hits += 1
            return buf

    def give(self, key: K, buf: B, nbytes: int) -> bool:
        """Keep ``buf`` (``nbytes`` long) for a later :meth:`take` of ``key``; False if that would
        pass the bound (the caller's reference is then the last: the buffer goes)."""
        with self._lock:
            if self.max_bytes is not None and self._held + nbytes > self.max_bytes:
                return False
            self._free.setdefault(key, []).append((buf, nbytes))
            self._held += nbytes
            return True

    def has(self, key: K) -> bool:
        """Whether a :meth:`take` of ``key`` would find a buffer now."""
        with self._lock:
            return bool(self._free.get(key))

    def count(self) -> int:
        """The free buffers held."""
        with self._lock:
            return sum(len(v) for v in self._free.values())

    def held_bytes(self) -> int:
        """The bytes of the free buffers held."""
        with self._lock:
            return self._held

    def clear(self) -> None:
        """Let every free buffer go (those in use are kept when they come back, within the bound)."""
        with self._lock:
            self._free.clear()
            self._held = 0
