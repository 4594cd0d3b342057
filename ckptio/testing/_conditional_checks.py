"""Conformance checks of the conditional delete: ``delete_if`` and the versions ``stat`` and ``list`` name.

Part of :class:`ckptio.testing.BackendConformance`; see :mod:`ckptio.testing.conformance`. A
backend that declares no ``conditional_delete`` must say so by raising NotImplementedError (the
store then falls back to a re-read before an unconditional delete); one that declares it must
delete only the version named, atomically, against other clients of the same storage.
"""

from __future__ import annotations

import asyncio

import pytest

from ckptio.backends.base import Backend
from ckptio.testing._harness import ConformanceHarness, backend_test

__all__ = ["ConditionalDeleteChecks"]


class ConditionalDeleteChecks(ConformanceHarness):
    """``delete_if`` deletes the version a stat or listing named, and nothing newer."""

    #: Clients racing to delete one version (one must win, the others must learn they lost).
    delete_racers: int = 8

    @staticmethod
    def require_conditional(b: Backend) -> None:
        if not b.capabilities.conditional_delete:
            pytest.skip("the backend declares no conditional_delete")

    @backend_test
    async def test_delete_if_without_the_capability_refuses(self, b: Backend) -> None:
        self.require_writable(b)
        if b.capabilities.conditional_delete:
            pytest.skip("the backend declares conditional_delete")
        await b.write("k", [memoryview(b"data")])
        with pytest.raises(NotImplementedError):
            await b.delete_if("k", (await b.stat("k")).version or "0")
        assert await b.read("k") == b"data"

    @backend_test
    async def test_delete_if_takes_the_version_named(self, b: Backend) -> None:
        self.require_writable(b)
        self.require_conditional(b)
        await b.write("a/k", [memoryview(b"one")])
        await b.create_if_absent("a/m", b"marker")
        info = await b.stat("a/k")
        assert info.version, "a backend with conditional_delete names each version"
        assert (await b.stat("a/k")).version == info.version, "the version of an unchanged object changed"
        listed = {i.key: i.version for i in await b.list("a/")}
        assert listed == {"a/k": info.version, "a/m": (await b.stat("a/m")).version}
        assert await b.delete_if("a/k", info.version) is True
        with pytest.raises(FileNotFoundError):
            await b.stat("a/k")
        with pytest.raises(FileNotFoundError):
            await b.delete_if("a/k", info.version)
        assert await b.delete_if("a/m", listed["a/m"]) is True  # a listing's version serves too
        assert await b.list("a/") == []
        assert await b.list_children() == []  # no emptied "directory" lingers

    @backend_test
    async def test_delete_if_spares_a_newer_version(self, b: Backend) -> None:
        self.require_writable(b)
        self.require_conditional(b)
        await b.create_if_absent("s/m", b"checkpoint-A")
        old = (await b.stat("s/m")).version
        await b.delete("s/m")
        await b.create_if_absent("s/m", b"checkpoint-B")  # same size, same name, written at once
        new = (await b.stat("s/m")).version
        assert new != old, "a re-created object carries the version of the one it replaced"
        assert await b.delete_if("s/m", old) is False
        await self.assert_object(b, "s/m", b"checkpoint-B")
        await b.write("s/m", [memoryview(b"checkpoint-C")])  # an overwrite is a new version too
        assert (await b.stat("s/m")).version not in (old, new)
        assert await b.delete_if("s/m", new) is False
        await self.assert_object(b, "s/m", b"checkpoint-C")
        assert [i.key for i in await b.list("s/")] == ["s/m"], "the spared object left something behind"

    @backend_test
    async def test_delete_if_race_has_one_winner(self, b: Backend) -> None:
        self.require_writable(b)
        self.require_conditional(b)
        await b.create_if_absent("r/m", b"marker")
        version = (await b.stat("r/m")).version
        others = self.create_racer_instances - 1
        clients = [b] + [await self.open_backend(self._tmp_path) for _ in range(others)]

        async def one(i: int) -> str:
            try:
                return "deleted" if await clients[i % len(clients)].delete_if("r/m", version) else "spared"
            except FileNotFoundError:
                return "gone"

        try:
            outcomes = await asyncio.gather(*(one(i) for i in range(self.delete_racers)))
        finally:
            await asyncio.gather(*(self.close_backend(c) for c in clients[1:]))
        # One takes it; the others find it gone (none may see "another version": there never was one).
        assert sorted(outcomes) == ["deleted"] + ["gone"] * (self.delete_racers - 1), outcomes
        with pytest.raises(FileNotFoundError):
            await b.stat("r/m")

    @backend_test
    async def test_delete_if_against_a_concurrent_recreate(self, b: Backend) -> None:
        """Whatever the interleaving, the newer object is never what goes."""
        self.require_writable(b)
        self.require_conditional(b)
        for round_ in range(10):
            key = f"c/{round_}"
            await b.create_if_absent(key, b"old")
            old = (await b.stat(key)).version

            async def replace() -> None:
                try:
                    await b.delete(key)
                except FileNotFoundError:
                    pass  # take() was first
                await b.create_if_absent(key, b"new")

            async def take() -> bool:
                try:
                    return await b.delete_if(key, old)
                except FileNotFoundError:
                    return False

            took, _ = await asyncio.gather(take(), replace())
            try:
                assert await b.read(key) == b"new", "delete_if took the newer object"
            except FileNotFoundError:
                pytest.fail(f"round {round_}: no object left (took={took!r}); the new one was deleted")
