"""The writer process reads a save's unstaged arrays straight out of the trainer's memory.

JAX arrays (immutable) and ``copy=False`` saves are staged without a copy, so their bytes are
in the trainer's private memory, which the writer process (:mod:`ckptio.saving.writers.sidecar`) cannot map.
Without this module the trainer's background thread copies them into shared memory, object by
object within a two-object budget: a copy, and its GIL round trips, beside the training step.
Here the writer process reads them itself with ``process_vm_readv(2)`` (one system call per
chunk into its own memory, no trainer thread involved) and checksums each chunk as it arrives,
while it is still in cache (:func:`ckptio.system.checksum.fill_summed`).

What it costs and buys (issue 35, this 2-core VM): the kernel copies page by page, pinning each
4 KiB page of the trainer's -- ~0.2 s of system time per GiB in the writer process, against ~0.07
for the trainer's own copy -- so a JAX save costs 10-25 % more CPU in all; but the training
process's share, the part a step competes with, fell from 38-42 to 11-13 ms per 256 MiB save, and
under ``ckptio bench --train --pin`` a 1 GiB JAX save cost the step 8-10 ms against 20-22.

Contracts:

- **Only where the kernel allows it**, which the child learns once, at its start
  (:func:`readable`): it reads a token of random bytes the trainer keeps (:func:`token`) and
  compares -- only once the trainer has named it as the one process that may read it
  (:func:`allow_reads`: ``PR_SET_PTRACER``, which Yama's ``ptrace_scope`` 1 needs to let a child
  read its parent). Yama's scope 2 (``CAP_SYS_PTRACE`` only) or 3, a seccomp filter or a kernel
  without the call each make it fail; the trainer then copies, as before.
- **The trainer keeps the bytes alive and unchanged until the object is written**: its save
  holds the plans (whose extents reference the arrays) until the child's final reply, on
  failure and abort too (:meth:`ckptio.saving.writers.sidecar.Sidecar.write`); these are the same arrays an
  in-process save writes from directly.
- **The write follows the reads**: an object's write starts with its first piece and sends each
  request once the pieces under it are in (:meth:`RemoteObject.wait`, the object being its write's
  :class:`~ckptio.backends.base.Filling`); its checksums once all are. A read that fails fails the
  write at its next request, which leaves no object. (Before, each object was read whole before its
  write began: with two objects in flight the disk idled while the next two were read, ~15 ms of a
  256 MiB save's ~180 here.)
- **Bounded memory**: the child reads into buffers of its own pool, at most
  :data:`REMOTE_OBJECTS` objects' worth in flight (:class:`RemoteReads`), which is also what
  it keeps between saves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import secrets
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ckptio.engine import ByteBudget
from ckptio.engine.layout import PlannedExtent
from ckptio.errors import SaveFailedError
from ckptio.system import HUGE_PAGE, address, fresh_pages, libc
from ckptio.system.bufferpool import StagingPool
from ckptio.system.checksum import fill_summed
from ckptio.system.threadwait import threads_done

__all__ = ["ENV", "REMOTE_OBJECTS", "RemoteObject", "RemoteReads", "allow_reads", "readable", "remote_wanted",
           "token", "vm_read"]

#: ``CKPTIO_REMOTE_READS=0``: the trainer copies into shared memory even where the writer
#: process could read its memory (the behaviour before; for comparison, or a host that forbids it).
ENV = "CKPTIO_REMOTE_READS"

#: Objects whose bytes the child holds at once (read, being written); also what its pool keeps.
REMOTE_OBJECTS = 2

#: Bytes a thread reads at a time (whole checksum blocks): the unit threads share an object in.
_PIECE = 8 << 20
_TOKEN_BYTES = 32
#: Yama's prctl(2) option ("Yama"): name the one process (with its descendants) that may trace this one.
_PR_SET_PTRACER = 0x59616D61

T = TypeVar("T")


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Any:
    fn = getattr(libc(), "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    iov = ctypes.POINTER(_IoVec)
    fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _load()


def vm_read(pid: int, dst: memoryview, remote: int) -> None:
    """Fill ``dst`` with the bytes at address ``remote`` of process ``pid`` (ctypes drops the GIL
    for the call). OSError (EPERM, ESRCH, EFAULT, ...) if the kernel refuses or the range is gone."""
    if _READV is None:
        raise OSError(38, "process_vm_readv is not available here")  # ENOSYS
    done, n = 0, dst.nbytes
    base = address(dst)
    while done < n:
        local = _IoVec(base + done, n - done)
        far = _IoVec(remote + done, n - done)
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else 5  # EIO: nothing read, no error given
            where = f"reading {n} bytes of process {pid} at {remote + done:#x}"
            raise OSError(err, f"{where}: {os.strerror(err)}")
        done += got


def remote_wanted() -> bool:
    """Whether this process lets its writer process read its memory (:data:`ENV`), where it can."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def allow_reads(pid: int, lib: Any = None) -> bool:
    """The trainer's side, before the child probes: let process ``pid`` (its writer process) read
    this process's memory where Yama's ``ptrace_scope`` is 1 -- Ubuntu's default, under which a
    process may otherwise read only its own descendants, never its parent.

    True if the kernel took it; False where there is nothing to allow (no Yama: EINVAL) or it
    refused; never raises. The permission ends when ``pid`` exits. Yama keeps one such process per
    traced process: this replaces one named before (a crash handler's, say), which
    ``CKPTIO_REMOTE_READS=0`` (:data:`ENV`) avoids. Scope 2 (``CAP_SYS_PTRACE`` only) or 3 and a
    seccomp filter still refuse the reads: the probe then fails and the trainer copies. ``lib``: the
    C library to call (tests), else this process's.
    """
    lib = lib if lib is not None else libc()
    prctl = getattr(lib, "prctl", None)
    if prctl is None:
        return False
    try:
        return prctl(ctypes.c_int(_PR_SET_PTRACER), ctypes.c_ulong(pid), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)) == 0
    except (OSError, ctypes.ArgumentError):
        return False


_token: np.ndarray | None = None


def token() -> tuple[int, bytes]:
    """The trainer's side of the probe: the address and value of bytes this process keeps."""
    global _token
    if _token is None:
        _token = np.frombuffer(secrets.token_bytes(_TOKEN_BYTES), np.uint8).copy()
    return int(_token.ctypes.data), _token.tobytes()


def readable(pid: int, at: int, expected: bytes) -> bool:
    """The child's side of the probe: whether it can read ``expected`` at ``at`` in ``pid``."""
    got = bytearray(len(expected))
    try:
        vm_read(pid, memoryview(got), at)
    except OSError:
        return False
    return bytes(got) == expected


class _HugePool(StagingPool):
    """Buffers in transparent huge pages from the first touch: O_DIRECT writes from 4 KiB pages
    cost ~1.2x in time here (ckptio.system.pages.collapse)."""

    def _allocate(self, nbytes: int) -> np.ndarray:
        return fresh_pages(nbytes, huge=True)


class RemoteObject:
    """One object's extents whose bytes are in the trainer: read into one buffer of the pool.

    The reads are cut into pieces of whole checksum blocks (at most :data:`_PIECE` bytes) that
    several threads take in order, so that one object is read by all of them before the next and
    an object of one large array is read in parallel too. It is its write's
    :class:`~ckptio.backends.base.Filling`: the write follows the pieces as they arrive.
    """

    def __init__(self, pid: int, parts: Sequence[tuple[PlannedExtent, int]], block_size: int) -> None:
        self.pid = pid
        self.parts = sorted(parts, key=lambda p: p[0].offset)  # (extent, its address in the trainer)
        # Each extent at its offset in the object, as in the file: in step with it for O_DIRECT
        # (an extent at an aligned offset starts on an aligned address, and is written unbounced).
        self.nbytes = max((e.offset + e.length for e, _a in self.parts), default=0)
        self.buffer: np.ndarray | None = None
        self._pieces: list[tuple[int, int, int, int]] = []  # (part, start, end, block) in object order
        for k, (e, _a) in enumerate(self.parts):
            block = e.block or block_size
            step = block * max(1, _PIECE // block)
            self._pieces += [(k, lo, min(e.length, lo + step), block) for lo in range(0, e.length, step)]
        self._sums: list[list[int] | None] = [None] * len(self._pieces)
        self._next = 0
        self._lock = threading.Lock()
        # What the write may read: every byte below the first piece not read yet (padding between
        # extents is the plan's, not ours).
        self._arrived = threading.Condition(self._lock)
        self._read = [False] * len(self._pieces)
        self._front = 0  # the first piece not read yet
        self._stop: BaseException | None = None  # a piece failed, or the object was abandoned
        self.settled: asyncio.Future[None] | None = None  # every piece read and summed (RemoteReads.run)

    def read(self) -> None:
        """Read pieces until none is left (one of several threads; the buffer is already taken)."""
        assert self.buffer is not None
        view = memoryview(self.buffer)
        while True:
            with self._lock:
                i, self._next = self._next, self._next + 1
            if i >= len(self._pieces):
                return
            try:
                self._read_piece(view, i)
            except BaseException as e:
                self._halt(e)  # the other threads stop too: the object fails as a whole
                raise
            with self._arrived:
                self._read[i] = True
                while self._front < len(self._read) and self._read[self._front]:
                    self._front += 1
                self._arrived.notify_all()

    def _halt(self, why: BaseException) -> None:
        with self._arrived:
            self._next = len(self._pieces)
            if self._stop is None:
                self._stop = why
            self._arrived.notify_all()

    def abandon(self) -> None:
        """Stop the readers and fail the write's waits (its write ended, or was given up)."""
        self._halt(SaveFailedError(f"the write of {self.nbytes} bytes from process {self.pid} was given up"))

    def wait(self, end: int) -> None:
        """:meth:`Filling.wait <ckptio.backends.base.Filling.wait>`: until bytes ``[0, end)`` are read."""
        with self._arrived:
            while self._stop is None and self._front < len(self._pieces) and self._start(self._front) < end:
                self._arrived.wait()
            if self._stop is not None:
                why = self._stop
                raise SaveFailedError(f"reading the object's bytes from process {self.pid} failed: {why}")

    async def complete(self) -> None:
        """:meth:`Filling.complete <ckptio.backends.base.Filling.complete>`: every piece read and summed."""
        assert self.settled is not None
        await asyncio.shield(self.settled)

    def _start(self, i: int) -> int:
        k, lo, _hi, _b = self._pieces[i]
        return self.parts[k][0].offset + lo

    def _read_piece(self, view: memoryview, i: int) -> None:
        k, lo, hi, block = self._pieces[i]
        e, at = self.parts[k]
        dst = view[e.offset + lo : e.offset + hi]
        if e.cuts is None:
            # One process_vm_readv per checksum.FUSED_CHUNK: each chunk checksummed from cache.
            self._sums[i] = fill_summed(dst, lambda part, off: vm_read(self.pid, part, at + lo + off), block)
        else:  # a pack's members have checksums of their own: the engine computes them
            vm_read(self.pid, dst, at + lo)

    def expose(self) -> None:
        """Each extent's view of the buffer, for the write that follows the reads."""
        assert self.buffer is not None
        view = memoryview(self.buffer)
        for e, _a in self.parts:
            e.data = view[e.offset : e.offset + e.length]

    def finish(self) -> None:
        """Once every :meth:`read` returned: each extent without cuts gets its block checksums (its
        pieces' in order). Its bytes are its view from :meth:`expose`."""
        sums: list[list[int]] = [[] for _ in self.parts]
        for (k, _lo, _hi, _b), got in zip(self._pieces, self._sums):
            if got is not None:
                sums[k] += got
        for k, (e, _a) in enumerate(self.parts):
            if e.cuts is None:
                e.sums = sums[k]


class RemoteReads:
    """The child's reads of the trainer's memory: a pool of buffers and a byte budget over it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pool = _HugePool(max_bytes=0)
        self._budgets: dict[asyncio.AbstractEventLoop, ByteBudget] = {}
        self._limit = 0

    def limit(self, object_size: int) -> None:
        """Hold at most :data:`REMOTE_OBJECTS` objects of ``object_size`` (the largest asked so far)."""
        want = REMOTE_OBJECTS * object_size
        if want > self._limit:
            self._limit = want
            self._pool = _HugePool(max_bytes=want)
            self._budgets.clear()

    async def run(self, obj: RemoteObject, pool: Any, threads: int,
                  then: Callable[[RemoteObject], Awaitable[T]]) -> T:
        """Read ``obj`` on ``threads`` threads of ``pool`` (an executor) while ``then(obj)`` writes it
        (``obj`` is the write's :class:`~ckptio.backends.base.Filling`: it follows the pieces as they
        arrive), holding its buffer; give the buffer back once neither the reading threads nor the
        write use it."""
        loop = asyncio.get_running_loop()
        budget = self._budgets.get(loop)
        if budget is None:
            budget = self._budgets[loop] = ByteBudget(max(1, self._limit))
        held = await budget.acquire(obj.nbytes)
        readers: list[concurrent.futures.Future[None]] = []
        try:
            obj.buffer = self._pool.take(-(-obj.nbytes // HUGE_PAGE) * HUGE_PAGE)  # whole pages: more reuse
            obj.expose()
            readers = [pool.submit(obj.read) for _ in range(max(1, threads))]
            obj.settled = asyncio.ensure_future(_settle(obj, readers))
            return await then(obj)
        finally:
            obj.abandon()  # a write that ended early leaves no reader or waiting thread behind
            try:
                await threads_done(readers)  # through cancellations: they fill the buffer given back below
            finally:
                _forget(obj.settled)
                if obj.buffer is not None:
                    for e, _a in obj.parts:
                        e.data = None
                    self._pool.give_back([obj.buffer])
                    obj.buffer = None
                await budget.release(held)


def _forget(settled: asyncio.Future[None] | None) -> None:
    """The settling of an object whose write is over: its error was the write's (raised through
    :meth:`RemoteObject.complete`), or nobody waits for it any more."""
    if settled is None:
        return
    if not settled.done():
        settled.cancel()
    elif not settled.cancelled():
        settled.exception()


async def _settle(obj: RemoteObject, readers: Sequence[concurrent.futures.Future[None]]) -> None:
    """Once every reader returned: the first read's error, else the object's block sums."""
    await threads_done(readers)
    for r in readers:
        r.result()  # a failed read fails the object
    obj.finish()
