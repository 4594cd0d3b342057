"""Fresh host memory (backends/_pages.py): private pages for restore destinations and staging
buffers, and populating them ahead of the reads or copies that fill them."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from ckptio._system import FRESH_MIN, POPULATE_MIN, fresh_pages, populate
from ckptio.staging import StagingArea, StagingPool, aligned_empty


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


def _mapping_perms(addr: int) -> str:
    """The permissions column of /proc/self/maps for the mapping holding ``addr`` ("rw-p": private)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_large_staging_buffers_are_private_page_aligned_mappings() -> None:
    """Not mmap's default shared (shmem) mapping, whose first touch costs the most per page."""
    buf = aligned_empty(4 << 20)
    assert buf.ctypes.data % mmap.PAGESIZE == 0 and buf.flags.writeable
    assert _mapping_perms(buf.ctypes.data) == "rw-p"


def test_a_pool_says_which_buffers_are_new() -> None:
    pool = StagingPool()
    a, new = pool.obtain(2 << 20)
    assert new
    pool.give_back([a])
    b, new = pool.obtain(2 << 20)
    assert b is a and not new
    c, new = pool.obtain(2 << 20)
    assert new and c is not a


def test_a_save_prefaults_only_its_new_buffers_and_changes_no_byte() -> None:
    """A first save's buffers are populated on a helper thread while the copies run; reused
    ones are not (their pages are there already), nor small ones; no byte ever changes."""
    pool = StagingPool()
    rng = np.random.default_rng(1)
    first = StagingArea(pool)
    srcs = [rng.integers(0, 255, n, dtype=np.uint8) for n in (3 << 20, POPULATE_MIN - 1, 2 << 20)]
    outs = [first.snapshot(s) for s in srcs]
    assert [id(b) for b in first.fresh] == [id(first.owned[0]), id(first.owned[2])]
    thread = first.prefault()
    assert thread is not None
    for o in outs:  # the copies race the populate: whichever touches a page first, bytes survive
        first.fill(o)
    thread.join(30)
    assert not thread.is_alive() and first.fresh == []
    assert all(np.array_equal(o, s) for o, s in zip(outs, srcs))
    first.release()

    again = StagingArea(pool)  # the next save reuses every buffer: nothing to prefault
    outs = [again.snapshot(s) for s in srcs]
    assert again.fresh == [] and again.prefault() is None
    again.fill_all()
    assert all(np.array_equal(o, s) for o, s in zip(outs, srcs))
