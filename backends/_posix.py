"""POSIX file machinery shared by the local, Hyperdisk ML and Parallelstore backends.

Bulk IO is ``os.pwritev`` / ``os.preadv`` on memoryviews from worker threads:
both release the GIL for the whole system call and copy nothing in Python.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ckptio.backends.base import RetryableError
from ckptio.system.bytes import byte_views

__all__ = [
    "TMP_MARK", "aligned_buffer", "fsync_dir", "iov_batches", "preadv_all", "pwritev_all", "translate_os_errors",
    "unlink_quietly",
]

#: Temporary files carry this in their name; listings skip them.
TMP_MARK = ".ckptio-tmp-"

# Linux caps one vectored call at IOV_MAX iovecs and ~2 GiB of bytes.
_IOV_MAX = min(getattr(os, "IOV_MAX", 1024), 1024)
_MAX_CALL_BYTES = 0x7FFFF000

_RETRYABLE_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT}


@contextmanager
def translate_os_errors(what: str) -> Iterator[None]:
    """Translate OSErrors raised inside into the backend contract's error classes, naming ``what``."""
    try:
        yield
    except OSError as e:
        if e.errno is None:  # already one of ours, with its own message
            raise
        if e.errno == errno.EROFS:
            raise PermissionError(f"{what}: the file system is mounted read-only") from e
        if e.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(f"{what}: {e.strerror}") from e
        # ENOTDIR: a component of the path is a file, e.g. reading "a/b" when "a" is an
        # object. In the object-store view the backends offer, that object is simply absent.
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(f"{what}: no such file") from e
        if e.errno == errno.EEXIST:
            raise FileExistsError(f"{what}: exists") from e
        if e.errno in _RETRYABLE_ERRNOS:
            raise RetryableError(f"{what}: {e.strerror}") from e
        raise OSError(e.errno, f"{what}: {e.strerror}") from e


def iov_batches(views: list[memoryview]) -> Iterator[list[memoryview]]:
    """Split views into batches that one vectored system call accepts."""
    batch: list[memoryview] = []
    size = 0
    for v in views:
        while v.nbytes > _MAX_CALL_BYTES:
            if batch:
                yield batch
                batch, size = [], 0
            yield [v[:_MAX_CALL_BYTES]]
            v = v[_MAX_CALL_BYTES:]
        if batch and (len(batch) == _IOV_MAX or size + v.nbytes > _MAX_CALL_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(v)
        size += v.nbytes
    if batch:
        yield batch


def pwritev_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Write every buffer at ``offset`` onward, looping over short writes. Returns bytes written."""
    total = 0
    for batch in iov_batches(byte_views(buffers)):
        while batch:
            n = os.pwritev(fd, batch, offset + total)
            total += n
            # Drop fully written views, trim the partially written one.
            while batch and n >= batch[0].nbytes:
                n -= batch[0].nbytes
                batch.pop(0)
            if batch and n:
                batch[0] = batch[0][n:]
    return total


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Fill every buffer from ``offset`` onward; raises EOFError on a short file."""
    total = 0
    for batch in iov_batches(byte_views(buffers)):
        while batch:
            n = os.preadv(fd, batch, offset + total)
            if n == 0:
                raise EOFError(f"end of file at offset {offset + total}")
            total += n
            while batch and n >= batch[0].nbytes:
                n -= batch[0].nbytes
                batch.pop(0)
            if batch and n:
                batch[0] = batch[0][n:]
    return total


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned, writable byte buffer (anonymous mmap), suitable for O_DIRECT."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


def fsync_dir(directory: str) -> None:
    """Make ``directory``'s entries durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
