"""A job's request budget on one storage, shared by its hosts without a central server.

Object stores limit request rates per bucket and key range, and answer a burst
beyond it with 429/503 ("slow down"): at restart every host lists and reads at
once, at save every host writes at once. GCS's guidance is to start at about
1000 writes/s and 5000 reads/s per bucket and to double at most every 20
minutes. :class:`RequestRate` says what the *job* may send; each host derives
its own share from its rank and the job's size alone -- no message is sent:

* host ``r`` of ``n`` gets ``1/n`` of the job's rate, in slots on a grid of
  wall-clock time offset by ``r/rate``: the job's hosts interleave their
  requests evenly instead of all firing at the top of each second (their
  clocks need agree only to well under a slot, as NTP does). The write grid
  sits half a slot after the read grid, so a host alternating the two waits
  half a round between them, not a whole one;
* the rate starts at the configured (conservative) value and doubles every
  ``ramp_period_s`` (in eighths of a doubling) up to ``ramp_limit`` times it;
* a host held back by its share grows its rate gently (an eighth at most every
  half slot); a :class:`~ckptio.backends.base.ThrottledError` sends a host
  above its share back to it, and halves one at or below it that was
  throttled before within ``4 * recover_s`` (once per burst of throttles),
  which doubles back every ``recover_s`` without one: a job that guessed its
  rate too high settles under what the storage allows, and a one-off burst
  (requests bunched by a paused process) costs no host its share;
* where every other host waits on one in a collective (the coordinator's
  commit, host 0's choice of the step to restore) that host sends at the
  job's whole rate (:func:`alone`), so the job's rate is not left unused;
* every HTTP request counts: a backend that sends several per call (the GCS
  backend: a listing's pages, an upload's chunks) takes a slot for each after
  the first through :func:`each_request`;
* one host is one share however many processes it sends from: its sidecar
  writer joins the trainer's budget (:meth:`RequestBudget.share_fd`, state in
  a memfd under a lock both take; :mod:`ckptio.backends._budget_slots`).

A throttled call's retry waits for its slot in the budget, plus a short jitter
only (``ThrottledError.paced``), not an exponential backoff on top.

:class:`BudgetedBackend` is the wrapper that makes every call of a backend wait
for a slot of its class ("read": reads, stats, listings; "write": writes,
creates, deletes). The engine wraps its backend in one when
``EngineConfig.request_rate`` is set, so saves, restores, listings, gc and
retention all draw from one budget per host and storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from ckptio.backends._budget_slots import STARTED, TAKEN, Slots, SlotState
from ckptio.backends._budget_slots import discard as discard_shared_state
from ckptio.backends.base import Backend, ByteRange, Filling, ObjectInfo, ThrottledError
from ckptio.backends.wrappers import WrapperBackend

__all__ = [
    "BudgetedBackend", "RequestBudget", "RequestRate", "alone", "budget_of", "budgeted", "discard_shared_state",
    "each_request",
]

T = TypeVar("T")

#: Each call's class: its own slots, its own rate.
READ, WRITE = "read", "write"
#: A wait that ends this many of the job's slots after its own takes a fresh slot (see ``wait``).
_LATE_SLOTS = 4
#: The ramp goes up in steps of this fraction of a doubling.
_RAMP_STEPS = 8


@dataclasses.dataclass(frozen=True)
class RequestRate:
    """How many requests per second a whole job may send to one storage (picklable).

    ``reads_per_s`` / ``writes_per_s``: the job's starting rates (reads, stats and listings;
    writes, creates and deletes), defaults from GCS's per-bucket guidance. ``ramp_period_s``:
    the rate doubles this often, up to ``ramp_limit`` times the start. ``recover_s``: after a
    throttle halved a host's rate, it doubles back this often. ``hosts`` / ``rank``: the job's
    size and this host's place in it; None: the save's or restore's coordinator says (through
    :meth:`for_host`), else ``WORLD_SIZE`` / ``RANK`` in the environment, else one host.
    """

    reads_per_s: float = 5000.0
    writes_per_s: float = 1000.0
    ramp_period_s: float = 1200.0
    ramp_limit: float = 8.0
    recover_s: float = 2.0
    hosts: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("reads_per_s", "writes_per_s", "ramp_period_s", "recover_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"RequestRate.{name} must be a finite number > 0, got {value!r}")
        if not self.ramp_limit >= 1:
            raise ValueError(f"RequestRate.ramp_limit must be >= 1, got {self.ramp_limit!r}")
        if self.hosts is not None and self.hosts < 1:
            raise ValueError(f"RequestRate.hosts must be >= 1, got {self.hosts!r}")
        if self.rank is not None and not 0 <= self.rank < (self.hosts or 1 << 62):
            raise ValueError(f"RequestRate.rank must be in [0, hosts), got {self.rank!r} of {self.hosts!r}")

    def for_host(self, rank: int, hosts: int) -> RequestRate:
        """This rate for host ``rank`` of ``hosts``, unless it names its host already."""
        if self.hosts is not None:
            return self
        return dataclasses.replace(self, hosts=hosts, rank=rank)

    def resolved(self) -> tuple[int, int]:
        """``(rank, hosts)``: as given, else from ``RANK`` / ``WORLD_SIZE``, else ``(0, 1)``."""
        if self.hosts is not None:
            return self.rank or 0, self.hosts
        hosts = int(os.environ.get("WORLD_SIZE", "1") or 1)
        rank = int(os.environ.get("RANK", "0") or 0)
        return (rank, hosts) if 0 <= rank < hosts else (0, 1)


class RequestBudget:
    """One host's share of a job's :class:`RequestRate` on one storage; thread-safe.

    ``clock``: wall-clock seconds (shared by the job's hosts: their slots interleave on it).
    """

    def __init__(self, rate: RequestRate, *, clock: Callable[[], float] = time.time) -> None:
        self.rate = rate
        self.rank, self.hosts = rate.resolved()
        self._clock = clock
        self._state = SlotState(clock())
        st = self._state
        self._slots = {READ: Slots(rate.reads_per_s, self.rank, self.hosts, st, 0),
                       WRITE: Slots(rate.writes_per_s, self.rank, self.hosts, st, 1)}
        #: While every other host waits on this one (:meth:`alone`): the job's whole rate, alone.
        self._solo = {READ: Slots(rate.reads_per_s, 0, 1, st, 2), WRITE: Slots(rate.writes_per_s, 0, 1, st, 3)}
        self._alone = 0
        #: Throttles seen, and how many of them lowered the rate (this process's).
        self.throttles = 0
        self.slowdowns = 0
        #: Slots this process took, per class (:meth:`taken`: the host's, every process sharing it).
        self.taken_here = {READ: 0, WRITE: 0}

    def share_fd(self) -> int:
        """A memfd holding this budget's state, for another process of this host (its sidecar
        writer) to :meth:`join`: both then draw from one share. Owned by the budget: do not close."""
        return self._state.share()

    def join(self, fd: int) -> None:
        """Draw from the state another process of this host shares through ``fd`` (its
        :meth:`share_fd`) from now on, instead of a share of this process's own; takes ``fd``."""
        self._state.join(fd)

    def taken(self, kind: str) -> int:
        """Slots of ``kind`` this host took, in every process that shares its state."""
        with self._state.locked():
            return int(self._state.view[TAKEN + (kind == WRITE)])

    def share(self, kind: str, now: float | None = None) -> float:
        """This host's share of the job's ``kind`` rate at ``now``: ``1/hosts`` of it, ramped."""
        r = self.rate
        now = self._clock() if now is None else now
        started = self._state.view[STARTED]
        # In eighths of a doubling, not smoothly: hosts whose budgets began seconds apart then have the
        # same share (and interleave) but in the seconds after each step, not a share a part in 10^3 apart.
        doublings = math.floor(max(0.0, (now - started) / r.ramp_period_s) * _RAMP_STEPS) / _RAMP_STEPS
        ramp = min(r.ramp_limit, 2.0 ** doublings)
        return self._slots[kind].job_rate * ramp / self.hosts

    def host_rate(self, kind: str) -> float:
        """This host's current requests per second of ``kind``: its share times its boost."""
        with self._state.locked():
            return self.share(kind) * self._slots[kind].boost

    def reserve(self, kind: str, *, again: bool = False) -> float:
        """Reserve a slot of ``kind`` ("read" or "write"); returns the seconds to wait for it.
        ``again``: for a request that missed its slot (not counted twice)."""
        with self._state.locked():
            now = self._clock()
            if not again:
                self.taken_here[kind] += 1
                self._state.view[TAKEN + (kind == WRITE)] += 1
            if self._alone:  # the others wait on this host: the job's rate is all its own
                start = self._solo[kind].take(now, self.share(kind, now) * self.hosts, self.rate.recover_s)
                self._slots[kind].next = max(self._slots[kind].next, start)
                return max(0.0, start - now)
            offset = 0.5 if kind == WRITE else 0.0
            return max(0.0, self._slots[kind].take(now, self.share(kind, now), self.rate.recover_s, offset) - now)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """While in it, this host sends at the job's whole rate: for a phase in which every other
        host of the job waits on this one in a collective (the coordinator's commit of a save, host
        0's choice of the step to restore), so their shares would otherwise go unused."""
        with self._state.locked():
            self._alone += 1
        try:
            yield
        finally:
            with self._state.locked():
                self._alone -= 1

    def throttled(self, kind: str) -> None:
        """The storage said "slow down" to a ``kind`` request: cut this host's rate of it."""
        with self._state.locked():
            now = self._clock()
            self.throttles += 1
            slots = self._solo[kind] if self._alone else self._slots[kind]
            self.slowdowns += slots.halve(now, self.share(kind, now) * (self.hosts if self._alone else 1), self.rate.recover_s)

    async def wait(self, kind: str) -> None:
        """Wait for a slot of ``kind``.

        A wait that ends well after its slot (this process was paused: a loaded machine, a long
        garbage collection) would send together with every other request whose slot passed
        meanwhile -- a burst the storage refuses. Such a request takes a fresh slot, once.
        """
        delay = self.reserve(kind)
        if delay <= 0:
            return
        due = self._clock() + delay
        await asyncio.sleep(delay)
        if self._clock() - due > _LATE_SLOTS / (self.share(kind) * self.hosts):
            delay = self.reserve(kind, again=True)
            if delay > 0:
                await asyncio.sleep(delay)


class _Meter:
    """The budget one wrapped call runs under, and the slot it already took for its first request."""

    def __init__(self, budget: RequestBudget) -> None:
        self.budget, self.paid = budget, True

    async def request(self, kind: str) -> None:
        if self.paid:  # the wrapper's slot is the first request's
            self.paid = False
            return
        await self.budget.wait(kind)


#: The meter of the budgeted call running in this task (None: no budget above this backend).
_meter: contextvars.ContextVar[_Meter | None] = contextvars.ContextVar("ckptio_request_meter", default=None)


async def each_request(method: str) -> None:
    """A backend calls this before each HTTP request it sends: under a :class:`BudgetedBackend`,
    every request after a call's first (a listing's next page, an upload's next chunk, a resumable
    session's status query) waits for a slot of its own. ``method``: the HTTP method (GET and
    HEAD are reads, as the storage counts them; the rest writes). Without a budget: nothing."""
    meter = _meter.get()
    if meter is not None:
        await meter.request(READ if method in ("GET", "HEAD") else WRITE)


class BudgetedBackend(WrapperBackend):
    """Every call of ``inner`` waits for a slot of ``budget`` first, and tells it of throttles.

    A call's first request uses that slot; a backend that sends more than one request per call
    (the GCS backend's listing pages and upload chunks) takes one more slot for each through
    :func:`each_request`. A backend that does not call it counts as one request per call.
    """

    def __init__(self, inner: Backend, budget: RequestBudget) -> None:
        super().__init__(inner)
        self.budget = budget

    async def _call(self, kind: str, call: Callable[[], Awaitable[T]]) -> T:
        await self.budget.wait(kind)
        token = _meter.set(_Meter(self.budget))
        try:
            return await call()
        except ThrottledError as e:
            self.budget.throttled(kind)
            e.paced = True  # the retry's wait is this budget's next slot, not a backoff on top of it
            raise
        finally:
            _meter.reset(token)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._call(WRITE, lambda: self.inner.write(key, buffers))

    async def write_filling(self, key: str, buffers: Sequence[memoryview], filling: Filling) -> None:
        await self._call(WRITE, lambda: self.inner.write_filling(key, buffers, filling))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._call(READ, lambda: self.inner.read_into(key, rng, buffers))

    async def read(self, key: str) -> bytes:
        # The inner backend's own whole read (GCS: one request, not a stat and a read).
        return await self._call(READ, lambda: self.inner.read(key))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._call(WRITE, lambda: self.inner.create_if_absent(key, data))

    async def delete(self, key: str) -> None:
        await self._call(WRITE, lambda: self.inner.delete(key))

    async def delete_if(self, key: str, version: str) -> bool:
        return await self._call(WRITE, lambda: self.inner.delete_if(key, version))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._call(READ, lambda: self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._call(READ, lambda: self.inner.list(prefix))

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._call(READ, lambda: self.inner.list_children(prefix))


def budget_of(backend: Backend) -> RequestBudget | None:
    """The request budget ``backend`` draws from (through its wrappers), if any."""
    seen = 0
    while backend is not None and seen < 32:  # wrappers nest a few deep; never loop on a cycle
        if isinstance(backend, BudgetedBackend):
            return backend.budget
        backend, seen = getattr(backend, "inner", None), seen + 1
    return None


@contextlib.contextmanager
def alone(backend: Backend) -> Iterator[None]:
    """:meth:`RequestBudget.alone` for ``backend``'s budget; nothing without one."""
    budget = budget_of(backend)
    if budget is None:
        yield
        return
    with budget.alone():
        yield


_shared: dict[tuple[str, RequestRate], RequestBudget] = {}
_shared_lock = threading.Lock()


def budgeted(backend: Backend, rate: RequestRate | None) -> Backend:
    """``backend`` drawing from this process's budget for its URL and ``rate`` (None: as is).

    One budget per storage URL and rate in a process: the engine and the store's own calls,
    and every store this host opens on the same root, share one host's share.
    """
    if rate is None or isinstance(backend, BudgetedBackend):
        return backend
    with _shared_lock:
        budget = _shared.get((backend.url, rate))
        if budget is None:
            budget = _shared[(backend.url, rate)] = RequestBudget(rate)
    return BudgetedBackend(backend, budget)
