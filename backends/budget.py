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
_MIN_PENALTY = 1 / 64


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
    recover_s: float = 10.0
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
    """One class's slots for one host: a grid of wall-clock times, the host's own phase on it."""

    def __init__(self, job_rate: float, rank: int, hosts: int) -> None:
        self.job_rate, self.rank, self.hosts = job_rate, rank, hosts
        self.next = 0.0  # the earliest time the next slot may start
        self.low = 1.0  # the fraction of its share a throttle left this host, at ``halved_at``
        self.halved_at = -math.inf

    def penalty(self, now: float, recover_s: float) -> float:
        """The fraction of its share this host sends now: ``low`` doubling back every ``recover_s``."""
        return min(1.0, self.low * 2.0 ** ((now - self.halved_at) / recover_s))

    def take(self, now: float, rate: float) -> float:
        """Reserve the next slot at or after ``now`` at ``rate`` (this host's requests/s); returns when it starts."""
        step = 1.0 / rate
        phase = self.rank * step / self.hosts  # host r's slots sit r job-wide slots into each round
        aligned = phase + math.ceil((now - phase) / step) * step
        start = max(self.next, aligned)
        self.next = start + step
        return start


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

    def _rate(self, kind: str, now: float) -> float:
        """This host's requests per second of ``kind`` at ``now``: its share, ramped, throttled."""
        r, slots = self.rate, self._slots[kind]
        ramp = min(r.ramp_limit, 2.0 ** max(0.0, (now - self._started) / r.ramp_period_s))
        return slots.job_rate * ramp * slots.penalty(now, r.recover_s) / self.hosts

    def reserve(self, kind: str) -> float:
        """Reserve a slot of ``kind`` ("read" or "write"); returns the seconds to wait for it."""
        with self._lock:
            now = self._clock()
            return max(0.0, self._slots[kind].take(now, self._rate(kind, now)) - now)

    def host_rate(self, kind: str) -> float:
        """This host's current requests per second of ``kind``."""
        with self._lock:
            return self._rate(kind, self._clock())

    def throttled(self, kind: str) -> None:
        """The storage said "slow down" to a ``kind`` request: halve this host's rate of it, once
        per burst (the requests already in flight answer alike; one halving answers them all)."""
        with self._lock:
            now = self._clock()
            slots = self._slots[kind]
            self.throttles += 1
            burst = max(0.5, 4.0 / self._rate(kind, now))
            if now - slots.halved_at < burst:
                return  # the same burst: already halved for it
            slots.low = max(_MIN_PENALTY, slots.penalty(now, self.rate.recover_s) / 2)
            slots.halved_at = now
            self.slowdowns += 1

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
