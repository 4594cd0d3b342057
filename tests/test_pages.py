"""Restore destinations (backends/_pages.py): fresh private pages, and populating them ahead of reads."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from ckptio.backends._pages import FRESH_MIN, fresh_pages, populate


@pytest.mark.parametrize("nbytes", [0, 1, FRESH_MIN - 1, FRESH_MIN, (4 << 20) + 3])
def test_fresh_pages_are_writable_buffers_of_the_asked_size(nbytes: int) -> None:
    buf = fresh_pages(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable and buf.flags.c_contiguous
    if nbytes >= FRESH_MIN:
        assert buf.ctypes.data % mmap.PAGESIZE == 0
    buf[:] = 7
    assert (buf == 7).all()


def test_populate_keeps_every_byte() -> None:
    """It only faults pages in: data already there, in any buffer and at any offset, is unchanged."""
    data = np.random.default_rng(0).integers(0, 255, (3 << 20) + 123, dtype=np.uint8)
    mapped = fresh_pages(data.nbytes)
    mapped[:] = data
    heap = data.copy()
    floats = heap[: (2 << 20)].view(np.float32).reshape(512, -1)  # a multi-dimensional, non-byte view
    read_only = memoryview(b"read-only" * 200_000)
    populate([memoryview(mapped)[5:], memoryview(heap), memoryview(floats), read_only])
    assert np.array_equal(mapped, data) and np.array_equal(heap, data)


def test_populated_fresh_pages_read_as_written() -> None:
    buf = fresh_pages(2 << 20)
    populate([memoryview(buf)])
    buf[::4096] = 1
    assert int(buf.sum()) == (2 << 20) // 4096
