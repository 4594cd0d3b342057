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
  clocks need agree only to well under a slot, as NTP does);
* the rate starts at the configured (conservative) value and doubles every
  ``ramp_period_s`` up to ``ramp_limit`` times it;
* a :class:`~ckptio.backends.base.ThrottledError` halves this host's rate
  (once per burst of them), and it doubles back every ``recover_s`` without
  one: additive-free AIMD, so a job that guessed its rate too high settles
  under what the storage allows.

:class:`BudgetedBackend` is the wrapper that makes every call of a backend wait
for a slot of its class ("read": reads, stats, listings; "write": writes,
creates, deletes). The engine wraps its backend in one when
``EngineConfig.request_rate`` is set, so saves, restores, listings, gc and
retention all draw from one budget per host and storage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from .base import Backend, ByteRange, ObjectInfo, ThrottledError
from .wrappers import WrapperBackend

__all__ = ["BudgetedBackend", "RequestBudget", "RequestRate", "budgeted"]

T = TypeVar("T")

#: Each call's class: its own slots, its own rate.
READ, WRITE = "read", "write"
#: A throttled host's rate never drops below this fraction of its share.
_MIN_BOOST = 1 / 64


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


class _Slots:
    """One class's slots for one host: a grid of wall-clock times, the host's own phase on it,
    spaced by its share times ``boost`` (AIMD: grown while the host waits for slots, halved by a throttle)."""

    def __init__(self, job_rate: float, rank: int, hosts: int) -> None:
        self.job_rate, self.rank, self.hosts = job_rate, rank, hosts
        self.next = -math.inf  # the earliest time the next slot may start
        self.boost = 1.0  # the multiple of its share this host sends at
        self.changed = -math.inf  # when ``boost`` last grew or was halved
        self.halved_at = -math.inf

    def take(self, now: float, share: float, recover_s: float) -> float:
        """Reserve the next slot at or after ``now``; returns when it starts.

        A host whose previous slot is still ahead has more to send than its rate allows: its boost
        grows, at most once a slot, doubling until the storage first throttles it and by an
        eighth after that (within ``recover_s``), up to the job's whole rate. An idle host's boost
        halves each second down to its share, so that idle hosts do not all come back in a burst.
        """
        if now > self.next and self.boost != 1.0:  # idle: back towards its share (down each second, up each recover_s)
            idle = now - max(self.next, self.changed)
            self.boost = max(1.0, self.boost * 0.5 ** idle) if self.boost > 1 else min(1.0, self.boost * 2 ** (idle / recover_s))
            self.changed = now
        step = 1.0 / (share * self.boost)
        phase = self.rank * step / self.hosts  # host r's slots sit r job-wide slots into each round
        start = max(self.next, phase + math.ceil((now - phase) / step) * step)
        if self.next > now and now - self.changed >= step and self.boost < self.hosts:  # held back: grow
            self.boost = min(float(self.hosts), self.boost * (1.125 if now - self.halved_at < recover_s else 2.0))
            self.changed = now
        self.next = start + 1.0 / (share * self.boost)
        return start

    def halve(self, now: float, share: float) -> bool:
        """Halve the boost, once per burst of throttles (those in flight answer alike); True if it did."""
        if now - self.halved_at < max(0.5, 4.0 / (share * self.boost)):
            return False
        self.boost = max(_MIN_BOOST, self.boost / 2)
        self.halved_at = self.changed = now
        self.next = max(self.next, now + 1.0 / (share * self.boost))
        return True


class RequestBudget:
    """One host's share of a job's :class:`RequestRate` on one storage; thread-safe.

    ``clock``: wall-clock seconds (shared by the job's hosts: their slots interleave on it).
    """

    def __init__(self, rate: RequestRate, *, clock: Callable[[], float] = time.time) -> None:
        self.rate = rate
        self.rank, self.hosts = rate.resolved()
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._slots = {READ: _Slots(rate.reads_per_s, self.rank, self.hosts),
                       WRITE: _Slots(rate.writes_per_s, self.rank, self.hosts)}
        #: Throttles seen, and how many of them lowered the rate.
        self.throttles = 0
        self.slowdowns = 0

    def share(self, kind: str, now: float | None = None) -> float:
        """This host's share of the job's ``kind`` rate at ``now``: ``1/hosts`` of it, ramped."""
        r = self.rate
        now = self._clock() if now is None else now
        ramp = min(r.ramp_limit, 2.0 ** max(0.0, (now - self._started) / r.ramp_period_s))
        return self._slots[kind].job_rate * ramp / self.hosts

    def host_rate(self, kind: str) -> float:
        """This host's current requests per second of ``kind``: its share times its boost."""
        with self._lock:
            return self.share(kind) * self._slots[kind].boost

    def reserve(self, kind: str) -> float:
        """Reserve a slot of ``kind`` ("read" or "write"); returns the seconds to wait for it."""
        with self._lock:
            now = self._clock()
            return max(0.0, self._slots[kind].take(now, self.share(kind, now), self.rate.recover_s) - now)

    def throttled(self, kind: str) -> None:
        """The storage said "slow down" to a ``kind`` request: halve this host's rate of it."""
        with self._lock:
            now = self._clock()
            self.throttles += 1
            self.slowdowns += self._slots[kind].halve(now, self.share(kind, now))

    async def wait(self, kind: str) -> None:
        """Wait for a slot of ``kind``."""
        delay = self.reserve(kind)
        if delay > 0:
            await asyncio.sleep(delay)


class BudgetedBackend(WrapperBackend):
    """Every call of ``inner`` waits for a slot of ``budget`` first, and tells it of throttles.

    One slot per call: a listing the backend pages through, or a large upload sent in chunks,
    counts as one request (the budget is a floor on spacing, not an exact count).
    """

    def __init__(self, inner: Backend, budget: RequestBudget) -> None:
        super().__init__(inner)
        self.budget = budget

    async def _call(self, kind: str, call: Callable[[], Awaitable[T]]) -> T:
        await self.budget.wait(kind)
        try:
            return await call()
        except ThrottledError:
            self.budget.throttled(kind)
            raise

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._call(WRITE, lambda: self.inner.write(key, buffers))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._call(READ, lambda: self.inner.read_into(key, rng, buffers))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._call(WRITE, lambda: self.inner.create_if_absent(key, data))

    async def delete(self, key: str) -> None:
        await self._call(WRITE, lambda: self.inner.delete(key))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._call(READ, lambda: self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._call(READ, lambda: self.inner.list(prefix))

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._call(READ, lambda: self.inner.list_children(prefix))


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
