"""A read-only backend serving byte ranges of objects held in memory: what a read-once restore received.

A host of a read-once restore (:mod:`ckptio.restore.readonce`) receives the
stored bytes its read plan needs from the hosts that read them, then executes
its unchanged plan through the normal engine against this backend, so every
byte is verified against its checksums where it is used, as if read from
storage. A read of bytes it was not given is an error (never zeros).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence

from ckptio._system import flat_bytes
from ckptio._system.bytes import copy_bytes
from ckptio.backends.base import ByteRange, Capabilities, ObjectInfo, ReadOnlyBackend, check_fill

__all__ = ["RangesBackend"]

#: Copies from this size on run in a thread (below, the hop costs more than the copy).
_THREAD_MIN = 1 << 20


class RangesBackend(ReadOnlyBackend):
    """Disjoint byte ranges of objects (``add``), served by ``read_into``; nothing else."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._starts: dict[str, list[int]] = {}
        self._views: dict[str, list[memoryview]] = {}
        self.capabilities = Capabilities(read_only=True, process_local=True, preferred_io_size=8 << 20,
                                         concurrency=8)

    @property
    def url(self) -> str:
        return self._url

    def add(self, key: str, start: int, data: memoryview) -> None:
        """Hold ``data`` as bytes ``[start, start + len)`` of ``key`` (ranges of a key never overlap)."""
        starts = self._starts.setdefault(key, [])
        views = self._views.setdefault(key, [])
        i = bisect.bisect_left(starts, start)
        starts.insert(i, start)
        views.insert(i, flat_bytes(data))

    def clear(self) -> None:
        """Drop every range (their memory goes with the last reference)."""
        self._starts.clear()
        self._views.clear()

    def _cover(self, key: str, rng: ByteRange) -> list[memoryview]:
        """Views of the held bytes ``rng`` of ``key``, in order; LookupError if any byte is not held."""
        starts, views = self._starts.get(key, []), self._views.get(key, [])
        out: list[memoryview] = []
        pos = rng.start
        i = bisect.bisect_right(starts, pos) - 1
        while pos < rng.end:
            if i < 0 or i >= len(starts) or not starts[i] <= pos < starts[i] + views[i].nbytes:
                raise LookupError(f"{self._url}/{key}: bytes [{pos}, {rng.end}) were not received "
                                  "(a read-once restore read outside what it asked for)")
            lo = pos - starts[i]
            piece = views[i][lo : lo + rng.end - pos]
            out.append(piece)
            pos += piece.nbytes
            i += 1
        return out

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        check_fill(rng, buffers)
        sources = self._cover(key, rng)
        if rng.length >= _THREAD_MIN:
            await asyncio.to_thread(_copy, sources, buffers)
        else:
            _copy(sources, buffers)

    async def stat(self, key: str) -> ObjectInfo:
        if not self._starts.get(key):
            raise FileNotFoundError(f"{self._url}/{key}: no bytes of it were received")
        return ObjectInfo(key, self._starts[key][-1] + self._views[key][-1].nbytes, 0.0)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return [await self.stat(k) for k in sorted(self._starts) if k.startswith(prefix)]



def _copy(sources: list[memoryview], buffers: Sequence[memoryview]) -> None:
    """Fill ``buffers`` in order from ``sources`` in order (equal totals), cutting both as needed."""
    si, so = 0, 0
    for b in buffers:
        if not b.nbytes:
            continue
        dst, pos = flat_bytes(b), 0
        while pos < dst.nbytes:
            src = sources[si]
            n = min(dst.nbytes - pos, src.nbytes - so)
            copy_bytes(dst[pos : pos + n], src[so : so + n])
            pos, so = pos + n, so + n
            if so == src.nbytes:
                si, so = si + 1, 0
