"""Byte compares of many buffer pairs at once: the frozen base's check on the caller's thread.

An incremental save proves a private copy unchanged by comparing the caller's bytes with its
shadow (:mod:`.shadow`): ``memcmp``, memory-bound, ~8 GB per CPU-second here. The training step
waits for it, so the pairs are cut into chunks and compared on a few threads at once (``memcmp``
through ctypes releases the GIL); a pair stops being compared at its first differing chunk.
Equal means every byte was compared and found equal: no sample, no hash, no crc decides.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Hashable, Mapping

import numpy as np

__all__ = ["equal_pairs", "same_bytes"]

#: Compared per call: a changed shard usually differs early, and each call releases the GIL.
_CHUNK = 16 << 20
#: Below this many bytes in all, one thread compares (a pool's hand-offs would cost more).
_PARALLEL_MIN = 64 << 20
#: The threads that compare (the caller's thread waits): more than a few only fight for memory bandwidth.
_THREADS = max(1, min(4, os.cpu_count() or 1))

try:
    _libc = ctypes.CDLL(None)
    _memcmp = _libc.memcmp
    _memcmp.restype = ctypes.c_int
    _memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
except (OSError, AttributeError):  # no C library to call: numpy compares (slower, same answer)
    _memcmp = None

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's compare threads do not exist there (their pool would never run)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _chunk_equal(x: np.ndarray, y: np.ndarray, start: int, end: int) -> bool:
    if _memcmp is not None:
        return _memcmp(x.ctypes.data + start, y.ctypes.data + start, end - start) == 0
    return bool(np.array_equal(x[start:end], y[start:end]))


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes in C order (their dtypes are not compared), on this thread."""
    if a.nbytes != b.nbytes:
        return False
    x, y = _bytes_of(a), _bytes_of(b)
    return all(_chunk_equal(x, y, s, min(s + _CHUNK, x.nbytes)) for s in range(0, x.nbytes, _CHUNK))


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="ckptio-compare")
        return _pool


def equal_pairs(pairs: Mapping[Hashable, tuple[np.ndarray, np.ndarray]]) -> set[Hashable]:
    """The keys of ``pairs`` whose two arrays hold the same bytes in C order (:func:`same_bytes`
    of each), compared in chunks on :data:`_THREADS` threads when there are enough bytes."""
    views = {k: (_bytes_of(a), _bytes_of(b)) for k, (a, b) in pairs.items() if a.nbytes == b.nbytes}
    total = sum(x.nbytes for x, _ in views.values())
    if _THREADS == 1 or total < _PARALLEL_MIN:
        return {k for k, (x, y) in views.items() if same_bytes(x, y)}
    differs: set[Hashable] = set()  # a pair's other chunks are skipped once one differs (set.add: atomic)

    def compare(key: Hashable, start: int) -> None:
        if key in differs:
            return
        x, y = views[key]
        if not _chunk_equal(x, y, start, min(start + _CHUNK, x.nbytes)):
            differs.add(key)

    jobs = [(k, s) for k, (x, _) in views.items() for s in range(0, x.nbytes, _CHUNK)]
    futures = [_executor().submit(compare, k, s) for k, s in jobs]
    for f in futures:
        f.result()  # every chunk compared (or skipped for a pair already found different)
    return set(views) - differs
