"""A save by many hosts to host-local stores commits format 2 with carried fragments (ckptio.saving.carried_fragments, #33).

Host 0 commits a small root and holds every host's fragment; it never merges another host's shards.
Each host's own part (what its commit record is built from) names the objects the checkpoint gives
it, at its fragment's base; bad fragments and a crash before the root leave no checkpoint behind.
"""

from __future__ import annotations

import base64
import copy
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import ManifestError
from ckptio.manifest import MANIFEST_NAME
from ckptio.saving.carried_fragments import carried_save_ids, carried_summary, write_carried
from ckptio.saving.job import start_save
from ckptio.store import CheckpointStore

HOSTS, ROWS, COLS = 3, 48, 8
W = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
B = np.arange(ROWS, dtype=np.int32) * 3


def _state(rank: int) -> dict[str, Any]:
    rows = ROWS // HOSTS
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    return {"w": ckptio.Sharded(W.shape, W.dtype, [(ix, W[ix])]),
            "b": ckptio.Sharded(B.shape, B.dtype, [((ix[0],), B[ix[0]])]), "lr": 0.5}


def _save_on_hosts(tmp_path: Path, step: int) -> list[Any]:
    def host(rank: int, coord: Any) -> Any:
        store = CheckpointStore(str(tmp_path / f"r{rank}"), host_local=True)
        h = start_save(store, step, _state(rank), coordinator=coord)
        h.result()
        return h

    return on_hosts(HOSTS, host)


def test_host_0_commits_a_root_and_every_fragment_and_each_part_is_its_hosts(tmp_path: Path) -> None:
    handles = _save_on_hosts(tmp_path, 4)
    lead = tmp_path / "r0" / "4"
    frags = sorted(n for n in os.listdir(lead) if n.startswith("ckptio.fragment."))
    assert len(frags) == HOSTS  # every host's, carried: host 0 can read the whole checkpoint
    for r in range(1, HOSTS):  # no other host holds a manifest or a fragment
        names = os.listdir(tmp_path / f"r{r}" / "4")
        assert MANIFEST_NAME not in names and not [n for n in names if n.startswith("ckptio.fragment.")], names
    store = CheckpointStore(str(tmp_path / "r0"), host_local=True)
    root = run_sync(store.read_manifest("4", shards=False))
    assert root.fragments is not None and len(root.fragments) == HOSTS and root.objects == []
    m = run_sync(store.read_manifest("4"))
    bases = handles[0].part_bases
    for r, h in enumerate(handles):
        part = h.part
        assert m.objects[bases[r]:bases[r] + len(part["objects"])] == part["objects"], r
        for key, size in zip(part["objects"], part["sizes"]):
            assert os.path.getsize(tmp_path / f"r{r}" / key) >= size
    # Root + fragments on host 0 and every host's objects: a whole checkpoint, bit-exact.
    for r in range(1, HOSTS):
        for key in handles[r].part["objects"]:
            os.makedirs(tmp_path / "r0" / os.path.dirname(key), exist_ok=True)
            shutil.copyfile(tmp_path / f"r{r}" / key, tmp_path / "r0" / key)
    out = ckptio.restore(str(tmp_path / "r0"), step=4)
    np.testing.assert_array_equal(np.asarray(out["w"]), W)
    np.testing.assert_array_equal(np.asarray(out["b"]), B)
    assert out["lr"] == 0.5


def _summaries(step_dir: str = "7") -> list[dict[str, Any]]:
    out = []
    for r in range(2):
        record = {"objects": [f"{step_dir}/{r:012x}.h{r:05d}-00000"], "items": {"w": {
            "kind": "array", "dtype": "float32", "shape": [2, 2], "scalar": False, "origin": None,
            "shards": [{"offsets": [r, 0], "shape": [1, 2], "host": r, "extents": [[0, 0, 0, 8, [1]]]}]}}}
        out.append(carried_summary(record, step_dir, int(step_dir), f"{r:012x}", r))
    return out


@pytest.mark.parametrize("damage", ["a flipped byte", "another step's key", "another host's fragment", "not base64"])
def test_a_fragment_that_is_not_what_its_reference_says_is_refused_and_nothing_is_written(tmp_path: Path,
                                                                                          damage: str) -> None:
    summaries = _summaries()
    s = summaries[1]
    if damage == "a flipped byte":
        data = bytearray(base64.b64decode(s["fragment_data"]))
        data[5] ^= 1
        s["fragment_data"] = base64.b64encode(bytes(data)).decode()
    elif damage == "another step's key":
        s["fragment"] = {**s["fragment"], "key": s["fragment"]["key"].replace("7/", "8/")}
    elif damage == "another host's fragment":
        s["fragment"] = {**s["fragment"], "host": 0}
    else:
        s["fragment_data"] = "*not base64*"
    store = CheckpointStore(str(tmp_path / "r0"), host_local=True)
    with pytest.raises(ManifestError, match="host 1"):
        carried_save_ids(copy.deepcopy(summaries), "7", "here")
        run_sync(write_carried(store.io, summaries, "here"))
    assert not (tmp_path / "r0" / "7").exists() or os.listdir(tmp_path / "r0" / "7") == []


def test_sound_fragments_are_written_with_their_bases(tmp_path: Path) -> None:
    summaries = _summaries()
    store = CheckpointStore(str(tmp_path / "r0"), host_local=True)
    assert carried_save_ids(summaries, "7", "here") == ["000000000000", "000000000001"]
    assert run_sync(write_carried(store.io, summaries, "here")) == [0, 1]
    assert sorted(os.listdir(tmp_path / "r0" / "7")) == ["ckptio.fragment.000000000000", "ckptio.fragment.000000000001"]
    assert all("fragment_data" not in s for s in summaries)  # dropped once written


def test_a_commit_that_dies_after_the_fragments_leaves_no_checkpoint_and_the_step_saves_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host 0 dies between writing the carried fragments and its root: no manifest, the save fails on
    every host; the fragments are a dead save's keys (its intent covered their ids), and a re-save of the
    step commits and restores."""
    save_mod = sys.modules["ckptio.saving.recording"]

    real = save_mod.build_root

    def dies(*a: Any, **k: Any) -> Any:
        raise OSError("killed between the fragments and the root")

    monkeypatch.setattr(save_mod, "build_root", dies)
    with pytest.raises(Exception):
        _save_on_hosts(tmp_path, 5)
    lead = tmp_path / "r0" / "5"
    assert not (lead / MANIFEST_NAME).exists()
    assert len([n for n in os.listdir(lead) if n.startswith("ckptio.fragment.")]) == HOSTS
    assert run_sync(CheckpointStore(str(tmp_path / "r0"), host_local=True).committed_steps()) == []
    monkeypatch.setattr(save_mod, "build_root", real)
    handles = _save_on_hosts(tmp_path, 5)
    assert run_sync(CheckpointStore(str(tmp_path / "r0"), host_local=True).committed_steps()) == [5]
    m = run_sync(CheckpointStore(str(tmp_path / "r0"), host_local=True).read_manifest("5"))
    assert m.checkpoint_id == handles[0].result().checkpoint_id
