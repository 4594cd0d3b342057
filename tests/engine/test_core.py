"""The engine under faults, corruption, budgets; ranged restore reads only what it needs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import ckptio
from ckptio.backends.base import LayoutDefaults, RetryableError
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import CountingBackend, FaultInjectingBackend, LatencyBackend, WrapperBackend

FAST_RETRY = ckptio.EngineConfig(backoff_initial=0.001, backoff_max=0.01, retries=12, block_size=64 << 10)


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((512, 300)), "v": [rng.integers(0, 9, 5000) for _ in range(20)], "step": 3}


def _same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["w"].tobytes() == b["w"].tobytes()
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a["v"], b["v"]))


def test_retryable_faults_are_retried_until_success(tmp_path):
    url = f"mem://faults-{tmp_path.name}"
    faulty = FaultInjectingBackend(MemoryBackend(url), rate=0.3, seed=7, fail_after=0.3)
    state = _state()
    small = ckptio.EngineConfig(**{**FAST_RETRY.__dict__})
    ckptio.save(url, state, step=1, backend=faulty, engine_config=small,
                naming=None).result()
    _same(ckptio.restore(url, backend=faulty, engine_config=small), state)
    assert sum(faulty.injected.values()) > 3


def test_non_retryable_errors_are_not_retried(tmp_path):
    url = f"mem://perm-{tmp_path.name}"

    class Denied(WrapperBackend):
        calls = 0

        async def write(self, key, buffers):
            if "ckptio.intent." in key:  # the save announces itself, then fails on its data
                return await super().write(key, buffers)
            Denied.calls += 1
            raise PermissionError(f"{key}: denied")

    h = ckptio.save(url, _state(), step=1, backend=Denied(MemoryBackend(url)), engine_config=FAST_RETRY)
    with pytest.raises(PermissionError, match="denied"):
        h.result()
    assert Denied.calls <= 2  # one object (maybe two), each tried once
    with pytest.raises(ckptio.CheckpointNotFoundError):
        ckptio.restore(url)


def test_retries_give_up_after_the_limit(tmp_path):
    url = f"mem://giveup-{tmp_path.name}"
    always = FaultInjectingBackend(MemoryBackend(url), rate=1.0, faults=("write",))
    cfg = ckptio.EngineConfig(retries=3, backoff_initial=0.001, backoff_max=0.001)
    with pytest.raises(RetryableError):
        ckptio.save(url, {"a": np.ones(10)}, step=1, backend=always, engine_config=cfg).result()
    assert always.injected[("write", "error")] == 4


def test_corruption_on_the_wire_is_reread_and_on_disk_is_reported(tmp_path):
    url = f"mem://corrupt-{tmp_path.name}"
    state = _state()
    ckptio.save(url, state, step=1, engine_config=FAST_RETRY).result()

    class CorruptFirstRead(WrapperBackend):
        """Flips a byte of the first read of each object: corruption on the wire, not at rest."""

        seen: set = set()

        async def read_into(self, key, rng, buffers):
            await self.inner.read_into(key, rng, buffers)
            if key not in self.seen and rng.length:
                self.seen.add(key)
                buffers[0].cast("B")[0] ^= 1

    flaky = CorruptFirstRead(MemoryBackend(url))
    _same(ckptio.restore(url, backend=flaky), state)  # each corrupt read is read once more
    assert len(flaky.seen) >= 2  # the manifest and the data object
    broken = FaultInjectingBackend(MemoryBackend(url), rate=1.0, faults=(), corrupt_reads=True)
    with pytest.raises(ckptio.IntegrityError, match="checksum mismatch in manifest"):
        ckptio.restore(url, backend=broken)  # every read corrupt: the manifest is the first casualty


def test_corrupted_write_is_caught_on_restore(tmp_path):
    url = f"mem://badwrite-{tmp_path.name}"

    class CorruptData(WrapperBackend):
        async def write(self, key, buffers):
            data = bytearray(b"".join(buffers))
            data[len(data) // 2] ^= 0x40
            await self.inner.write(key, [memoryview(data)])

    ckptio.save(url, {"w": np.arange(1000.0)}, step=1, backend=CorruptData(MemoryBackend(url))).result()
    with pytest.raises(ckptio.IntegrityError) as e:
        ckptio.restore(url)
    assert e.value.item == "w"
    # A corrupted manifest is caught by its own checksum.
    url2 = url + "-manifest"
    bad = FaultInjectingBackend(MemoryBackend(url2), rate=1.0, faults=(), corrupt_writes=True)
    ckptio.save(url2, {"w": np.arange(1000.0)}, step=1, backend=bad).result()
    with pytest.raises((ckptio.IntegrityError, ckptio.ManifestError)):
        ckptio.restore(url2)


class InFlight(WrapperBackend):
    """Records the most bytes and requests in flight at once."""

    def __init__(self, inner):
        super().__init__(inner)
        self.bytes = self.reqs = self.max_bytes = self.max_reqs = 0

    async def _track(self, n, call):
        self.bytes += n
        self.reqs += 1
        self.max_bytes, self.max_reqs = max(self.max_bytes, self.bytes), max(self.max_reqs, self.reqs)
        try:
            await asyncio.sleep(0.002)
            return await call()
        finally:
            self.bytes -= n
            self.reqs -= 1

    async def write(self, key, buffers):
        return await self._track(sum(b.nbytes for b in buffers), lambda: self.inner.write(key, buffers))

    async def read_into(self, key, rng, buffers):
        return await self._track(rng.length, lambda: self.inner.read_into(key, rng, buffers))


def test_concurrency_and_byte_budget_bound_requests(tmp_path):
    url = f"mem://budget-{tmp_path.name}"
    inner = MemoryBackend(url)
    inner.capabilities = type(inner.capabilities)(concurrency=8)
    inner.layout_defaults = LayoutDefaults(object_size=64 << 10)
    tracked = InFlight(LatencyBackend(inner, 0.001))
    state = {f"a{i}": np.full(60 << 10, i, np.uint8) for i in range(40)}
    cfg = ckptio.EngineConfig(concurrency=6, byte_budget=200 << 10)
    ckptio.save(url, state, step=1, backend=tracked, engine_config=cfg).result()
    assert tracked.max_reqs <= 6 and tracked.max_bytes <= 200 << 10 and tracked.max_reqs >= 2
    tracked.max_reqs = tracked.max_bytes = 0
    out = ckptio.restore(url, backend=tracked, engine_config=cfg)
    assert all((out[k] == v).all() for k, v in state.items())
    assert tracked.max_reqs <= 6 and tracked.max_bytes <= 200 << 10


def test_restoring_a_slice_reads_about_the_slice(tmp_path):
    url = f"mem://slice-{tmp_path.name}"
    full = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)  # 4 MiB, rows of 1 KiB
    ckptio.save(url, {"w": full}, step=1, engine_config=ckptio.EngineConfig(block_size=64 << 10)).result()
    counting = CountingBackend(MemoryBackend(url))
    rows = (slice(1000, 1100), slice(None))  # 100 KiB of 4 MiB
    out = ckptio.restore(url, backend=counting, target={"w": ckptio.Sharded(full.shape, full.dtype, [(rows, None)])})
    assert out["w"].pieces[0][1].tobytes() == full[rows].tobytes()
    data_read = sum(r.length for k, r in counting.reads if not k.endswith(".json"))
    assert 100 << 10 <= data_read <= (100 << 10) + 2 * (64 << 10)


def test_progress_reports_every_byte(tmp_path):
    seen = {"written": 0, "read": 0}

    def progress(event, n):
        seen[event] += n

    state = {"w": np.ones((1000, 100))}
    ckptio.save(tmp_path, state, step=1, progress=progress).result()
    ckptio.restore(tmp_path, progress=progress)
    assert seen == {"written": state["w"].nbytes, "read": state["w"].nbytes}


def test_an_objects_write_does_not_wait_for_its_checksums(tmp_path, monkeypatch):
    """The checksums and the write of one object run at once: a checksum pass that waits for its
    object's write to begin still ends (run one after the other, it would wait forever), and the
    checkpoint restores with every checksum verified."""
    import threading

    from ckptio.engine import core as engine

    url = f"mem://overlap-{tmp_path.name}"
    writing = threading.Event()
    waited: list[bool] = []
    checksums = engine._checksums

    def after_the_write_began(plan, block_size):
        waited.append(writing.wait(30))
        return checksums(plan, block_size)

    class Marking(WrapperBackend):
        async def write(self, key, buffers):
            if "ckptio." not in key:
                writing.set()
            return await super().write(key, buffers)

    monkeypatch.setattr(engine, "_checksums", after_the_write_began)
    state = _state()
    ckptio.save(url, state, step=1, backend=Marking(MemoryBackend(url)), engine_config=FAST_RETRY).result(timeout=60)
    assert waited and all(waited)
    _same(ckptio.restore(url, backend=MemoryBackend(url)), state)


def test_a_failed_write_releases_its_buffers_only_after_their_checksums(tmp_path, monkeypatch):
    """A write that fails at once still waits for the checksum pass reading the same buffers before
    they are given back (a tiled object's scratch goes to the next object)."""
    import threading
    import time

    from ckptio.engine import core as engine
    from ckptio.engine import layout

    url = f"mem://release-{tmp_path.name}"
    events: list[str] = []
    lock = threading.Lock()
    checksums, release = engine._checksums, layout.ObjectPlan.release

    def slow(plan, block_size):
        time.sleep(0.2)
        out = checksums(plan, block_size)
        with lock:
            events.append(("summed", plan.key))
        return out

    def released(plan):
        with lock:
            events.append(("released", plan.key))
        release(plan)

    class Failing(WrapperBackend):
        async def write(self, key, buffers):
            if "ckptio.intent." in key:
                return await super().write(key, buffers)
            raise PermissionError(f"{key}: denied")

    monkeypatch.setattr(engine, "_checksums", slow)
    monkeypatch.setattr(layout.ObjectPlan, "release", released)
    small_objects = ckptio.EngineConfig(**{**FAST_RETRY.__dict__, "concurrency": 4})
    h = ckptio.save(url, {"a": np.ones(1 << 20), "b": np.ones(1 << 20)}, step=1, backend=Failing(MemoryBackend(url)),
                    engine_config=small_objects)
    with pytest.raises(PermissionError, match="denied"):
        h.result(timeout=60)
    released_keys = [k for e, k in events if e == "released"]
    assert released_keys  # every written object, failed or cancelled, once its checksums are done
    assert all(events.index(("summed", k)) < events.index(("released", k)) for k in released_keys)


def test_a_failed_write_whose_checksums_fail_too_raises_the_writes_error_and_loses_none(
    tmp_path, monkeypatch, caplog
):
    """Objects in flight: the first one's write fails, which cancels the others' writes; every
    checksum pass fails too, once those writes are over. The save fails with the write's error;
    each checksum error is retrieved (none reaches the IO loop as "never retrieved"), and each
    object's buffers are given back only after its checksum pass ended."""
    import gc
    import logging
    import threading

    from ckptio.engine import core as engine
    from ckptio.engine import layout

    url = f"mem://bothfail-{tmp_path.name}"
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    failed, cancelled = threading.Event(), threading.Event()  # the first write failed / another was cancelled
    release = layout.ObjectPlan.release

    def failing_checksums(plan, block_size):  # ends after its object's write failed or was cancelled
        failed.wait(30)
        if plan.key != FirstFailsOthersHang.started[0]:
            cancelled.wait(30)
        with lock:
            events.append(("summed", plan.key))
        raise ValueError(f"{plan.key}: checksum failed")

    def released(plan):
        with lock:
            events.append(("released", plan.key))
        release(plan)

    class FirstFailsOthersHang(WrapperBackend):
        started: list[str] = []
        another = asyncio.Event()  # another object's write is in flight, for the failure to cancel

        async def write(self, key, buffers):
            if "ckptio." in key:
                return await super().write(key, buffers)
            self.started.append(key)
            if len(self.started) == 1:
                await asyncio.wait_for(self.another.wait(), 30)
                failed.set()
                raise PermissionError(f"{key}: denied")
            self.another.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    inner = MemoryBackend(url)
    inner.layout_defaults = LayoutDefaults(object_size=1 << 20)
    monkeypatch.setattr(engine, "_checksums", failing_checksums)
    monkeypatch.setattr(layout.ObjectPlan, "release", released)
    caplog.set_level(logging.DEBUG, logger="ckptio.engine")
    # A kept log record naming the write's error holds its traceback's frames, and so its checksum
    # future, past the gc below: the save's own report of the failure is not needed here.
    monkeypatch.setattr(logging.getLogger("ckptio.save"), "disabled", True)
    loop, unretrieved = engine._io_loop(), []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        cfg = ckptio.EngineConfig(**{**FAST_RETRY.__dict__, "concurrency": 4, "checksum_threads": 4})
        h = ckptio.save(url, {"a": np.ones(1 << 18), "b": np.ones(1 << 18)}, step=1,
                        backend=FirstFailsOthersHang(inner), engine_config=cfg)
        with pytest.raises(PermissionError, match="denied") as failure:
            h.result(timeout=60)
        del h, failure  # the same: they hold the write's error
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert unretrieved == []
    assert "never retrieved" not in caplog.text
    summed = [k for e, k in events if e == "summed"]
    assert len(summed) >= 2  # the failed write's object and at least one cancelled one
    assert all(f"{k}: checksum failed" in caplog.text for k in summed)  # each error retrieved, none lost
    assert {k for e, k in events if e == "released"} == set(summed)
    assert all(events.index(("summed", k)) < events.index(("released", k)) for k in summed)
