"""One client object per event loop, made lazily on the loop that needs it.

HTTP sessions (aiohttp's, and the async fsspec filesystems' built on them)
are bound to the loop they were created on, and a backend is driven from
several: the engine's loop thread, a fresh loop per Orbax commit future, a
test's own loop. Each object is tied to an async generator parked on its
loop, so a loop that ends properly (``asyncio.run``, or
``loop.shutdown_asyncgens()`` before ``close()``) closes it, and its
sockets, even if nobody calls :meth:`PerLoop.close_current`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["PerLoop"]

T = TypeVar("T")


class PerLoop(Generic[T]):
    """``get()`` returns the running loop's object, made by ``factory(loop)`` on first use.

    ``close(obj)`` closes one; ``live(obj)`` says whether a cached one is still
    usable (else a new one is made); ``forget(obj)`` is awaited for objects
    of loops that were closed without shutting them down (their sockets died
    with the loop; this only silences 'unclosed' warnings).
    """

    def __init__(
        self,
        factory: Callable[[asyncio.AbstractEventLoop], T],
        close: Callable[[T], Awaitable[None]],
        *,
        live: Callable[[T], bool] = lambda _: True,
        forget: Callable[[T], Awaitable[None]] | None = None,
    ) -> None:
        self._factory, self._close, self._live, self._forget = factory, close, live, forget
        self._lock = threading.Lock()
        self._by_loop: dict[asyncio.AbstractEventLoop, tuple[T, AsyncGenerator[None, None]]] = {}

    async def _closer(self, obj: T) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:  # runs at the loop's shutdown_asyncgens(), or when we aclose() it
            await self._close(obj)

    async def get(self) -> T:
        """The running loop's object (created on first use)."""
        loop = asyncio.get_running_loop()
        entry = self._by_loop.get(loop)
        if entry is not None and self._live(entry[0]):
            return entry[0]
        with self._lock:
            stale = [self._by_loop.pop(lp)[0] for lp in [lp for lp in self._by_loop if lp.is_closed()]]
            obj = self._factory(loop)
            closer = self._closer(obj)
            self._by_loop[loop] = (obj, closer)
        await closer.__anext__()  # parks it on this loop: the loop now finalises it at shutdown
        await self._forget_all(stale)
        return obj

    async def _forget_all(self, objs: list[T]) -> None:
        if self._forget is not None:
            for obj in objs:
                with contextlib.suppress(Exception):
                    await self._forget(obj)

    async def close_current(self) -> None:
        """Close the running loop's object only (before closing a short-lived loop by hand)."""
        with self._lock:
            entry = self._by_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    async def close_all(self) -> None:
        """Close every loop's object: ours directly, other running loops' through their loop."""
        current = asyncio.get_running_loop()
        with self._lock:
            entries, self._by_loop = self._by_loop, {}
        for loop, (obj, closer) in entries.items():
            if loop is current:
                await closer.aclose()
            elif loop.is_closed():
                await self._forget_all([obj])
            elif loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(closer.aclose(), loop)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(fut), 5.0)
            # A stopped but unclosed loop cannot run the close; its shutdown_asyncgens() will.
