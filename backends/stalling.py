"""A wrapper backend that never answers for chosen objects: the hang a deadline must turn into an error.

:class:`StallingBackend` passes every call through except those of ``methods`` on a
key ``matches`` picks, which wait forever (until cancelled), as a request to a
starved storage target or over a stuck connection does. Tests and fault
drills put it under a save or restore to check that it fails by name instead of
hanging (``ckptio.backends.deadline``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

from ckptio.backends.base import Backend, ByteRange, ObjectInfo
from ckptio.backends.wrappers import WrapperBackend

__all__ = ["StallingBackend"]


class StallingBackend(WrapperBackend):
    """Calls of ``methods`` on keys for which ``matches(key)`` is true never return; ``stalled``
    counts them. A cancelled stall raises CancelledError as any cancelled call does."""

    def __init__(self, inner: Backend, matches: Callable[[str], bool],
                 methods: Sequence[str] = ("write", "read_into")) -> None:
        super().__init__(inner)
        self.matches, self.methods = matches, frozenset(methods)
        self.stalled = 0
        self._lock = threading.Lock()

    async def _maybe_stall(self, method: str, key: str) -> None:
        if method in self.methods and self.matches(key):
            with self._lock:
                self.stalled += 1
            await asyncio.Event().wait()  # nobody ever sets it

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._maybe_stall("write", key)
        await self.inner.write(key, buffers)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._maybe_stall("read_into", key)
        await self.inner.read_into(key, rng, buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._maybe_stall("create_if_absent", key)
        await self.inner.create_if_absent(key, data)

    async def stat(self, key: str) -> ObjectInfo:
        await self._maybe_stall("stat", key)
        return await self.inner.stat(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await self._maybe_stall("list", prefix)
        return await self.inner.list(prefix)
