"""Conformance checks of a backend's life: concurrent callers, read-only, sync and sweep, several
event loops, and a Hypothesis state machine against a dict model.

Part of :class:`ckptio.testing.BackendConformance`; see :mod:`ckptio.testing.conformance`.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ckptio.backends.base import Backend, ByteRange
from ckptio.testing._harness import ConformanceHarness, backend_test, payload
from ckptio.testing.model import machine_for

__all__ = ["LifecycleChecks"]


class LifecycleChecks(ConformanceHarness):
    """Many callers at once, read-only and sync declarations honoured, any event loop, the model check."""

    # -- concurrency -----------------------------------------------------

    @backend_test
    async def test_concurrent_writes_of_many_objects(self, b: Backend) -> None:
        self.require_writable(b)
        keys = [f"step_1/d{i % 5}/obj-{i:04d}" for i in range(self.concurrent_objects)]
        datas = {k: payload(1000 + 37 * i, i) for i, k in enumerate(keys)}
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
