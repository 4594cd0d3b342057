"""The harness the conformance checks stand on: a fresh backend per test in its own event loop.

* Each test runs in its own event loop (``asyncio.run``; no pytest-asyncio),
  and ``make_backend`` is called *inside* that loop, so a backend may bind
  sessions to the running loop. ``close_backend`` is awaited at the end.
* Sizes and counts are class attributes, so a slow backend can shrink them.
* A read-only backend's read tests seed their data through
  :meth:`ConformanceHarness.writer_for` (see :mod:`ckptio.testing.conformance`).
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest

from ckptio.backends.base import Backend, ByteRange

__all__ = ["AsyncBody", "ConformanceHarness", "backend_test", "payload"]

T = TypeVar("T")
AsyncBody = Callable[[Any, Backend], Awaitable[None]]


def backend_test(fn: AsyncBody) -> Callable[[Any, Path], None]:
    """Make ``async def test_x(self, b)`` a pytest test that gets a fresh backend ``b``.

    The test runs in its own event loop; the backend is made and closed in
    that loop. Subclasses may use it for their own backend-specific tests.
    """

    def test(self: ConformanceHarness, tmp_path: Path) -> None:
        self.run_with_backend(tmp_path, lambda b: fn(self, b))

    # Copy the name but not ``__wrapped__``: pytest would read the wrapped
    # signature and look for a fixture called ``b``.
    test.__name__ = fn.__name__
    test.__qualname__ = fn.__qualname__
    test.__doc__ = fn.__doc__
    if hasattr(fn, "pytestmark"):
        test.pytestmark = fn.pytestmark  # type: ignore[attr-defined]
    return test


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class ConformanceHarness:
    """What every group of checks stands on: the hook a backend's test file implements
    (:meth:`make_backend`), the sizes a slow backend may shrink, and the helpers the checks share."""

    #: Examples and steps of the state machine (keep the whole class well under a minute).
    state_machine_examples: ClassVar[int] = 60
    state_machine_steps: ClassVar[int] = 30
    #: An object larger than the local backend's 8 MiB O_DIRECT bounce buffer.
    large_object_size: ClassVar[int] = (9 << 20) + 4099
    #: More buffers than one vectored system call takes (IOV_MAX is 1024 on Linux).
    many_buffers: ClassVar[int] = 1500
    concurrent_objects: ClassVar[int] = 100
    create_racers: ClassVar[int] = 16
    create_racer_instances: ClassVar[int] = 4
    #: How far ``ObjectInfo.mtime`` may be from this machine's clock.
    mtime_tolerance_s: ClassVar[float] = 600.0

    # -- what a backend's test file provides ------------------------------

    def make_backend(self, tmp_path: Path) -> Backend | Awaitable[Backend]:
        """A backend over storage named by ``tmp_path`` (may be a coroutine function)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_backend(self, tmp_path)")

    async def close_backend(self, backend: Backend) -> None:
        """Called at the end of every test, in the test's loop."""
        await backend.close()

    def writer_for(self, backend: Backend) -> Backend:
        """The backend that seeds data for read tests: ``backend`` itself unless read-only."""
        return backend

    # -- machinery ----------------------------------------------------------

    async def open_backend(self, tmp_path: Path) -> Backend:
        """Call :meth:`make_backend`, awaiting it if it is a coroutine."""
        made = self.make_backend(tmp_path)
        backend = await made if inspect.isawaitable(made) else made
        assert isinstance(backend, Backend), f"make_backend returned {backend!r}, not a Backend"
        return backend

    def run_with_backend(self, tmp_path: Path, body: Callable[[Backend], Awaitable[T]]) -> T:
        """Run ``body(backend)`` in a fresh event loop with a fresh backend."""

        async def main() -> T:
            backend = await self.open_backend(tmp_path)
            try:
                return await body(backend)
            finally:
                await self.close_backend(backend)

        return asyncio.run(main())

    @staticmethod
    def require_writable(b: Backend) -> None:
        if b.capabilities.read_only:
            pytest.skip("the backend declares read_only: write-path test")

    def seeder(self, b: Backend) -> Backend:
        """:meth:`writer_for` ``b``; skips the test if a read-only backend has no writer."""
        writer = self.writer_for(b)
        if writer.capabilities.read_only:
            pytest.skip(f"{type(self).__name__}.writer_for gives no writable client to seed data with")
        return writer

    async def put(self, b: Backend, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` through the seeding writer, in two buffers."""
        cut = len(data) // 3
        await self.seeder(b).write(key, [memoryview(data)[:cut], memoryview(data)[cut:]])

    async def assert_object(self, b: Backend, key: str, data: bytes) -> None:
        """``key`` holds exactly ``data``, by ``stat``, whole ``read`` and one ranged read."""
        info = await b.stat(key)
        assert (info.key, info.size) == (key, len(data))
        assert await b.read(key) == data
        buf = bytearray(len(data))
        await b.read_into(key, ByteRange(0, len(data)), [memoryview(buf)])
        assert buf == data

    @pytest.fixture(autouse=True)
    def _remember_tmp_path(self, tmp_path: Path) -> None:
        # Tests that open extra clients of the same storage need the test's tmp_path.
        self._tmp_path = tmp_path
