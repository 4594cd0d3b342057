"""Wrapper backends: behaviour layered around any backend, never flags inside one.

* :class:`FaultInjectingBackend` -- transient errors, silent corruption and
  truncation at a seeded rate, for retry and checksum tests.
* :class:`LatencyBackend` -- a fixed delay (plus optional jitter and
  bandwidth) per call, to make overlap and concurrency visible in tests and
  benchmarks.
* :class:`CountingBackend` -- calls, errors and bytes per method, so tests can
  assert e.g. "restoring a slice read about as many bytes as the slice".
* :class:`ReadOnlyBackend` -- declares ``read_only`` and refuses every
  mutation with :class:`PermissionError` (restore/verify paths that must
  never write).
* :class:`WrapperBackend` (in :mod:`._wrapper_base`, re-exported here) -- the base: delegates.
  A subclass that overrides ``delete`` but not ``delete_if`` declares no ``conditional_delete``
  (deleters then use its ``delete``), so no conditional delete bypasses what it does to deletes.
* :class:`ckptio.backends.retrying.RetryingBackend` (its own module) --
  retries :class:`RetryableError`: the one place the store's calls are retried.

Every wrapper delegates what it does not change -- ``capabilities``,
``layout_defaults``, ``url``, ``list_children``, ``sync``, ``close`` included
-- to the backend it wraps, and goes on satisfying the backend contract itself (the conformance suite
runs against each one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar

from ckptio.backends._wrapper_base import METHODS, WrapperBackend
from ckptio.backends.base import Backend, ByteRange, Capabilities, ObjectInfo, RetryableError, check_key
from ckptio.system.bytes import byte_views

__all__ = [
    "CountingBackend",
    "FaultInjectingBackend",
    "LatencyBackend",
    "MethodStats",
    "ReadOnlyBackend",
    "WrapperBackend",
]

log = logging.getLogger("ckptio.backends.wrappers")

T = TypeVar("T")

class FaultInjectingBackend(WrapperBackend):
    """Injects faults into a fraction ``rate`` of calls, reproducibly from ``seed``.

    Each call of a method draws once; with probability ``rate`` it suffers one
    fault, chosen uniformly among those enabled for that method:

    * ``"error"`` (methods named in ``faults``): :class:`RetryableError`. By
      default it is raised before the inner call, so the call had no effect;
      a fraction ``fail_after`` of them is raised after the inner call
      succeeded instead -- a lost reply, after which e.g. a retried
      ``create_if_absent`` meets its own object.
    * ``"corrupt"`` (``read_into`` with ``corrupt_reads``, ``write`` and
      ``create_if_absent`` with ``corrupt_writes``): one byte of the data
      returned or stored is flipped, silently.
    * ``"truncate"`` (``read_into`` with ``truncate_reads``, ``write`` and
      ``create_if_absent`` with ``truncate_writes``): a write stores a strict
      prefix of its data; a read leaves a tail of the caller's buffers
      unfilled -- a short read or write that went unnoticed.

    ``injected`` counts what was done, as ``(method, kind)`` pairs, so tests
    can assert that faults really happened.
    """

    def __init__(
        self,
        inner: Backend,
        rate: float,
        seed: int = 0,
        faults: Collection[str] = METHODS,
        *,
        fail_after: float = 0.0,
        corrupt_reads: bool = False,
        corrupt_writes: bool = False,
        truncate_reads: bool = False,
        truncate_writes: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(inner)
        if not 0.0 <= rate <= 1.0 or not 0.0 <= fail_after <= 1.0:
            raise ValueError(f"rate {rate} and fail_after {fail_after} must lie in [0, 1]")
        unknown = set(faults) - set(METHODS)
        if unknown:
            raise ValueError(f"cannot inject errors into {sorted(unknown)}; methods are {METHODS}")
        self.rate = rate
        self.faults = frozenset(faults)
        self.fail_after = fail_after
        self.retry_after = retry_after
        self._kinds: dict[str, tuple[str, ...]] = {}
        for method in METHODS:
            kinds = ["error"] if method in self.faults else []
            if method == "read_into":
                kinds += ["corrupt"] * corrupt_reads + ["truncate"] * truncate_reads
            if method in ("write", "create_if_absent"):
                kinds += ["corrupt"] * corrupt_writes + ["truncate"] * truncate_writes
            self._kinds[method] = tuple(kinds)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # wrappers may be shared by several event-loop threads
        self.injected: Counter[tuple[str, str]] = Counter()

    def _draw(self, method: str) -> tuple[str | None, bool, random.Random]:
        """The fault for this call (or None), whether an error comes after the call, and an RNG for it."""
        with self._lock:
            kinds = self._kinds[method]
            if not kinds or self._rng.random() >= self.rate:
                return None, False, self._rng  # unused when there is no fault
            kind = self._rng.choice(kinds)
            after = kind == "error" and self._rng.random() < self.fail_after
            # A private RNG for the fault's details keeps the shared sequence lock-protected.
            detail = random.Random(self._rng.getrandbits(64))
            self.injected[(method, kind)] += 1
        return kind, after, detail

    def _error(self, method: str, key: str) -> RetryableError:
        return RetryableError(f"{self.url}: injected transient fault in {method}({key!r})", retry_after=self.retry_after)

    async def _guard(self, method: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call()`` under an error fault, if one is drawn; other kinds are handled by the caller."""
        kind, after, _ = self._draw(method)
        if kind == "error" and not after:
            raise self._error(method, key)
        result = await call()
        if kind == "error":
            raise self._error(method, key)
        return result

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        kind, after, rng = self._draw("write")
        if kind == "error" and not after:
            raise self._error("write", key)
        if kind in ("corrupt", "truncate"):
            buffers = [memoryview(_damage(b"".join(byte_views(buffers)), kind, rng))]
        await self.inner.write(key, buffers)
        if kind == "error":
            raise self._error("write", key)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        kind, after, rng = self._draw("create_if_absent")
        if kind == "error" and not after:
            raise self._error("create_if_absent", key)
        if kind in ("corrupt", "truncate"):
            data = _damage(bytes(data), kind, rng)
        await self.inner.create_if_absent(key, data)
        if kind == "error":
            raise self._error("create_if_absent", key)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        kind, after, detail = self._draw("read_into")
        if kind == "error" and not after:
            raise self._error("read_into", key)
        if kind == "truncate" and rng.length:
            # Fill only a prefix of the destination: read the whole range aside, copy part of it.
            scratch = bytearray(rng.length)
            await self.inner.read_into(key, rng, [memoryview(scratch)])
            keep = detail.randrange(rng.length)
            pos = 0
            for view in byte_views(buffers):
                n = max(0, min(view.nbytes, keep - pos))
                view[:n] = scratch[pos : pos + n]
                pos += view.nbytes
            return
        await self.inner.read_into(key, rng, buffers)
        if kind == "corrupt" and rng.length:
            _flip_one_byte(byte_views(buffers), detail.randrange(rng.length))
        if kind == "error":
            raise self._error("read_into", key)

    async def delete(self, key: str) -> None:
        await self._guard("delete", key, lambda: self.inner.delete(key))

    async def delete_if(self, key: str, version: str) -> bool:
        return await self._guard("delete_if", key, lambda: self.inner.delete_if(key, version))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._guard("stat", key, lambda: self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._guard("list", prefix, lambda: self.inner.list(prefix))

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._guard("list_children", prefix, lambda: self.inner.list_children(prefix))

    async def sync(self) -> None:
        await self._guard("sync", "", self.inner.sync)


def _damage(data: bytes, kind: str, rng: random.Random) -> bytes:
    """``data`` with one byte flipped (``corrupt``) or cut to a strict prefix (``truncate``)."""
    if not data:
        return data  # nothing to damage; an empty object stays empty
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    out[rng.randrange(len(out))] ^= 0xFF
    return bytes(out)


def _flip_one_byte(views: list[memoryview], index: int) -> None:
    """Flip byte ``index`` of the concatenation of ``views``."""
    for view in views:
        if index < view.nbytes:
            view[index] ^= 0xFF
            return
        index -= view.nbytes


class LatencyBackend(WrapperBackend):
    """Delays each call by ``seconds`` (+ uniform ``jitter``), plus ``bytes / bandwidth`` for data.

    The delay is an ``asyncio.sleep`` before the inner call, so concurrent
    calls overlap their latency the way requests to a remote store do.
    """

    def __init__(
        self,
        inner: Backend,
        seconds: float,
        *,
        jitter: float = 0.0,
        bandwidth: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(inner)
        if seconds < 0 or jitter < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError(f"invalid latency {seconds}s, jitter {jitter}s or bandwidth {bandwidth} B/s")
        self.seconds = seconds
        self.jitter = jitter
        self.bandwidth = bandwidth
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    async def _delay(self, nbytes: int = 0) -> None:
        with self._lock:
            extra = self._rng.uniform(0.0, self.jitter) if self.jitter else 0.0
        delay = self.seconds + extra + (nbytes / self.bandwidth if self.bandwidth else 0.0)
        # sleep(0) still yields, so even a zero latency reorders concurrent calls a little.
        await asyncio.sleep(delay)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._delay(sum(b.nbytes for b in buffers))
        await self.inner.write(key, buffers)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._delay(rng.length)
        await self.inner.read_into(key, rng, buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._delay(len(data))
        await self.inner.create_if_absent(key, data)

    async def delete(self, key: str) -> None:
        await self._delay()
        await self.inner.delete(key)

    async def delete_if(self, key: str, version: str) -> bool:
        await self._delay()
        return await self.inner.delete_if(key, version)

    async def stat(self, key: str) -> ObjectInfo:
        await self._delay()
        return await self.inner.stat(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await self._delay()
        return await self.inner.list(prefix)

    async def list_children(self, prefix: str = "") -> list[str]:
        await self._delay()
        return await self.inner.list_children(prefix)

    async def sync(self) -> None:
        await self._delay()
        await self.inner.sync()


@dataclasses.dataclass
class MethodStats:
    """What :class:`CountingBackend` saw of one method."""

    calls: int = 0
    #: Calls that raised (any exception).
    errors: int = 0
    #: Payload bytes moved by the calls that succeeded (written or read).
    bytes: int = 0


class CountingBackend(WrapperBackend):
    """Counts calls, errors and payload bytes per method; thread-safe.

    Bytes are counted only for calls that succeed: ``write`` and
    ``create_if_absent`` count bytes written, ``read_into`` bytes read. Every
    range read is also logged in ``reads`` as ``(key, ByteRange)``, so tests
    can check which ranges a restore asked for, not only how many bytes.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._stats: dict[str, MethodStats] = {m: MethodStats() for m in METHODS}
        self.reads: list[tuple[str, ByteRange]] = []

    def _done(self, method: str, nbytes: int, ok: bool) -> None:
        with self._lock:
            s = self._stats[method]
            s.calls += 1
            if ok:
                s.bytes += nbytes
            else:
                s.errors += 1

    async def _count(self, method: str, nbytes: int, call: Callable[[], Awaitable[T]]) -> T:
        try:
            result = await call()
        except BaseException:
            self._done(method, 0, ok=False)
            raise
        self._done(method, nbytes, ok=True)
        return result

    # -- the numbers -----------------------------------------------------

    def stats(self) -> dict[str, MethodStats]:
        """A consistent copy of the per-method counters."""
        with self._lock:
            return {m: dataclasses.replace(s) for m, s in self._stats.items()}

    def calls(self, method: str) -> int:
        with self._lock:
            return self._stats[method].calls

    @property
    def bytes_read(self) -> int:
        with self._lock:
            return self._stats["read_into"].bytes

    @property
    def bytes_written(self) -> int:
        with self._lock:
            return self._stats["write"].bytes + self._stats["create_if_absent"].bytes

    def reset(self) -> None:
        """Zero every counter and forget the logged reads."""
        with self._lock:
            self._stats = {m: MethodStats() for m in METHODS}
            self.reads = []

    # -- the calls -------------------------------------------------------

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        n = sum(b.nbytes for b in buffers)
        await self._count("write", n, lambda: self.inner.write(key, buffers))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._count("read_into", rng.length, lambda: self.inner.read_into(key, rng, buffers))
        with self._lock:
            self.reads.append((key, rng))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._count("create_if_absent", len(data), lambda: self.inner.create_if_absent(key, data))

    async def delete(self, key: str) -> None:
        await self._count("delete", 0, lambda: self.inner.delete(key))

    async def delete_if(self, key: str, version: str) -> bool:
        return await self._count("delete_if", 0, lambda: self.inner.delete_if(key, version))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._count("stat", 0, lambda: self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._count("list", 0, lambda: self.inner.list(prefix))

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._count("list_children", 0, lambda: self.inner.list_children(prefix))

    async def sync(self) -> None:
        await self._count("sync", 0, self.inner.sync)


class ReadOnlyBackend(WrapperBackend):
    """Declares ``read_only`` and refuses ``write``, ``create_if_absent`` and ``delete``.

    Keys are still validated first, so a bad key is a ValueError here as on
    any backend.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._capabilities = dataclasses.replace(inner.capabilities, read_only=True)

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def _refuse(self, what: str, key: str) -> PermissionError:
        check_key(key)
        return PermissionError(f"{self.url}: cannot {what} {key!r}: this backend is read-only")

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        raise self._refuse("write", key)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        raise self._refuse("create", key)

    async def sweep_temporaries(
        self, older_than_s: float, *, dry_run: bool = False, prefix: str | None = None
    ) -> list[str]:
        return []  # removes nothing through a read-only view

    async def delete(self, key: str) -> None:
        raise self._refuse("delete", key)

    async def delete_if(self, key: str, version: str) -> bool:
        raise self._refuse("delete", key)
