"""Fresh host memory for restores, and faulting its pages in before the bytes arrive.

A cold restore writes every byte into memory that was never touched, and on
this VM first-touch page faults, not the disk, were its largest CPU cost
(issue 17; 1 GiB in 32 MiB buffers, kernel 6.18, system time per GiB):

=====================================  =========
first touch, shared anonymous mmap       0.80 s
first touch, private anonymous mmap      0.47 s
MADV_POPULATE_WRITE, private mmap        0.34 s
numpy's ``np.empty`` (THP, madvise)      0.44 s, and 2.3 s when the kernel had to compact
=====================================  =========

against ~0.42 s for the disk to deliver that GiB. So destinations come from
:func:`fresh_pages` (private, 4 KiB pages: no transparent-huge-page lottery;
``mmap.mmap(-1, n)``'s default is a *shared* mapping, i.e. shmem, the slowest
row), and the engine calls :func:`populate` on a worker thread for each piece
of a read while the piece before it is read, so the faults run while the disk
works instead of inside the copy that waits for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import sys
from collections.abc import Callable, Sequence

import numpy as np

from ckptio.system.bytes import flat_bytes

__all__ = [
    "FRESH_MIN", "HUGE_PAGE", "POPULATE_MIN", "ask_huge_pages", "collapse", "collapse_shared", "fresh_pages",
    "libc", "populate",
]

log = logging.getLogger(__name__)

#: Buffers at least this large get their own mapping; smaller ones come from numpy's
#: allocator (a mapping per small leaf would cost more in system calls than it saves).
FRESH_MIN = 1 << 16
#: Below this, populating costs a system call (and the engine a thread hop) for a handful of faults.
POPULATE_MIN = 1 << 20
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python's mmap module before 3.13
_MADV_COLLAPSE = 25  # Linux 6.1+
#: A transparent huge page (x86-64, arm64 with 4 KiB pages): what :func:`collapse` moves memory into.
HUGE_PAGE = 2 << 20
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MAP_FIXED, _PROT_NONE = 0x10, 0  # Linux; not in Python's mmap module


def fresh_pages(nbytes: int, *, huge: bool = False) -> np.ndarray:
    """An uninitialised, writable uint8 buffer of ``nbytes``; page-aligned private anonymous
    memory in 4 KiB pages when large (see the module docstring for why not ``np.empty``).

    ``huge``: ask for transparent huge pages before the first touch (:func:`ask_huge_pages`), for
    buffers kept and written from again and again, where the kernel's one-time cost of finding
    huge pages is repaid by every O_DIRECT write (see :func:`collapse`)."""
    if nbytes < FRESH_MIN:
        return np.empty(nbytes, np.uint8)
    if not _PRIVATE:  # no mmap flags on this platform: its default mapping, page-aligned all the same
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    mm = mmap.mmap(-1, nbytes, flags=_PRIVATE)
    if huge:
        ask_huge_pages(mm)
    return np.frombuffer(mm, dtype=np.uint8)


def ask_huge_pages(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages for a fresh mapping, before its first touch (MADV_HUGEPAGE).

    O_DIRECT from 4 KiB pages goes to the disk in requests of at most ``max_segments`` pages
    (~1 MiB here), from huge pages in requests of up to ``max_sectors_kb`` (4 MiB). What the
    kernel grants depends on the host's policy (``/sys/kernel/mm/transparent_hugepage/enabled``,
    and ``shmem_enabled`` for shared memory); a refusal (no THP, an old kernel) leaves the pages
    small: an optimisation only.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mm.madvise(advice)


def _load_libc() -> ctypes.CDLL | None:
    """The C library on Linux (madvise, mmap, munmap; process_vm_readv for ckptio.saving.writers.remoteread); None
    elsewhere or where it will not load."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def libc() -> ctypes.CDLL | None:
    """This process's C library (:func:`_load_libc`), loaded once; None where there is none."""
    return _libc


def _load_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise when the kernel has MADV_POPULATE_WRITE, else None (a no-op populate)."""
    fn = getattr(_libc, "madvise", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    probe = mmap.mmap(-1, _PAGE, flags=_PRIVATE) if _PRIVATE else None
    if probe is None:
        return None
    try:
        addr = np.frombuffer(probe, np.uint8).ctypes.data
        if fn(addr, _PAGE, _MADV_POPULATE_WRITE) != 0:
            log.debug("MADV_POPULATE_WRITE unavailable (errno %d): pages fault in on first touch",
                      ctypes.get_errno())
            return None
    finally:
        probe.close()
    return fn  # type: ignore[no-any-return]


_madvise = _load_madvise()


def _load_mmap() -> tuple[Callable[..., int | None], Callable[[int, int], int]] | None:
    """libc's mmap and munmap (Python's mmap cannot map at an address of our choosing)."""
    fn, un = getattr(_libc, "mmap", None), getattr(_libc, "munmap", None)
    if _madvise is None or fn is None or un is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fn.restype = ctypes.c_void_p
    un.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    un.restype = ctypes.c_int
    return fn, un


_sys_mmap = _load_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value


def populate(buffers: Sequence[memoryview]) -> None:
    """Fault in, writable, the whole pages of each large buffer, keeping their contents.

    An optimisation only: it never changes a byte (MADV_POPULATE_WRITE faults pages in
    "as if writing to each page" without writing), so it is safe on any caller memory, and
    any failure (an old kernel, a mapping that refuses it) leaves the pages to fault in on
    first touch as before. ctypes releases the GIL for the call.
    """
    if _madvise is None:
        return
    for b in buffers:
        n = b.nbytes
        if n < POPULATE_MIN or b.readonly or not b.c_contiguous:
            continue
        start = np.frombuffer(flat_bytes(b), np.uint8).ctypes.data
        # Whole pages inside the buffer only: a neighbour page may be a guard page or read-only.
        lo = -(-start // _PAGE) * _PAGE
        hi = (start + n) // _PAGE * _PAGE
        if hi > lo:
            _madvise(lo, hi - lo, _MADV_POPULATE_WRITE)


def collapse(buffers: Sequence[np.ndarray]) -> int:
    """Move the whole huge pages inside each buffer into transparent huge pages (MADV_COLLAPSE),
    keeping their contents; returns the bytes now in huge pages.

    For buffers that are filled and written again and again (a save's staging pool): an
    O_DIRECT write from 4 KiB pages pins every page and goes to the disk in requests of at
    most ``max_segments`` pages (254 here: ~1 MiB), from 2 MiB pages in requests of up to
    ``max_sectors_kb`` (4 MiB). Measured here, 256 MiB written by 4 threads with O_DIRECT +
    fsync, buffers alternated in one sitting: 0.99-1.59 s and 0.022-0.026 s of CPU from
    4 KiB pages, 0.65-0.85 s and 0.004-0.006 s from huge pages; copying into them costs
    ~10 % less. Collapsing costs about what faulting the memory in once did (256 MiB:
    ~0.4 s of CPU, ~1.1 s at load 18), so it is for memory that lives across many writes,
    off the path anyone waits on. Like :func:`populate`, an optimisation only: the kernel
    keeps every byte (concurrent writers wait for it), and a refusal (an old kernel, THP
    off for this mapping, no huge page to be had) leaves the pages as they were. Only
    private anonymous memory is asked for (``fresh_pages``' own); ctypes releases the GIL.
    """
    if _madvise is None:
        return 0
    done = 0
    for b in buffers:
        if b.nbytes < HUGE_PAGE or not b.flags.c_contiguous or not b.flags.writeable:
            continue
        start = b.ctypes.data
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = (start + b.nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo and _madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def collapse_shared(fd: int, offset: int, nbytes: int) -> int:
    """As :func:`collapse`, for ``nbytes`` at ``offset`` of a shared-memory file (a memfd slab):
    its whole huge pages move into transparent huge pages, contents kept; the bytes moved.

    MADV_COLLAPSE moves shared memory whatever the host's shmem THP policy says (``never``
    on this VM; only ``deny`` refuses), but only through a mapping that puts the file's 2 MiB
    boundaries on 2 MiB addresses, and a slab's own mapping lies wherever mmap put it. So the
    range is collapsed through a mapping of our own, at an aligned address, unmapped after:
    the huge pages belong to the file, and every mapping of it (the trainer's, the writer
    process's) then reads the same bytes from physically contiguous memory, which O_DIRECT
    sends in 4 MiB requests. Measured here: a 256 MiB JAX save through the writer process,
    alternated with the raw O_DIRECT write in one process, went from 0.84 / 0.74x the raw write
    (slabs in 4 KiB pages) to 0.90 / 0.90x (slabs in huge pages). An optimisation only, like :func:`collapse`: a page still being written from
    (pinned) or any refusal leaves the range as it was.
    """
    lo = -(-offset // HUGE_PAGE) * HUGE_PAGE
    hi = (offset + nbytes) // HUGE_PAGE * HUGE_PAGE
    if _madvise is None or _sys_mmap is None or hi <= lo:
        return 0
    sys_mmap, munmap = _sys_mmap
    span = hi - lo + HUGE_PAGE  # room to slide the mapping onto a 2 MiB boundary
    base = sys_mmap(None, span, _PROT_NONE, _PRIVATE | getattr(mmap, "MAP_NORESERVE", 0), -1, 0)
    if base is None or base == _MAP_FAILED:
        return 0
    try:
        at = -(-base // HUGE_PAGE) * HUGE_PAGE
        fixed = sys_mmap(at, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, lo)
        if fixed != at:
            return 0
        return hi - lo if _madvise(at, hi - lo, _MADV_COLLAPSE) == 0 else 0
    finally:
        munmap(base, span)  # the reservation and the file's mapping inside it
