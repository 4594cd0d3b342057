"""``CheckpointManager(incremental=True)``: unchanged arrays are not written again, every kept step
restores bit-exact, and retention keeps exactly what kept steps reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paths import WORKERS

import ckptio
from ckptio.cli import main as cli_main
from ckptio.engine import run_sync
from ckptio.manage.copying import copy_checkpoint
from ckptio.manifest.names import parse_object
from ckptio.store import CheckpointStore
from ckptio.store.pins import PIN_DIR

FROZEN = 1 << 20  # float32 elements: 4 MiB
MOVING = 1 << 18  # 1 MiB


def state(step: int, frozen: np.ndarray) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"frozen": frozen, "moving": rng.standard_normal(MOVING).astype(np.float32),
            "small": np.full(3, step, np.int32), "step": step}


def data_objects(root: Path) -> dict[str, int]:
    out = {}
    for p in root.rglob("*"):
        key = str(p.relative_to(root))
        if p.is_file() and parse_object(key):
            out[key] = p.stat().st_size
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in ("frozen", "moving", "small")) \
        and a["step"] == b["step"]


def test_a_frozen_base_is_written_once_and_every_kept_step_restores(tmp_path: Path) -> None:
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    mngr = ckptio.CheckpointManager(tmp_path, max_to_keep=3, incremental=True)
    states, written = {}, []
    for step in range(1, 8):
        before = data_objects(tmp_path)
        states[step] = state(step, frozen.copy())  # equal bytes, another buffer
        mngr.save(step, states[step], force=True)
        mngr.wait_until_finished()
        new = {k: v for k, v in data_objects(tmp_path).items() if k not in before}
        written.append(sum(new.values()))
    assert written[0] >= FROZEN * 4  # the first save writes everything
    assert all(w < FROZEN * 4 // 2 for w in written[1:]), written  # later ones: not the frozen array
    kept = mngr.all_steps()
    assert kept == [5, 6, 7]
    for step in kept:
        assert same(mngr.restore(step), states[step])
    store = mngr.store
    named = set().union(*(run_sync(store.read_manifest(str(s))).objects for s in kept))
    assert set(data_objects(tmp_path)) == named  # retention took what no kept step references
    frozen_keys = {k for k in named if k.startswith("1/")}
    assert frozen_keys and sum(data_objects(tmp_path)[k] for k in frozen_keys) >= FROZEN * 4
    mngr.close()


def as_kind(kind: str, arr: np.ndarray) -> Any:
    """numpy: staged as a private copy (compared with its shadow); jax: an immutable view (digested)."""
    if kind == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(arr)
    return arr


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_a_changing_array_is_written_each_time(tmp_path: Path, kind: str) -> None:
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    rng = np.random.default_rng(1)
    sizes = []
    for step in range(1, 4):
        before = data_objects(tmp_path)
        mngr.save(step, {"w": as_kind(kind, rng.standard_normal(FROZEN).astype(np.float32))}, force=True)
        mngr.wait_until_finished()
        sizes.append(sum(v for k, v in data_objects(tmp_path).items() if k not in before))
    assert all(s >= FROZEN * 4 for s in sizes)
    # A first save digests the views it cannot keep a copy of; a private copy is never digested.
    assert bool(run_sync(mngr.store.read_manifest("1")).digests) == (kind == "jax")
    m = run_sync(mngr.store.read_manifest("3"))
    assert m.bases is None and m.digests is None  # its crcs differ from the base's: not even digested
    mngr.close()


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_an_array_that_stops_changing_is_reused(tmp_path: Path, kind: str) -> None:
    """A private copy is reused from its first unchanged save (its shadow is the last save's copy).
    A view: its crcs differed, so it had no digest; the first save that finds them equal digests it
    (and writes it), the next one references it."""
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    rng = np.random.default_rng(2)
    w = rng.standard_normal(FROZEN).astype(np.float32)
    for step in range(1, 6):
        if step <= 2:
            w = rng.standard_normal(FROZEN).astype(np.float32)
        mngr.save(step, {"w": as_kind(kind, w)}, force=True)
        mngr.wait_until_finished()
    refs = {s: run_sync(mngr.store.read_manifest(str(s))).bases for s in range(1, 6)}
    first = 3 if kind == "jax" else 2  # the step every later one references
    assert all(refs[s] is None for s in range(1, first + 1))
    cid = run_sync(mngr.store.read_manifest(str(first))).checkpoint_id
    assert all(refs[s] == {str(first): cid} for s in range(first + 1, 6))
    assert np.asarray(mngr.restore(5)["w"]).tobytes() == w.tobytes()
    mngr.close()


def test_deleting_every_older_step_keeps_the_newest_whole(tmp_path: Path) -> None:
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    for step in range(1, 4):
        mngr.save(step, state(step, frozen), force=True)
        mngr.wait_until_finished()
    for step in (1, 2):
        mngr.delete(step)
    assert same(mngr.restore(3), state(3, frozen))
    run_sync(mngr.store.sweep(grace_seconds=0))
    assert same(mngr.restore(3), state(3, frozen))
    assert set(data_objects(tmp_path)) == set(run_sync(mngr.store.read_manifest("3")).objects)
    pins = sorted(p.name for p in (tmp_path / PIN_DIR).iterdir())
    assert pins and all(".3." in p for p in pins)  # only the standing step's pins remain
    mngr.close()


def test_cp_of_an_incremental_step_is_self_contained(tmp_path: Path) -> None:
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    src, dst = tmp_path / "src", tmp_path / "dst"
    mngr = ckptio.CheckpointManager(src, incremental=True)
    for step in (1, 2):
        mngr.save(step, state(step, frozen), force=True)
        mngr.wait_until_finished()
    assert run_sync(mngr.store.read_manifest("2")).bases  # step 2 references step 1
    copied = CheckpointStore(str(dst))
    run_sync(copy_checkpoint(mngr.store, copied, "2"))
    m = run_sync(copied.read_manifest("2"))
    assert m.bases is None and all(k.startswith("2/") for k in m.objects)
    assert set(data_objects(dst)) == set(m.objects)
    mngr.delete(1)
    mngr.delete(2)
    assert same(ckptio.restore(str(dst), step=2), state(2, frozen))
    mngr.close()


def test_ls_shows_a_deleted_base_whose_objects_later_steps_reference(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True, max_to_keep=2)
    for step in range(1, 4):
        mngr.save(step, state(step, frozen), force=True)
        mngr.wait_until_finished()
    mngr.close()
    assert cli_main(["ls", str(tmp_path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["1"])
    assert "deleted, objects referenced" in line and "held for step(s) 2, 3" in line


def test_convert_of_an_incremental_step_is_self_contained(tmp_path: Path) -> None:
    """``ckptio convert`` of a step that references an older one writes every byte it names: the
    copy restores bit-exact once the source root is gone."""
    from ckptio.convert import convert

    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    src = tmp_path / "src"
    mngr = ckptio.CheckpointManager(src, incremental=True, max_to_keep=1)
    for step in (1, 2, 3):
        mngr.save(step, state(step, frozen), force=True)
        mngr.wait_until_finished()
    assert mngr.all_steps() == [3] and run_sync(mngr.store.read_manifest("3")).bases == {
        "1": run_sync(mngr.store.read_manifest("3")).bases["1"]}  # type: ignore[index]
    mngr.close()
    convert(str(src), str(tmp_path / "dcp"), src_format="ckptio", dst_format="dcp", step=3)
    import shutil

    shutil.rmtree(src)
    convert(str(tmp_path / "dcp"), str(tmp_path / "back"), src_format="dcp", dst_format="ckptio", step=3)
    out = ckptio.restore(str(tmp_path / "back"), step=3)
    for name in ("frozen", "moving", "small"):
        assert np.asarray(out[name]).tobytes() == np.asarray(state(3, frozen)[name]).tobytes(), name


@pytest.mark.slow
def test_a_multi_process_job_saves_incrementally(tmp_path: Path) -> None:
    """Real processes (torch.distributed, gloo): each references its own frozen shard from step 1,
    kept through retention's deletion of step 1, and step 3 restores bit-exact on every process
    (threads as hosts: tests/saving/incremental/test_hosts.py)."""
    pytest.importorskip("torch")
    from ckptio.bench.readonce import spawn

    spawn(str(WORKERS / "mp_native_worker.py"), 2, ["incremental", str(tmp_path / "ckpt")], 120)


def test_views_are_digested_off_the_training_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An immutable array (a jax array: a view, not copied) is digested on the save's thread, never in
    the ``save`` call (the step's stall): a frozen one is still referenced from its first save, and a
    changing one -- laid out after the rest, once that thread decides -- restores bit-exact beside
    changing private copies and packed small arrays."""
    jnp = pytest.importorskip("jax.numpy")
    import threading

    from ckptio.saving.incremental import plan as plan_mod

    threads: list[str] = []
    digest = plan_mod.digest_of

    def spy(data: Any) -> str:
        threads.append(threading.current_thread().name)
        return digest(data)

    monkeypatch.setattr(plan_mod, "digest_of", spy)
    rng = np.random.default_rng(3)
    frozen = jnp.asarray(rng.standard_normal(FROZEN).astype(np.float32))
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    states = {}
    for step in range(1, 5):
        states[step] = {"frozen": frozen, "moving_jax": jnp.full(MOVING, step, jnp.float32),
                        "moving_np": np.full(MOVING, -step, np.float32), "small": np.arange(3) + step}
        mngr.save(step, states[step], force=True)
        assert not [t for t in threads if t == threading.current_thread().name], threads
        mngr.wait_until_finished()
    assert threads and all(t.startswith("ckptio-save-") for t in threads), threads
    for step in range(1, 5):
        m = run_sync(mngr.store.read_manifest(str(step)))
        steps = {name: {m.objects[e.object].split("/")[0] for s in m.items[name].shards for e in s.extents}
                 for name in ("frozen", "moving_jax")}  # type: ignore[union-attr]
        assert steps == {"frozen": {"1"}, "moving_jax": {str(step)}}, (step, steps)
        out = mngr.restore(step)
        assert all(np.asarray(out[k]).tobytes() == np.asarray(v).tobytes() for k, v in states[step].items()), step
    mngr.close()
