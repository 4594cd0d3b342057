"""MemoryBackend against the shared conformance suite."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ckptio.backends import memory
from ckptio.backends.base import ByteRange, ObjectInfo
from ckptio.backends.memory import MemoryBackend
from ckptio.testing import BackendConformance


def memory_url(tmp_path: Path) -> str:
    """A store name no other test uses (stores are process-wide, keyed by URL)."""
    return f"mem://{tmp_path}"


class TestMemoryBackend(BackendConformance):
    def make_backend(self, tmp_path: Path) -> MemoryBackend:
        return MemoryBackend(memory_url(tmp_path))

    @pytest.fixture(autouse=True)
    def _forget_stores(self, tmp_path: Path) -> Iterator[None]:
        # Not in close_backend: several clients of one store close at different times.
        yield
        for url in [u for u in memory._STORES if u.startswith(memory_url(tmp_path))]:
            MemoryBackend.forget(url)


class _LoopBoundMemory(MemoryBackend):
    """Like a client holding an aiohttp session: usable only in the loop that created it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.loop = asyncio.get_running_loop()

    def _check_loop(self) -> None:
        assert asyncio.get_running_loop() is self.loop, "used outside the event loop it was made in"

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        self._check_loop()
        await super().write(key, buffers)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        self._check_loop()
        await super().read_into(key, rng, buffers)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._check_loop()
        return await super().list(prefix)

    async def close(self) -> None:
        self._check_loop()


class TestAsyncFactory(TestMemoryBackend):
    """The suite with an ``async def make_backend``, as a GCS backend's test file would write it."""

    state_machine_examples = 10

    async def make_backend(self, tmp_path: Path) -> MemoryBackend:  # type: ignore[override]
        await asyncio.sleep(0)  # e.g. open a session, create a bucket
        return _LoopBoundMemory(memory_url(tmp_path))

    def test_one_backend_on_several_event_loops(self, tmp_path: Path) -> None:
        pytest.skip("this test double is bound to one loop on purpose (it checks the suite's own machinery)")


def test_instances_with_one_url_share_objects(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = MemoryBackend(memory_url(tmp_path)), MemoryBackend(memory_url(tmp_path) + "/")
        await a.write("k", [memoryview(b"shared")])
        assert await b.read("k") == b"shared"
        other = MemoryBackend(memory_url(tmp_path / "other"))
        assert await other.list() == []

    try:
        asyncio.run(main())
    finally:
        MemoryBackend.forget(memory_url(tmp_path))
