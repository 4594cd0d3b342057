"""A failed storage call leaves nothing running: the requests issued beside the one that failed are
cancelled before the error reaches the caller. Else they retry against the storage after the caller
gave up, and (a CLI) remake a session the store already closed: "Unclosed client session" at exit."""

from __future__ import annotations

import asyncio

import pytest

from ckptio.backends import ObjectInfo
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.store import CheckpointStore


class _OneFailsOneHangs(WrapperBackend):
    """A stat of the tombstone fails at once; every other stat waits forever (until cancelled)."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.hanging = 0
        self.cancelled = 0

    async def stat(self, key: str) -> ObjectInfo:
        if key.endswith("ckptio.deleting"):
            raise ConnectionError(f"{key}: storage unreachable")
        self.hanging += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


def test_a_failed_check_cancels_the_checks_beside_it() -> None:
    backend = _OneFailsOneHangs(MemoryBackend("mem://no-stragglers"))
    store = CheckpointStore("mem://no-stragglers", backend=backend)

    async def check() -> None:
        with pytest.raises(ConnectionError, match="unreachable"):
            await store.catalog.is_committed("7")
        # Cancelled and finished before the error was raised: none is left to retry after the caller.
        assert backend.hanging >= 1 and backend.cancelled == backend.hanging, (backend.hanging, backend.cancelled)

    run_sync(check())
