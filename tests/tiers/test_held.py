"""A host's commit record (ckptio.tiers.held): the restart's scan reads it instead of the job's manifest,
it goes with its step, gc keeps it exactly while it names the standing commit, and anything doubtful
about it sends the scan back to the manifest. Replica markers likewise carry what the scan needs (#33).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.manifest.names import HeldName, held_key, parse_held
from ckptio.store import CheckpointStore
from ckptio.tiers import Holding, TieredCheckpointManager
from ckptio.tiers.fastcommit import commit_everywhere
from ckptio.tiers.held import part_records, read_held
from ckptio.tiers.peer import _commit_replica, holdings


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32),
            "v": rng.integers(0, 1 << 30, size=(5000,), dtype=np.int64), "step": step}


def records(root, step: int) -> list[str]:
    return sorted(n for n in os.listdir(root / str(step)) if n.startswith("ckptio.held."))


def by_manifest(store: CheckpointStore, rank: int = 0) -> list[Holding]:
    """What the scan said before records existed: the manifest's id and size, for committed steps."""
    out = []
    for s in run_sync(store.committed_steps()):
        m = run_sync(store.read_manifest(str(s)))
        out.append(Holding(rank, s, m.checkpoint_id, rank, m.num_hosts, True))
    return out


@pytest.fixture
def saved(tmp_path):
    with TieredCheckpointManager(str(tmp_path / "fast")) as m:
        for s in (1, 2):
            m.save(s, state(s))
    return tmp_path / "fast"


def no_manifest_reads(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the scan read a manifest")
    monkeypatch.setattr(CheckpointStore, "read_manifest", refuse)


def test_names_parse_only_as_written():
    key = held_key("7", "0123456789ab", 1)
    assert key == "7/ckptio.held.0123456789ab.h00001"
    assert parse_held(key) == HeldName("7", "0123456789ab", 1)
    for other in ["7/ckptio.held.0123456789ab.h1", "7/ckptio.held.0123456789ab.h00001.bak", "ckptio.held.0123456789ab.h00001",
                  "07/ckptio.held.0123456789ab.h00001", "7/ckptio.held.0123456789AB.h00001", "h3f/7/ckptio.held.0123456789ab.h00001"]:
        assert parse_held(other) is None, other
    for bad in [("", "0123456789ab", 1), ("7", "nope", 1), ("7", "0123456789ab", -1)]:
        with pytest.raises(ValueError):
            held_key(*bad)


def test_each_save_records_its_commit_and_the_scan_reads_no_manifest(saved, monkeypatch):
    fast = CheckpointStore(str(saved), host_local=True)
    expected = by_manifest(fast)
    assert [h.step for h in expected] == [1, 2]
    for h in expected:
        assert records(saved, h.step) == [f"ckptio.held.{h.checkpoint_id}.h00000"]
    fresh = CheckpointStore(str(saved), host_local=True)
    no_manifest_reads(monkeypatch)
    assert holdings(fresh, None, 0) == expected


@pytest.mark.parametrize("damage", ["absent", "garbled", "wrong_id_inside", "a_second_record", "its_fence_gone"])
def test_a_doubtful_record_sends_the_scan_to_the_manifest(saved, damage):
    fast = CheckpointStore(str(saved), host_local=True)
    expected = by_manifest(fast)
    (name,) = records(saved, 2)
    path = saved / "2" / name
    if damage == "absent":
        path.unlink()
    elif damage == "garbled":
        path.write_bytes(b"{not json")
    elif damage == "wrong_id_inside":
        doc = json.loads(path.read_bytes())
        path.write_text(json.dumps({**doc, "checkpoint_id": "ffffffffffff"}))
    elif damage == "its_fence_gone":  # written late by a process paused past a delete + re-save of step 2
        doc = json.loads(path.read_bytes())
        path.write_text(json.dumps({**doc, "fence": "0" * len(doc["fence"])}))
    else:  # a stale record beside the right one: neither is trusted
        (saved / "2" / "ckptio.held.ffffffffffff.h00000").write_bytes(path.read_bytes())
    assert run_sync(read_held(CheckpointStore(str(saved), host_local=True), 2, 0)) is None
    assert holdings(CheckpointStore(str(saved), host_local=True), None, 0) == expected


def test_a_lost_object_means_not_held_with_or_without_a_record(saved):
    fast = CheckpointStore(str(saved), host_local=True)
    m = run_sync(fast.read_manifest("2"))
    os.remove(saved / m.objects[0])
    assert [h.step for h in holdings(CheckpointStore(str(saved), host_local=True), None, 0)] == [1]
    for name in records(saved, 2):
        os.remove(saved / "2" / name)
    assert [h.step for h in holdings(CheckpointStore(str(saved), host_local=True), None, 0)] == [1]


def test_the_record_goes_with_its_step_and_lookalikes_stay(saved):
    lookalike = saved / "2" / "ckptio.held.0123456789ab.h0"
    lookalike.write_text("someone else's")
    fast = CheckpointStore(str(saved), host_local=True)
    run_sync(fast.delete("2"))
    assert os.listdir(saved / "2") == [lookalike.name]
    assert run_sync(fast.committed_steps()) == [1]


def test_gc_keeps_the_standing_commits_record_and_takes_stale_ones(saved):
    (standing,) = records(saved, 2)
    doc = json.loads((saved / "2" / standing).read_text())
    stale = "ckptio.held.ffffffffffff.h00000"  # another checkpoint's record, its fence not in the step
    (saved / "2" / stale).write_text(json.dumps({**doc, "checkpoint_id": "ffffffffffff", "fence": "eeeeeeeeeeee"}))
    os.makedirs(saved / "9")
    leftover = {**doc, "step": 9, "checkpoint_id": "0123456789ab", "objects": [], "sizes": []}
    (saved / "9" / "ckptio.held.0123456789ab.h00000").write_text(json.dumps(leftover))  # no fence: never stood
    gc = CheckpointStore(str(saved), host_local=True)
    report = run_sync(gc.sweep(3600.0))
    assert not [k for k in report.deleted if parse_held(k)]  # young: spared
    report = run_sync(gc.sweep(0.0))
    assert sorted(k for k in report.deleted if parse_held(k)) == ["2/" + stale, "9/ckptio.held.0123456789ab.h00000"]
    assert records(saved, 2) == [standing] and records(saved, 1)
    assert run_sync(gc.sweep_step(2, 0.0)).deleted == []


def test_gc_leaves_a_step_with_a_damaged_record_alone(saved):
    """A record that cannot be read may be the only proof of a host's committed part (#33): gc keeps its
    step whole and reports it damaged; deletion (retention) still takes the step by name."""
    (saved / "2" / "ckptio.held.ffffffffffff.h00003").write_text("{}")
    before = sorted(os.listdir(saved / "2"))
    report = run_sync(CheckpointStore(str(saved), host_local=True).sweep(0.0))
    assert sorted(os.listdir(saved / "2")) == before and "2" in report.damaged


def test_a_replica_marker_says_what_the_scan_needs(tmp_path, monkeypatch):
    replica = CheckpointStore(str(tmp_path / "peer"), host_local=True)
    ckptio.save(replica.url, state(3), step=3).result()
    m = run_sync(replica.read_manifest("3"))
    run_sync(_commit_replica(replica, 3, m, 1))  # the same checkpoint already there: only the marker is new
    no_manifest_reads(monkeypatch)
    own = CheckpointStore(str(tmp_path / "own"), host_local=True)
    assert holdings(own, CheckpointStore(replica.url, host_local=True), 0) == [
        Holding(0, 3, m.checkpoint_id, 1, m.num_hosts, False)]


class _NoManifestDeletes(WrapperBackend):
    """A deletion that dies when it reaches the manifest (a crash between the objects and the manifest)."""

    async def delete(self, key: str) -> None:
        if key.endswith("/ckptio.manifest.json"):
            raise OSError("killed before the manifest went")
        await self.inner.delete(key)


def test_a_deletion_takes_the_record_before_the_manifest(saved):
    fast = CheckpointStore(str(saved), backend=_NoManifestDeletes(open_backend(str(saved))), host_local=True)
    with pytest.raises(OSError):
        run_sync(fast.delete("2"))
    assert records(saved, 2) == []  # the record is gone while its manifest is still there
    assert (saved / "2" / "ckptio.manifest.json").exists()
    assert [h.step for h in holdings(CheckpointStore(str(saved), host_local=True), None, 0)] == [1]


class _Follower:
    """Host 1's side of the fast tier's commit (the only collectives it joins): host 0 sends it the length of
    its message, then the message (the checkpoint id and host 1's fragment base); :attr:`received` counts
    the bytes it receives."""

    rank, size = 1, 2

    def __init__(self, message: bytes) -> None:
        self.queue = [struct.pack("<q", len(message)), message]
        self.received = 0

    def exchange(self, sends: dict, sizes: dict | None = None) -> dict:
        assert sends == {} and sizes is not None  # it sends nothing, and knows what it receives
        if not sizes:  # host 0 sends nothing (every host still joins the exchange)
            return {}
        data = self.queue.pop(0)
        assert sizes == {0: [len(data)]}
        self.received += len(data)
        return {0: bytearray(data)}


def _as_host_1(saved, root, m0, checkpoint_id: str | None = None, base: int = 0) -> tuple[bytes, dict]:
    """Host 0's message to host 1 as host 0 sends it, and host 1's own part as its save recorded it: host 0's
    part of ``m0`` (a one-host save) played as host 1's of a two-host job, its objects copied into host 1's
    fast tier ``root``."""
    rec = part_records(m0, "0" * 12, [0])[0]
    for k in rec.objects:
        os.makedirs(root / os.path.dirname(k), exist_ok=True)
        shutil.copyfile(saved / k, root / k)
    part = {"objects": rec.objects, "sizes": rec.sizes, "extents": rec.extra["extents"]}
    return json.dumps({"checkpoint_id": checkpoint_id or rec.checkpoint_id, "base": base}).encode(), part


def _commit_as_host_1(message: bytes, part: dict, root) -> tuple[BaseException | None, _Follower]:
    group = _Follower(message)
    return commit_everywhere(group, CheckpointStore(str(root), host_local=True), 2, part), group


def test_a_non_coordinator_commits_its_part_by_its_record_alone(saved, tmp_path, monkeypatch):
    """A non-coordinator receives only its own part's record (#33 item 1: O(its part), not the manifest) and
    commits it under a fence of its own, with no manifest in its fast tier; the restart's scan trusts that
    record, the step counts as committed, and deleting it takes everything."""
    m0 = run_sync(CheckpointStore(str(saved), host_local=True).read_manifest("2", shards=False))
    root = tmp_path / "fast1"
    follower = CheckpointStore(str(root), host_local=True)
    err, group = _commit_as_host_1(*_as_host_1(saved, root, m0, base=7), root)
    assert err is None
    assert group.received < 100 and not (root / "2" / "ckptio.manifest.json").exists()
    assert run_sync(follower.committed_steps()) == [2]
    (name,) = records(root, 2)
    doc = json.loads((root / "2" / name).read_bytes())
    fence = doc["fence"]
    assert doc["indices"] == list(range(7, 7 + len(doc["objects"])))  # its fragment's base onwards
    assert fence != m0.fence and (root / "2" / f"ckptio.fence.{fence}").exists()
    with monkeypatch.context() as mp:
        no_manifest_reads(mp)
        part = run_sync(read_held(CheckpointStore(str(root), host_local=True), 2, 1))
        assert part is not None and part.checkpoint_id == m0.checkpoint_id
        assert holdings(CheckpointStore(str(root), host_local=True), None, 1) == [
            Holding(1, 2, m0.checkpoint_id, 1, 2, True)]
    run_sync(follower.delete("2"))
    assert not (root / "2").exists() or os.listdir(root / "2") == []


@pytest.mark.parametrize("damage", ["nothing sent", "not JSON", "no base", "a negative base", "a bad id", "no part"])
def test_a_non_coordinator_refuses_a_message_that_is_not_one(saved, tmp_path, damage):
    """What host 0 sends must be a checkpoint id and a base, and the save must have recorded this host's part:
    else nothing is committed, and the error names host 0 or the part (the host then does not hold the step)."""
    m0 = run_sync(CheckpointStore(str(saved), host_local=True).read_manifest("2", shards=False))
    root = tmp_path / "fast1"
    message, part = _as_host_1(saved, root, m0)
    doc = json.loads(message)
    data = {"nothing sent": b"", "not JSON": b"{part", "no base": json.dumps({"checkpoint_id": doc["checkpoint_id"]}),
            "a negative base": json.dumps({**doc, "base": -1}), "a bad id": json.dumps({**doc, "checkpoint_id": "../x"}),
            "no part": message}[damage]
    data = data.encode() if isinstance(data, str) else data
    group = _Follower(data)
    if not data:
        group.queue = [struct.pack("<q", 0)]
    err = commit_everywhere(group, CheckpointStore(str(root), host_local=True), 2, None if damage == "no part" else part)
    assert err is not None and ("host 0" in str(err) or "part" in str(err)), err
    assert records(root, 2) == [] and run_sync(CheckpointStore(str(root), host_local=True).committed_steps()) == []


def test_a_paused_record_writer_cannot_make_a_resaved_step_look_like_the_old_one(saved, tmp_path):
    """Step 2 is deleted and re-saved on a non-coordinator while a writer of the old commit's record is
    paused; its record lands late, beside the new one: it does not stand (its fence went with the old
    checkpoint), so the scan takes the new checkpoint's. A record in a step with no commit is no holding."""
    m0 = run_sync(CheckpointStore(str(saved), host_local=True).read_manifest("2", shards=False))
    root = tmp_path / "fast1"
    follower = CheckpointStore(str(root), host_local=True)
    assert _commit_as_host_1(*_as_host_1(saved, root, m0), root)[0] is None
    (old,) = records(root, 2)
    late = (root / "2" / old).read_bytes()
    run_sync(follower.delete("2"))
    assert not (root / "2").exists() or records(root, 2) == []
    assert _commit_as_host_1(*_as_host_1(saved, root, m0, "0123456789ab"), root)[0] is None
    (root / "2" / old).write_bytes(late)  # the paused writer wakes
    scan = CheckpointStore(str(root), host_local=True)
    assert run_sync(read_held(scan, 2, 1)).checkpoint_id == "0123456789ab"
    assert holdings(scan, None, 1) == [Holding(1, 2, "0123456789ab", 1, 2, True)]
    os.makedirs(root / "3")
    (root / "3" / old.replace(m0.checkpoint_id, "ffffffffffff")).write_bytes(late)  # a record, no commit
    assert [h.step for h in holdings(CheckpointStore(str(root), host_local=True), None, 1)] == [2]


def test_a_replica_of_a_part_is_its_record_and_objects_without_the_manifest(saved, tmp_path, monkeypatch):
    """The peer round's receiving side (#33): the source's record (version 2) and objects, checked against
    the record's extents, committed in the replica store under a fence of the replica's own; the scan
    reads it without a manifest; the previous replica goes once the new one is marked."""
    from ckptio.tiers.peerround import _check, _commit_part_replica, own_part

    fast = CheckpointStore(str(saved), host_local=True)
    replica = CheckpointStore(str(tmp_path / "peer"), host_local=True)
    for step in (1, 2):
        rec, _m = own_part(fast, step, 0)
        assert rec.sizes is not None and len(rec.extra["extents"]) == len(rec.objects)
        for j, key in enumerate(rec.objects):
            data = bytearray((saved / key).read_bytes())
            _check(rec, j, data)
            run_sync(replica.io.write(key, [memoryview(data)]))
        run_sync(_commit_part_replica(replica, step, rec, None, 0))
    assert not (tmp_path / "peer" / "2" / "ckptio.manifest.json").exists()
    assert run_sync(replica.committed_steps()) == [2]  # step 1's replica retired
    (standing,) = run_sync(replica.parts.standing("2"))
    assert standing.fence != rec.fence and standing.objects == rec.objects
    no_manifest_reads(monkeypatch)
    assert holdings(CheckpointStore(str(tmp_path / "own"), host_local=True), replica, 0) == [
        Holding(0, 2, rec.checkpoint_id, 0, rec.num_hosts, False)]
    bad = bytearray((saved / rec.objects[0]).read_bytes())
    bad[0] ^= 1
    with pytest.raises(Exception, match="checksum|crc|mismatch"):
        _check(rec, 0, bad)


def test_ls_and_verify_show_and_check_a_part_committed_by_its_record(saved, tmp_path, capsys):
    """``ckptio ls`` shows a record-only step as the host's part it is (not as an uncommitted leftover), and
    ``ckptio verify`` re-reads its objects against the record's extents: a flipped byte is reported by name."""
    from ckptio.cli import main

    m0 = run_sync(CheckpointStore(str(saved), host_local=True).read_manifest("2", shards=False))
    root = tmp_path / "fast1"
    assert _commit_as_host_1(*_as_host_1(saved, root, m0), root)[0] is None
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"host 1's part of checkpoint {m0.checkpoint_id} (of 2 hosts)" in out and "UNCOMMITTED" not in out
    assert main(["ls", "--json", str(root)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "part" and row["parts"][0]["host"] == 1 and row["parts"][0]["objects"] == len(m0.objects)
    assert main(["verify", str(root / "2")]) == 0
    assert "host 1's part" in capsys.readouterr().out
    key = m0.objects[0]
    data = bytearray((root / key).read_bytes())
    data[10] ^= 0xFF
    (root / key).write_bytes(bytes(data))
    assert main(["verify", str(root / "2")]) == 4
    err = capsys.readouterr().err
    assert key.rpartition("/")[2] in err and "host 1's part" in err, err
