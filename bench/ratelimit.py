"""A rate-limiting reverse proxy in front of fake-gcs-server: N requests/s per prefix, 429 beyond.

Real object stores limit request rates per bucket and key range and turn the
excess away with 429 (GCS) or 503 SlowDown (S3). :class:`RateLimitProxy`
reproduces that in front of the emulator, so that tests and ``ckptio bench
--fake-gcs --rate-limit R`` see what a job meets when every host lists,
reads or writes at once.

Each prefix has two token buckets, reads (GET, HEAD) and writes (everything
else), as GCS limits the two apart: each refills at ``limit`` tokens a second
and holds at most ``limit * burst_s`` (at least one). A request that finds
its bucket empty is answered 429 at once and never forwarded. A *prefix* is
the bucket plus the first ``depth`` components of the object name (depth 0:
the whole bucket, the strictest). Counts: ``admitted`` and ``refused`` per
class, and the first and last admitted times (the span the limit allows is
``admitted / limit``).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.parse
from collections import Counter
from typing import Any

from ckptio.bench.appserver import ProxyServer

__all__ = ["RateLimitProxy", "request_prefix"]

_BUCKET = re.compile(r"/b/([^/?]+)")
_OBJECT = re.compile(r"/b/[^/?]+/o/([^?]+)")


def request_prefix(path_qs: str, depth: int) -> str:
    """The rate-limited prefix a GCS JSON-API request falls in: ``bucket`` and the first ``depth``
    components of the object name (from the path, or the ``name`` / ``prefix`` query)."""
    m = _BUCKET.search(path_qs)
    bucket = m.group(1) if m else ""
    if depth <= 0:
        return bucket
    o = _OBJECT.search(path_qs)
    if o is not None:
        name = urllib.parse.unquote(o.group(1))
    else:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path_qs).query)
        name = (query.get("name") or query.get("prefix") or [""])[0]
    return "/".join([bucket, *name.split("/")[:depth]])


class _Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``depth`` held."""

    def __init__(self, rate: float, depth: float, now: float) -> None:
        self.rate, self.depth, self.tokens, self.at = rate, depth, depth, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.depth, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class RateLimitProxy(ProxyServer):
    """Forwards to ``upstream`` at most ``limit`` requests a second per prefix and class; 429 beyond."""

    thread_name = "rate-limit-proxy"

    def __init__(self, upstream: str, limit: float, *, depth: int = 0, burst_s: float = 0.1) -> None:
        super().__init__(upstream)
        if not limit > 0:
            raise ValueError(f"limit must be > 0 requests/s, got {limit!r}")
        self.limit, self.depth, self.burst_s = float(limit), depth, burst_s
        self.admitted: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.first: float | None = None
        self.last: float | None = None
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def _admit(self, prefix: str, kind: str) -> bool:
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get((prefix, kind))
            if bucket is None:
                bucket = self._buckets[(prefix, kind)] = _Bucket(self.limit, max(1.0, self.limit * self.burst_s), now)
            ok = bucket.take(now)
            (self.admitted if ok else self.refused)[kind] += 1
            if ok:
                self.first = now if self.first is None else self.first
                self.last = now
            return ok

    def reset(self) -> None:
        """Forget the counts (the buckets keep their tokens)."""
        with self._lock:
            self.admitted.clear()
            self.refused.clear()
            self.first = self.last = None

    def allowed_span_s(self) -> float:
        """The least time the admitted requests could have taken under the limit (the busier class)."""
        with self._lock:
            return max(self.admitted.values(), default=0) / self.limit

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        kind = "read" if request.method in ("GET", "HEAD") else "write"
        body = await request.read()  # read first, as a real front end does before answering
        if not self._admit(request_prefix(request.path_qs, self.depth), kind):
            return web.Response(status=429, text="rate limit exceeded (RateLimitProxy)")
        status, headers, payload = await self.forward(request, body)
        return web.Response(status=status, headers=headers, body=payload)
