"""One host's request slots (:mod:`ckptio.backends.budget`), kept in a small block of doubles that
the host's processes can share.

A host is one share of the job's request rate, however many processes it sends from: the trainer
hands its block (an anonymous ``memfd``) to its sidecar writer (:mod:`ckptio.saving.writers.sidecar`), and both
reserve slots from the same state under one lock -- a ``threading.Lock`` within a process and a
POSIX record lock (``lockf``, held per process) on the memfd between them. So trainer and sidecar
together keep the host's share, rather than one share each.

A process drops every ``lockf`` it holds on a file when it closes *any* descriptor of that file.
So each memfd has one process-wide thread lock (:func:`_file_lock`), held by whoever holds the
``lockf`` and by whoever closes a descriptor of it (:meth:`SlotState.join`, :func:`discard`): a
descriptor is never closed while a thread of this process is inside :meth:`SlotState.locked`.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["SlotState", "Slots", "STARTED", "TAKEN", "discard"]

#: A throttled host's rate never drops below this fraction of its share.
_MIN_BOOST = 1 / 64
#: A held-back host's boost grows by this factor at most every half slot. Gently: every host of a
#: job that saves or restores at once is held back at once, so growth is mostly overshoot (doubling
#: measured 170-240 throttles per 64-host restore at the limit; 1.125: none).
_GROW = 1.125
#: ... and only once it has been held back this many of its slots in a row. A save's or a restore's
#: chain of dependent requests (each asked as the one before it returns: held back every time) is
#: every host's at once and about 4-8 slots long; growing during it is pure overshoot. A host held
#: back longer than any such chain has more to send than its share: peers idle, or a backlog.
_PATIENCE_SLOTS = 16

#: The state, in doubles: five per slot table (next, boost, changed, halved_at, held_since) -- reads, writes,
#: and the two solo tables of :meth:`RequestBudget.alone` --, then the ramp's start, then the
#: slots taken per class (reads, writes).
_PER_TABLE = 5
_TABLES = 4
STARTED = _TABLES * _PER_TABLE
TAKEN = STARTED + 1
_SIZE = 8 * (TAKEN + 2)


#: Per memfd (device, inode): the lock of this process's threads around its ``lockf`` and its closes.
_file_locks: dict[tuple[int, int], threading.Lock] = {}
_file_locks_lock = threading.Lock()


def _file_lock(fd: int) -> threading.Lock:
    """The process-wide thread lock of the file behind ``fd``."""
    st = os.fstat(fd)
    with _file_locks_lock:
        return _file_locks.setdefault((st.st_dev, st.st_ino), threading.Lock())


def discard(fd: int) -> None:
    """Close ``fd``, a descriptor of a shared state this process may hold the ``lockf`` of through
    another descriptor: only once no thread of this process is inside :meth:`SlotState.locked`."""
    with _file_lock(fd):
        os.close(fd)


class SlotState:
    """The doubles behind one host's slots: process-local until :meth:`share` puts them in a memfd
    another process can :meth:`join`. Read and write them only inside :meth:`locked`."""

    def __init__(self, started: float) -> None:
        self.view = memoryview(bytearray(_SIZE)).cast("d")
        for t in range(_TABLES):
            self.view[t * _PER_TABLE] = -math.inf  # next
            self.view[t * _PER_TABLE + 1] = 1.0  # boost
            self.view[t * _PER_TABLE + 2] = -math.inf  # changed
            self.view[t * _PER_TABLE + 3] = -math.inf  # halved_at
            self.view[t * _PER_TABLE + 4] = math.inf  # held_since (not held back yet)
        self.view[STARTED] = started
        self.fd: int | None = None
        self._flock: threading.Lock | None = None  # _file_lock(self.fd), looked up once per fd
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the state, against this process's threads and the processes sharing it."""
        with self._lock:
            fd, flock = self.fd, self._flock
            if fd is None or flock is None:
                yield
                return
            with flock:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN)

    def share(self) -> int:
        """The memfd holding this state (made on first call, the current values copied in); the
        caller may send it to another process (SCM_RIGHTS duplicates it) but must not close it."""
        with self._lock:
            if self.fd is None:
                fd = os.memfd_create("ckptio-request-budget", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, _SIZE)
                    mm = mmap.mmap(fd, _SIZE)
                except BaseException:
                    os.close(fd)  # ours alone yet: no lock of it can be held
                    raise
                view = memoryview(mm).cast("d")
                view[:] = self.view
                self.view, self.fd, self._flock = view, fd, _file_lock(fd)
                self._maps.append(mm)
            return self.fd

    def join(self, fd: int) -> None:
        """Use the state behind ``fd`` (another process's :meth:`share`) from now on; takes ``fd``.
        Joining the state already joined only closes ``fd``."""
        with self._lock:
            if self.fd is not None and _file_lock(self.fd) is _file_lock(fd):
                discard(fd)
                return
            try:
                if os.fstat(fd).st_size < _SIZE:
                    raise ValueError(f"a request budget's shared state must hold {_SIZE} bytes")
                mm = mmap.mmap(fd, _SIZE)
            except BaseException:
                discard(fd)  # taken: closed on every path
                raise
            self._maps.append(mm)
            old, self.view, self.fd, self._flock = self.fd, memoryview(mm).cast("d"), fd, _file_lock(fd)
            if old is not None:
                discard(old)


class _Field:
    """One number of a slot table, read from and written to the (maybe shared) state."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __get__(self, obj: Slots | None, owner: type | None = None) -> Any:
        if obj is None:  # looked up on the class (help(), introspection): the field itself
            return self
        return obj._state.view[obj._at + self.index]

    def __set__(self, obj: Slots, value: float) -> None:
        obj._state.view[obj._at + self.index] = value


class Slots:
    """One class's slots for one host: a grid of wall-clock times, the host's own phase on it,
    spaced by its share times ``boost`` (grown while the host waits for slots, cut by a throttle).
    The four numbers live in ``state`` at table ``table``."""

    def __init__(self, job_rate: float, rank: int, hosts: int, state: SlotState, table: int) -> None:
        self.job_rate, self.rank, self.hosts = job_rate, rank, hosts
        self._state, self._at = state, table * _PER_TABLE

    next = _Field(0)  # the earliest time the next slot may start
    boost = _Field(1)  # the multiple of its share this host sends at
    changed = _Field(2)  # when ``boost`` last grew or was cut
    halved_at = _Field(3)  # when the last burst of throttles came
    held_since = _Field(4)  # since when every reservation found the previous slot still ahead

    def take(self, now: float, share: float, recover_s: float, offset: float = 0.0) -> float:
        """Reserve the next slot at or after ``now``; returns when it starts.

        ``offset``: where this class's grid sits within a host's round (0 for reads, 1/2 for
        writes), so that a host alternating reads and writes waits half a round between them, not
        a whole one (the storage limits the two classes apart).

        A host whose previous slot is still ahead at every reservation for ``_PATIENCE_SLOTS`` of
        its slots has more to send than its rate allows: its boost then grows by an eighth at most
        every half slot, up to the job's whole rate (the phases in which one host alone works while
        the others wait use ``RequestBudget.alone`` instead). A shorter run of such reservations
        is a chain of dependent requests, every host's at once in a save or a restore: no growth. An
        idle host's boost halves each second down to its share, so that idle hosts do not all come
        back in a burst.
        """
        if now > self.next and self.boost != 1.0:  # idle: back towards its share (down each second, up each recover_s)
            idle = now - max(self.next, self.changed)
            self.boost = max(1.0, self.boost * 0.5 ** idle) if self.boost > 1 else min(1.0, self.boost * 2 ** (idle / recover_s))
            self.changed = now
        step = 1.0 / (share * self.boost)
        # Host r's slots sit r job-wide slots into each round, counted from the start of the round
        # (at the share without ramp or boost, the same number on every host) that ``now`` is in.
        # Counted from time 0 instead, a step that differs between hosts by a part in 10^9 (a ramp
        # begun a second apart) moved their grids by seconds, and the hosts' slots collided.
        base = self.hosts / self.job_rate
        anchor = math.floor(now / base) * base + (self.rank / self.hosts + offset) * step
        start = max(self.next, anchor + math.ceil((now - anchor) / step) * step)
        if self.next <= now:  # not held back: a run of held-back reservations ends
            self.held_since = math.inf
        else:
            self.held_since = min(self.held_since, now)
            if (now - self.held_since >= _PATIENCE_SLOTS * step and now - self.changed >= step / 2
                    and self.boost < self.hosts):  # held back longer than a chain: grow
                self.boost = min(float(self.hosts), self.boost * _GROW)
                self.changed = now
        self.next = start + 1.0 / (share * self.boost)
        return start

    def halve(self, now: float, share: float, recover_s: float) -> bool:
        """Slow down, once per burst of throttles (those in flight answer alike); True if it cut.

        A host above its share drops back to it: the job's rate is the one every host may keep
        at once, and which host's excess tripped the storage is unknowable. A host at or below its
        share halves if it was throttled before within ``4 * recover_s``: the storage allows less
        than the job's configured rate. A lone burst at its share is the job's requests bunching
        (a paused process, clocks apart): the throttled request's retry waits for the next slot."""
        if now - self.halved_at < max(0.5, 4.0 / (share * self.boost)):
            return False
        again = now - self.halved_at < 4 * recover_s
        self.halved_at = now
        if self.boost <= 1.0 and not again:
            return False
        self.boost = 1.0 if self.boost > 1.0 else max(_MIN_BOOST, self.boost / 2)
        self.changed = now
        self.held_since = math.inf  # growth waits for a whole run of held-back slots again
        self.next = max(self.next, now + 1.0 / (share * self.boost))
        return True
