"""``raw-direct``: the device's own limit, and the CPU floor ckptio's cost is read against.

``raw-disk`` (:mod:`ckptio.bench.anchors_raw`) writes through the page cache, so its
figure swings with writeback (0.54-1.26 GiB/s here from one run to the next). This
case is what "close to the device" means: the same stream count, each stream one file
written with ``O_DIRECT`` from page-aligned buffers in large requests, then fsync'd;
read back with ``O_DIRECT`` into fresh page-aligned buffers. No checksums, no index on
disk, no commit: a ceiling, not a format.

O_DIRECT needs aligned memory, so the state is laid out once, untimed (in
:meth:`RawDirect.setup`), in one page-aligned buffer per stream, each array padded to a
page, then moved into huge pages where the kernel gives them (``info.huge_page_bytes``);
the timed save writes those buffers as they are. A library that must send the
caller's own arrays pays one copy more: that copy is part of the *floor* below, not of
this ceiling.

**The CPU floor** (:meth:`RawDirect.info`): the least CPU a checkpoint that stages and
checksums its bytes can spend per GiB is one memcpy + one crc32c + the kernel's O_DIRECT
path. The first two are timed here on the state itself (thread CPU time, after the
rounds); the third is this case's own CPU per GiB, measured per round by the harness
like every case's. ``report.cpu_floor`` adds them up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptio.bench.anchors_raw import RawDisk
from ckptio.bench.cases import register
from ckptio.system import collapse, fresh_pages

__all__ = ["ALIGN", "RawDirect", "RawDirectSnapshot", "aligned_layout"]

#: O_DIRECT alignment of offsets, lengths and buffer addresses: one page covers every
#: logical block size in use (512 B and 4 KiB).
ALIGN = 4096
_CHUNK = 8 << 20  # bytes per request: large enough that per-request cost vanishes
_GIB = float(1 << 30)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_layout(sizes: Mapping[str, int], streams: int) -> list[dict[str, int]]:
    """Balance arrays over ``streams`` files (largest first onto the lightest), each array at a
    page-aligned offset: ``[{name: offset}, ...]`` per stream."""
    plan: list[dict[str, int]] = [{} for _ in range(max(1, streams))]
    loads = [0] * len(plan)
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        i = loads.index(min(loads))
        plan[i][name] = loads[i]
        loads[i] += _up(n)
    return plan


def _stream_bytes(plan: dict[str, int], sizes: Mapping[str, int]) -> int:
    return max((off + _up(sizes[name]) for name, off in plan.items()), default=0)


def _pwrite_all(fd: int, view: memoryview, start: int, end: int) -> None:
    """Write ``view[start:end]`` at offset ``start`` in requests of at most ``_CHUNK`` bytes."""
    for off in range(start, end, _CHUNK):
        chunk = view[off:min(end, off + _CHUNK)]
        while chunk:  # a short O_DIRECT write stops on an aligned boundary
            n = os.pwrite(fd, chunk, off)
            chunk, off = chunk[n:], off + n


def _bytes(arr: Any) -> np.ndarray:
    return np.asarray(arr).reshape(-1).view(np.uint8)


@register
class RawDirect(RawDisk):
    """4 files in parallel, O_DIRECT from page-aligned buffers: write + fsync; O_DIRECT read.

    ``raw-disk``'s save and restore (a thread per stream, then the directory's fsync) over
    this class's own layout and its O_DIRECT ``_write_one`` / ``_read_one``.
    """

    name = "raw-direct"
    sweep_max_tensors = 0
    description = (f"{RawDisk.streams} files by {RawDisk.streams} threads, O_DIRECT from page-aligned buffers: "
                   "pwrite + fsync (+ dir fsync); O_DIRECT preadv into fresh aligned buffers; no checksums")
    durability = "fsync of every file and of the directory"

    def setup(self) -> None:
        self._sizes = {k: int(v.nbytes) for k, v in self.state.items()}
        streams = max(1, self.streams // self.ctx.world_size)
        layout = aligned_layout(self._sizes, streams)
        self._plan = [list(p.items()) for p in layout]  # raw-disk's form: (name, offset) per stream
        self._lengths = [_stream_bytes(p, self._sizes) for p in layout]
        # The state in aligned memory, laid out as on disk (untimed: see the module docstring).
        self._staged = [fresh_pages(n) for n in self._lengths]
        for buf, plan in zip(self._staged, self._plan):
            for name, off in plan:
                buf[off:off + self._sizes[name]] = _bytes(self.state[name])
        # In huge pages where the kernel gives them, as ckptio's reused staging buffers are: from
        # 4 KiB pages a request carries at most max_segments pages (~1 MiB here, against 4 MiB),
        # which cost this ceiling ~1.4x in time and 4x in kernel CPU (ckptio.system.pages.collapse).
        self._huge_bytes = collapse(self._staged)
        self._pool = ThreadPoolExecutor(len(self._plan), thread_name_prefix="raw-direct")

    def _file(self, step: int, i: int) -> str:
        return os.path.join(self.step_path(step) or "", f"r{self.ctx.rank}_d{i}.bin")

    def _write_one(self, step: int, i: int) -> None:
        view = memoryview(self._staged[i])
        fd = os.open(self._file(step, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            _pwrite_all(fd, view, 0, len(view))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_one(self, step: int, i: int) -> dict[str, np.ndarray]:
        buf = fresh_pages(self._lengths[i])
        view = memoryview(buf)
        fd = os.open(self._file(step, i), os.O_RDONLY | os.O_DIRECT)
        try:
            for off in range(0, len(view), _CHUNK):
                chunk = view[off:off + _CHUNK]
                while chunk:
                    n = os.preadv(fd, [chunk], off)
                    if n == 0:
                        raise EOFError(f"{self._file(step, i)}: short read at offset {off}")
                    chunk, off = chunk[n:], off + n
        finally:
            os.close(fd)
        out = {}
        for name, off in self._plan[i]:
            src = self.state[name]
            out[name] = buf[off:off + self._sizes[name]].view(np.asarray(src).dtype).reshape(src.shape)
        return out

    def info(self) -> dict[str, Any]:
        return {"streams": len(self._plan), "request_bytes": _CHUNK, "huge_page_bytes": self._huge_bytes,
                **floor_parts(self.state)}



def floor_parts(state: Mapping[str, Any], repeats: int = 3) -> dict[str, float]:
    """CPU seconds per GiB of one memcpy into touched memory and one crc32c, on ``state``
    (the fastest of ``repeats``: what the work costs, not what a neighbour took from it)."""
    from ckptio.system.checksum import crc32c

    views = [_bytes(v) for v in state.values()]
    gib = sum(v.nbytes for v in views) / _GIB
    dst = [np.ones_like(v) for v in views]  # touched: a staging pool reused across saves
    copy, crc = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        for d, v in zip(dst, views):
            np.copyto(d, v)
        t1 = time.thread_time()
        for v in views:
            crc32c(memoryview(v))
        crc.append(time.thread_time() - t1)
        copy.append(t1 - t0)
    return {"floor_copy_cpu_s_per_gib": min(copy) / gib if gib else 0.0,
            "floor_crc32c_cpu_s_per_gib": min(crc) / gib if gib else 0.0}


@register
class RawDirectSnapshot(RawDirect):
    """``raw-direct`` with the work every checksummed asynchronous save must do before its bytes
    can go out: the caller's arrays copied into the aligned buffers (a snapshot: the step may
    change them once the save returns) and a crc32c of each array, then the same O_DIRECT writes.

    Why beside ``raw-direct``: where the disk writes about as fast as one core copies memory (this
    VM: 2.3-3.4 GiB/s O_DIRECT against a 3.3-3.8 GiB/s memcpy of the state), the bare device's
    limit is out of reach of anything that copies first, so ``ckptio`` / ``raw-direct`` reads the
    memory bus, not the library. This case is the device's limit for a save that snapshots and
    checksums, pipelined as well as a few lines can: each stream copies, checksums and writes
    one array at a time, so one stream's copy overlaps the others' writes.
    """

    name = "raw-direct-snapshot"
    description = (f"raw-direct after the work of a checksummed snapshot: {RawDisk.streams} threads each copy "
                   "their arrays into page-aligned buffers, crc32c each, O_DIRECT pwrite + fsync (+ dir fsync)")

    def setup(self) -> None:
        super().setup()
        for buf in self._staged:  # the buffers are the save's to fill: nothing of the state in them
            buf[:] = 0

    def _write_one(self, step: int, i: int) -> None:
        from ckptio.system.checksum import crc32c

        buf = self._staged[i]
        view = memoryview(buf)
        fd = os.open(self._file(step, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for name, off in self._plan[i]:  # arrays in offset order, each starting on a page
                n = self._sizes[name]
                np.copyto(buf[off:off + n], _bytes(self.state[name]))
                crc32c(view[off:off + n])
                _pwrite_all(fd, view, off, off + _up(n))
            os.fsync(fd)
        finally:
            os.close(fd)

    def info(self) -> dict[str, Any]:
        return {"streams": len(self._plan), "request_bytes": _CHUNK, "huge_page_bytes": self._huge_bytes}
