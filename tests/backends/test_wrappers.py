"""The wrapper backends: each passes the conformance suite around MemoryBackend, then its own tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptio.backends import RetryableError
from ckptio.backends import memory as memory_module
from ckptio.backends.base import Backend, ByteRange
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import (
    CountingBackend,
    FaultInjectingBackend,
    LatencyBackend,
    MethodStats,
    ReadOnlyBackend,
    WrapperBackend,
)
from ckptio.testing import BackendConformance


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[MemoryBackend]:
    url = f"mem://{tmp_path}"
    yield MemoryBackend(url)
    MemoryBackend.forget(url)


# -- the conformance suite, through each wrapper ----------------------------------


class _OverMemory(BackendConformance):
    """Wraps a MemoryBackend named after tmp_path; forgets every store the test made."""

    def wrap(self, inner: Backend) -> Backend:
        raise NotImplementedError

    def make_backend(self, tmp_path: Path) -> Backend:
        return self.wrap(MemoryBackend(f"mem://{tmp_path}"))

    @pytest.fixture(autouse=True)
    def _forget_stores(self, tmp_path: Path) -> Iterator[None]:
        yield
        for url in [u for u in memory_module._STORES if u.startswith(f"mem://{tmp_path}")]:
            MemoryBackend.forget(url)


class TestCountingConformance(_OverMemory):
    def wrap(self, inner: Backend) -> Backend:
        return CountingBackend(inner)


class TestLatencyConformance(_OverMemory):
    state_machine_examples = 10

    def wrap(self, inner: Backend) -> Backend:
        return LatencyBackend(inner, 0.0002, jitter=0.0005)


class TestFaultInjectingAtRateZeroConformance(_OverMemory):
    def wrap(self, inner: Backend) -> Backend:
        return FaultInjectingBackend(inner, rate=0.0, corrupt_reads=True, truncate_writes=True)


class TestReadOnlyConformance(_OverMemory):
    """Read-path tests run on data seeded through the wrapped (writable) backend."""

    def wrap(self, inner: Backend) -> Backend:
        return ReadOnlyBackend(inner)

    def writer_for(self, backend: Backend) -> Backend:
        assert isinstance(backend, ReadOnlyBackend)
        return backend.inner


# -- delegation --------------------------------------------------------------


class _SpyBackend(MemoryBackend):
    """Records the calls that wrappers must pass through untouched."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.seen: list[str] = []

    async def list_children(self, prefix: str = "") -> list[str]:
        self.seen.append(f"list_children:{prefix}")
        return await super().list_children(prefix)

    async def sync(self) -> None:
        self.seen.append("sync")

    async def close(self) -> None:
        self.seen.append("close")


WRAPPERS: list[Callable[[Backend], WrapperBackend]] = [
    WrapperBackend,
    CountingBackend,
    lambda b: LatencyBackend(b, 0.0),
    lambda b: FaultInjectingBackend(b, rate=0.0),
    ReadOnlyBackend,
]


@pytest.mark.parametrize("wrap", WRAPPERS, ids=["plain", "counting", "latency", "faults", "read_only"])
def test_wrappers_delegate(tmp_path: Path, wrap: Callable[[Backend], WrapperBackend]) -> None:
    spy = _SpyBackend(f"mem://{tmp_path}")
    w = wrap(spy)
    try:
        assert w.url == spy.url and spy.url in repr(w)
        if isinstance(w, ReadOnlyBackend):
            assert w.capabilities.read_only and not spy.capabilities.read_only
            assert w.capabilities.alignment == spy.capabilities.alignment
        else:
            assert w.capabilities is spy.capabilities

        async def main() -> None:
            await spy.write("d/x", [memoryview(b"x")])
            assert await w.list_children("d") == ["x"]
            await w.sync()
            await w.close()

        run(main())
        assert spy.seen == ["list_children:d", "sync", "close"]
    finally:
        MemoryBackend.forget(spy.url)


# -- FaultInjectingBackend -------------------------------------------------------


def test_fault_arguments_are_checked(mem: MemoryBackend) -> None:
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError):
            FaultInjectingBackend(mem, rate=rate)
    with pytest.raises(ValueError, match="fail_after"):
        FaultInjectingBackend(mem, rate=0.5, fail_after=2.0)
    with pytest.raises(ValueError, match="read"):
        FaultInjectingBackend(mem, rate=0.5, faults=("read",))


def test_error_before_the_call_has_no_effect(mem: MemoryBackend) -> None:
    f = FaultInjectingBackend(mem, rate=1.0, faults=("write", "create_if_absent", "delete"), retry_after=2.5)

    async def main() -> None:
        with pytest.raises(RetryableError) as info:
            await f.write("k", [memoryview(b"data")])
        assert info.value.retry_after == 2.5 and "'k'" in str(info.value)
        with pytest.raises(RetryableError):
            await f.create_if_absent("c", b"data")
        assert await mem.list() == []
        await mem.write("k", [memoryview(b"old")])
        with pytest.raises(RetryableError):
            await f.delete("k")
        assert await f.read("k") == b"old"  # stat and read_into were not named in faults
        await f.list_children()

    run(main())
    assert f.injected == {("write", "error"): 1, ("create_if_absent", "error"): 1, ("delete", "error"): 1}


def test_error_after_the_call_is_a_lost_reply(mem: MemoryBackend) -> None:
    f = FaultInjectingBackend(mem, rate=1.0, faults=("create_if_absent", "write"), fail_after=1.0)

    async def main() -> None:
        with pytest.raises(RetryableError):
            await f.create_if_absent("manifest", b"v1")
        # The create happened; a retry meets the object it made itself.
        assert await mem.read("manifest") == b"v1"
        with pytest.raises(FileExistsError):
            await mem.create_if_absent("manifest", b"v1")
        with pytest.raises(RetryableError):
            await f.write("obj", [memoryview(b"done")])
        assert await mem.read("obj") == b"done"

    run(main())


def test_fault_rate_and_seed_are_reproducible(mem: MemoryBackend) -> None:
    run(mem.write("k", [memoryview(b"x")]))

    def outcomes(seed: int, rate: float = 0.3, n: int = 1000) -> list[bool]:
        f = FaultInjectingBackend(mem, rate=rate, seed=seed)

        async def main() -> list[bool]:
            out = []
            for _ in range(n):
                try:
                    await f.stat("k")
                    out.append(True)
                except RetryableError:
                    out.append(False)
            return out

        result = run(main())
        assert f.injected[("stat", "error")] == result.count(False)
        return result

    first = outcomes(seed=1)
    assert 230 <= first.count(False) <= 370  # 300 expected, sigma ~14.5
    assert outcomes(seed=1) == first
    assert outcomes(seed=2) != first
    assert all(outcomes(seed=3, rate=0.0, n=200))
    assert not any(outcomes(seed=3, rate=1.0, n=200))


def test_corrupt_reads_flip_one_byte_of_the_data_returned(mem: MemoryBackend) -> None:
    data = bytes(range(256)) * 16
    run(mem.write("k", [memoryview(data)]))
    f = FaultInjectingBackend(mem, rate=1.0, faults=(), corrupt_reads=True, seed=5)

    async def main() -> None:
        for start, end in [(0, len(data)), (100, 3000), (7, 8)]:
            a, b = np.empty((end - start) // 2, np.uint8), bytearray(end - start - (end - start) // 2)
            await f.read_into("k", ByteRange(start, end), [memoryview(a), memoryview(b)])
            got = a.tobytes() + bytes(b)
            assert sum(x != y for x, y in zip(got, data[start:end])) == 1
        await f.read_into("k", ByteRange(5, 5), [])  # nothing to corrupt in an empty range
        assert await mem.read("k") == data  # storage itself is intact

    run(main())
    assert f.injected[("read_into", "corrupt")] == 4


def test_truncate_reads_leave_a_tail_unfilled(mem: MemoryBackend) -> None:
    data = bytes(range(1, 201))
    run(mem.write("k", [memoryview(data)]))
    f = FaultInjectingBackend(mem, rate=1.0, faults=(), truncate_reads=True, seed=9)

    async def main() -> None:
        for _ in range(20):
            parts = [bytearray(50), bytearray(0), bytearray(150)]
            await f.read_into("k", ByteRange(0, 200), [memoryview(p) for p in parts])
            got = b"".join(parts)
            filled = len(got.rstrip(b"\0"))
            assert filled < 200 and got[:filled] == data[:filled]

    run(main())


def test_corrupt_and_truncate_writes(mem: MemoryBackend) -> None:
    data = np.arange(1000, dtype=np.float32)
    raw = data.tobytes()

    async def main() -> None:
        corrupt = FaultInjectingBackend(mem, rate=1.0, faults=(), corrupt_writes=True)
        await corrupt.write("c", [memoryview(data[:10]), memoryview(data[10:])])
        stored = await mem.read("c")
        assert len(stored) == len(raw) and sum(x != y for x, y in zip(stored, raw)) == 1
        await corrupt.create_if_absent("cc", raw)
        assert sum(x != y for x, y in zip(await mem.read("cc"), raw)) == 1

        truncate = FaultInjectingBackend(mem, rate=1.0, faults=(), truncate_writes=True)
        await truncate.write("t", [memoryview(data)])
        stored = await mem.read("t")
        assert len(stored) < len(raw) and raw.startswith(stored)
        await truncate.write("empty", [])  # an empty object has nothing to lose
        assert await mem.read("empty") == b""
        assert data.tobytes() == raw  # the caller's buffers were not touched

    run(main())


def test_faults_mix_errors_and_corruption(mem: MemoryBackend) -> None:
    run(mem.write("k", [memoryview(bytes(1000))]))
    f = FaultInjectingBackend(mem, rate=1.0, faults=("read_into",), corrupt_reads=True, seed=3)

    async def main() -> None:
        for _ in range(100):
            buf = bytearray(1000)
            try:
                await f.read_into("k", ByteRange(0, 1000), [memoryview(buf)])
            except RetryableError:
                continue
            assert buf.count(0) == 999

    run(main())
    assert f.injected[("read_into", "error")] + f.injected[("read_into", "corrupt")] == 100
    assert 25 < f.injected[("read_into", "error")] < 75


# -- LatencyBackend -------------------------------------------------------------


def test_latency_overlaps_across_concurrent_calls(mem: MemoryBackend) -> None:
    run(mem.write("k", [memoryview(b"x")]))
    slow = LatencyBackend(mem, 0.05)

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(slow.stat("k") for _ in range(20)))
        return time.perf_counter() - t0

    elapsed = run(main())
    assert 0.05 <= elapsed < 0.5, elapsed  # 20 sequential calls would take 1 s


def test_latency_bandwidth_and_jitter(mem: MemoryBackend) -> None:
    with pytest.raises(ValueError):
        LatencyBackend(mem, -1.0)
    with pytest.raises(ValueError):
        LatencyBackend(mem, 0.0, bandwidth=0)
    slow = LatencyBackend(mem, 0.0, bandwidth=10e6, jitter=0.01)

    async def main() -> float:
        t0 = time.perf_counter()
        await slow.write("big", [memoryview(bytes(1 << 20))])  # 1 MiB at 10 MB/s: >= 0.1 s
        return time.perf_counter() - t0

    elapsed = run(main())
    assert 0.1 <= elapsed < 1.0, elapsed


# -- CountingBackend ------------------------------------------------------------


def test_counting_calls_and_bytes(mem: MemoryBackend) -> None:
    c = CountingBackend(mem)
    arr = np.zeros((10, 10), np.float64)

    async def main() -> None:
        await c.write("a", [memoryview(arr), memoryview(b"tail")])  # 804 bytes
        await c.create_if_absent("m", b"12345")
        with pytest.raises(FileExistsError):
            await c.create_if_absent("m", b"ignored")
        dest = np.empty(25, np.float32)
        await c.read_into("a", ByteRange(100, 200), [memoryview(dest)])
        assert await c.read("m") == b"12345"  # stat + read_into
        with pytest.raises(FileNotFoundError):
            await c.stat("missing")
        await c.list()
        await c.list_children()
        await c.delete("m")
        await c.sync()

    run(main())
    assert c.bytes_written == 804 + 5
    assert c.bytes_read == 100 + 5
    assert c.reads == [("a", ByteRange(100, 200)), ("m", ByteRange(0, 5))]
    s = c.stats()
    assert s["write"] == MethodStats(calls=1, errors=0, bytes=804)
    assert s["create_if_absent"] == MethodStats(calls=2, errors=1, bytes=5)
    assert s["read_into"] == MethodStats(calls=2, errors=0, bytes=105)
    assert s["stat"] == MethodStats(calls=2, errors=1, bytes=0)
    assert [c.calls(m) for m in ("list", "list_children", "delete", "sync")] == [1, 1, 1, 1]
    s["write"].calls = 99  # a copy: the counters are not touched
    assert c.calls("write") == 1
    c.reset()
    assert c.bytes_read == c.bytes_written == 0 and c.reads == [] and c.calls("write") == 0


def test_counting_slice_read_costs_about_the_slice(mem: MemoryBackend) -> None:
    """The use the engine's tests make of it: reading a slice reads about the slice, not the object."""
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    run(mem.write("obj", [memoryview(big)]))
    c = CountingBackend(mem)
    out = np.empty(1000, np.float32)
    run(c.read_into("obj", ByteRange(4 * 5000, 4 * 6000), [memoryview(out)]))
    assert np.array_equal(out, big[5000:6000])
    assert c.bytes_read == out.nbytes


def test_counting_is_thread_safe(mem: MemoryBackend) -> None:
    c = CountingBackend(mem)
    threads, per_thread = 4, 300

    def worker(t: int) -> None:
        async def main() -> None:
            for i in range(per_thread):
                await c.write(f"t{t}/{i}", [memoryview(b"abc")])
                await c.read_into(f"t{t}/{i}", ByteRange(0, 2), [memoryview(bytearray(2))])

        asyncio.run(main())

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    n = threads * per_thread
    assert (c.calls("write"), c.bytes_written, c.calls("read_into"), c.bytes_read) == (n, 3 * n, n, 2 * n)
    assert len(c.reads) == n


def test_wrappers_stack(mem: MemoryBackend) -> None:
    """Counting around fault injection sees every attempt, failed ones as errors."""
    run(mem.write("k", [memoryview(b"x")]))
    c = CountingBackend(FaultInjectingBackend(mem, rate=0.5, seed=4, faults=("stat",)))

    async def main() -> int:
        failures = 0
        for _ in range(200):
            try:
                await c.stat("k")
            except RetryableError:
                failures += 1
        return failures

    failures = run(main())
    assert c.stats()["stat"] == MethodStats(calls=200, errors=failures, bytes=0)
    assert 60 < failures < 140


# -- ReadOnlyBackend ------------------------------------------------------------


def test_read_only_refuses_mutations_and_checks_keys_first(mem: MemoryBackend) -> None:
    run(mem.write("k", [memoryview(b"data")]))
    ro = ReadOnlyBackend(mem)

    async def main() -> None:
        for attempt in (
            lambda: ro.write("k", [memoryview(b"x")]),
            lambda: ro.create_if_absent("new", b"x"),
            lambda: ro.delete("k"),
        ):
            with pytest.raises(PermissionError, match="read-only"):
                await attempt()
        with pytest.raises(ValueError):
            await ro.write("../k", [memoryview(b"x")])
        assert await ro.read("k") == b"data"

    run(main())


def test_a_filling_write_passes_through_a_wrapper_only_if_it_leaves_write_alone(mem: MemoryBackend) -> None:
    """A wrapper that changes ``write`` (counts it, injects faults) sees a filling write as a write of
    its own, once every byte is in; one that does not passes it on, so the backend below streams."""
    from ckptio.testing._filling_checks import PieceFilling, filling_object

    calls: list[str] = []

    class Streaming(MemoryBackend):
        async def write_filling(self, key: str, buffers: Any, filling: Any) -> None:
            calls.append("write_filling")
            await super().write_filling(key, buffers, filling)

    inner = Streaming(mem.url)

    async def main() -> None:
        for wrapper, expected, writes in [(WrapperBackend(inner), "write_filling", 0),
                                          (CountingBackend(inner), "write", 1)]:
            calls.clear()
            src, buf, views = filling_object(3 << 20, 4)
            await wrapper.write_filling("k", views, PieceFilling(src, memoryview(buf), 1 << 20).start())
            assert calls == ([expected] if expected == "write_filling" else [])
            assert await inner.read("k") == src
            if isinstance(wrapper, CountingBackend):
                assert wrapper.calls("write") == writes

    run(main())
