"""Conformance checks of the byte path: declarations, ``write``, ``read_into``, ``create_if_absent``.

Part of :class:`ckptio.testing.BackendConformance`; see :mod:`ckptio.testing.conformance`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import pytest

from ckptio.backends.base import Backend, ByteRange, Capabilities, LayoutDefaults
from ckptio.testing._harness import ConformanceHarness, backend_test, payload
from ckptio.testing.model import split_views

__all__ = ["ByteChecks"]


class ByteChecks(ConformanceHarness):
    """Objects go in whole, from any buffers, and come back byte for byte; one create wins a race."""

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
        long, short = payload(5000, 1), payload(10, 2)
        await b.write("obj", [memoryview(long)])
        await b.write("obj", [memoryview(short[:4]), memoryview(short[4:])])
        await self.assert_object(b, "obj", short)  # no tail of the longer old object survives
        longer = payload(7000, 3)
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
            data = payload(size, 100 + i)
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
        data = payload(10_000, 11)
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
        data = payload(8192, 12)
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
        data = payload(100, 13)
        await self.put(b, "short", data)
        for start, end in [(0, 101), (99, 101), (100, 101), (101, 101), (150, 200)]:
            with pytest.raises(ValueError):
                await b.read_into("short", ByteRange(start, end), [memoryview(bytearray(end - start))])
        await self.assert_object(b, "short", data)

    @backend_test
    async def test_read_with_wrong_buffer_total_is_an_error(self, b: Backend) -> None:
        await self.put(b, "obj", payload(100, 14))
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
