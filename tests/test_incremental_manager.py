"""``CheckpointManager(incremental=True)``: unchanged arrays are not written again, every kept step
restores bit-exact, and retention keeps exactly what kept steps reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio.cli import main as cli_main
from ckptio.copy import copy_checkpoint
from ckptio.engine import run_sync
from ckptio.incremental.pins import PIN_DIR
from ckptio.names import parse_object
from ckptio.store import CheckpointStore

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


def test_a_changing_array_is_written_each_time(tmp_path: Path) -> None:
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    rng = np.random.default_rng(1)
    sizes = []
    for step in range(1, 4):
        before = data_objects(tmp_path)
        mngr.save(step, {"w": rng.standard_normal(FROZEN).astype(np.float32)}, force=True)
        mngr.wait_until_finished()
        sizes.append(sum(v for k, v in data_objects(tmp_path).items() if k not in before))
    assert all(s >= FROZEN * 4 for s in sizes)
    assert run_sync(mngr.store.read_manifest("1")).digests  # a first save digests everything
    m = run_sync(mngr.store.read_manifest("3"))
    assert m.bases is None and m.digests is None  # its crcs differ from the base's: not even digested
    mngr.close()


def test_an_array_that_stops_changing_is_reused_from_its_second_unchanged_save(tmp_path: Path) -> None:
    """Its crcs differed, so it had no digest; the first save that finds them equal digests it
    (and writes it), the next one references it."""
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    rng = np.random.default_rng(2)
    w = rng.standard_normal(FROZEN).astype(np.float32)
    for step in range(1, 6):
        if step <= 2:
            w = rng.standard_normal(FROZEN).astype(np.float32)
        mngr.save(step, {"w": w}, force=True)
        mngr.wait_until_finished()
    refs = {s: run_sync(mngr.store.read_manifest(str(s))).bases for s in range(1, 6)}
    assert refs[1] is None and refs[2] is None and refs[3] is None  # changed, changed, digested now
    assert refs[4] == {"3": run_sync(mngr.store.read_manifest("3")).checkpoint_id} and refs[5] == refs[4]
    assert mngr.restore(5)["w"].tobytes() == w.tobytes()
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
