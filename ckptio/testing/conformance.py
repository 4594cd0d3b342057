"""The backend conformance suite: one base test class that every backend's test file subclasses.

It checks each point of the contract in :mod:`ckptio.backends.base`, plus a
Hypothesis state machine that drives the backend and a dict model with the
same random operations and compares them after every step.

A backend's test file provides ``make_backend``; everything else is inherited::

    from ckptio.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        async def make_backend(self, tmp_path):        # may also be a plain def
            return MyBackend(f"my://test-bucket{tmp_path}")  # tmp_path: unique per test

How the suite drives a backend:

* Each test runs in its own event loop (``asyncio.run``; no pytest-asyncio),
  and ``make_backend`` is called *inside* that loop, so a backend may bind
  sessions to the running loop. ``close_backend`` is awaited at the end.
* ``make_backend(tmp_path)`` must return a backend over empty storage that
  no other test sees. Calling it again with the same ``tmp_path`` must give
  another client of the *same* storage (two clients of one bucket): the
  commit race runs across several instances. The state machine calls it
  with fresh sub-directories of ``tmp_path``, one per example.
* Fixtures the backend needs (a fake server, a mount) come in through an
  autouse fixture defined on the subclass; pytest binds it to the same
  instance as the test, so it can store them on ``self``.
* A read-only backend (``capabilities.read_only``) skips the tests of the
  write path and runs the read-path tests on data seeded through
  :meth:`BackendConformance.writer_for`, which it overrides to return a
  writable client of the same storage.
* Sizes and counts are class attributes, so a slow backend can shrink them;
  a test that cannot apply is overridden in the subclass with a skipped one.

Not required (file systems cannot do it): an object and a "directory" of the
same name (``a`` and ``a/b``) at once. No test stores both.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ckptio.backends.base import Backend, ByteRange, Capabilities, LayoutDefaults, ObjectInfo

from .model import machine_for, split_views

__all__ = ["BackendConformance", "backend_test", "split_views"]

T = TypeVar("T")
AsyncBody = Callable[[Any, Backend], Awaitable[None]]


def backend_test(fn: AsyncBody) -> Callable[[Any, Path], None]:
    """Make ``async def test_x(self, b)`` a pytest test that gets a fresh backend ``b``.

    The test runs in its own event loop; the backend is made and closed in
    that loop. Subclasses may use it for their own backend-specific tests.
    """

    def test(self: BackendConformance, tmp_path: Path) -> None:
        self.run_with_backend(tmp_path, lambda b: fn(self, b))

    # Copy the name but not ``__wrapped__``: pytest would read the wrapped
    # signature and look for a fixture called ``b``.
    test.__name__ = fn.__name__
    test.__qualname__ = fn.__qualname__
    test.__doc__ = fn.__doc__
    if hasattr(fn, "pytestmark"):
        test.pytestmark = fn.pytestmark  # type: ignore[attr-defined]
    return test


def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class BackendConformance:
    """The shared conformance tests. Subclass it and implement :meth:`make_backend`."""

    #: Examples and steps of the state machine (keep the whole class well under a minute).
    state_machine_examples: ClassVar[int] = 60
    state_machine_steps: ClassVar[int] = 30
    #: An object larger than the local backend's 8 MiB O_DIRECT bounce buffer.
    large_object_size: ClassVar[int] = (9 << 20) + 4099
    #: More buffers than one vectored system call takes (IOV_MAX is 1024 on Linux).
    many_buffers: ClassVar[int] = 1500
    concurrent_objects: ClassVar[int] = 100
    create_racers: ClassVar[int] = 16
    create_racer_instances: ClassVar[int] = 4
    #: How far ``ObjectInfo.mtime`` may be from this machine's clock.
    mtime_tolerance_s: ClassVar[float] = 600.0

    # -- what a backend's test file provides ------------------------------

    def make_backend(self, tmp_path: Path) -> Backend | Awaitable[Backend]:
        """A backend over storage named by ``tmp_path`` (may be a coroutine function)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_backend(self, tmp_path)")

    async def close_backend(self, backend: Backend) -> None:
        """Called at the end of every test, in the test's loop."""
        await backend.close()

    def writer_for(self, backend: Backend) -> Backend:
        """The backend that seeds data for read tests: ``backend`` itself unless read-only."""
        return backend

    # -- machinery ----------------------------------------------------------

    async def open_backend(self, tmp_path: Path) -> Backend:
        """Call :meth:`make_backend`, awaiting it if it is a coroutine."""
        made = self.make_backend(tmp_path)
        backend = await made if inspect.isawaitable(made) else made
        assert isinstance(backend, Backend), f"make_backend returned {backend!r}, not a Backend"
        return backend

    def run_with_backend(self, tmp_path: Path, body: Callable[[Backend], Awaitable[T]]) -> T:
        """Run ``body(backend)`` in a fresh event loop with a fresh backend."""

        async def main() -> T:
            backend = await self.open_backend(tmp_path)
            try:
                return await body(backend)
            finally:
                await self.close_backend(backend)

        return asyncio.run(main())

    @staticmethod
    def require_writable(b: Backend) -> None:
        if b.capabilities.read_only:
            pytest.skip("the backend declares read_only: write-path test")

    def seeder(self, b: Backend) -> Backend:
        """:meth:`writer_for` ``b``; skips the test if a read-only backend has no writer."""
        writer = self.writer_for(b)
        if writer.capabilities.read_only:
            pytest.skip(f"{type(self).__name__}.writer_for gives no writable client to seed data with")
        return writer

    async def put(self, b: Backend, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` through the seeding writer, in two buffers."""
        cut = len(data) // 3
        await self.seeder(b).write(key, [memoryview(data)[:cut], memoryview(data)[cut:]])

    async def assert_object(self, b: Backend, key: str, data: bytes) -> None:
        """``key`` holds exactly ``data``, by ``stat``, whole ``read`` and one ranged read."""
        info = await b.stat(key)
        assert (info.key, info.size) == (key, len(data))
        assert await b.read(key) == data
        buf = bytearray(len(data))
        await b.read_into(key, ByteRange(0, len(data)), [memoryview(buf)])
        assert buf == data

    # -- capabilities and identity -------------------------------------------

    @backend_test
    async def test_capabilities_declared(self, b: Backend) -> None:
        caps = b.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.alignment >= 1 and caps.alignment & (caps.alignment - 1) == 0
        assert caps.concurrency >= 1 and caps.preferred_io_size > 0
        assert isinstance(b.layout_defaults, LayoutDefaults) and b.layout_defaults.object_size > 0
        assert b.layout_defaults.dir_fanout >= 0 and b.layout_defaults.tile_bytes >= 0
        assert isinstance(b.url, str) and b.url
        assert b.url in repr(b)

    # -- write -----------------------------------------------------------

    @backend_test
    async def test_write_from_several_buffers(self, b: Backend) -> None:
        self.require_writable(b)
        parts = [b"hello", b"", b" ", bytearray(b"wide"), b"", b" world"]
        await b.write("greeting", [memoryview(p) for p in parts])
        await self.assert_object(b, "greeting", b"hello wide world")
        # A readonly view of immutable bytes and a slice of a larger buffer are both fine.
        big = bytearray(range(256))
        await b.write("slices", [memoryview(bytes(10)), memoryview(big)[100:200]])
        await self.assert_object(b, "slices", bytes(10) + bytes(big[100:200]))

    @backend_test
    async def test_write_numpy_arrays_of_many_dtypes(self, b: Backend) -> None:
        self.require_writable(b)
        rng = np.random.default_rng(0)
        arrays = [
            rng.integers(-128, 127, 33, dtype=np.int8),
            rng.integers(0, 255, (3, 5), dtype=np.uint8),
            rng.integers(0, 60000, 17, dtype=np.uint16),
            rng.integers(-(2**31), 2**31 - 1, (4, 3), dtype=np.int32),
            rng.integers(-(2**62), 2**62, 9, dtype=np.int64),
            rng.standard_normal(13).astype(np.float16),
            rng.standard_normal((2, 3, 4)).astype(np.float32),
            rng.standard_normal(7),
            (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
            rng.standard_normal((2, 2)) + 1j,
            rng.random(11) > 0.5,
            np.array(3.25, dtype=np.float32),  # a 0-d scalar
            np.zeros((0, 4), dtype=np.float32),  # zero-size
            np.array([np.nan, np.inf, -0.0], dtype=np.float64),
            # bfloat16 / float8 have no buffer format: adapters hand their bits over.
            rng.standard_normal((3, 3)).astype(ml_dtypes.bfloat16).view(np.uint16),
            rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
        ]
        await b.write("arrays", [memoryview(a) for a in arrays])
        expected = b"".join(a.tobytes() for a in arrays)
        await self.assert_object(b, "arrays", expected)
        # Read straight back into arrays of the same dtypes and shapes, in one call.
        outs = [np.empty_like(a) for a in arrays]
        await b.read_into("arrays", ByteRange(0, len(expected)), [memoryview(o) for o in outs])
        for a, o in zip(arrays, outs):
            assert a.tobytes() == o.tobytes(), a.dtype

    @backend_test
    async def test_zero_length_buffers_and_empty_objects(self, b: Backend) -> None:
        self.require_writable(b)
        await b.write("empty/none", [])
        await b.write("empty/zeros", [memoryview(b""), memoryview(bytearray()), memoryview(b"")])
        await b.write("empty/array", [memoryview(np.zeros((0, 3), np.float64)), memoryview(np.zeros(0, np.int8))])
        for key in ("empty/none", "empty/zeros", "empty/array"):
            await self.assert_object(b, key, b"")
            await b.read_into(key, ByteRange(0, 0), [])
            await b.read_into(key, ByteRange(0, 0), [memoryview(bytearray()), memoryview(np.zeros((0, 2)))])
            with pytest.raises(ValueError):
                await b.read_into(key, ByteRange(0, 1), [memoryview(bytearray(1))])
        assert [(i.key, i.size) for i in await b.list("empty/")] == [
            ("empty/array", 0),
            ("empty/none", 0),
            ("empty/zeros", 0),
        ]

    @backend_test
    async def test_overwrite_replaces_whole_object(self, b: Backend) -> None:
        self.require_writable(b)
        long, short = _payload(5000, 1), _payload(10, 2)
        await b.write("obj", [memoryview(long)])
        await b.write("obj", [memoryview(short[:4]), memoryview(short[4:])])
        await self.assert_object(b, "obj", short)  # no tail of the longer old object survives
        longer = _payload(7000, 3)
        await b.write("obj", [memoryview(longer)])
        await self.assert_object(b, "obj", longer)
        await b.write("obj", [])
        await self.assert_object(b, "obj", b"")
        assert [i.key for i in await b.list()] == ["obj"]

    @backend_test
    async def test_object_sizes_around_alignment(self, b: Backend) -> None:
        self.require_writable(b)
        align = max(b.capabilities.alignment, 4096)
        sizes = [1, 511, 512, align - 1, align, align + 1, 16 * align + 7, self.large_object_size]
        for i, size in enumerate(sizes):
            data = _payload(size, 100 + i)
            cut = size // 2 + 1 if size > 1 else 0  # an odd split: buffers are not aligned
            await b.write(f"sized/{size}", [memoryview(data)[:cut], memoryview(data)[cut:]])
            await self.assert_object(b, f"sized/{size}", data)
            start, end = min(3, size), max(min(3, size), size - 5)
            buf = bytearray(end - start)
            await b.read_into(f"sized/{size}", ByteRange(start, end), [memoryview(buf)])
            assert buf == data[start:end]

    @backend_test
    async def test_more_buffers_than_iov_max(self, b: Backend) -> None:
        self.require_writable(b)
        rng = random.Random(7)
        parts = [rng.randbytes(rng.choice([0, 1, 3, 8, 17])) for _ in range(self.many_buffers)]
        data = b"".join(parts)
        await b.write("many", [memoryview(p) for p in parts])
        await self.assert_object(b, "many", data)
        # ...and read back into as many destination buffers, cut elsewhere.
        cuts = sorted(rng.randrange(len(data) + 1) for _ in range(self.many_buffers - 1))
        dest = bytearray(len(data))
        await b.read_into("many", ByteRange(0, len(data)), split_views(dest, cuts))
        assert dest == data

    # -- read ------------------------------------------------------------

    @backend_test
    async def test_read_ranges(self, b: Backend) -> None:
        data = _payload(10_000, 11)
        bounds = [1, 1000, 1000, 5096]  # the object is written as buffers cut here
        await self.seeder(b).write(
            "ranged", [memoryview(data)[x:y] for x, y in itertools.pairwise([0, *bounds, len(data)])]
        )
        n = len(data)
        ranges = [
            (0, 0), (0, 1), (0, n), (0, 1000), (1, 1000),  # start
            (999, 1001), (995, 5100), (5000, 5001),  # middle, across the written buffers' edges
            (n - 1, n), (n - 4096, n), (n, n),  # end, and the empty range at the end
            (4321, 4321),  # empty, in the middle
        ]  # fmt: skip
        for start, end in ranges:
            buf = bytearray(end - start)
            await b.read_into("ranged", ByteRange(start, end), [memoryview(buf)])
            assert buf == data[start:end], (start, end)

    @backend_test
    async def test_read_into_several_destination_buffers(self, b: Backend) -> None:
        data = _payload(8192, 12)
        await self.put(b, "dest", data)
        rng = random.Random(3)
        for start, end in [(0, 8192), (100, 7000), (4095, 4097), (17, 17)]:
            length = end - start
            for _ in range(5):
                cuts = sorted(rng.randrange(length + 1) for _ in range(rng.randrange(6)))
                dest = bytearray(length)
                await b.read_into("dest", ByteRange(start, end), split_views(dest, cuts))
                assert dest == data[start:end], (start, end, cuts)
        # Typed destinations: a float32 array and a 2-D int16 array share one range.
        f32, i16 = np.empty(100, np.float32), np.empty((10, 10), np.int16)
        await b.read_into("dest", ByteRange(96, 96 + 400 + 200), [memoryview(f32), memoryview(i16)])
        assert f32.tobytes() + i16.tobytes() == data[96:696]

    @backend_test
    async def test_read_past_end_is_an_error(self, b: Backend) -> None:
        data = _payload(100, 13)
        await self.put(b, "short", data)
        for start, end in [(0, 101), (99, 101), (100, 101), (101, 101), (150, 200)]:
            with pytest.raises(ValueError):
                await b.read_into("short", ByteRange(start, end), [memoryview(bytearray(end - start))])
        await self.assert_object(b, "short", data)

    @backend_test
    async def test_read_with_wrong_buffer_total_is_an_error(self, b: Backend) -> None:
        await self.put(b, "obj", _payload(100, 14))
        for sizes in ([9], [11], [5, 6], []):
            with pytest.raises(ValueError):
                await b.read_into("obj", ByteRange(0, 10), [memoryview(bytearray(n)) for n in sizes])

    @backend_test
    async def test_missing_objects(self, b: Backend) -> None:
        await self.put(b, "dir/obj", b"x")
        await self.put(b, "file", b"y")
        # Absent keys, a "directory" (a prefix of keys, no object) and a key beneath an object.
        for key in ("nothing", "dir/nothing", "dir", "nothing/deeper", "file/under"):
            with pytest.raises(FileNotFoundError):
                await b.stat(key)
            with pytest.raises(FileNotFoundError):
                await b.read_into(key, ByteRange(0, 0), [])
            with pytest.raises(FileNotFoundError):
                await b.read_into(key, ByteRange(0, 1), [memoryview(bytearray(1))])
            with pytest.raises(FileNotFoundError):
                await b.read(key)
            if not b.capabilities.read_only:
                with pytest.raises(FileNotFoundError):
                    await b.delete(key)
        await self.assert_object(b, "dir/obj", b"x")
        await self.assert_object(b, "file", b"y")

    # -- create_if_absent --------------------------------------------------

    @backend_test
    async def test_create_if_absent(self, b: Backend) -> None:
        self.require_writable(b)
        await b.create_if_absent("commit/manifest", b"first")
        await self.assert_object(b, "commit/manifest", b"first")
        with pytest.raises(FileExistsError):
            await b.create_if_absent("commit/manifest", b"second")
        await self.assert_object(b, "commit/manifest", b"first")
        # An object made by write counts as present too.
        await b.write("written", [memoryview(b"w")])
        with pytest.raises(FileExistsError):
            await b.create_if_absent("written", b"c")
        await self.assert_object(b, "written", b"w")
        # Deleted, it can be created again; new parent "directories" and empty data are fine.
        await b.delete("commit/manifest")
        await b.create_if_absent("commit/manifest", b"again")
        await self.assert_object(b, "commit/manifest", b"again")
        await b.create_if_absent("new/deep/dir/marker", b"")
        await self.assert_object(b, "new/deep/dir/marker", b"")
        await b.create_if_absent("from-memoryview", memoryview(b"mv").tobytes())
        await self.assert_object(b, "from-memoryview", b"mv")

    @backend_test
    async def test_create_if_absent_race_has_one_winner(self, b: Backend) -> None:
        self.require_writable(b)
        if not b.capabilities.conditional_create:
            pytest.skip("the backend does not declare conditional_create")
        tmp_path = self._tmp_path

        async def race(clients: Sequence[Backend], key: str) -> None:
            payloads = [f"writer {i} ".encode() * (i + 1) for i in range(self.create_racers)]
            results = await asyncio.gather(
                *(clients[i % len(clients)].create_if_absent(key, p) for i, p in enumerate(payloads)),
                return_exceptions=True,
            )
            winners = [p for p, r in zip(payloads, results) if r is None]
            losers = [r for r in results if r is not None]
            assert len(winners) == 1, results
            assert all(isinstance(r, FileExistsError) for r in losers), losers
            await self.assert_object(b, key, winners[0])

        for round_ in range(3):  # one client, many concurrent creators
            await race([b], f"race/one-client/{round_}")
        others = [await self.open_backend(tmp_path) for _ in range(self.create_racer_instances - 1)]
        try:  # several clients of the same storage
            for round_ in range(3):
                await race([b, *others], f"race/many-clients/{round_}")
        finally:
            for other in others:
                await self.close_backend(other)

    # -- delete ------------------------------------------------------------

    @backend_test
    async def test_delete(self, b: Backend) -> None:
        self.require_writable(b)
        for key in ("a/b/c", "a/b/d", "a/e", "f"):
            await b.write(key, [memoryview(key.encode())])
        await b.delete("a/b/c")
        with pytest.raises(FileNotFoundError):
            await b.stat("a/b/c")
        with pytest.raises(FileNotFoundError):
            await b.read("a/b/c")
        with pytest.raises(FileNotFoundError):
            await b.delete("a/b/c")
        assert [i.key for i in await b.list()] == ["a/b/d", "a/e", "f"]
        await b.delete("a/b/d")
        # No empty "directory" lingers once its last object is gone.
        assert await b.list_children("a") == ["e"]
        assert await b.list_children("a/b") == []
        await b.delete("a/e")
        await b.delete("f")
        assert await b.list() == []
        assert await b.list_children() == []
        await b.write("a/b/c", [memoryview(b"back")])  # and the same names can be used again
        await self.assert_object(b, "a/b/c", b"back")

    @backend_test
    async def test_delete_missing(self, b: Backend) -> None:
        self.require_writable(b)
        with pytest.raises(FileNotFoundError):
            await b.delete("never/was")

    # -- list, list_children, stat -----------------------------------------

    _TREE: ClassVar[dict[str, int]] = {
        "a/b/c": 3, "a/b/d": 0, "a/bc": 7, "a/c": 1, "ab": 2, "b": 5,
        "3f/ckpt/step_1/obj-0": 10, "3f/ckpt/step_1/obj-1": 11, "a/b/e/f/g": 4,
    }  # fmt: skip

    async def _seed_tree(self, b: Backend) -> None:
        await asyncio.gather(*(self.put(b, k, _payload(n, n)) for k, n in self._TREE.items()))

    @backend_test
    async def test_list_by_prefix(self, b: Backend) -> None:
        await self._seed_tree(b)
        expect = lambda p: sorted((k, n) for k, n in self._TREE.items() if k.startswith(p))
        for prefix in ["", "a", "a/", "a/b", "a/b/", "a/b/c", "a/b/e/f/", "ab", "b", "3f/", "3f/ckpt/step_", "z", "a/x/"]:
            listed = await b.list(prefix)
            assert [(i.key, i.size) for i in listed] == expect(prefix), prefix
            assert all(isinstance(i, ObjectInfo) for i in listed)
        everything = await b.list()
        assert [i.key for i in everything] == sorted(self._TREE)
        now = time.time()
        for info in everything:
            assert abs(info.mtime - now) < self.mtime_tolerance_s, info

    @backend_test
    async def test_list_children(self, b: Backend) -> None:
        await self._seed_tree(b)
        assert await b.list_children() == ["3f", "a", "ab", "b"]
        assert await b.list_children("") == ["3f", "a", "ab", "b"]
        assert await b.list_children("a") == ["b", "bc", "c"]
        assert await b.list_children("a/") == ["b", "bc", "c"]
        assert await b.list_children("a/b") == ["c", "d", "e"]
        assert await b.list_children("a/b/e") == ["f"]
        assert await b.list_children("3f/ckpt/step_1") == ["obj-0", "obj-1"]
        assert await b.list_children("nothing") == []
        assert await b.list_children("a/nothing/") == []

    @backend_test
    async def test_stat_sizes(self, b: Backend) -> None:
        sizes = [0, 1, 7, 4095, 4096, 4097, 100_000]
        for n in sizes:
            await self.put(b, f"stat/{n}", _payload(n, n))
        before = time.time()
        for n in sizes:
            info = await b.stat(f"stat/{n}")
            assert (info.key, info.size) == (f"stat/{n}", n)
            assert abs(info.mtime - before) < self.mtime_tolerance_s
        assert {(i.key, i.size) for i in await b.list("stat/")} == {(f"stat/{n}", n) for n in sizes}

    # -- keys ------------------------------------------------------------

    BAD_KEYS: ClassVar[tuple[str, ...]] = (
        "", "/abs", "/", "a/../b", "..", "../escape", "a/..", ".", "./a", "a/./b",
        "a//b", "a/", "//", "a\\b", "nul\x00byte",
    )  # fmt: skip
    #: Bad for ``list`` and ``list_children`` alike (the latter may forgive trailing slashes).
    BAD_PREFIXES: ClassVar[tuple[str, ...]] = ("/", "/abs/", "../", "a/../", "./", "x/./y", "a/../b/")

    @backend_test
    async def test_invalid_keys_are_rejected(self, b: Backend) -> None:
        await self.put(b, "good", b"g")
        calls: list[tuple[str, Callable[[str], Awaitable[Any]]]] = [
            ("stat", b.stat),
            ("read_into", lambda k: b.read_into(k, ByteRange(0, 0), [])),
            ("read", b.read),
            ("write", lambda k: b.write(k, [memoryview(b"x")])),
            ("create_if_absent", lambda k: b.create_if_absent(k, b"x")),
            ("delete", b.delete),
        ]
        for key in self.BAD_KEYS:
            for name, call in calls:
                with pytest.raises(ValueError) as info:
                    await call(key)
                if key:  # the message names the offending key
                    assert repr(key) in str(info.value) or key in str(info.value), (name, key, info.value)
        for prefix in self.BAD_PREFIXES:
            with pytest.raises(ValueError):
                await b.list(prefix)
            with pytest.raises(ValueError):
                await b.list_children(prefix)
        # A partial last component may look odd ("..hidden" starts with ".."), but as a
        # directory to list the children of, ".." is outside the root.
        await b.list("..")
        with pytest.raises(ValueError):
            await b.list_children("..")
        assert [i.key for i in await b.list()] == ["good"]  # nothing was written anywhere

    @backend_test
    async def test_unusual_but_valid_keys(self, b: Backend) -> None:
        keys = ["..hidden", "a/...", ".dotfile", "a b/c d", "ünïcødé/键", "x" * 200, "a/.b/c", "trailing."]
        for i, key in enumerate(keys):
            await self.put(b, key, _payload(i + 1, i))
        for i, key in enumerate(keys):
            await self.assert_object(b, key, _payload(i + 1, i))
        assert [i.key for i in await b.list()] == sorted(keys)

    # -- concurrency -----------------------------------------------------

    @backend_test
    async def test_concurrent_writes_of_many_objects(self, b: Backend) -> None:
        self.require_writable(b)
        keys = [f"step_1/d{i % 5}/obj-{i:04d}" for i in range(self.concurrent_objects)]
        datas = {k: _payload(1000 + 37 * i, i) for i, k in enumerate(keys)}
        await asyncio.gather(*(b.write(k, [memoryview(d)[:500], memoryview(d)[500:]]) for k, d in datas.items()))

        async def check(key: str) -> None:
            buf = bytearray(len(datas[key]))
            await b.read_into(key, ByteRange(0, len(buf)), [memoryview(buf)])
            assert buf == datas[key], key

        await asyncio.gather(*(check(k) for k in keys))
        assert [(i.key, i.size) for i in await b.list("step_1/")] == sorted((k, len(d)) for k, d in datas.items())

    @backend_test
    async def test_concurrent_overwrites_are_atomic(self, b: Backend) -> None:
        """Readers racing writers see some whole version, never a mix or a partial object."""
        self.require_writable(b)
        if not b.capabilities.atomic_write:
            pytest.skip("the backend does not declare atomic_write")
        size, versions = 256 << 10, 8
        await b.write("hot", [memoryview(bytes([0]) * size)])
        torn: list[set[int]] = []

        async def writer(v: int) -> None:
            for _ in range(3):
                chunk = bytes([v]) * (size // 4)
                await b.write("hot", [memoryview(chunk)] * 4)  # the same buffer four times

        async def reader() -> None:
            for _ in range(10):
                buf = await b.read("hot")
                if len(buf) != size or len(set(buf)) != 1:
                    torn.append(set(buf))
                await asyncio.sleep(0)

        await asyncio.gather(*(writer(v) for v in range(1, versions + 1)), *(reader() for _ in range(4)))
        assert not torn, f"{len(torn)} torn reads"
        final = await b.read("hot")
        assert len(final) == size and len(set(final)) == 1 and final[0] in range(1, versions + 1)

    @backend_test
    async def test_concurrent_writes_and_deletes_in_one_directory(self, b: Backend) -> None:
        """Deleting a directory's last object while another write lands there loses nothing."""
        self.require_writable(b)

        async def churn(i: int) -> None:
            for j in range(10):
                await b.write(f"busy/sub/t{i}-{j}", [memoryview(b"x")])
                await b.delete(f"busy/sub/t{i}-{j}")

        async def keep(i: int) -> None:
            for j in range(10):
                await b.write(f"busy/sub/k{i}-{j}", [memoryview(b"k")])
                await b.delete(f"busy/sub/k{i}-{j}")
            await b.write(f"busy/sub/k{i}", [memoryview(b"kept")])

        await asyncio.gather(*(churn(i) for i in range(6)), *(keep(i) for i in range(6)))
        assert [i.key for i in await b.list("busy/")] == sorted(f"busy/sub/k{i}" for i in range(6))

    # -- capabilities: read-only, sync ---------------------------------------

    @backend_test
    async def test_read_only_refuses_writes(self, b: Backend) -> None:
        if not b.capabilities.read_only:
            pytest.skip("the backend does not declare read_only")
        writer = self.writer_for(b)
        if writer is not b:
            await writer.write("seeded", [memoryview(b"seed")])
        with pytest.raises(PermissionError):
            await b.write("new", [memoryview(b"x")])
        with pytest.raises(PermissionError):
            await b.create_if_absent("new", b"x")
        if writer is not b:
            with pytest.raises(PermissionError):
                await b.write("seeded", [memoryview(b"x")])
            with pytest.raises(PermissionError):
                await b.delete("seeded")
            await self.assert_object(b, "seeded", b"seed")
        with pytest.raises(FileNotFoundError):
            await b.stat("new")

    @backend_test
    async def test_sync(self, b: Backend) -> None:
        await b.sync()  # on a fresh backend: nothing to do
        if b.capabilities.read_only:
            return
        for key in ("s/a/1", "s/a/2", "s/b/deep/3", "top"):
            await b.write(key, [memoryview(key.encode())])
        await b.create_if_absent("s/commit", b"c")
        await b.sync()
        await b.delete("s/b/deep/3")  # its directories go away before the next sync
        await b.sync()
        await b.sync()
        for key in ("s/a/1", "s/a/2", "top"):
            await self.assert_object(b, key, key.encode())

    @backend_test
    async def test_sweep_of_temporaries_spares_every_object(self, b: Backend) -> None:
        """After complete writes and a commit there is nothing temporary: the sweep, even with no
        grace at all, removes nothing and every object stays whole."""
        keys = ["t/a", "t/b/c", "top"]
        for key in keys:
            await self.put(b, key, key.encode() * 100)
        if not self.seeder(b).capabilities.read_only:
            await self.seeder(b).create_if_absent("t/commit", b"c")
            keys.append("t/commit")
        assert await b.sweep_temporaries(0.0) == []
        assert await b.sweep_temporaries(0.0, dry_run=True) == []
        assert sorted(i.key for i in await b.list()) == sorted(keys)
        await self.assert_object(b, "t/b/c", b"t/b/c" * 100)

    # -- event loops ---------------------------------------------------------

    def test_one_backend_on_several_event_loops(self, tmp_path: Path) -> None:
        """One instance driven from successive ``asyncio.run`` loops and two loop threads at
        once (the engine's loop, Orbax's per-commit loops), closed, and used again after."""
        b = asyncio.run(self.open_backend(tmp_path))
        self.require_writable(b)

        async def first() -> None:
            await b.write("a", [memoryview(b"one")])

        asyncio.run(first())  # that loop ends here: whatever it bound must not break the next one
        assert asyncio.run(b.read("a")) == b"one"
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            async def body() -> None:
                for j in range(4):
                    await b.write(f"t{i}/{j}", [memoryview(bytes([i, j]))])
                    assert await b.read(f"t{i}/{j}") == bytes([i, j])
                await b.close_loop()

            try:
                asyncio.run(body())
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

        async def last() -> None:
            assert len(await b.list("t")) == 8
            await b.close()
            assert await b.read("a") == b"one"  # usable after close
            await self.close_backend(b)

        asyncio.run(last())

    # -- the model check ---------------------------------------------------

    def test_state_machine_against_dict_model(self, tmp_path: Path) -> None:
        machine = machine_for(self, tmp_path)
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.state_machine_examples,
                stateful_step_count=self.state_machine_steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )

    @pytest.fixture(autouse=True)
    def _remember_tmp_path(self, tmp_path: Path) -> None:
        # Tests that open extra clients of the same storage need the test's tmp_path.
        self._tmp_path = tmp_path
