"""Fresh host memory (backends/_pages.py): private pages for restore destinations and staging
buffers, and populating them ahead of the reads or copies that fill them."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from ckptio.saving.staging import StagingArea
from ckptio.system import FRESH_MIN, HUGE_PAGE, POPULATE_MIN, collapse, fresh_pages, populate
from ckptio.system.bufferpool import StagingPool, aligned_empty


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


def _smaps_field(buf: np.ndarray, field: str) -> list[str]:
    """The values of ``field`` (e.g. ``AnonHugePages:``) for the mapping holding ``buf`` (/proc/self/smaps)."""
    addr, found = buf.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = lo <= addr < hi
            elif found and head[0] == field:
                return head[1:]
    return []


def _huge_bytes(buf: np.ndarray) -> int:
    """Bytes of the mapping holding ``buf`` that sit in transparent huge pages."""
    kib = _smaps_field(buf, "AnonHugePages:")
    return int(kib[0]) << 10 if kib else 0


def test_collapse_keeps_every_byte_and_leaves_what_it_cannot_move() -> None:
    """Huge pages or not (a kernel or a host may refuse), every byte reads back as written, in
    buffers of any size and offset; small, read-only and non-contiguous buffers are not asked for."""
    data = np.random.default_rng(2).integers(0, 255, (5 << 20) + 4321, dtype=np.uint8)
    mapped = fresh_pages(data.nbytes)
    mapped[:] = data
    small = fresh_pages(HUGE_PAGE - 1)
    small[:] = 3
    read_only = np.frombuffer(b"x" * (3 << 20), np.uint8)
    strided = mapped[::2]
    moved = collapse([mapped, small, read_only, strided, mapped[7:]])
    assert 0 <= moved <= 2 * mapped.nbytes and moved % HUGE_PAGE == 0
    assert np.array_equal(mapped, data) and (small == 3).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_collapse_moves_a_buffer_into_huge_pages_where_the_kernel_can() -> None:
    buf = fresh_pages(8 << 20)
    buf[:] = 5
    moved = collapse([buf])
    if moved == 0:
        pytest.skip("this kernel or host gives no huge page to MADV_COLLAPSE")
    assert _huge_bytes(buf) >= moved >= 6 << 20  # the whole 2 MiB pages inside the buffer
    assert (buf == 5).all()


class _Counting(StagingPool):
    def __init__(self) -> None:
        super().__init__()
        self.settled: list[list[int]] = []

    def settle(self, new: Sequence[np.ndarray]) -> int:
        self.settled.append([b.nbytes for b in new])
        return super().settle(new)


def test_a_save_settles_only_the_buffers_its_pool_made_for_it() -> None:
    """New pool buffers of a save are settled once, after it; reused and small ones never; an
    area without a pool (its buffers die with the save) settles nothing."""
    pool = _Counting()
    srcs = [np.full(n, 9, np.uint8) for n in (3 << 20, POPULATE_MIN - 1, 2 << 20)]
    first = StagingArea(pool)
    outs = [first.snapshot(s) for s in srcs]
    first.fill_all()
    first.release()
    first.settle()
    first.settle()
    assert pool.settled == [[3 << 20, 2 << 20]]
    assert all(np.array_equal(o, s) for o, s in zip(outs, srcs))
    again = StagingArea(pool)
    outs = [again.snapshot(s) for s in srcs]
    again.fill_all()
    again.settle()
    assert pool.settled == [[3 << 20, 2 << 20]]
    assert all(np.array_equal(o, s) for o, s in zip(outs, srcs))
    lone = StagingArea(None)
    lone.snapshot(srcs[0])
    lone.settle()


def _huge_pages_to_be_had() -> bool:
    """Whether MADV_COLLAPSE moves private memory into a huge page here and now."""
    probe = fresh_pages(4 << 20)
    probe[:] = 1
    return collapse([probe]) > 0


def _shmem_policy() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd slabs are Linux's")
def test_a_shared_memory_pool_settles_its_buffers_into_huge_pages_through_the_slab_file() -> None:
    """A slab's mapping lies wherever mmap put it (off 2 MiB boundaries) and the host's shmem THP
    policy may say "never" (this VM's): the shared pool still moves a settled buffer's whole huge
    pages into huge pages, through the slab's file, and every byte reads back as written through
    the pool's mapping and through another mapping of the slab (the writer process's)."""
    from ckptio.saving.writers.shm import ShmStagingPool

    if not _huge_pages_to_be_had() or "[deny]" in _shmem_policy():
        pytest.skip("this kernel or host gives no huge page to MADV_COLLAPSE")
    pool = ShmStagingPool()
    try:
        small = pool.take((1 << 20) + 5)
        off = pool.take(5 << 20)  # page-aligned, off a 2 MiB boundary of its slab: [1 MiB + 4 KiB, 6 MiB + 4 KiB)
        big = pool.take(9 << 20)  # large: starts on a 2 MiB boundary (8 MiB)
        rng = np.random.default_rng(7)
        data = [rng.integers(0, 255, b.nbytes, dtype=np.uint8) for b in (off, big)]
        off[:], big[:], small[:] = data[0], data[1], 4
        located = [pool.locate(memoryview(b)) for b in (off, big)]
        assert located[0] is not None and located[0][1] % HUGE_PAGE and located[1] == (located[0][0], 8 << 20)
        moved = pool.settle([off, big, small, np.zeros(4 << 20, np.uint8)])  # the last is no slab's
        if moved < (12 << 20) and not _huge_pages_to_be_had():
            pytest.skip("no huge page to be had just now (memory fragmented by other tests)")
        assert moved == (4 << 20) + (8 << 20)  # the whole 2 MiB pages inside each: [2, 6) and [8, 16) MiB
        assert np.array_equal(off, data[0]) and np.array_equal(big, data[1]) and (small == 4).all()
        fd, size = next((fd, size) for i, fd, size in pool.slabs() if i == located[0][0])
        other = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            for b, (_sid, at), want in zip((off, big), located, data):
                assert np.array_equal(np.frombuffer(other, np.uint8, b.nbytes, at), want)
        finally:
            other.close()
    finally:
        pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="reads /proc/self/smaps")
def test_kept_buffers_ask_for_huge_pages_before_their_first_touch() -> None:
    """O_DIRECT writes go out in larger requests from huge pages: the bounce buffers and the writer
    process's shared-memory slabs ask for them (MADV_HUGEPAGE, "hg") whatever the host's policy then
    grants; plain fresh pages (restore destinations) do not, and every byte is kept."""
    from ckptio.backends._bounce import BouncePool
    from ckptio.saving.writers.shm import ShmStagingPool

    plain, huge = fresh_pages(4 << 20), fresh_pages(4 << 20, huge=True)
    assert "hg" not in _smaps_field(plain, "VmFlags:") and "hg" in _smaps_field(huge, "VmFlags:")
    shared = ShmStagingPool()
    try:
        with BouncePool(size=4 << 20).lend() as bounce:
            for buf in (np.frombuffer(bounce, np.uint8), shared.take(4 << 20)):
                assert "hg" in _smaps_field(buf, "VmFlags:")
                data = np.random.default_rng(6).integers(0, 255, buf.nbytes, dtype=np.uint8)
                buf[:] = data
                assert np.array_equal(buf, data)
    finally:
        shared.close()


def _fresh_process_pool(monkeypatch: pytest.MonkeyPatch, max_bytes: int) -> StagingPool:
    import ckptio.system.bufferpool as sp

    monkeypatch.setattr(sp, "_process_pool", None)
    monkeypatch.setattr(sp, "PROCESS_POOL_BYTES", max_bytes)
    return sp.process_pool()


def test_saves_without_a_pool_reuse_the_process_pool_and_save_what_they_were_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ckptio.save`` staging in this process with no pool: the second save stages into the first
    one's buffers (no fresh pages), and each step restores exactly the state it was given."""
    import ckptio
    pool = _fresh_process_pool(monkeypatch, 64 << 20)
    config = ckptio.SaveOptions(writer="thread")
    state = {"a": np.arange(1 << 20, dtype=np.float32), "b": np.full((512, 1024), 3, np.float64)}
    ckptio.save(tmp_path, state, step=1, save_options=config).result()
    assert pool._free.misses >= 2 and pool._free.held_bytes() > 0
    misses = pool._free.misses
    state["a"] += 1  # the caller's arrays change between saves; the buffers are reused
    ckptio.save(tmp_path, state, step=2, save_options=config).result()
    assert pool._free.misses == misses and pool._free.hits >= 2
    assert pool._free.held_bytes() <= 64 << 20
    first = ckptio.restore(tmp_path, step=1)
    second = ckptio.restore(tmp_path, step=2)
    assert np.array_equal(first["a"], np.arange(1 << 20, dtype=np.float32))
    assert np.array_equal(second["a"], np.arange(1 << 20, dtype=np.float32) + 1)
    assert np.array_equal(second["b"], state["b"])


def test_the_process_pool_keeps_within_its_bound_and_a_pool_of_nothing_keeps_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptio
    pool = _fresh_process_pool(monkeypatch, 5 << 20)
    config = ckptio.SaveOptions(writer="thread")
    state = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(3)}  # 3 x 4 MiB
    ckptio.save(tmp_path, state, step=1, save_options=config).result()
    assert 0 < pool._free.held_bytes() <= 5 << 20
    nothing = StagingPool(max_bytes=0)
    ckptio.save(tmp_path, state, step=2, save_options=config, pool=nothing).result()
    assert nothing._free.held_bytes() == 0 and nothing._free.count() == 0
    assert all(np.array_equal(ckptio.restore(tmp_path, step=2)[k], v) for k, v in state.items())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_without_the_parents_process_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptio.system.bufferpool as sp

    parent = _fresh_process_pool(monkeypatch, 8 << 20)
    parent.give_back([aligned_empty(4 << 20)])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pool of its own, empty
        try:
            child = sp.process_pool()
            os.write(w, b"ok" if child is not parent and child._free.held_bytes() == 0 else b"no")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 2)
    os.waitpid(pid, 0)
    assert got == b"ok"
    assert sp.process_pool() is parent and parent._free.held_bytes() == 4 << 20
