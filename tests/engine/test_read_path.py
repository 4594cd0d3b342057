"""The read path's shortcuts keep their promises: nothing skipped, nothing stale."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest

import ckptio.backends as backends
from ckptio.backends.local import LocalBackend
from ckptio.backends.memory import MemoryBackend


@pytest.fixture
def fresh_plugins() -> Any:
    backends._plugins.cache_clear()
    yield
    backends._plugins.cache_clear()


def test_backend_entry_points_are_read_once_per_process_and_still_override(monkeypatch: Any, fresh_plugins: Any) -> None:
    calls = []

    def fake_entry_points(group: str) -> list[EntryPoint]:
        calls.append(group)
        return [EntryPoint("file", "ckptio.backends.memory:MemoryBackend", group)]

    monkeypatch.setattr(backends, "entry_points", fake_entry_points)
    assert backends.backend_class("file") is MemoryBackend  # a plugin overrides a built-in scheme
    assert backends.backend_class("file") is MemoryBackend
    assert backends.backend_class("mem") is MemoryBackend
    with pytest.raises(ValueError, match="no ckptio backend"):
        backends.backend_class("nope")
    assert calls == ["ckptio.backends"]  # one scan, however many stores a process opens


def test_the_builtin_local_backend_without_plugins(monkeypatch: Any, fresh_plugins: Any) -> None:
    monkeypatch.setattr(backends, "entry_points", lambda group: [])
    assert backends.backend_class("file") is LocalBackend


def test_start_workers_starts_every_thread_up_front_and_the_pool_still_works() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ckptio.system import start_workers

    pool = start_workers(ThreadPoolExecutor(4, thread_name_prefix="t"), 4)
    try:
        assert len(pool._threads) == 4 and all(t.is_alive() for t in pool._threads)
        gate = threading.Barrier(5)  # four tasks at once run on the four started threads
        futures = [pool.submit(gate.wait, 5) for _ in range(4)]
        gate.wait(5)
        assert [f.result() is not None for f in futures] == [True] * 4
        assert len(pool._threads) == 4
    finally:
        pool.shutdown()


def test_a_local_backend_and_an_engine_start_their_read_threads_before_the_reads(tmp_path: Any) -> None:
    import asyncio

    import numpy as np

    from ckptio.backends.base import ByteRange
    from ckptio.engine import Engine, EngineConfig, ReadRequest
    from ckptio.system.checksum import block_crcs

    backend = LocalBackend(str(tmp_path), threads=3)
    engine = Engine(backend, EngineConfig(checksum_threads=2))
    data = np.arange(1 << 20, dtype=np.uint8)
    out = np.zeros_like(data)

    async def go() -> None:
        await backend.write("obj", [memoryview(data)])
        req = ReadRequest("obj", ByteRange(0, data.nbytes), [memoryview(out)],
                          [(0, data.nbytes, block_crcs(memoryview(data), 1 << 16), "x")], block_size=1 << 16)
        await engine.read([req])

    asyncio.run(go())
    assert (out == data).all()
    assert backend._pool.pool is not None and len(backend._pool.pool._threads) == 3
    assert engine._cpu.pool is not None and len(engine._cpu.pool._threads) == 2
    engine.close()
    asyncio.run(backend.close())
