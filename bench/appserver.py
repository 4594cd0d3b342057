"""An aiohttp server on its own loop thread, and a reverse proxy built on it, for fake storage.

:class:`AppServer` serves one handler on 127.0.0.1 from a background thread, so
any client loop (or several) can use it. :class:`ProxyServer` forwards every
request to an upstream (fake-gcs-server) and hands back its answer, rewriting
``Location`` headers so resumable uploads keep going through the proxy. The
tests' fault-injecting proxy (``tests/support/fake_gcs.py``) and the bench's
rate-limiting one (:mod:`ckptio.bench.ratelimit`) are built on them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, TypeVar

from ckptio.bench.fakegcs import free_port

__all__ = ["AppServer", "ProxyServer", "Upstream"]

_S = TypeVar("_S", bound="AppServer")


class AppServer:
    """An aiohttp web handler served on 127.0.0.1 from its own loop thread.

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

    def start(self: _S) -> _S:
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
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: What the upstream answered: status, headers (Location rewritten to the proxy), body.
Upstream = tuple[int, dict[str, str], bytes]


class ProxyServer(AppServer):
    """An :class:`AppServer` that can forward a request to ``upstream`` (:meth:`forward`)."""

    def __init__(self, upstream: str) -> None:
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self._client: Any = None

    async def setup(self) -> None:
        import aiohttp

        self._client = aiohttp.ClientSession(auto_decompress=False)

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def forward(self, request: Any, body: bytes) -> Upstream:
        """Send ``request`` (with ``body``) on to the upstream, as sent; its answer."""
        from yarl import URL

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
        return up.status, out_headers, payload
