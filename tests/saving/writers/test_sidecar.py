"""The writer process per host (ckptio.saving.writers.sidecar): same checkpoints as in-process, and its crash semantics.

Properties only, never timings: a dead sidecar fails the save and nothing is
committed; gc then leaves no orphan; the next save starts a new sidecar and
commits; a killed trainer takes its sidecar with it; a trainer that exits
normally leaves no sidecar process; shared memory never outlives them.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptio
from ckptio import SaveOptions
from ckptio.engine import EngineConfig
from ckptio.errors import SaveFailedError
from ckptio.saving.writers import remoteread, sidecar, sidecar_export
from ckptio.saving.writers.shm import ShmStagingPool
from ckptio.system import HUGE_PAGE

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the sidecar needs Linux memfd")

SIDECAR = SaveOptions(writer="sidecar")
THREAD = SaveOptions(writer="thread")


@pytest.fixture(autouse=True)
def _fresh_sidecar(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(sidecar.ENV, raising=False)
    yield
    sidecar.shutdown()


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    big = rng.random((256, 1024), dtype=np.float32)
    return {
        "f32": rng.random(300_000, dtype=np.float32),
        "bf16": rng.random((64, 96)).astype(ml_dtypes.bfloat16),
        "i8": rng.integers(-128, 127, 5000, dtype=np.int8),
        "view": big[:, ::2],  # non-contiguous
        "big": big,
        "empty": np.zeros((0, 7), np.float32),
        "scalar": np.float64(2.5),
        "step": 7,
        "name": "run",
        "nested": {"small": np.arange(10), "key": b"\x00\x01"},
    }


def _normalized_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest without what differs between any two saves (ids, times, object names)."""
    doc = json.loads((step_dir / "ckptio.manifest.json").read_text())["manifest"]
    sid = doc.pop("checkpoint_id")
    doc.pop("created")
    doc.pop("fence", None)  # fresh per commit
    doc["objects"] = [o.replace(sid, "ID") for o in doc["objects"]]
    return doc


def _placement_free(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without where each extent starts in its object: a JAX array is written in place by a thread (its
    large extents in step with its memory) but from an aligned copy by the writer process (aligned)."""
    for item in doc["items"].values():
        for shard in item.get("shards", []) if isinstance(item, dict) else []:
            for extent in shard["extents"]:
                extent[1] = None
    return doc


def _objects(step_dir: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(step_dir.iterdir()) if not p.name.startswith("ckptio.")]


def _assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b


@pytest.mark.parametrize("tile_bytes", [None, 64 << 10])
def test_sidecar_and_in_process_saves_write_the_same_checkpoint(tmp_path: Path, tile_bytes: int | None) -> None:
    state = _state()
    for name, writer in (("thread", "thread"), ("sidecar", "sidecar")):
        options = SaveOptions(writer=writer, tile_bytes=tile_bytes)
        ckptio.save(tmp_path / name, state, step=3, save_options=options).result()
    assert sidecar.current_pid() is not None  # the sidecar did the writing
    a, b = tmp_path / "thread" / "3", tmp_path / "sidecar" / "3"
    assert _normalized_manifest(a) == _normalized_manifest(b)
    if tile_bytes:
        items = _normalized_manifest(b)["items"].values()  # tiles were cut (in the sidecar)
        assert any("tile" in sh for it in items if isinstance(it, dict) for sh in it["shards"])
    assert _objects(a) == _objects(b)
    expected = {**state, "view": np.ascontiguousarray(state["view"])}
    _assert_same_tree(ckptio.restore(tmp_path / "sidecar", 3), ckptio.restore(tmp_path / "thread", 3))
    _assert_same_tree(ckptio.restore(tmp_path / "sidecar", 3), expected)


@pytest.mark.parametrize("tiled", [False, True])
def test_jax_arrays_are_copied_into_shared_memory_off_the_stall(tmp_path: Path, tiled: bool) -> None:
    """JAX shards (not staged by a copy) are copied into shared memory by the background thread;
    tiled, one shard's copy serves the tiles of many small objects and is reused once they are written."""
    jnp = pytest.importorskip("jax.numpy")
    state = {"w": jnp.arange(200_000, dtype=jnp.float32).reshape(400, 500), "b": jnp.ones(33, jnp.bfloat16),
             "v": jnp.arange(50_000, dtype=jnp.int32)}
    opts = {"object_size": 128 << 10, "tile_bytes": 32 << 10} if tiled else {}
    for name in ("thread", "sidecar"):
        mngr = ckptio.CheckpointManager(tmp_path / name, save_options=SaveOptions(writer=name), backend_options=opts)
        mngr.save(1, state)
        mngr.wait_until_finished()
        mngr.close()
    if tiled:
        items = _normalized_manifest(tmp_path / "sidecar" / "1")["items"].values()
        assert any("tile" in sh for it in items if isinstance(it, dict) for sh in it["shards"])
    thread, sidecar_ = (_placement_free(_normalized_manifest(tmp_path / name / "1")) for name in ("thread", "sidecar"))
    assert thread == sidecar_
    out = ckptio.restore(tmp_path / "sidecar", 1)
    assert out["w"].tobytes() == np.asarray(state["w"]).tobytes() and out["b"].tobytes() == np.asarray(state["b"]).tobytes()


@pytest.fixture(params=["copied", "read"])
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Unstaged bytes copied into shared memory by the trainer, or read by the writer process
    (ckptio.saving.writers.remoteread) where this host lets it."""
    if request.param == "copied":
        monkeypatch.setenv(remoteread.ENV, "0")
    else:
        at, expected = remoteread.token()
        if not remoteread.readable(os.getpid(), at, expected):
            pytest.skip("process_vm_readv is not allowed here")
        monkeypatch.delenv(remoteread.ENV, raising=False)
    return str(request.param)


def _copy_aligned(row: tuple[Any, ...], reads: str) -> bool:
    """A described extent's place in the file is aligned, and so is its copy in shared memory (copied)
    or the writer process reads it (read: its buffer mirrors the file's offsets)."""
    src = row[5]
    if reads == "copied":
        return row[3] % 4096 == 0 and src[0] == "shm" and src[2] % 4096 == 0
    return row[3] % 4096 == 0 and src[0] == "mem"


def test_a_jax_arrays_copy_and_its_place_in_the_file_are_both_aligned(tmp_path: Path, reads: str,
                                                                   described: list[tuple[Any, ...]]) -> None:
    """JAX's arrays lie 64 bytes past a page, but the writer process writes their copies in shared memory
    (or in its own memory, where it reads them from the trainer): the layout must put those at aligned
    offsets, as the copies are, not in step with the arrays (then the writer process bounced every byte: a
    JAX save's CPU rose from 0.36 to 0.52 s/GiB; copies kept in step with the arrays still cost 5 % against
    the raw write)."""
    jnp = pytest.importorskip("jax.numpy")
    state = {"w": jnp.arange(3 << 20, dtype=jnp.float32), "v": jnp.arange(1 << 18, dtype=jnp.int32) + 1}
    assert any(np.asarray(a).ctypes.data % 4096 for a in state.values())
    mngr = ckptio.CheckpointManager(tmp_path, save_options=SIDECAR)
    try:
        mngr.save(1, state).result()
    finally:
        mngr.close()
    large = [d for d in described if d[4] >= (1 << 20)]
    assert len(large) == 2 and all(_copy_aligned(d, reads) for d in large)
    out = ckptio.restore(tmp_path, 1)
    assert all(out[k].tobytes() == np.asarray(v).tobytes() for k, v in state.items())


@pytest.mark.parametrize("torch_readable", [True, False])
def test_a_sync_dcp_saves_tensors_are_laid_out_aligned_for_their_copies(tmp_path: Path, torch_readable: bool,
                                                                        reads: str,
                                                                        described: list[tuple[Any, ...]]) -> None:
    """A sync ``dcp.save`` hands over torch's tensors as they lie (64 bytes past a page); the writer process
    writes aligned copies of them, so their records and extents must start aligned, as for JAX arrays."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from ckptio.dcp import Reader, Writer

    sd = {"w": torch.arange(3 << 20, dtype=torch.float32), "v": torch.arange(1 << 18, dtype=torch.int32) + 1}
    assert any(t.data_ptr() % 4096 for t in sd.values())
    dcp.save(sd, storage_writer=Writer(tmp_path / "ck", save_options=SIDECAR, torch_readable=torch_readable))
    large = [d for d in described if d[4] >= (1 << 20)]
    assert len(large) == 2 and all(_copy_aligned(d, reads) for d in large)
    readers = [Reader(tmp_path / "ck")] + ([dcp.FileSystemReader(str(tmp_path / "ck"))] if torch_readable else [])
    for reader in readers:
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=reader)
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_the_copies_a_jax_save_makes_in_shared_memory_are_settled_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-memory copies of a JAX save (where the writer process does not read the trainer's
    memory) stay in the pool for the saves after it, so once it is written the pool moves the buffers
    it made into huge pages (``ShmStagingPool.settle``: the writer process's O_DIRECT writes go out in
    larger requests), each large one starting on a huge page of its slab; the next save reuses them and
    settles none; the bytes restore as saved."""
    jnp = pytest.importorskip("jax.numpy")
    monkeypatch.setenv(remoteread.ENV, "0")
    settled: list[int] = []
    real = ShmStagingPool.settle

    def spy(self: ShmStagingPool, new: Any) -> int:
        for b in new:
            located = self.locate(memoryview(b))
            assert located is not None and (b.nbytes < 4 * HUGE_PAGE or located[1] % HUGE_PAGE == 0)
        settled.extend(b.nbytes for b in new if b.nbytes >= HUGE_PAGE)
        return real(self, new)

    monkeypatch.setattr(ShmStagingPool, "settle", spy)
    state = {"w": jnp.arange(3 << 20, dtype=jnp.float32), "b": jnp.ones(33, jnp.bfloat16)}
    mngr = ckptio.CheckpointManager(tmp_path, save_options=SIDECAR)
    try:
        mngr.save(1, state).result()
        assert settled == [12 << 20]
        mngr.save(2, state).result()
        assert settled == [12 << 20]
    finally:
        mngr.close()
    out = ckptio.restore(tmp_path, 2)
    assert out["w"].tobytes() == np.asarray(state["w"]).tobytes() and out["b"].tobytes() == np.asarray(state["b"]).tobytes()


def test_dcp_async_save_through_the_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptio.dcp import Reader, Writer

    monkeypatch.setenv(sidecar.ENV, "sidecar")
    sd = {"w": torch.arange(100_000, dtype=torch.float32).reshape(100, 1000), "h": torch.ones(7, dtype=torch.bfloat16),
          "step": 4}
    copies: list[int] = []
    copy = sidecar_export.copy_bytes
    monkeypatch.setattr(sidecar_export, "copy_bytes", lambda d, s: (copies.append(s.nbytes), copy(d, s)))
    dcp.async_save(sd, storage_writer=Writer(tmp_path / "a")).result()
    assert sidecar.current_pid() is not None
    # Tensors staged straight into shared memory: what is copied is byte items and the torch.save frames
    # around each chunk (torch_readable; ~1.5 KB a chunk, one page under direct IO), never the 400 KB of w.
    assert sum(copies) < 16 << 10, copies
    out = {"w": torch.zeros(100, 1000), "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    dcp.load(out, storage_reader=Reader(tmp_path / "a"))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["h"], sd["h"]) and out["step"] == 4


def test_orbax_manager_through_the_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    jax = pytest.importorskip("jax")
    import ckptio.orbax

    monkeypatch.setenv(sidecar.ENV, "sidecar")
    state = {"w": jax.numpy.arange(60_000, dtype=jax.numpy.float32).reshape(200, 300), "b": jax.numpy.ones(9)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    with ocp.CheckpointManager(tmp_path / "o") as mngr:
        mngr.save(1, args=ckptio.orbax.Save(state))
        mngr.wait_until_finished()
        assert sidecar.current_pid() is not None
        out = mngr.restore(1, args=ckptio.orbax.Restore(abstract))
    assert all(np.asarray(out[k]).tobytes() == np.asarray(state[k]).tobytes() for k in state)


def test_a_backend_object_keeps_the_in_process_writer(tmp_path: Path) -> None:
    from ckptio.backends.memory import MemoryBackend

    backend = MemoryBackend("mem://x")
    ckptio.save("mem://x", {"a": np.arange(5)}, step=1, save_options=SIDECAR, backend=backend).result()
    assert sidecar.current_pid() is None
    assert ckptio.restore("mem://x", 1, backend=backend)["a"].tolist() == list(range(5))


def test_an_unknown_writer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SaveOptions.writer='proc'"):
        ckptio.save(tmp_path, {"a": np.arange(5)}, step=1, save_options=SaveOptions(writer="proc"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _our_shm(owner: int, *started: int) -> list[str]:
    """Shared memory of ``owner``'s staging: named segments, or its memfds held by this process, its
    descendants or the processes named in ``started`` (an orphaned sidecar is no longer our
    descendant).

    Only those: a slab reaches its owner (this process, or a trainer it started and has reaped)
    and the sidecar it is passed to, all of them named here; any other process on the machine is
    none of this test's business.
    """
    import psutil

    found = [str(p) for p in Path("/dev/shm").glob(f"*ckptio*{owner}*")] if Path("/dev/shm").is_dir() else []
    pids = {os.getpid(), *started, *(c.pid for c in psutil.Process().children(recursive=True))}
    for pid in sorted(pids):
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                if f"memfd:ckptio-stage-{owner} " in os.readlink(fd):
                    found.append(str(fd))
            except OSError:
                pass  # a process (or descriptor) gone since the listing holds nothing
    return found


def test_a_killed_sidecar_fails_the_save_and_the_next_save_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptio.backends.local import TMP_MARK

    monkeypatch.setenv("CKPTIO_LEASE_S", "2")
    root = tmp_path / "ckpt"
    ckptio.save(root, _state(1), step=1, save_options=SIDECAR).result()
    first = sidecar.current_pid()
    assert first is not None
    # Many small objects, and the sidecar frozen at its first confirmed write, then killed:
    # the save is mid-way (some objects written, some not) when its writer dies.
    opts = {"object_size": 1 << 20}
    state = {f"a{i}": np.full(300_000, i, np.float32) for i in range(24)}
    killed: list[int] = []

    def kill_at_first_object(_event: str, _n: int) -> None:
        if not killed:
            os.kill(first, signal.SIGSTOP)
            killed.append(first)
            os.kill(first, signal.SIGKILL)

    handle = ckptio.save(root, state, step=2, save_options=SIDECAR, backend_options=opts, progress=kill_at_first_object)
    with pytest.raises(SaveFailedError, match=f"pid {first}"):
        handle.result()
    assert killed and not (root / "2" / "ckptio.manifest.json").exists()
    assert _wait_gone(first)
    # The failed save's lease runs out: gc takes every file it left, and nothing of step 1.
    step1 = {p: p.read_bytes() for p in (root / "1").iterdir()}
    old = time.time() - 10
    for p in (root / "2").iterdir():
        os.utime(p, (old, old))
    mngr = ckptio.CheckpointManager(root)
    mngr.sweep_orphans(grace_seconds=0)
    assert not (root / "2").exists() or not [p for p in (root / "2").iterdir()], list((root / "2").iterdir())
    assert {p: p.read_bytes() for p in (root / "1").iterdir()} == step1
    mngr.close()
    # The next save starts a new sidecar and commits.
    ckptio.save(root, state, step=2, save_options=SIDECAR, backend_options=opts).result()
    second = sidecar.current_pid()
    assert second is not None and second != first
    assert not list(root.rglob(f"*{TMP_MARK}*"))
    _assert_same_tree(ckptio.restore(root, 2), state)


def test_a_writer_process_that_never_starts_fails_the_save_and_the_next_starts_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child silent past ``START_S`` (here: never told to probe, so it never says hello) is
    killed and the save fails, naming it; it does not hang. The next save's child starts."""
    sidecar.shutdown()
    release = threading.Event()
    stuck: list[int] = []

    def never(pid: int) -> bool:
        stuck.append(pid)
        release.wait(60)
        return False

    monkeypatch.setattr(sidecar, "START_S", 1.0)
    monkeypatch.setattr(sidecar, "allow_reads", never)
    handle = ckptio.save(tmp_path, _state(), step=1, save_options=SIDECAR)
    with pytest.raises(SaveFailedError, match=r"writer process \(pid \d+\) did not start within 1 s"):
        handle.result()
    assert stuck and _wait_gone(stuck[0])
    assert not (tmp_path / "1" / "ckptio.manifest.json").exists()
    monkeypatch.setattr(sidecar, "allow_reads", lambda pid: False)
    monkeypatch.setattr(sidecar, "START_S", 120.0)  # a loaded machine may take over 1 s to start the next one
    release.set()
    ckptio.save(tmp_path, _state(), step=1, save_options=SIDECAR).result()
    assert sidecar.current_pid() not in (None, stuck[0])
    _assert_same_tree(ckptio.restore(tmp_path, 1), _state())


TRAINER = textwrap.dedent("""
    import sys, time, numpy as np, ckptio
    from ckptio.saving.writers import remoteread, sidecar, sidecar_export
    mngr = ckptio.CheckpointManager(sys.argv[1], save_options=ckptio.SaveOptions(writer="sidecar"))
    state = {f"a{i}": np.full(1 << 20, i, np.float32) for i in range(8)}
    mngr.save(1, state)
    mngr.wait_until_finished()
    print(sidecar.current_pid(), flush=True)
    if sys.argv[2] == "loop":  # saves in flight, one after another, until killed
        step = 2
        while True:
            mngr.save(step, state)
            step += 1
    mngr.close()
""")


def _trainer(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path / "ckpt"), mode], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), line
    return proc, int(line)


def test_a_killed_trainer_takes_its_sidecar_and_shared_memory_with_it(tmp_path: Path) -> None:
    proc, pid = _trainer(tmp_path, "loop")
    assert _alive(pid)
    time.sleep(0.3)  # a save or two in flight
    proc.kill()
    proc.wait(timeout=30)
    assert _wait_gone(pid), f"sidecar {pid} outlived its killed trainer"
    assert _our_shm(proc.pid, pid) == []
    # The next run saves on the same root (the killed saves are a gc's business, not a blocker).
    ckptio.save(tmp_path / "ckpt", {"a": np.arange(3)}, step=1000, save_options=SIDECAR).result()
    assert ckptio.restore(tmp_path / "ckpt", 1000)["a"].tolist() == [0, 1, 2]


def test_a_trainer_that_exits_normally_leaves_no_sidecar(tmp_path: Path) -> None:
    proc, pid = _trainer(tmp_path, "once")
    assert proc.wait(timeout=60) == 0
    assert _wait_gone(pid), f"sidecar {pid} outlived its trainer's normal exit"
    assert _our_shm(proc.pid, pid) == []


def test_shutdown_stops_the_sidecar_and_frees_its_memory(tmp_path: Path) -> None:
    ckptio.save(tmp_path, {"a": np.arange(100_000)}, step=1, save_options=SIDECAR).result()
    pid = sidecar.current_pid()
    assert pid is not None
    sidecar.shutdown()
    assert _wait_gone(pid) and sidecar.current_pid() is None
    gc.collect()  # a slab's memory (and mmap's own descriptor of it) goes with the last view into it
    assert _our_shm(os.getpid(), pid) == []


def test_current_is_the_sidecar_ensure_started_until_shutdown() -> None:
    """``current()`` never starts one; ``ensure()`` starts one once and hands back the same while it lives."""
    sidecar.shutdown()
    assert sidecar.current() is None
    sc = sidecar.ensure()
    assert sidecar.current() is sc and sidecar.ensure() is sc
    assert sc.pid is not None and sidecar.current_pid() == sc.pid
    sidecar.shutdown()
    assert sidecar.current() is None and _wait_gone(sc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("jax", [False, True])
def test_kill_minus_9_campaign_with_the_sidecar(tmp_path: Path, jax: bool) -> None:
    """tests/scenarios/crash_campaign.py with the saver writing through its sidecar: savers, sidecars, gc and
    cp killed at random; only committed steps listed, all bit-exact, no orphan after the final gc.
    With JAX arrays, the sidecar reads them out of the saver's memory (ckptio.saving.writers.remoteread)."""
    if jax:
        pytest.importorskip("jax")
    from crash_campaign import run_campaign

    result = run_campaign(trials=5 if jax else 8, root=str(tmp_path / "ckpt"), seed=17, writer="sidecar",
                          jax=jax)
    assert result["newest"] >= 2 and result["kills"]["sidecar"] > 0
    assert result["bytes_on_disk"] == result["bytes_of_kept_steps"]


def test_the_sidecar_and_the_trainer_draw_from_one_request_budget(tmp_path: Path) -> None:
    """A host is one share of the job's request rate whichever of its processes sends: the sidecar
    joins the trainer's budget, so its object writes are counted in (and spaced by) the host's
    slots -- not a second share of its own on top (issue 38, part 3)."""
    from ckptio.backends import open_backend
    from ckptio.backends.budget import RequestRate, budget_of

    rate = RequestRate(reads_per_s=1e5, writes_per_s=1e5, hosts=1, rank=0)
    cfg = EngineConfig(request_rate=rate)
    url = str(tmp_path / "c")
    for step in (1, 2):  # the second save reuses the child's engine and its joined budget
        ckptio.save(url, _state(step), step=step, engine_config=cfg, save_options=SIDECAR).result()
    assert sidecar.current_pid() is not None  # the sidecar did the writing
    budget = budget_of(cfg.drive(open_backend(url)))  # this process's budget for the storage
    assert budget is not None
    objects = sum(len(_objects(tmp_path / "c" / str(s))) for s in (1, 2))
    by_sidecar = budget.taken("write") - budget.taken_here["write"]
    assert objects > 0 and by_sidecar >= objects, (objects, by_sidecar, budget.taken_here)



def test_the_sidecar_keeps_the_hosts_budget_lock_while_a_thread_holds_it(tmp_path: Path, monkeypatch) -> None:
    """The child's request budget state is shared with the trainer under a lockf, which a process
    drops when it closes *any* descriptor of the memfd. A save's "open" brings the trainer's fd
    again; a thread of the child holding the state's lock right then (a write reserving its slot)
    must keep it: the trainer must not be let in to the same doubles at the same moment."""
    import threading

    from lockprobe import locked_elsewhere

    from ckptio.backends._budget_slots import SlotState
    from ckptio.backends.budget import RequestBudget, RequestRate
    from ckptio.saving.writers.sidecar_child import _Writer

    rate = RequestRate(reads_per_s=1e5, writes_per_s=1e5, hosts=1, rank=0)
    trainer = RequestBudget(rate)
    fd = trainer.share_fd()
    held, release = threading.Event(), threading.Event()
    real_join = SlotState.join

    def join_then_hold(self: SlotState, joined: int) -> None:
        """The join, then (as an IO thread of the child might at once) a thread takes the state's lock."""
        real_join(self, joined)

        def hold() -> None:
            with self.locked():
                held.set()
                release.wait(120)

        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(60)

    monkeypatch.setattr(SlotState, "join", join_then_hold)

    class Chan:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def send(self, msg: Any, fd: int | None = None) -> None:
            self.sent.append(msg)

    chan = Chan()
    writer = _Writer(chan)  # type: ignore[arg-type]
    spec = (str(tmp_path / "c"), {}, EngineConfig(request_rate=rate), tuple(sorted(os.environ.items())))
    try:
        writer.handle(("open", 1, spec, 0), [os.dup(fd)])
        assert locked_elsewhere(fd), "the child dropped its lock on the host's budget state"
    finally:
        release.set()
    deadline = time.monotonic() + 60
    while not chan.sent and time.monotonic() < deadline:  # the empty save's answer
        time.sleep(0.01)
    assert chan.sent and chan.sent[0][0] == "done", chan.sent
