"""The default writer (ckptio.saving.writers.auto): large saves (numpy, torch, JAX) on a local backend go to
the writer process when no writer is named; everything else, and every named writer, is left as it was."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio.saving.writers import auto as writer_auto
from ckptio.saving.writers import remoteread, sidecar, sidecar_export

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the sidecar needs Linux memfd")

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _small_threshold(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A 1 MiB threshold (the rule, not its size, is under test), no writer named, no sidecar running."""
    monkeypatch.delenv(sidecar.ENV, raising=False)
    monkeypatch.setattr(writer_auto, "AUTO_MIN_BYTES", MIB)
    monkeypatch.setattr(writer_auto, "_unusable", None)  # each test starts with the default on
    monkeypatch.setattr(writer_auto, "_used", False)
    sidecar.shutdown()
    yield
    sidecar.shutdown()


def _arrays(n_mib: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((MIB // 4 // 256, 256), dtype=np.float32) for i in range(n_mib)}


def _jax(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jax.device_put(v) for k, v in arrays.items()}


def _save_and_check(root: Path, state: dict[str, Any], expected: dict[str, np.ndarray], **kw: Any) -> bool:
    """Save ``state`` as step 1, check it restores to ``expected``; whether a writer process ran it."""
    with ckptio.CheckpointManager(root, **kw) as m:
        m.save(1, state).result()
    back = ckptio.restore(root, 1)
    for k, v in expected.items():
        assert np.asarray(back[k]).tobytes() == v.tobytes()
    return sidecar.current_pid() is not None


def test_a_large_jax_save_goes_to_the_writer_process_by_default(tmp_path: Path) -> None:
    arrays = _arrays(4)
    assert _save_and_check(tmp_path / "c", _jax(arrays), arrays)


@pytest.mark.parametrize("how", ["config", "env"])
def test_naming_the_thread_writer_opts_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    arrays = _arrays(4)
    kw: dict[str, Any] = {}
    if how == "config":
        kw["save_options"] = ckptio.SaveOptions(writer="thread")
    else:
        monkeypatch.setenv(sidecar.ENV, "thread")
    assert not _save_and_check(tmp_path / "c", _jax(arrays), arrays, **kw)


@pytest.mark.parametrize("kind", ["numpy", "torch", "mixed"])
def test_a_large_numpy_or_torch_save_goes_to_the_writer_process_too(tmp_path: Path, kind: str) -> None:
    """Measured beside a GIL-bound training step (issue 35), numpy and torch saves lose the step less
    and finish sooner through the writer process, as JAX saves do."""
    arrays = _arrays(4)
    state: dict[str, Any] = dict(arrays)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        state = {k: torch.from_numpy(v) for k, v in arrays.items()}
    elif kind == "mixed":
        state["w0"] = jax.device_put(arrays["w0"])
    assert _save_and_check(tmp_path / "c", state, arrays)


def test_a_small_jax_save_keeps_the_in_process_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_auto, "AUTO_MIN_BYTES", 8 * MIB)
    arrays = _arrays(4)
    assert not _save_and_check(tmp_path / "c", _jax(arrays), arrays)


def test_a_process_local_backend_keeps_the_in_process_writer() -> None:
    arrays = _arrays(4)
    with ckptio.CheckpointManager("mem://auto-writer") as m:
        m.save(1, _jax(arrays)).result()
        back = m.restore(1)
    assert np.asarray(back["w3"]).tobytes() == arrays["w3"].tobytes()
    assert sidecar.current_pid() is None


def test_array_bytes_counts_what_this_host_writes_without_staging() -> None:
    """Counted from the leaves before staging, as staging would split them: plain arrays and
    tensors on host 0 only, a JAX array's shards of replica 0, a ``Sharded`` leaf's pieces."""
    from ckptio import Sharded

    a = np.zeros((8, 128), np.float32)  # 4 KiB
    leaves: list[Any] = [a, jax.device_put(a), Sharded((16, 128), a.dtype, [((slice(0, 8), slice(None)), a)]),
                         3, np.float32(1.0), "text"]
    devices = jax.devices()
    if len(devices) >= 2:  # replicated on two devices: written once
        mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",))
        leaves.append(jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    torch = pytest.importorskip("torch")
    leaves.append(torch.zeros(8, 128, dtype=torch.bfloat16))  # 2 KiB
    jax_bytes = 4096 * (len(leaves) - 6)
    assert writer_auto.array_bytes(leaves, 0) == 4096 + jax_bytes + 4096 + 2048
    assert writer_auto.array_bytes(leaves, 1) == jax_bytes + 4096


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_default_save_snapshots_straight_into_the_writer_process_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The default is chosen before staging: a numpy or torch save's snapshots are taken into the
    shared memory the writer process reads, never copied there a second time."""
    arrays = _arrays(4)
    state: dict[str, Any] = dict(arrays)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        state = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    copied: list[int] = []
    real = sidecar_export.Export._copy_into_slab

    def spy(self: Any, n: int, *args: Any) -> Any:
        copied.append(n)
        return real(self, n, *args)

    monkeypatch.setattr(sidecar_export.Export, "_copy_into_slab", spy)
    assert _save_and_check(tmp_path / "c", state, arrays)
    assert copied == []
    monkeypatch.setenv(remoteread.ENV, "0")  # JAX arrays copied, not read by the writer process
    assert _save_and_check(tmp_path / "d", _jax(arrays), arrays)
    assert sum(copied) >= sum(v.nbytes for v in arrays.values())  # the spy sees copies where there are some


@pytest.mark.parametrize("reads", ["copied", "read"])
def test_a_jax_save_holds_at_most_the_export_budget_of_shared_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str) -> None:
    """JAX arrays are copied into shared memory object by object, and those copies are reused:
    after a save of 16 one-MiB objects the pool holds what was ever in flight, which the budget
    (``EXPORT_OBJECTS`` objects, or the backend's requests in flight) bounds, not the state. Where
    the writer process reads them from the trainer (ckptio.saving.writers.remoteread), nothing is copied at all."""
    if reads == "copied":
        monkeypatch.setenv(remoteread.ENV, "0")
    else:
        monkeypatch.delenv(remoteread.ENV, raising=False)
    arrays = _arrays(16)
    opts = {"object_size": MIB, "threads": 1}  # a budget of max(2 x 1 MiB, 1 x 8 MiB) = 8 MiB
    assert _save_and_check(tmp_path / "c", _jax(arrays), arrays, backend_options=opts)
    budget = max(sidecar_export.EXPORT_OBJECTS * MIB, 8 * MIB)
    held = sidecar.shared_pool()._free.held_bytes()
    current = sidecar.current()
    if reads == "read" and current is not None and current.reads_remote:
        assert held == 0, held
    else:
        assert MIB <= held <= budget, (held, budget)


@pytest.mark.parametrize("copy", [False, True])
def test_sharded_host_views_go_to_the_writer_process_copied_or_not(tmp_path: Path, copy: bool) -> None:
    """The Orbax handler saves JAX arrays as ``Sharded`` host views with ``copy=False``; snapshotted
    (``copy=True``) or not, a large save of them goes to the writer process."""
    from ckptio import Sharded

    arrays = _arrays(4)
    state = {k: Sharded(v.shape, v.dtype, [((slice(None), slice(None)), v)]) for k, v in arrays.items()}
    ckptio.save(tmp_path / "c", state, 1, copy=copy).result()
    back = ckptio.restore(tmp_path / "c", 1)
    assert np.asarray(back["w2"]).tobytes() == arrays["w2"].tobytes()
    assert sidecar.current_pid() is not None


def test_a_writer_process_that_cannot_start_leaves_default_saves_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A default must not fail saves where no process can be spawned: one warning, saves in-process."""
    def no_spawn(_sock: Any) -> Any:
        raise OSError("spawning is not allowed here")

    monkeypatch.setattr(sidecar, "_spawn", no_spawn)
    with caplog.at_level("WARNING", logger="ckptio.writers"):
        for i, root in enumerate(("a", "b")):
            assert not _save_and_check(tmp_path / root, _jax(_arrays(4, seed=i)), _arrays(4, seed=i))
    assert sum("could not start the ckptio writer process" in r.getMessage() for r in caplog.records) == 1
    assert writer_auto._unusable is not None


def test_an_incremental_jax_save_keeps_the_in_process_writer(tmp_path: Path) -> None:
    arrays = _arrays(4)
    assert not _save_and_check(tmp_path / "c", _jax(arrays), arrays, incremental=True)


def test_a_writer_process_that_dies_turns_the_default_off_after_the_save_it_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A child that starts but cannot work (here: exits at once, as one that cannot import ckptio
    would) fails the save it was given; the next default save stays in this process and succeeds."""
    import subprocess
    import sys

    def dying(sock: Any) -> Any:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], pass_fds=(sock.fileno(),))

    monkeypatch.setattr(sidecar, "_spawn", dying)
    with pytest.raises(Exception, match="writer process"):
        with ckptio.CheckpointManager(tmp_path / "a") as m:
            m.save(1, _jax(_arrays(4))).result()
    with caplog.at_level("WARNING", logger="ckptio.writers"):
        assert not _save_and_check(tmp_path / "b", _jax(_arrays(4, seed=1)), _arrays(4, seed=1))
    assert sum("large saves stay in this process" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "a").glob("1/ckptio.manifest*"))  # the failed save committed nothing


def test_a_writer_process_that_died_before_the_save_reached_it_turns_the_default_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The race of the test above, forced: the child is dead by the time the save hands it its objects,
    so the save's request for the writer process starts another (which dies as well) and the save fails
    on that one. The next default save still stays in this process."""
    import subprocess
    import sys
    import time

    def dying(sock: Any) -> Any:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], pass_fds=(sock.fileno(),))

    write = sidecar.SidecarWriter.write
    reached: list[Any] = []  # the writer process the default chose, as the save reaches it

    def once_it_died(self: Any, *args: Any) -> Any:
        reached.append(sidecar.current())
        for _ in range(3000):  # until its reader thread has seen the child exit
            if reached[-1] is None or reached[-1].dead is not None:
                break
            time.sleep(0.01)
        return write(self, *args)

    monkeypatch.setattr(sidecar, "_spawn", dying)
    monkeypatch.setattr(sidecar.SidecarWriter, "write", once_it_died)
    with pytest.raises(Exception, match="writer process"):
        with ckptio.CheckpointManager(tmp_path / "a") as m:
            m.save(1, _jax(_arrays(4))).result()
    assert reached[0] is not None and reached[0].dead is not None  # dead before the save reached it
    assert sidecar.current() is not reached[0]  # the save failed on its replacement
    with caplog.at_level("WARNING", logger="ckptio.writers"):
        assert not _save_and_check(tmp_path / "b", _jax(_arrays(4, seed=1)), _arrays(4, seed=1))
    assert sum("large saves stay in this process" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("size_mib, named, expected", [(4, None, True), (4, "thread", False), (0, None, False)])
def test_a_dcp_async_save_of_cpu_tensors_follows_the_same_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size_mib: int, named: str | None, expected: bool
) -> None:
    """``ckptio.dcp.Writer`` under ``async_save``: a large save of CPU tensors to a local disk is
    staged into shared memory and written by the writer process, unless a writer is named; a small
    one stays in-process. Either way it restores bit-exact, and a later synchronous save on the same
    Writer writes in-process."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import ckptio.dcp

    if named:
        monkeypatch.setenv(sidecar.ENV, named)
    arrays = _arrays(size_mib) if size_mib else {"w0": np.arange(1000, dtype=np.float32)}
    state = {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    writes: list[str] = []
    for cls in (type(sidecar.SIDECAR_WRITER), type(ckptio.saving.writers.base.THREAD_WRITER)):
        real = cls.write
        monkeypatch.setattr(cls, "write", lambda self, *a, _real=real, **k: (writes.append(self.name), _real(self, *a, **k))[1])
    writer = ckptio.dcp.Writer(str(tmp_path / "a"))
    dcp.async_save(state, storage_writer=writer).result()
    assert writes == (["sidecar"] if expected else ["thread"])
    assert (sidecar.current_pid() is not None) == expected
    back = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=ckptio.dcp.Reader(str(tmp_path / "a")))
    assert all(back[k].numpy().tobytes() == v.tobytes() for k, v in arrays.items())
    writes.clear()
    writer.reset(str(tmp_path / "b"))
    dcp.save(state, storage_writer=writer)  # synchronous: no staging copy, in-process
    assert writes == ["thread"]
