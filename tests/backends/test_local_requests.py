"""How the local backend sends an object's bytes to the disk: O_DIRECT requests, and the page cache for
unaligned memory when ``direct_unaligned`` is off (issue 35)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.backends import test_local as test_backend_local
from tests.backends.test_local import direct_root

from ckptio.backends._bounce import BOUNCE, BOUNCE_BYTES
from ckptio.backends._posix import aligned_buffer
from ckptio.backends.base import Backend
from ckptio.backends.local import LocalBackend
from ckptio.testing import BackendConformance

direct_cleanup = test_backend_local.direct_cleanup  # the fixture, here too


@pytest.fixture(autouse=True)
def _cleanup(direct_cleanup: None) -> None:
    pass


class TestLocalBackendDirectAlignedOnly(BackendConformance):
    """O_DIRECT only for objects mostly in aligned memory: the suite holds in either mode of each write."""

    def make_backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(str(direct_root(tmp_path) / "root"), direct=True, direct_unaligned=False)


class _Spy:
    """Records, per file descriptor opened with O_DIRECT or not, the pwritev calls made and their sizes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct: set[int] = set()
        self.calls: list[tuple[bool, int]] = []  # (through O_DIRECT, bytes asked)
        self.fsyncs = 0
        real_open, real_pwritev, real_fsync = os.open, os.pwritev, os.fsync

        def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            (self.direct.add if flags & os.O_DIRECT else self.direct.discard)(fd)
            return fd

        def spy_pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            self.calls.append((fd in self.direct, sum(memoryview(b).nbytes for b in buffers)))
            return real_pwritev(fd, buffers, offset, *args)

        def spy_fsync(fd: int) -> None:
            self.fsyncs += 1
            real_fsync(fd)

        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "pwritev", spy_pwritev)
        monkeypatch.setattr(os, "fsync", spy_fsync)

    def direct_calls(self) -> list[int]:
        return [n for d, n in self.calls if d]


def _unaligned(nbytes: int, seed: int) -> memoryview:
    """``nbytes`` random bytes 64 bytes into a page, as torch allocates its tensors."""
    buf = aligned_buffer(nbytes + 4096)
    buf[64 : 64 + nbytes] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    return buf[64 : 64 + nbytes]


def _aligned(nbytes: int, seed: int) -> memoryview:
    buf = aligned_buffer(nbytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    return buf


def _frame(seed: int) -> memoryview:
    return _aligned(4096, seed)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Spy]:
    yield _Spy(monkeypatch)


def _write_and_read(backend: LocalBackend, key: str, views: list[memoryview]) -> bytes:
    async def body() -> bytes:
        await backend.write(key, views)
        return await backend.read(key)

    return asyncio.run(body())


def test_small_aligned_views_go_out_with_the_bulk_in_one_request(tmp_path: Path, spy: _Spy) -> None:
    """A DCP chunk's 4 KiB frame beside its 8 MiB of data is not a request of its own: every O_DIRECT
    write waits for the device, behind the other streams' large requests."""
    backend = LocalBackend(str(direct_root(tmp_path) / "root"))
    mib8 = BOUNCE_BYTES
    for name, data in {
        "aligned": [_frame(0), _aligned(mib8, 1), _frame(2), _aligned(mib8, 3), _frame(4)],
        "unaligned": [_frame(0), _unaligned(mib8, 1), _frame(2), _unaligned(mib8, 3), _frame(4)],
    }.items():
        spy.calls.clear()
        assert _write_and_read(backend, name, data) == b"".join(bytes(v) for v in data)
        total = sum(v.nbytes for v in data)
        sizes = spy.direct_calls()
        # Old: one request per view and per bounce buffer (5); now ceil(total / 8 MiB) = 3.
        assert len(sizes) == -(-total // mib8), (name, sizes)
        assert sum(sizes) == total


def test_unaligned_memory_goes_through_the_page_cache_when_direct_unaligned_is_off(
        tmp_path: Path, spy: _Spy) -> None:
    backend = LocalBackend(str(direct_root(tmp_path) / "root"), direct_unaligned=False)
    lent = BOUNCE.lent
    torchlike = [_frame(0), _unaligned(4 << 20, 1), _frame(2), _unaligned(4 << 20, 3)]
    assert _write_and_read(backend, "torch", torchlike) == b"".join(bytes(v) for v in torchlike)
    assert BOUNCE.lent == lent, "no bounce copy: the kernel's copy into the page cache replaces it"
    assert not spy.direct_calls() and spy.calls
    assert spy.fsyncs >= 1, "a buffered object is fsync'd before its rename, as a direct one is"
    # Staged (page-aligned) memory still goes to the device as it is.
    spy.calls.clear()
    staged = [_aligned(4 << 20, 4), _aligned(4 << 20, 5), memoryview(b"tail")]
    assert _write_and_read(backend, "staged", staged) == b"".join(bytes(v) for v in staged)
    assert sum(spy.direct_calls()) == 8 << 20 and BOUNCE.lent == lent
    # The default keeps O_DIRECT through the bounce buffer for everything.
    spy.calls.clear()
    default = LocalBackend(str(direct_root(tmp_path) / "root2"))
    assert _write_and_read(default, "torch", torchlike) == b"".join(bytes(v) for v in torchlike)
    assert BOUNCE.lent > lent and sum(spy.direct_calls()) == sum(v.nbytes for v in torchlike)


def _in_step(nbytes: int, at: int, seed: int) -> memoryview:
    """``nbytes`` random bytes whose address is ``at`` past a page: in step with a file offset ``at`` mod 4096."""
    buf = aligned_buffer(nbytes + 8192)
    view = buf[at % 4096 : at % 4096 + nbytes]
    view[:] = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    return view


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts direct writes copy into bounce buffers."""
    import ckptio.backends._direct as direct

    out: list[int] = []
    real = direct.copy_bytes

    def spy(dst: memoryview, src: memoryview) -> None:
        out.append(src.nbytes)
        real(dst, src)

    monkeypatch.setattr(direct, "copy_bytes", spy)
    return out


def test_memory_in_step_with_the_file_goes_direct_in_place_but_for_its_partial_pages(
        tmp_path: Path, spy: _Spy, copied: list[int]) -> None:
    """A sync ``dcp.save`` hands over torch's tensors, 64 bytes past a page; laid out 64 bytes past an aligned
    offset (``ckptio.engine.layout.direct_offset``), their pages go to the device as they are: the bounce copies
    only the partial pages at either end and the frames, not every byte (issue 35)."""
    from ckptio.backends._direct import bounced_bytes

    frame = _aligned(4096 + 64, 0)  # a frame ending 64 bytes past a page, where the tensor starts
    views = [frame, _in_step(3 << 20, 64, 1), _frame(2)[:100], _in_step(5 << 20, 64 + (3 << 20) + 100, 3),
             memoryview(b"tail")]
    total = sum(v.nbytes for v in views)
    for direct_unaligned in (True, False):  # mostly in place: direct either way
        spy.calls.clear()
        copied.clear()
        backend = LocalBackend(str(direct_root(tmp_path) / f"root{direct_unaligned}"),
                               direct_unaligned=direct_unaligned)
        assert _write_and_read(backend, "t", views) == b"".join(bytes(v) for v in views)
        assert sum(spy.direct_calls()) == total - total % 4096
        assert sum(copied) == bounced_bytes(views, 4096) - total % 4096 < 5 * 4096
        assert len(spy.direct_calls()) <= -(-total // BOUNCE_BYTES), "bounced runs go out inside the requests"


@pytest.mark.parametrize("seed", range(6))
def test_a_direct_write_copies_exactly_the_bytes_out_of_step_with_the_file(
        tmp_path: Path, seed: int, copied: list[int]) -> None:
    """Any mix of views (aligned, in step, out of step, tiny) reads back as written, and the bounce copies
    exactly what ``bounced_bytes`` counts (but the final partial block, which goes through the page cache)."""
    from ckptio.backends._direct import bounced_bytes

    rng = np.random.default_rng(seed)
    views, at = [], 0
    for i in range(int(rng.integers(3, 12))):
        n = int(rng.choice([10, 777, 4096, 5000, 70000, 1 << 20, 3 << 20]))
        kind = rng.integers(3)
        v = _aligned(n, i) if kind == 0 else _in_step(n, at, i) if kind == 1 else _unaligned(n, i)
        views.append(v)
        at += n
    backend = LocalBackend(str(direct_root(tmp_path) / "root"), direct=True)
    assert _write_and_read(backend, "k", views) == b"".join(bytes(v) for v in views)
    if at >= (1 << 16):  # smaller objects are written through the page cache, no bounce at all
        assert sum(copied) == bounced_bytes(views, 4096) - at % 4096


def test_a_read_into_memory_in_step_with_the_file_goes_direct_but_for_its_partial_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``direct_reads``, restoring into torch's or numpy's own allocations (not page-aligned) at offsets
    in step with them: the pages between come straight from the device, the partial pages at either end
    through the page cache."""
    from ckptio.backends.base import ByteRange

    backend = LocalBackend(str(direct_root(tmp_path) / "root"), direct=True, direct_reads=True)
    data = _aligned(6 << 20, 7)
    asyncio.run(backend.write("k", [data]))
    direct: set[int] = set()
    reads: list[tuple[bool, int]] = []
    real_open, real_preadv = os.open, os.preadv

    def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        (direct.add if flags & os.O_DIRECT else direct.discard)(fd)
        return fd

    def spy_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        reads.append((fd in direct, sum(memoryview(b).nbytes for b in buffers)))
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    start, n = 4096 + 64, (4 << 20) + 1000
    into = _in_step(n, start, 8)
    out_of_step = _in_step(n, start + 16, 9)
    asyncio.run(backend.read_into("k", ByteRange(start, start + n), [into]))
    assert bytes(into) == bytes(data[start : start + n])
    assert sum(b for d, b in reads if d) == (4 << 20) - 4096 and sum(b for d, b in reads if not d) == n - (4 << 20) + 4096
    reads.clear()
    asyncio.run(backend.read_into("k", ByteRange(start, start + n), [out_of_step]))
    assert bytes(out_of_step) == bytes(data[start : start + n]) and not any(d for d, _ in reads)
