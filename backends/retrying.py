"""Retries, once: :class:`RetryingBackend` retries :class:`RetryableError` with exponential
backoff and full jitter (:class:`RetryPolicy`). The store wraps its backend in it, so no
caller wraps a call in a retry loop of its own.

A :class:`ThrottledError` (the storage said "slow down") is retried for as long as
``throttle_patience_s`` allows, however many attempts that takes: throttling says the
storage is busy, not that the call is wrong, and at a job's restart every host meets it
at once. When even that runs out, the error says the storage is throttled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ckptio.backends.base import Backend, ByteRange, ObjectInfo, Read, RetryableError, ThrottledError
from ckptio.backends.wrappers import WrapperBackend

__all__ = ["RetryPolicy", "RetryingBackend", "retry_call"]

log = logging.getLogger("ckptio.backends.retrying")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried (the engine's knobs of the same names)."""

    retries: int = 8
    backoff_initial: float = 0.05
    backoff_max: float = 8.0
    #: A throttled call is retried until this many seconds have passed since its first attempt.
    throttle_patience_s: float = 600.0


async def retry_call(what: str, call: Callable[[], Awaitable[T]], policy: RetryPolicy) -> T:
    """Run ``call()``, retrying RetryableError with exponential backoff and full jitter.

    A server's ``retry_after`` lengthens the wait (up to ``backoff_max``); the last
    attempt's error propagates. A ThrottledError is retried past ``retries`` until
    ``throttle_patience_s`` has passed, then raised as "the storage is throttled".
    Every other exception propagates at once.
    """
    began = time.monotonic()
    attempt = 0
    while True:
        try:
            return await call()
        except ThrottledError as e:
            waited = time.monotonic() - began
            if attempt >= policy.retries and waited >= policy.throttle_patience_s:
                raise ThrottledError(f"the storage is throttled: {what} was still refused after "
                                     f"{attempt + 1} attempts over {waited:.0f}s: {e}") from e
            delay = _backoff(attempt, e, policy)
        except RetryableError as e:
            if attempt >= policy.retries:
                raise
            delay = _backoff(attempt, e, policy)
        log.debug("retrying %s in %.2fs (attempt %d)", what, delay, attempt + 1)
        await asyncio.sleep(delay)
        attempt += 1


def _backoff(attempt: int, e: RetryableError, policy: RetryPolicy) -> float:
    """Full jitter over an exponential ceiling; a server's ``retry_after`` lengthens it. A throttle
    a request budget already answered (``paced``) waits only a jitter: the budget's slot is the wait."""
    ceiling = policy.backoff_initial if getattr(e, "paced", False) else policy.backoff_initial * 2 ** min(attempt, 60)
    delay = random.uniform(0, min(policy.backoff_max, ceiling))
    if e.retry_after is not None:
        delay = max(delay, min(e.retry_after, policy.backoff_max))
    return delay


class RetryingBackend(WrapperBackend):
    """Retries each call of ``inner`` that fails with :class:`RetryableError` (:func:`retry_call`).

    A whole-object ``read`` is retried as one call of ``inner.read`` (a retry re-stats the
    object), as callers used to wrap it. Wrap a backend once: a retrying wrapper under
    another retry loop multiplies the attempts.
    """

    def __init__(self, inner: Backend, policy: RetryPolicy | None = None) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        return await retry_call(f"{what} on {self.inner.url}", call, self.policy)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._retry(f"write {key!r}", lambda: self.inner.write(key, buffers))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._retry(f"read {key!r}", lambda: self.inner.read_into(key, rng, buffers))

    async def read_many(self, reads: Sequence[Read]) -> None:
        if not self.batches_reads:
            await super().read_many(reads)
            return
        # Retried as one call: every buffer is filled again, so a retry after a partial batch is whole.
        first = reads[0][0] if reads else ""
        await self._retry(f"read {len(reads)} objects ({first!r}, ...)", lambda: self.inner.read_many(reads))

    async def read(self, key: str) -> bytes:
        return await self._retry(f"read {key!r}", lambda: self.inner.read(key))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._retry(f"create {key!r}", lambda: self.inner.create_if_absent(key, data))

    async def delete(self, key: str) -> None:
        await self._retry(f"delete {key!r}", lambda: self.inner.delete(key))

    async def delete_if(self, key: str, version: str) -> bool:
        # A retry after a lost reply meets no object (FileNotFoundError): the caller's "gone".
        return await self._retry(f"delete {key!r} if unchanged", lambda: self.inner.delete_if(key, version))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._retry(f"stat {key!r}", lambda: self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._retry(f"list {prefix!r}", lambda: self.inner.list(prefix))

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._retry(f"list {prefix!r}", lambda: self.inner.list_children(prefix))

    async def sync(self) -> None:
        await self._retry("sync", self.inner.sync)

    async def sweep_temporaries(
        self, older_than_s: float, *, dry_run: bool = False, prefix: str | None = None
    ) -> list[str]:
        """The inner sweep, retried; ``prefix`` is passed only when given (the ABC's sweep has none)."""
        sweep: Any = self.inner.sweep_temporaries
        kw: dict[str, Any] = {"dry_run": dry_run} if prefix is None else {"dry_run": dry_run, "prefix": prefix}
        return await self._retry("sweep temporaries", lambda: sweep(older_than_s, **kw))
