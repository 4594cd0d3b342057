"""The references with no library in the way: the disk's own limit, and the memcpy floor.

``raw-disk`` is what any checkpoint library could reach on this disk: the
arrays written back to back into 4 files by 4 threads (``pwrite`` releases
the GIL), each file fsync'd, then the directory; read back by 4 threads with
``preadv`` into freshly allocated buffers. It keeps its index in memory, so
it pays no metadata or commit cost at all: a ceiling, not a format.

Its buffers come from private anonymous ``mmap`` (4 KiB pages), as ckptio's own
restore buffers do (a shared mapping faults in markedly slower, which flattered
every reader that did not use one), not from ``np.empty``: numpy asks for transparent huge
pages on large arrays, and with THP ``defrag=madvise`` (this VM) faulting
them in swung between 0.5 and 5.5 GiB/s from one round to the next with the
host's memory fragmentation (measured: 32 x 32 MiB, three rounds), which
made the ceiling a measure of the allocator's luck rather than of the disk.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptio.bench.cases import Case, Pending, register

__all__ = ["MemcpyFloor", "RawDisk", "RawDisk1"]


def _bytes_view(arr: np.ndarray) -> memoryview:
    # uint8 view: memoryview refuses some dtypes (bfloat16, float8) but never bytes.
    return memoryview(arr.reshape(-1).view(np.uint8))


def _fresh(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised array in fresh 4 KiB pages (anonymous mmap; see the module docstring)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < (1 << 16):
        return np.empty(shape, dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).reshape(shape)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise EOFError(f"short read at offset {offset}")
        buf, offset = buf[n:], offset + n


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@register
class RawDisk(Case):
    """4 files in parallel: pwrite + fsync; cold read with preadv into fresh buffers."""

    name = "raw-disk"
    streams = 4
    max_world = 64
    sweep_max_tensors = 1_000_000
    description = "4 files by 4 threads: pwrite + fsync (+ dir fsync); preadv into fresh buffers"
    durability = "fsync of every file and of the directory"

    def setup(self) -> None:
        # Balance bytes over the streams (largest first onto the lightest file), so no
        # one file is the straggler; offsets are fixed here, outside the timing.
        streams = max(1, self.streams // self.ctx.world_size)
        self._plan: list[list[tuple[str, int]]] = [[] for _ in range(streams)]
        loads = [0] * streams
        for name, arr in sorted(self.state.items(), key=lambda kv: -kv[1].nbytes):
            i = loads.index(min(loads))
            self._plan[i].append((name, loads[i]))
            loads[i] += arr.nbytes
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix="raw-disk")

    def _file(self, step: int, i: int) -> str:
        return os.path.join(self.step_path(step) or "", f"r{self.ctx.rank}_s{i}.bin")

    def _write_one(self, step: int, i: int) -> None:
        fd = os.open(self._file(step, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name, off in self._plan[i]:
                _pwrite_all(fd, _bytes_view(self.state[name]), off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def save(self, step: int) -> Pending | None:
        d = self.step_path(step) or ""
        os.makedirs(d, exist_ok=True)
        list(self._pool.map(lambda i: self._write_one(step, i), range(len(self._plan))))
        _fsync_dir(d)
        return None

    def _read_one(self, step: int, i: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        fd = os.open(self._file(step, i), os.O_RDONLY)
        try:
            for name, off in self._plan[i]:
                src = self.state[name]
                dst = _fresh(src.shape, src.dtype)
                _pread_all(fd, _bytes_view(dst), off)
                out[name] = dst
        finally:
            os.close(fd)
        return out

    def restore(self, step: int) -> Mapping[str, Any]:
        out: dict[str, np.ndarray] = {}
        for part in self._pool.map(lambda i: self._read_one(step, i), range(len(self._plan))):
            out.update(part)
        return out

    def info(self) -> dict[str, Any]:
        return {"streams": len(self._plan)}

    def close(self) -> None:
        self._pool.shutdown()


@register
class RawDisk1(RawDisk):
    """One fsync'd stream: what a naive single-threaded writer gets."""

    name = "raw-disk-1"
    streams = 1
    max_world = 1
    sweep_max_tensors = 0
    in_default_run = False
    description = "1 file by 1 thread: pwrite + fsync; preadv into fresh buffers"


@register
class MemcpyFloor(Case):
    """Copying the state into freshly allocated memory: the least a staging copy costs.

    Its "save" is the copy (so its stall is the memcpy floor a torch save that
    must snapshot mutable tensors cannot beat); it has no restore.
    """

    name = "memcpy"
    kind = "floor"
    has_restore = False
    sweep_max_tensors = 0
    description = "copy of the state into fresh buffers (staging floor); no storage"
    durability = "n/a (memory only)"

    def save(self, step: int) -> Pending | None:
        fresh = {k: np.empty_like(v) for k, v in self.state.items()}
        for k, v in self.state.items():
            np.copyto(fresh[k], v)
        return None

    def info(self) -> dict[str, Any]:
        # The copy into already-touched memory (reused staging buffers) is timed here,
        # outside the harness's save timing, once the rounds are done.
        touched = {k: np.empty_like(v) for k, v in self.state.items()}
        for v in touched.values():
            v.reshape(-1).view(np.uint8)[:] = 0  # fault every page in first
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for k, v in self.state.items():
                np.copyto(touched[k], v)
            times.append(time.perf_counter() - t0)
        return {"touched_copy_s": times, "note": "save_s is the copy into fresh memory"}
