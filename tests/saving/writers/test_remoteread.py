"""The writer process reads unstaged arrays out of the trainer's memory (ckptio.saving.writers.remoteread).

Properties: what it reads is the trainer's bytes, checksummed in each extent's own blocks; every
manifest row of such a save matches the bytes on disk and restores; the trainer copies nothing
into shared memory for them; where the child cannot read the trainer (the probe fails) or
``CKPTIO_REMOTE_READS=0``, the trainer copies as before; a read that fails fails the save, commits
nothing, and the next save commits.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.saving.test_summedfill import _rows

import ckptio
from ckptio import SaveOptions
from ckptio.engine.layout import PlannedExtent
from ckptio.saving.writers import remoteread, sidecar
from ckptio.saving.writers.remoteread import RemoteObject, allow_reads, readable, token, vm_read
from ckptio.saving.writers.sidecar_export import Export
from ckptio.system import fresh_pages
from ckptio.system.checksum import block_crcs

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs memfd")

SIDECAR = SaveOptions(writer="sidecar")


@pytest.fixture(autouse=True)
def _fresh_sidecar(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(sidecar.ENV, raising=False)
    monkeypatch.delenv(remoteread.ENV, raising=False)
    sidecar.shutdown()
    yield
    sidecar.shutdown()


def _readable_here() -> bool:
    at, expected = token()
    return readable(os.getpid(), at, expected)


needs_reads = pytest.mark.skipif(not _readable_here(), reason="process_vm_readv is not allowed here")


@needs_reads
def test_vm_read_reads_this_process_and_names_what_it_could_not_read() -> None:
    src = np.random.default_rng(0).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    vm_read(os.getpid(), memoryview(dst), int(src.ctypes.data))
    assert dst.tobytes() == src.tobytes()
    with pytest.raises(OSError, match=f"process {os.getpid()} at 0x10"):
        vm_read(os.getpid(), memoryview(dst)[:4096], 16)  # nothing is mapped there


def test_the_probe_fails_on_other_bytes_and_on_a_process_that_is_gone() -> None:
    at, expected = token()
    assert not readable(os.getpid(), at, bytes(b ^ 1 for b in expected))
    assert not readable(2**22 + 12345, at, expected)  # no such pid (above the default pid_max)


class _Libc:
    """A C library whose prctl returns ``rc`` and records its arguments."""

    def __init__(self, rc: int) -> None:
        self.rc, self.calls = rc, []

    def prctl(self, *args: Any) -> int:
        self.calls.append(tuple(a.value for a in args))
        return self.rc


def test_the_trainer_names_its_writer_as_the_one_reader_yama_lets_read_it() -> None:
    took, refused = _Libc(0), _Libc(-1)
    assert allow_reads(4321, took) and not allow_reads(4321, refused)
    assert took.calls == [(0x59616D61, 4321, 0, 0, 0)]  # PR_SET_PTRACER, the child's pid
    assert not allow_reads(4321, object())  # a C library without prctl: nothing to allow
    allow_reads(os.getpid())  # this kernel's answer (EINVAL without Yama): never an error


@pytest.mark.parametrize("wanted", [True, False])
def test_the_child_probes_only_once_the_trainer_let_it_read(monkeypatch: pytest.MonkeyPatch,
                                                             wanted: bool) -> None:
    """Named first, probed after: a child probing first would find Yama's scope 1 closed for good."""
    if not wanted:
        monkeypatch.setenv(remoteread.ENV, "0")
    named: list[tuple[int, bool]] = []

    def slow_allow(pid: int) -> bool:
        with sidecar._current_lock:  # ensure() holds it until the sidecar is current
            sc = sidecar.current()
        assert sc is not None
        spoke = False
        for _ in range(20):  # the child starts meanwhile; a probe before this call would say hello
            time.sleep(0.05)
            try:
                spoke = spoke or bool(sc._chan.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                pass
        named.append((pid, spoke))
        return False

    monkeypatch.setattr(sidecar, "allow_reads", slow_allow)
    sc = sidecar.ensure()
    assert sc._hello.wait(60) and sc.dead is None
    assert named == ([(sc.pid, False)] if wanted else [])  # the hello came after, not before
    assert sc.reads_remote == _readable_here()  # no Yama here: the probe's answer is the kernel's


@needs_reads
@pytest.mark.parametrize("block", [4096, 1 << 20, 3 << 20])
def test_a_remote_object_reads_every_extent_at_its_offset_with_its_block_sums(block: int) -> None:
    """Extents of odd lengths and offsets; one (20 MiB) cut into pieces two threads share; one with
    cuts (a pack: its members' checksums are the engine's, so it gets none here)."""
    rng = np.random.default_rng(block)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (20 << 20, 4097, 1 << 20, 333)]
    extents, parts, pos = [], [], 0
    for i, a in enumerate(arrays):
        pos = -(-pos // 4096) * 4096
        e = PlannedExtent(f"a{i}", 0, 0, pos, None, a.nbytes, cuts=[100, a.nbytes] if i == 3 else None)
        extents.append(e)
        parts.append((e, int(a.ctypes.data)))
        pos += a.nbytes
    obj = RemoteObject(os.getpid(), parts, block)
    obj.buffer = fresh_pages(obj.nbytes)  # page-aligned, as the pool's buffers are
    obj.expose()
    readers = [threading.Thread(target=obj.read) for _ in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    obj.finish()
    for e, a in zip(extents, arrays):
        assert e.data is not None and bytes(e.data) == a.tobytes()
        assert e.sums == (None if e.cuts else block_crcs(memoryview(a), block))
        assert np.frombuffer(e.data, np.uint8).ctypes.data % 4096 == e.offset % 4096  # in step with the file


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {
        "big": rng.standard_normal(5 << 20, dtype=np.float32),  # 20 MiB: across objects
        "ragged": rng.standard_normal((1 << 18) + 37, dtype=np.float32),
        "matrix": rng.standard_normal((300, 1000)).astype(np.float32),
        "small": np.arange(100, dtype=np.int32),  # packed: staged, in shared memory
    }


def _check_rows_and_restore(root: Path, state: dict[str, Any]) -> None:
    rows = _rows(root / "1")
    for key, (offset, _shard_offset, length, crcs, *_), block in rows:
        data = (root / "1" / key.rsplit("/", 1)[-1]).read_bytes()[offset : offset + length]
        assert crcs == block_crcs(memoryview(data), block), key
    out = ckptio.restore(root, 1)  # every block verified on the way
    for k, v in state.items():
        assert np.asarray(out[k]).tobytes() == np.asarray(v).tobytes(), k


@needs_reads
def test_a_copy_false_save_is_read_from_the_trainer_not_copied(tmp_path: Path,
                                                               described: list[tuple[Any, ...]]) -> None:
    state = _state()
    ckptio.save(tmp_path, state, step=1, copy=False, save_options=SIDECAR,
                backend_options={"object_size": 8 << 20}).result()
    large = [d for d in described if d[4] >= (1 << 20)]
    assert large and all(d[5][0] == "mem" and d[3] % 4096 == 0 for d in large)
    _check_rows_and_restore(tmp_path, state)


@needs_reads
def test_a_jax_save_is_read_from_the_trainer(tmp_path: Path, described: list[tuple[Any, ...]]) -> None:
    jnp = pytest.importorskip("jax.numpy")
    state = {k: jnp.asarray(v) for k, v in _state().items()}
    mngr = ckptio.CheckpointManager(tmp_path, save_options=SIDECAR, backend_options={"object_size": 8 << 20})
    try:
        mngr.save(1, state).result()
    finally:
        mngr.close()
    assert sidecar.current() is not None and sidecar.current().reads_remote  # type: ignore[union-attr]
    assert [d for d in described if d[5][0] == "mem"]
    _check_rows_and_restore(tmp_path, state)


@pytest.mark.parametrize("how", ["env", "probe"])
def test_without_reads_the_trainer_copies_into_shared_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             described: list[tuple[Any, ...]],
                                                             how: str) -> None:
    if how == "env":
        monkeypatch.setenv(remoteread.ENV, "0")
    else:  # the child reads other bytes than the trainer's token: as if the kernel refused it
        at, expected = token()
        monkeypatch.setattr(sidecar, "token", lambda: (at, bytes(b ^ 1 for b in expected)))
    state = _state()
    ckptio.save(tmp_path, state, step=1, copy=False, save_options=SIDECAR,
                backend_options={"object_size": 8 << 20}).result()
    assert described and all(d[5][0] != "mem" for d in described)
    if how == "probe":
        assert not sidecar.current().reads_remote  # type: ignore[union-attr]
    _check_rows_and_restore(tmp_path, state)


@needs_reads
def test_a_read_that_fails_fails_the_save_and_the_next_save_commits(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is sent an address nothing is mapped at (as if the trainer's array were gone): its
    read fails, so does the save, nothing is committed, and the same writer process saves the next step."""
    real = Export._source

    def bad(self: Export, view: memoryview, user: int) -> tuple[Any, ...]:
        src = real(self, view, user)
        return ("mem", 16) if src[0] == "mem" else src

    monkeypatch.setattr(Export, "_source", bad)
    state = _state()
    with pytest.raises(Exception, match="reading .* bytes of process"):
        ckptio.save(tmp_path, state, step=1, copy=False, save_options=SIDECAR).result()
    pid = sidecar.current_pid()
    assert pid is not None and not (tmp_path / "1" / "ckptio.manifest.json").exists()
    monkeypatch.setattr(Export, "_source", real)
    ckptio.save(tmp_path, state, step=2, copy=False, save_options=SIDECAR).result()
    assert sidecar.current_pid() == pid
    out = ckptio.restore(tmp_path, 2)
    assert all(out[k].tobytes() == v.tobytes() for k, v in state.items())


@needs_reads
def test_a_failed_piece_stops_the_other_readers_of_its_object() -> None:
    good = np.ones(32 << 20, np.uint8)
    parts = [(PlannedExtent("good", 0, 0, 0, None, good.nbytes), int(good.ctypes.data)),
             (PlannedExtent("gone", 0, 0, good.nbytes, None, 1 << 20), 16)]
    obj = RemoteObject(os.getpid(), parts, 1 << 20)
    obj.buffer = fresh_pages(obj.nbytes)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            obj.read()
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and "reading 1048576 bytes of process" in str(errors[0])


@needs_reads
def test_the_write_may_read_a_byte_only_once_every_piece_before_it_is_in() -> None:
    """The object is its write's Filling: a wait returns once the bytes below its end (padding
    between extents included) are the trainer's; after a failed piece every wait fails."""
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (30 << 20, 5000, 9 << 20)]
    parts, pos = [], 0
    for i, a in enumerate(arrays):
        pos = -(-pos // 4096) * 4096
        parts.append((PlannedExtent(f"a{i}", 0, 0, pos, None, a.nbytes), int(a.ctypes.data)))
        pos += a.nbytes
    obj = RemoteObject(os.getpid(), parts, 1 << 20)
    obj.buffer = fresh_pages(obj.nbytes)
    obj.buffer[:] = 0xAA
    readers = [threading.Thread(target=obj.read) for _ in range(2)]
    for t in readers:
        t.start()
    for end in (1, 8 << 20, (30 << 20) + 4096, obj.nbytes):
        obj.wait(end)
        for (e, _a), a in zip(obj.parts, arrays):
            n = min(e.length, end - e.offset)
            if n > 0:
                assert bytes(obj.buffer[e.offset : e.offset + n]) == a[:n].tobytes(), (end, e.item)
    for t in readers:
        t.join()

    unmapped = (PlannedExtent("gone", 0, 0, 31 << 20, None, 1 << 20), 16)
    gone = RemoteObject(os.getpid(), [parts[0], unmapped], 1 << 20)
    gone.buffer = fresh_pages(gone.nbytes)
    with pytest.raises(OSError, match="Bad address"):
        gone.read()
    for end in (1, gone.nbytes):  # a failed object is failed as a whole: its write stops at once
        with pytest.raises(ckptio.SaveFailedError, match=f"bytes from process {os.getpid()} failed"):
            gone.wait(end)


def test_a_cancelled_read_gives_its_buffer_back_only_once_every_reader_is_done() -> None:
    """The buffer goes back to the pool (for the next object) only after the threads filling it
    have returned, however often the waiting task is cancelled meanwhile."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    started = threading.Barrier(3)
    given_back: list[bool] = []

    class Blocking(RemoteObject):
        def read(self) -> None:
            started.wait()
            release.wait()

    reads = remoteread.RemoteReads(os.getpid())
    reads.limit(1 << 20)
    real_give_back = reads._pool.give_back
    reads._pool.give_back = lambda bufs: (given_back.append(release.is_set()), real_give_back(bufs))  # type: ignore

    async def scenario() -> None:
        obj = Blocking(os.getpid(), [(PlannedExtent("x", 0, 0, 0, None, 4096), 0)], 4096)
        with ThreadPoolExecutor(2) as pool:
            task = asyncio.ensure_future(reads.run(obj, pool, 2, lambda _filling: asyncio.sleep(0)))
            await asyncio.get_running_loop().run_in_executor(None, started.wait)
            for _ in range(3):
                task.cancel()
                await asyncio.sleep(0.05)
                assert not task.done() and given_back == []
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert given_back == [True]

    asyncio.run(scenario())
