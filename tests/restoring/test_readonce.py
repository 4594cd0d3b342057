"""Read-once restore in one process: hosts as threads exchanging bytes, each with its own counting
backend. The byte counts, bit-exactness and the failure paths (a failed read on the host that
reads for the others, a flipped byte, a bad target) across hosts. Real processes over torch
gloo: tests/restoring/test_readonce_mp.py; the exchange's pieces: tests/restoring/test_boxexchange.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.base import ByteRange, ThrottledError
from ckptio.backends.wrappers import CountingBackend, WrapperBackend
from ckptio.coord.distributed import SingleProcess
from ckptio.engine import EngineConfig, run_sync
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.restoring import restore_step
from ckptio.restoring.agreement import can_read_once
from ckptio.store import CheckpointStore, StoreOptions

HOSTS = 4
ROWS, COLS = 256, 512  # float32: 512 KiB
W = np.random.default_rng(3).standard_normal((ROWS, COLS), dtype=np.float32)
EMB = np.random.default_rng(4).standard_normal(100_000, dtype=np.float32)


class _Group:
    """``size`` hosts as threads: every collective meets at a barrier and goes through JSON or bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size


class _Host:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _all(self, obj: Any) -> list[Any]:
        g = self.group
        g.slots[self.rank] = obj
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        return [json.loads(o) for o in self._all(json.dumps(obj))]

    def gather(self, obj: Any) -> list[Any] | None:
        out = self.all_gather(obj)
        return out if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        return self.all_gather(obj)[0]

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        return self._all(data)[src]  # type: ignore[no-any-return]

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        mine = {dst: ([len(b) for b in bufs], b"".join(bytes(b) for b in bufs)) for dst, bufs in sends.items()}
        out = {}
        for src, msgs in enumerate(self._all(mine)):
            if self.rank in msgs and msgs[self.rank][1]:
                lengths, data = msgs[self.rank]
                # The protocol: a receiver that says what it expects gets exactly that.
                assert sizes is None or sizes.get(src) == lengths, (src, sizes, lengths)
                out[src] = bytearray(data)
        return out

    def exchange_into(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]],
                      into: dict[int, list[memoryview]]) -> None:
        """The exchange, each source's buffers landing in the caller's ``into[src]``."""
        got = self.exchange(sends, sizes)
        for src, views in into.items():
            data, pos = memoryview(got.get(src, b"")), 0
            assert sum(v.nbytes for v in views) == data.nbytes, (src, sizes.get(src))
            for v in views:
                flat = v.cast("B") if v.ndim != 1 or v.format != "B" else v
                flat[:] = data[pos : pos + v.nbytes]
                pos += v.nbytes


def on_hosts(n: int, body: Any) -> list[Any]:
    """``body(rank, host)`` on ``n`` thread hosts; each one's result or exception."""
    group = _Group(n)
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, _Host(group, rank))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _save(root: Path, steps: tuple[int, ...] = (1,)) -> None:
    rows = ROWS // HOSTS
    pieces = [((slice(i * rows, (i + 1) * rows), slice(None)), W[i * rows:(i + 1) * rows]) for i in range(HOSTS)]
    for step in steps:
        ckptio.save(str(root), {"w": ckptio.Sharded((ROWS, COLS), np.float32, pieces), "emb": EMB},
                    step=step).result()


def _stored(root: Path, step: str = "1") -> int:
    return sum(p.stat().st_size for p in (root / step).iterdir())


def _columns(rank: int) -> tuple[slice, slice]:
    cols = COLS // HOSTS
    return (slice(None), slice(rank * cols, (rank + 1) * cols))


def _target(rank: int) -> dict[str, Any]:
    return {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(_columns(rank), None)]), "emb": None}


class _FailReads(WrapperBackend):
    """Reads of data objects fail as if the object were gone."""

    async def read_into(self, key: str, rng: ByteRange, buffers: Any) -> None:
        if "/ckptio." not in key:
            raise FileNotFoundError(f"{key}: gone")
        await self.inner.read_into(key, rng, buffers)


class _FlipOnce(WrapperBackend):
    """The first read of a data object comes back with one byte flipped (a glitch, not the object)."""

    flipped = False

    async def read_into(self, key: str, rng: ByteRange, buffers: Any) -> None:
        await self.inner.read_into(key, rng, buffers)
        if "/ckptio." not in key and not self.flipped:
            self.flipped = True
            buffers[0].cast("B")[0] ^= 1


def _restore(root: Path, step: int | None, wrap: Any = None, read_once: bool = True,
             chunk_hosts: int = HOSTS) -> list[Any]:
    def body(rank: int, host: _Host) -> Any:
        counting = CountingBackend(open_backend(str(root)))
        backend = wrap(rank, counting) if wrap else counting
        store = CheckpointStore(StoreOptions(str(root), backend=backend))
        try:
            out = restore_step(store, step, _target(rank), coordinator=host, read_once=read_once)
        finally:
            run_sync(store.close())
        return out, counting.bytes_read

    return on_hosts(chunk_hosts, body)


def test_each_stored_byte_is_read_once_across_hosts_and_restored_bit_exact(tmp_path: Path) -> None:
    _save(tmp_path)
    once = _restore(tmp_path, 1)
    plain = _restore(tmp_path, 1, read_once=False)
    for results in (once, plain):
        for rank, r in enumerate(results):
            assert not isinstance(r, BaseException), r
            out, _ = r
            assert out["w"].pieces[0][1].tobytes() == np.ascontiguousarray(W[_columns(rank)]).tobytes()
            assert out["emb"].tobytes() == EMB.tobytes()
    stored = _stored(tmp_path)
    assert sum(n for _, n in once) <= 1.1 * stored
    assert sum(n for _, n in plain) >= 0.9 * HOSTS * stored  # every host reads it all without read-once


def _reader_of(root: Path, step: int) -> tuple[str, int]:
    """A data object of ``step`` and a host that reads some of it from storage for the others."""
    data = next(p for p in (root / str(step)).iterdir() if not p.name.startswith("ckptio."))
    key = f"{step}/{data.name}"

    def body(rank: int, host: _Host) -> bool:
        counting = CountingBackend(open_backend(str(root)))
        store = CheckpointStore(StoreOptions(str(root), backend=counting))
        try:
            restore_step(store, step, _target(rank), coordinator=host, read_once=True)
        finally:
            run_sync(store.close())
        return any(k == key for k, _ in counting.reads)

    return key, on_hosts(HOSTS, body).index(True)


def test_a_failed_read_for_others_fails_every_host_naming_the_host(tmp_path: Path) -> None:
    _save(tmp_path)
    _key, reader = _reader_of(tmp_path, 1)
    results = _restore(tmp_path, 1, wrap=lambda rank, b: _FailReads(b) if rank == reader else b)
    assert all(isinstance(r, FileNotFoundError) for r in results), results
    assert all(f"host {reader}" in str(r) and "gone" in str(r) for r in results), results


class _Throttled(WrapperBackend):
    """Reads of data objects are refused: the storage says "slow down" for longer than the patience."""

    async def read_into(self, key: str, rng: ByteRange, buffers: Any) -> None:
        if "/ckptio." not in key:
            raise ThrottledError(f"{key}: slow down")
        await self.inner.read_into(key, rng, buffers)


def test_a_throttled_read_for_others_is_an_outage_on_every_host(tmp_path: Path) -> None:
    """A host throttled past its patience fails the read-once restore on every host as what it is,
    a storage outage (ThrottledError, retryable), not damage and not an unknown RuntimeError on the
    others: every host must make the same decision (a job retrying outages retries on all of them)."""
    _save(tmp_path)
    _key, reader = _reader_of(tmp_path, 1)
    quick = EngineConfig(retries=1, backoff_initial=0.001, backoff_max=0.002, throttle_patience_s=0.05)

    def body(rank: int, host: _Host) -> Any:
        backend = CountingBackend(open_backend(str(tmp_path)))
        store = CheckpointStore(StoreOptions(str(tmp_path), backend=_Throttled(backend) if rank == reader else backend,
                                             engine_config=quick))
        try:
            return restore_step(store, 1, _target(rank), coordinator=host, read_once=True)
        finally:
            run_sync(store.close())

    results = on_hosts(HOSTS, body)
    assert all(isinstance(r, ThrottledError) for r in results), results
    assert all(f"host {reader}" in str(r) and "slow down" in str(r) for r in results), results


def test_a_byte_flipped_once_is_read_again_by_every_host(tmp_path: Path) -> None:
    _save(tmp_path)
    _key, reader = _reader_of(tmp_path, 1)
    results = _restore(tmp_path, 1, wrap=lambda rank, b: _FlipOnce(b) if rank == reader else b)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r[0]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(W[_columns(rank)]).tobytes()
    # The flipped range was read once more (by the engine, on the host that reads it), nothing
    # else twice over: more than the checkpoint, at most two of it.
    assert _stored(tmp_path) < sum(n for _, n in results) <= 2.1 * _stored(tmp_path)


def test_a_flipped_byte_fails_every_host_and_step_none_falls_back_together(tmp_path: Path) -> None:
    _save(tmp_path, steps=(1, 2))
    data = next(p for p in (tmp_path / "2").iterdir() if not p.name.startswith("ckptio."))
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 1  # in w's first rows: every host restores a column block of them
    data.write_bytes(bytes(raw))
    results = _restore(tmp_path, 2)
    assert all(isinstance(r, IntegrityError) for r in results), results
    assert any(f"2/{data.name}" in str(r) and "another host" not in str(r) for r in results), results
    fallen = _restore(tmp_path, None)  # every host restores step 1, the same decision
    for rank, r in enumerate(fallen):
        assert not isinstance(r, BaseException), r
        assert r[0]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(W[_columns(rank)]).tobytes()


def test_a_bad_target_on_one_host_fails_every_host(tmp_path: Path) -> None:
    _save(tmp_path)

    def body(rank: int, host: _Host) -> Any:
        target = _target(rank) if rank != 1 else {"nope": None}
        return restore_step(CheckpointStore(str(tmp_path)), 1, target, coordinator=host, read_once=True)

    results = on_hosts(HOSTS, body)
    assert all(isinstance(r, CheckpointNotFoundError) for r in results), results
    assert all("nope" in str(r) for r in results), results


def test_a_single_host_or_a_coordinator_without_exchange_reads_as_ever(tmp_path: Path) -> None:
    _save(tmp_path)
    assert not can_read_once(SingleProcess())
    out = ckptio.restore(str(tmp_path), 1, read_once=True)
    assert out["w"].tobytes() == W.tobytes() and out["emb"].tobytes() == EMB.tobytes()


class _KV:
    """jax's coordination service in memory: values, directory reads and deletes, barriers."""

    def __init__(self, size: int) -> None:
        self.kv: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.barriers: dict[str, threading.Barrier] = {}
        self.size = size

    def key_value_set(self, key: str, value: Any) -> None:
        with self.cond:
            assert key not in self.kv, f"{key} set twice"
            self.kv[key] = value
            self.cond.notify_all()

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.kv, 60), f"{key} never came"
            return self.kv[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_dir_get_bytes(self, prefix: str) -> list[tuple[str, bytes]]:
        with self.cond:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, key: str) -> None:
        with self.cond:
            for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
                del self.kv[k]

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        with self.cond:
            barrier = self.barriers.setdefault(name, threading.Barrier(self.size, timeout=60))
        barrier.wait()


def test_read_once_over_jax_coordination_service(tmp_path: Path) -> None:
    from ckptio.coord.distributed import JaxCoordinator

    _save(tmp_path)
    kv = _KV(HOSTS)

    def body(rank: int, _host: _Host) -> Any:
        counting = CountingBackend(open_backend(str(tmp_path)))
        store = CheckpointStore(StoreOptions(str(tmp_path), backend=counting))
        coord = JaxCoordinator("t", client=kv, rank=rank, size=HOSTS)
        return restore_step(store, None, _target(rank), coordinator=coord, read_once=True), counting.bytes_read

    results = on_hosts(HOSTS, body)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r[0]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(W[_columns(rank)]).tobytes()
    assert sum(n for _, n in results) <= 1.1 * _stored(tmp_path)
    assert not [k for k in kv.kv if "/to/" in k]  # every host deleted what it received
