"""CheckpointManager retention, queries and the orphan sweep; layout naming spread."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

import ckptio
from ckptio.engine.layout import FlatNaming, HashedNaming, Piece, pack
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("url_kind", ["local", "mem"])
def test_retention_max_to_keep_and_keep_period(tmp_path, url_kind):
    url = str(tmp_path) if url_kind == "local" else f"mem://retention-{tmp_path.name}"
    with ckptio.CheckpointManager(url, max_to_keep=2, keep_period=4) as mngr:
        for step in range(1, 11):
            assert mngr.should_save(step)
            mngr.save(step, {"w": np.full(1000, step, np.float32), "step": step})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 9, 10]
        assert mngr.latest_step() == 10
        assert not mngr.should_save(10) and not mngr.should_save(3)
        assert mngr.restore(8)["step"] == 8
        assert (mngr.restore()["w"] == 10).all()
        # Deletion by manifest leaves nothing behind: exactly the kept checkpoints' objects.
        keys = [i.key for i in ckptio.engine.run_sync(mngr.store.backend.list(""))]
        assert {k.split("/")[0] for k in keys} == {"4", "8", "9", "10"}
        assert len(keys) == 4 * 3  # one object, one manifest and its commit's fence each


def test_save_interval_and_force(tmp_path):
    with ckptio.CheckpointManager(tmp_path, save_interval_steps=5) as mngr:
        assert mngr.save(3, {"a": 1}) is None
        assert mngr.save(5, {"a": 1}) is not None
        assert mngr.save(7, {"a": 1}, force=True) is not None
        mngr.wait_until_finished()
        assert mngr.all_steps() == [5, 7]


def test_interrupted_deletion_is_hidden_then_finished(tmp_path):
    with ckptio.CheckpointManager(tmp_path) as mngr:
        for s in (1, 2):
            mngr.save(s, {"w": np.ones(10)})
        mngr.wait_until_finished()
        (tmp_path / "1" / TOMBSTONE_NAME).write_bytes(b"")  # a crash right after the tombstone
        assert mngr.all_steps() == [2]
        with pytest.raises(ckptio.CheckpointNotFoundError, match="being deleted"):
            mngr.restore(1)
        mngr.sweep_orphans(grace_seconds=0)
        assert not (tmp_path / "1").exists()
        assert mngr.all_steps() == [2]


def test_orphan_sweep_respects_grace_and_committed(tmp_path):
    with ckptio.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"w": np.ones(10)})
        mngr.wait_until_finished()
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "0123456789ab.h00000-00000").write_bytes(b"x")
    (tmp_path / "1" / "0123456789ab.h00001-00000").write_bytes(b"y")
    (tmp_path / "notes.txt").write_text("user file, not ours")
    mngr = ckptio.CheckpointManager(tmp_path)
    assert mngr.sweep_orphans(grace_seconds=3600) == []
    doomed = mngr.sweep_orphans(grace_seconds=0)
    assert sorted(doomed) == ["1/0123456789ab.h00001-00000", "2/0123456789ab.h00000-00000"]
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "1" / MANIFEST_NAME).exists()
    assert (mngr.restore(1)["w"] == 1).all()


def test_failed_save_keeps_previous_checkpoints(tmp_path):
    from ckptio.backends.memory import MemoryBackend

    class Broken(MemoryBackend):
        async def write(self, key, buffers):
            if "ckptio.intent." in key:  # the save announces itself, then fails on its data
                return await super().write(key, buffers)
            raise PermissionError(f"{key}: denied")

    url = f"mem://broken-{tmp_path.name}"
    mngr = ckptio.CheckpointManager(url)
    mngr.save(1, {"w": np.ones(10)})
    mngr.wait_until_finished()
    from ckptio.store import CheckpointStore

    mngr.store = CheckpointStore(url, backend=Broken(url))
    h = mngr.save(2, {"w": np.zeros(10)})
    with pytest.raises(PermissionError, match="denied"):
        h.result()
    assert h.state == ckptio.SaveState.FAILED
    mngr._pending = None
    assert mngr.all_steps() == [1] and (mngr.restore()["w"] == 1).all()


def test_hashed_names_spread_evenly_and_steps_share_prefixes():
    """1000 objects from 8 hosts: >= 16 first components, none over twice its fair share."""
    naming = HashedNaming(chars=2)
    spread = {}
    for step in (100, 101):
        first = collections.Counter(
            naming.object_key(str(step), "abc", host, 8, n).split("/")[0] for host in range(8) for n in range(125)
        )
        fair = 1000 / len(first)
        assert len(first) >= 16 and max(first.values()) <= 2 * fair, first.most_common(3)
        spread[step] = set(first)
        key = naming.object_key(str(step), "abc", 3, 8, 7)
        assert key.split("/")[1] == str(step)  # the hash comes before the step
    assert len(spread[100] & spread[101]) >= 16


def test_pack_coalesces_small_and_splits_big():
    small = [Piece(f"s{i}", 0, memoryview(bytes(100))) for i in range(50)]
    big = Piece("big", 0, memoryview(bytes(10 << 20)))
    plans = pack([*small, big, *small], object_size=4 << 20, key_for=lambda n: f"o{n}", split_align=1 << 20)
    sizes = [p.size for p in plans]
    assert sizes == [5000, 4 << 20, 4 << 20, 2 << 20, 5000]
    assert [e.shard_offset for p in plans[1:4] for e in p.extents] == [0, 4 << 20, 8 << 20]
    assert FlatNaming().object_key("7", "id", 2, 4, 3) == "7/id.h00002-00003"
    # Direct IO: big extents start aligned (zero padding before them), small ones stay packed tight.
    mixed = [Piece("a", 0, memoryview(bytes(100))), Piece("b", 0, memoryview(b"\x01" * 8192)),
             Piece("c", 0, memoryview(bytes(10)))]
    [plan] = pack(mixed, object_size=1 << 20, key_for=str, align=4096)
    assert [e.offset for e in plan.extents] == [0, 4096, 4096 + 8192]
    assert b"".join(bytes(b) for b in plan.buffers) == bytes(100) + bytes(3996) + b"\x01" * 8192 + bytes(10)
    assert plan.size == 4096 + 8192 + 10


def _counted_manager(root, **kw):
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    counting = CountingBackend(open_backend(str(root)))
    return counting, ckptio.CheckpointManager(root, backend=counting, **kw)


def _calls(counting) -> int:
    return sum(counting.calls(m) for m in ("stat", "read_into", "list", "list_children"))


@pytest.mark.parametrize("max_to_keep", [None, 3])
def test_a_saves_bookkeeping_does_not_grow_with_the_steps_kept(tmp_path, max_to_keep):
    """"Is this step newer than the latest?" and retention read a bounded number of manifests: the
    60th save of a keep-everything run costs the same metadata calls as the 6th."""
    counting, mngr = _counted_manager(tmp_path, max_to_keep=max_to_keep)
    cost = {}
    with mngr:
        for step in range(60):
            before = _calls(counting)
            mngr.save(step, {"w": np.full(16, step, np.float32)}).result()
            cost[step] = _calls(counting) - before
        before = _calls(counting)
        assert mngr.latest_step() == 59
        latest_cost = _calls(counting) - before
    assert cost[59] <= cost[5], cost
    assert latest_cost <= 3  # one listing, the manifest's stat and the tombstone's
    assert mngr.all_steps() == (list(range(60)) if max_to_keep is None else [57, 58, 59])


def test_retention_deletes_intact_older_steps_and_leaves_damaged_ones(tmp_path):
    with ckptio.CheckpointManager(tmp_path) as mngr:
        for step in range(1, 5):
            mngr.save(step, {"w": np.full(16, step, np.float32)}).result()
    data = bytearray((tmp_path / "2" / MANIFEST_NAME).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "2" / MANIFEST_NAME).write_bytes(bytes(data))
    with ckptio.CheckpointManager(tmp_path, max_to_keep=2, keep_period=3) as mngr:
        mngr.save(5, {"w": np.full(16, 5, np.float32)}).result()
        # 4 and 5 are the newest two; 3 is periodic; 1 is intact and older: deleted;
        # 2 is damaged: never deleted by retention, left for inspection.
        assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [2, 3, 4, 5]
        assert mngr.all_steps() == [2, 3, 4, 5]
        assert (mngr.restore(3)["w"] == 3).all()


def test_retention_reads_no_manifest_while_the_root_holds_no_more_steps_than_it_keeps(tmp_path, monkeypatch):
    """Nothing can be deleted while there are at most ``max_to_keep`` step directories, so no
    save validates a step (manifests read, objects listed) for retention then; the first save
    past it deletes the oldest step as before."""
    state = {"w": np.arange(64, dtype=np.float32)}
    with ckptio.CheckpointManager(str(tmp_path), max_to_keep=3) as mngr:
        checked: list[object] = []
        real = mngr.store.intact_steps

        async def counting(*args, **kwargs):
            if kwargs.get("whole") or kwargs.get("among") is not None:  # retention's questions
                checked.append(kwargs.get("among"))
            return await real(*args, **kwargs)

        monkeypatch.setattr(mngr.store, "intact_steps", counting)
        for step in range(3):
            mngr.save(step, state)
            mngr.wait_until_finished()
        assert checked == []
        mngr.save(3, state)
        mngr.wait_until_finished()
        assert checked and mngr.all_steps() == [1, 2, 3]
