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
from ckptio.testing import BackendConformance

from ckptio.backends._bounce import BOUNCE, BOUNCE_BYTES
from ckptio.backends._posix import aligned_buffer
from ckptio.backends.base import Backend
from ckptio.backends.local import LocalBackend

import test_backend_local
from test_backend_local import direct_root

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
