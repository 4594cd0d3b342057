"""Waiting, from the event loop, for worker threads that read buffers the waiter will give back.

An asyncio wrapper of a thread's future is done as soon as it is cancelled, while the thread may
still read (or fill) the buffers; these wait on the threads' own futures instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

__all__ = ["thread_done", "threads_done"]


async def thread_done(fut: concurrent.futures.Future[Any]) -> None:
    """Wait until the worker thread running ``fut`` has finished it, through any number of
    cancellations (re-raised once it has). Waits on the thread's own future: an asyncio wrapper
    of it is done as soon as it is cancelled, while the thread may still read the buffers."""
    if fut.done():
        return
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    fut.add_done_callback(lambda _: loop.call_soon_threadsafe(finished.set))
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await finished.wait()
        except asyncio.CancelledError as e:
            cancelled = e
    if cancelled is not None:
        raise cancelled


async def threads_done(futures: Sequence[concurrent.futures.Future[Any]]) -> None:
    """:func:`thread_done` for each of ``futures``: returns once every one of their threads has
    finished, however often it is cancelled meanwhile (re-raised once they all have)."""
    cancelled: asyncio.CancelledError | None = None
    for f in futures:
        try:
            await thread_done(f)
        except asyncio.CancelledError as e:
            cancelled = e
    if cancelled is not None:
        raise cancelled
