"""Host-RAM backend: for tests and for the in-memory tier.

Objects live in a process-wide store keyed by the URL's name, so two
``MemoryBackend("mem://x")`` instances in one process see the same objects
(as two clients of one bucket would).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, ObjectInfo, check_fill, check_key, check_prefix,
)
from ckptio.system.bytes import gather_bytes, scatter_bytes

__all__ = ["MemoryBackend"]

#: Per URL: key -> (bytes, mtime, version number); a version number is never reused in the process.
_STORES: dict[str, dict[str, tuple[bytes | bytearray, float, int]]] = {}
_VERSIONS = itertools.count(1)
#: Per URL: one lock for every instance on it, so a compare-and-act (create_if_absent, delete_if)
#: is atomic across instances and threads, as on one bucket.
_LOCKS: dict[str, threading.Lock] = {}
#: Copies from this size on run in a thread (below, the hop costs more than the copy).
_THREAD_MIN = 1 << 20
T = TypeVar("T")


async def _maybe_in_thread(nbytes: int, fn: Callable[..., T], *args: Any) -> T:
    if nbytes >= _THREAD_MIN:
        return await asyncio.to_thread(fn, *args)
    result = fn(*args)
    await asyncio.sleep(0)  # a yield point, as an IO-bound backend would have
    return result
_STORES_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """Objects as byte buffers in a dict, never changed in place; writes replace them whole."""

    def __init__(self, url: str = "mem://default") -> None:
        self._url = url.rstrip("/")
        with _STORES_LOCK:
            self._objects = _STORES.setdefault(self._url, {})
            self._lock = _LOCKS.setdefault(self._url, threading.Lock())
        self.capabilities = Capabilities(
            durable_on_close=True, preferred_io_size=1 << 20, concurrency=8, process_local=True,
            conditional_delete=True,  # compared and deleted under the store's lock
        )

    @classmethod
    def forget(cls, url: str) -> None:
        """Drop every object stored under ``url`` (tests use this to free memory)."""
        with _STORES_LOCK:
            _STORES.pop(url.rstrip("/"), None)

    @property
    def url(self) -> str:
        return self._url

    def _get(self, key: str) -> tuple[bytes | bytearray, float, int]:
        try:
            return self._objects[check_key(key)]
        except KeyError:
            raise FileNotFoundError(f"{self._url}/{key}: no such object") from None

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        check_key(key)
        # Objects of the in-memory tier are tens of MiB: copied in a thread with the GIL
        # released, so neither the event loop nor the training thread waits on the memcpy.
        # The bytearray is never handed out (reads copy from it), so it stays as written.
        data = await _maybe_in_thread(sum(b.nbytes for b in buffers), gather_bytes, buffers)
        with self._lock:
            self._objects[key] = (data, time.time(), next(_VERSIONS))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        data, _, _ = self._get(key)
        if rng.end > len(data):
            raise ValueError(f"{self._url}/{key}: range [{rng.start}, {rng.end}) past end {len(data)}")
        check_fill(rng, buffers)
        await _maybe_in_thread(rng.length, scatter_bytes, memoryview(data)[rng.start : rng.end], buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            if key in self._objects:
                raise FileExistsError(f"{self._url}/{key}: object exists")
            self._objects[key] = (bytes(data), time.time(), next(_VERSIONS))

    async def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            if self._objects.pop(key, None) is None:
                raise FileNotFoundError(f"{self._url}/{key}: no such object")

    async def delete_if(self, key: str, version: str) -> bool:
        check_key(key)
        with self._lock:
            entry = self._objects.get(key)
            if entry is None:
                raise FileNotFoundError(f"{self._url}/{key}: no such object")
            if str(entry[2]) != version:
                return False
            del self._objects[key]
            return True

    async def stat(self, key: str) -> ObjectInfo:
        # One lookup: a second one could race with a delete and leak a KeyError.
        data, mtime, version = self._get(key)
        return ObjectInfo(key, len(data), mtime, str(version))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        with self._lock:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(prefix)]
        return [ObjectInfo(k, len(d), t, str(v)) for k, (d, t, v) in sorted(items)]
