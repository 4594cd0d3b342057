"""Conformance checks of the key space: ``delete``, ``list``, ``list_children``, ``stat``, key validation.

Part of :class:`ckptio.testing.BackendConformance`; see :mod:`ckptio.testing.conformance`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest

from ckptio.backends.base import Backend, ByteRange, ObjectInfo
from ckptio.testing._harness import ConformanceHarness, backend_test, payload

__all__ = ["NamespaceChecks"]


class NamespaceChecks(ConformanceHarness):
    """Keys are listed, found and deleted as an object store's would be; no key escapes the root."""

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
        await asyncio.gather(*(self.put(b, k, payload(n, n)) for k, n in self._TREE.items()))

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
            await self.put(b, f"stat/{n}", payload(n, n))
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
            await self.put(b, key, payload(i + 1, i))
        for i, key in enumerate(keys):
            await self.assert_object(b, key, payload(i + 1, i))
        assert [i.key for i in await b.list()] == sorted(keys)
