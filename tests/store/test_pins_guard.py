"""The mixed-version guard (ckptio/incremental/pins.py, "Holds"): an older ckptio, which cannot see
pins, never deletes what a kept incremental step references -- its gc and its ``delete`` spare the
objects of a live save, and each pin comes with a hold (an intent whose lease no clock reaches) in
the referenced step; every incremental manifest is format 9, which an older retention skips.
This version ignores holds (pins decide), and removes each with its pin."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from previous_release import previous_release, run_previous

import ckptio
from ckptio.engine import run_sync
from ckptio.manifest.formats import MANIFEST_NAME, REFS_VERSION
from ckptio.manifest.names import parse_intent, parse_object
from ckptio.store.pins import PIN_DIR

#: The last commit before incremental saves (format 8): the "older ckptio" of this guard.
PREVIOUS = "40c2020d3b10b47a5b23275238c1e8339f5427e0"
FROZEN = 1 << 19  # float32: 2 MiB


def _run(root: Path, steps: int, keep: int) -> tuple[ckptio.CheckpointManager, dict[int, dict[str, Any]]]:
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    mngr = ckptio.CheckpointManager(root, max_to_keep=keep, incremental=True)
    states = {}
    for step in range(1, steps + 1):
        states[step] = {"frozen": frozen, "moving": np.full(FROZEN // 4, step, np.float32)}
        mngr.save(step, states[step], force=True)
        mngr.wait_until_finished()
    return mngr, states


def _files(root: Path, under: str) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in (root / under).rglob("*") if p.is_file()} if (root / under).exists() \
        else {}


def _version(root: Path, step: int) -> int:
    return int(json.loads((root / str(step) / MANIFEST_NAME).read_bytes())["manifest"]["version"])


def _restores(mngr: ckptio.CheckpointManager, states: dict[int, dict[str, Any]]) -> None:
    for step in mngr.all_steps():
        out = mngr.restore(step)
        assert all(np.asarray(out[k]).tobytes() == v.tobytes() for k, v in states[step].items()), step


def test_a_held_base_is_spared_by_the_older_liveness_rule(tmp_path: Path) -> None:
    mngr, states = _run(tmp_path, 4, keep=2)
    assert mngr.all_steps() == [3, 4]
    for step in (3, 4):
        assert run_sync(mngr.store.read_manifest(str(step))).bases == {"1": run_sync(
            mngr.store.read_manifest("3")).bases["1"]}  # type: ignore[index]
    held = {k for k in _files(tmp_path, "1") if parse_object(k)}
    assert held  # step 1 is deleted, the frozen array's object is held
    holds = {k: p for k, p in _files(tmp_path, "1").items() if parse_intent(k)}
    pins = sorted(p.name for p in (tmp_path / PIN_DIR).iterdir())
    assert len(holds) == len(pins) == 2  # one hold per pin, under the pinning save's id
    covered: set[str] = set()
    for key, path in holds.items():
        doc = json.loads(path.read_text())
        assert doc["hold"].rpartition("/")[2] in pins and parse_intent(key).save_id == doc["save_id"]  # type: ignore[union-attr]
        # The older rule (ckptio.store.intents before #37): live while mtime is younger than the lease.
        assert time.time() + 10 * 365 * 86400 - path.stat().st_mtime < float(doc["lease_s"])
        covered |= {doc["save_id"], *doc["covers"]}
    assert {parse_object(k).save_id for k in held} <= covered  # type: ignore[union-attr]
    # This version: holds are no live save, and gc keeps what pins hold, holds included.
    run_sync(mngr.store.sweep(grace_seconds=0))
    assert set(_files(tmp_path, "1")) == held | set(holds)
    _restores(mngr, states)
    assert _version(tmp_path, 3) >= REFS_VERSION
    for step in (3, 4):
        mngr.delete(step)
    run_sync(mngr.store.sweep(grace_seconds=0))
    assert not _files(tmp_path, "1") and not _files(tmp_path, PIN_DIR)  # the holds went with their pins
    mngr.close()


def test_every_incremental_manifest_is_format_9(tmp_path: Path) -> None:
    """Even a first save that references nothing: an older retention never deletes by its manifest."""
    mngr, _ = _run(tmp_path, 1, keep=2)
    m = run_sync(mngr.store.read_manifest("1"))
    assert m.bases is None and _version(tmp_path, 1) >= REFS_VERSION
    mngr.close()


#: The format-8 release's retention with newer steps of its own (it runs after each save), on a root
#: whose base is standing.
_OLD_RETENTION = """
import numpy as np
import ckptio
m = ckptio.CheckpointManager(sys.argv[1], max_to_keep=1)
for step in (5, 6):
    m.save(step, {"x": np.zeros(4)}, force=True)
    m.wait_until_finished()
print("old retention kept", m.all_steps())
m.close()
"""


def _run_previous(
    old: Path, root: Path, step: int, cwd: Path, after_close: str = ""
) -> subprocess.CompletedProcess[str]:
    """The previous release (``old``: its sources) gcs ``root``, deletes ``step``, lists what it
    sees committed, then runs ``after_close``, importing its own code, not this tree's."""
    listing = 'print("old committed", run_sync(store.committed_steps()))'
    return run_previous(old, root, [step], cwd, version=8, with_store=listing, after_close=after_close)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["deleted", "standing"])
def test_the_previous_release_deletes_nothing_a_kept_step_references(tmp_path: Path, base: str) -> None:
    """The previous release's gc (grace 0), its ``delete`` of the base, and (base standing) its
    retention with newer steps of its own, on a root where kept incremental steps reference that
    base: every incremental step still restores bit-exact."""
    old = previous_release(tmp_path, PREVIOUS)
    root = tmp_path / base
    mngr, states = _run(root, 4 if base == "deleted" else 3, keep=2 if base == "deleted" else 3)
    mngr.close()
    done = _run_previous(old, root, 1, tmp_path, _OLD_RETENTION if base == "standing" else "")
    mngr = ckptio.CheckpointManager(root, incremental=True)
    for step in states:
        if step in mngr.all_steps():  # the older delete took step 1's manifest (by name), not its objects
            out = mngr.restore(step)
            assert all(np.asarray(out[k]).tobytes() == v.tobytes() for k, v in states[step].items()), step
    assert set(mngr.all_steps()) >= ({3, 4} if base == "deleted" else {2, 3}), done.stdout
    mngr.close()


@pytest.mark.slow
def test_the_previous_release_deleting_an_incremental_step_loses_nothing_kept(tmp_path: Path) -> None:
    """The previous release's gc (grace 0) and ``delete`` of an incremental step that is itself a base
    (step 3 reuses an array step 2 wrote): the older version deletes step 2 (what it was asked), but
    never the objects step 3 references there (spared through step 3's hold); steps 1 and 3 restore
    bit-exact, and this version's gc then leaves exactly the objects the kept steps reference."""
    old = previous_release(tmp_path, PREVIOUS)
    root = tmp_path / "steps"
    frozen = np.random.default_rng(0).standard_normal(FROZEN).astype(np.float32)
    mid = {1: 1.0, 2: 2.0, 3: 2.0}  # changes at step 2, not at step 3: step 3 references step 2's object
    states = {s: {"frozen": frozen, "mid": np.full(FROZEN // 4, mid[s], np.float32),
                  "moving": np.full(FROZEN // 4, s, np.float32)} for s in (1, 2, 3)}
    mngr = ckptio.CheckpointManager(root, max_to_keep=3, incremental=True)
    for step, state in states.items():
        mngr.save(step, state, force=True)
        mngr.wait_until_finished()
    m3 = run_sync(mngr.store.read_manifest("3"))
    assert {k.split("/")[0] for k in m3.objects} == {"1", "2", "3"}  # the scenario: references into 1 and 2
    mngr.close()
    done = _run_previous(old, root, 2, tmp_path)
    assert "old delete 2 done" in done.stdout, done.stdout
    mngr = ckptio.CheckpointManager(root, incremental=True)
    for rounds in ("after the older delete", "after this version's gc"):
        assert mngr.all_steps() == [1, 3], (rounds, done.stdout)
        for step in (1, 3):
            out = mngr.restore(step)
            assert all(np.asarray(out[k]).tobytes() == v.tobytes() for k, v in states[step].items()), (rounds, step)
        mngr.sweep_orphans(0.0)
    kept = {k for s in ("1", "3") for k in run_sync(mngr.store.read_manifest(s)).objects}
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and parse_object(str(p.relative_to(root)))}
    assert on_disk == kept
    assert not [p for p in (root / PIN_DIR).glob("*") if p.name.split(".")[1] == "2"]  # step 2's own pins went
    mngr.close()
