"""Conformance checks of :meth:`~ckptio.backends.base.Backend.write_filling`: a write whose buffers
are still being filled reads no byte before it is in, and a fill that fails leaves no object.

Part of :class:`ckptio.testing.BackendConformance`; see :mod:`ckptio.testing.conformance`.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from ckptio.backends.base import Backend
from ckptio.system import fresh_pages
from ckptio.testing._harness import ConformanceHarness, backend_test, payload

__all__ = ["FillingChecks", "PieceFilling", "filling_object"]

_GARBAGE = 0xAA


class PieceFilling:
    """A :class:`~ckptio.backends.base.Filling` that copies ``src`` into ``dst`` piece by piece on a
    thread of its own, and fails at byte ``fail_at`` (never, if None)."""

    def __init__(self, src: bytes, dst: memoryview, piece: int, fail_at: int | None = None) -> None:
        self.src, self.dst, self.piece, self.fail_at = src, dst, piece, fail_at
        self.front = 0  # bytes in
        self.error: BaseException | None = None
        self.waits: list[tuple[int, int]] = []  # each wait's end, and the bytes in when it returned
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._fill, name="conformance-fill", daemon=True)

    def start(self) -> PieceFilling:
        self._thread.start()
        return self

    def _fill(self) -> None:
        for lo in range(0, len(self.src), self.piece):
            hi = min(len(self.src), lo + self.piece)
            time.sleep(0.002)  # the write gets ahead of the fill
            if self.fail_at is not None and hi > self.fail_at:
                with self._cond:
                    self.error = OSError(5, f"the fill failed at byte {lo}")
                    self._cond.notify_all()
                return
            self.dst[lo:hi] = self.src[lo:hi]
            with self._cond:
                self.front = hi
                self._cond.notify_all()

    def wait(self, end: int) -> None:
        with self._cond:
            while self.front < end and self.error is None:
                self._cond.wait()
            self.waits.append((end, self.front))
            if self.front < end:
                raise self.error  # type: ignore[misc]

    async def complete(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.wait, len(self.src))


def filling_object(n: int, seed: int) -> tuple[bytes, np.ndarray, list[memoryview]]:
    """Bytes to write (none equal to the garbage the buffer starts with), the page-aligned buffer the
    fill copies them into, and views of it as a save hands them over: a large aligned run, a run of
    odd length, and the rest (out of step with the file)."""
    src = np.frombuffer(payload(n, seed), np.uint8).copy()
    src[src == _GARBAGE] = 0x55
    buf = fresh_pages(n)
    buf[:] = _GARBAGE
    view = memoryview(buf)
    cut = (n // 2) & ~4095
    return src.tobytes(), buf, [view[:cut], view[cut : cut + 333], view[cut + 333 :]]


class FillingChecks(ConformanceHarness):
    """``write_filling``: the object is the filled bytes, never what the buffers held before."""

    #: Bytes of the objects written while filled (large enough for a direct IO path's requests).
    filling_bytes = (6 << 20) + 777

    @backend_test
    async def test_write_filling_reads_only_bytes_already_in(self, b: Backend) -> None:
        self.require_writable(b)
        src, buf, views = filling_object(self.filling_bytes, 1)
        filling = PieceFilling(src, memoryview(buf), 1 << 20).start()
        await b.write_filling("filled", views, filling)
        await self.assert_object(b, "filled", src)
        assert filling.front == len(src)

    @backend_test
    async def test_write_filling_that_fails_leaves_no_object(self, b: Backend) -> None:
        self.require_writable(b)
        src, buf, views = filling_object(self.filling_bytes, 2)
        filling = PieceFilling(src, memoryview(buf), 1 << 20, fail_at=len(src) // 2).start()
        with pytest.raises(OSError, match="the fill failed"):
            await b.write_filling("half", views, filling)
        with pytest.raises(FileNotFoundError):
            await b.stat("half")
        assert "half" not in [o.key for o in await b.list()]
