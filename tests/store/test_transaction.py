"""The write transaction every writer saves through (ckptio.store.transaction): begun = prepared and
announced, committed once, ended once (retired, or marked dead at once)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

import ckptio
from ckptio.engine import run_sync
from ckptio.manifest.names import intent_key
from ckptio.saving.stream import StreamWriter
from ckptio.store import CheckpointStore


def _intent(root: Path, step_dir: str, save_id: str) -> dict | None:
    path = root / intent_key(step_dir, save_id)
    return json.loads(path.read_text()) if path.exists() else None


def _manifest(tmp_path: Path, step: int) -> ckptio.manifest.Manifest:
    """A manifest of ``step`` written by a streamed save elsewhere (its objects copied here by name)."""
    other = tmp_path / "other"
    w = StreamWriter(CheckpointStore(str(other)), step)
    w.add_array("w", np.float32, (4,))
    w.write_shard("w", (0,), np.arange(4, dtype=np.float32))
    m = w.commit()
    for key in m.objects:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes((other / key).read_bytes())
    return m


def test_a_transaction_announces_commits_and_retires(tmp_path: Path) -> None:
    m = _manifest(tmp_path, 3)
    store = CheckpointStore(str(tmp_path))
    with store.begin_save("3", covers=[m.checkpoint_id]) as tx:
        doc = _intent(tmp_path, "3", tx.save_id)
        assert doc is not None and doc["covers"] == [m.checkpoint_id] and doc["lease_s"] == store.lease_s
        assert m.checkpoint_id in run_sync(store.live_saves("3"))  # its objects are spared meanwhile
        tx.commit(m)
    assert _intent(tmp_path, "3", tx.save_id) is None  # retired: the manifest protects the objects now
    assert run_sync(store.is_committed("3"))
    tx.end(ok=False)  # ended once: again does nothing
    assert _intent(tmp_path, "3", tx.save_id) is None


def test_a_failed_transaction_marks_its_intent_dead_at_once(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(RuntimeError, match="the write failed"):
        with store.begin_save("4") as tx:
            raise RuntimeError("the write failed")
    doc = _intent(tmp_path, "4", tx.save_id)
    assert doc is not None and doc["lease_s"] == 0.0  # a dead attempt's, without waiting a lease
    assert run_sync(store.live_saves("4")) == set()
    assert not run_sync(store.is_committed("4"))


def test_begin_refuses_a_committed_step_before_announcing(tmp_path: Path) -> None:
    ckptio.save(str(tmp_path), {"w": np.zeros(2)}, step=5).result()
    store = CheckpointStore(str(tmp_path))
    before = sorted(p.name for p in (tmp_path / "5").iterdir())
    with pytest.raises(FileExistsError):
        store.begin_save("5")
    assert sorted(p.name for p in (tmp_path / "5").iterdir()) == before  # no intent written


def test_the_async_transaction_beats_from_a_task_and_commits(tmp_path: Path) -> None:
    m = _manifest(tmp_path, 6)
    store = CheckpointStore(str(tmp_path))
    store.lease_s = 0.2  # four beats a lease: several beats within the block

    async def save() -> str:
        async with await store.begin_save_async("6", covers=[m.checkpoint_id]) as tx:
            first = (tmp_path / intent_key("6", tx.save_id)).stat().st_mtime_ns
            await asyncio.sleep(0.5)
            assert (tmp_path / intent_key("6", tx.save_id)).stat().st_mtime_ns > first  # refreshed
            await tx.commit_async(m)
        return tx.save_id

    save_id = run_sync(save())
    assert _intent(tmp_path, "6", save_id) is None and run_sync(store.is_committed("6"))
