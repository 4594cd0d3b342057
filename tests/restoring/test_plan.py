"""Restore as plan + execute: the plan is pure data (what is read, into what), executing it is the IO."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import CheckpointNotFoundError
from ckptio.store import CheckpointStore

import ckptio.restoring as restore


def _saved(tmp_path: Path) -> CheckpointStore:
    state = {"w": np.arange(4000, dtype=np.float32).reshape(40, 100), "b": np.ones(3), "step": 7}
    ckptio.save(str(tmp_path), state, 1).result()
    return CheckpointStore(str(tmp_path))


def test_a_plan_names_every_read_and_executes_to_the_tree(tmp_path: Path) -> None:
    store = _saved(tmp_path)
    manifest = run_sync(store.read_manifest("1"))
    target = {"w": ckptio.Sharded((40, 100), np.float32, [((slice(10, 20), slice(None)), None)]),
              "b": None, "step": None}
    plan = restore.plan(manifest, target)
    assert plan.keys() <= set(manifest.objects) and plan.keys()
    assert plan.nbytes >= 10 * 100 * 4  # the slice's rows at least, rounded to checksum blocks
    out = restore.execute(plan, store.engine)
    ((_index, piece),) = out["w"].pieces
    np.testing.assert_array_equal(piece, np.arange(1000, 2000, dtype=np.float32).reshape(10, 100))
    assert out["b"].tolist() == [1, 1, 1] and out["step"] == 7
    run_sync(store.close())


def test_planning_reads_nothing_and_refuses_a_target_the_checkpoint_lacks(tmp_path: Path) -> None:
    store = _saved(tmp_path)
    manifest = run_sync(store.read_manifest("1"))
    run_sync(store.close())
    for key in manifest.objects:  # no object left: a plan that read one would fail
        (tmp_path / key).unlink()
    assert restore.plan(manifest).requests
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        restore.plan(manifest, {"nope": None})
