"""ckptio.tiers in one process: the restore plan, retention, the copy primitive, the manager and its queues.

The multi-process behaviour (peers over gloo, lost hosts, killed copies) is in test_tiers_mp.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

import ckptio
from ckptio.backends import Backend, open_backend
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import CountingBackend, WrapperBackend
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.manage.copying import copy_checkpoint, copy_objects, rekey
from ckptio.manifest import MANIFEST_NAME
from ckptio.manifest.names import ReplicaMark, fence_key, parse_replica_mark, replica_mark_key
from ckptio.store import CheckpointStore
from ckptio.store.intents import new_id
from ckptio.tiers import (
    DURABLE,
    LOCAL,
    PEER,
    Holding,
    Retention,
    TieredCheckpointManager,
    TierPolicy,
    plan_restore,
)
from ckptio.tiers.peer import holdings, retire_replica


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "v": rng.integers(0, 1 << 30, size=(5000,), dtype=np.int64),
        "step": step,
    }


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(a[k].tobytes() == b[k].tobytes() for k in ("w", "v"))


# -- the plan -------------------------------------------------------------------


def own(rank: int, step: int, cid: str = "c", n: int = 4) -> Holding:
    return Holding(rank, step, f"{cid}{step}", rank, n, True)


def replica(rank: int, writer: int, step: int, cid: str = "c", n: int = 4) -> Holding:
    return Holding(rank, step, f"{cid}{step}", writer, n, False)


def ring(step: int, lost: Sequence[int] = (), n: int = 4) -> list[Holding]:
    """Every live host holds its own copy and its predecessor's replica (partner = rank + 1)."""
    out = []
    for r in range(n):
        if r in lost:
            continue
        out += [own(r, step, n=n), replica(r, (r - 1) % n, step, n=n)]
    return out


def test_plan_all_local_takes_the_newest():
    plan = plan_restore(ring(4) + ring(5), [2, 4], 4)
    assert plan.step == 5 and plan.checkpoint_id == "c5" and plan.manifest_from == 0
    assert all(plan.source(r, r) == (LOCAL, r) for r in range(4))
    assert plan.source(1, 0) == (LOCAL, 1)  # host 1 keeps host 0's replica: it reads that
    assert plan.source(2, 0) == (PEER, 0)  # others get host 0's shards from host 0 itself


def test_plan_lost_host_reads_its_partners_replica():
    plan = plan_restore(ring(5, lost=[2]), [4], 4)
    assert plan.step == 5
    assert plan.source(2, 2) == (PEER, 3)  # host 3 keeps host 2's replica
    assert plan.source(2, 1) == (PEER, 1)  # host 1's own copy before host 2's (lost) replica of it


def test_plan_lost_host_and_partner_fall_back_to_the_durable_tier():
    # Replicas exist of the latest snapshot only (step 5); hosts 0 and 1 kept step 4 themselves.
    holdings = [own(0, 4), own(1, 4)] + ring(5, lost=[2, 3])
    plan = plan_restore(holdings, [2, 4], 4)
    assert plan.step == 4 and plan.in_durable
    assert plan.source(2, 2) == (DURABLE, None) and plan.source(0, 0) == (LOCAL, 0)
    assert plan.source(3, 3) == (DURABLE, None)
    with pytest.raises(CheckpointNotFoundError, match="step 5"):
        plan_restore(holdings, [2, 4], 4, step=5)


def test_plan_skips_incomplete_and_mismatched_checkpoints():
    # Step 6 is committed only on host 0 (a crash between commits); step 5 on all but under two ids.
    holdings = ring(4) + [own(0, 6)] + ring(5)[:4] + [Holding(r, 5, "other", r, 4, True) for r in (2, 3)]
    plan = plan_restore(holdings, [], 4)
    assert plan.step == 4


def test_plan_durable_only_and_tier_limits():
    plan = plan_restore([], [2, 4], 4)
    assert (plan.step, plan.manifest_from, plan.checkpoint_id) == (4, None, None)
    plan = plan_restore(ring(5), [4], 4, tiers=(DURABLE,))
    assert plan.step == 4 and plan.manifest_from is None
    plan = plan_restore(ring(5), [4], 4, tiers=(PEER,))
    assert plan.step == 5 and all(plan.source(r, r)[0] == PEER for r in range(4))
    plan = plan_restore(ring(5), [4], 4, tiers=(LOCAL,))  # each host only what it holds itself
    assert plan.step == 5 and plan.source(2, 2) == (LOCAL, 2) and plan.source(2, 1) == (LOCAL, 2)
    with pytest.raises(CheckpointNotFoundError, match="host 2 cannot get host 0"):
        plan.source(2, 0)
    with pytest.raises(CheckpointNotFoundError):
        plan_restore([], [], 4)
    with pytest.raises(ValueError):
        plan_restore([], [], 4, tiers=("tape",))


def test_plan_takes_the_manifest_from_host_0s_part():
    """The manifest is broadcast by a holder of host 0's part (its own copy first, then its replica):
    where host 0 committed it, never a copy in another host's fast tier (#33)."""
    # Partner = rank + 3 (mod 4): host 3 keeps host 0's replica. Host 0 is lost, and the lowest-ranked
    # holder of the step (host 1) holds nothing of host 0's part: host 3 sends the manifest.
    lost0 = [h for r in (1, 2, 3) for h in (own(r, 5), replica(r, (r - 3) % 4, 5))]
    plan = plan_restore(lost0, [], 4)
    assert plan.step == 5 and plan.holders(0) == (3,) and plan.manifest_from == 3
    assert plan_restore(lost0 + [own(0, 5), replica(0, 1, 5)], [], 4).manifest_from == 0  # host 0 itself
    # Host 0's part is in no fast tier (the durable tier fills it in): the lowest-ranked holder.
    plan = plan_restore([h for h in lost0 if h.writer != 0], [5], 4)
    assert plan.step == 5 and plan.manifest_from == 1 and plan.source(1, 0) == (DURABLE, None)
    # The choice survives the plan's compact encoding: every host derives the same holder of host 0's part.
    again = type(plan).from_json(plan_restore(lost0, [], 4).to_json())
    assert again.manifest_from == 3 and again.holders(0)[0] == 3


def test_retention_keeps_newest_periodic_and_pinned():
    r = Retention(max_to_keep=2, keep_period=10)
    assert r.doomed([5, 10, 11, 12, 13], pinned={11}) == [5]
    assert Retention().doomed([1, 2, 3]) == []
    with pytest.raises(ValueError):
        Retention(max_to_keep=0)


# -- the copy primitive -----------------------------------------------------------------


@pytest.fixture
def src(tmp_path) -> CheckpointStore:
    ckptio.save(str(tmp_path / "src"), state(7), step=7, backend_options={"object_size": 16 << 10}).result()
    return CheckpointStore(str(tmp_path / "src"))


def test_copy_to_a_hashed_store_verifies_and_commits_last(src, tmp_path):
    url = f"mem://copy-{tmp_path.name}"
    dst = CheckpointStore(url, naming=HashedNaming())
    m, stats = run_sync(copy_checkpoint(src, dst, "7"))
    assert stats.written == len(m.objects) >= 2 and stats.kept == 0
    assert all(k.startswith("h") and "/7/" in k for k in m.objects)  # hashed prefix before the step
    assert same(ckptio.restore(url, step=7, backend=dst.backend), state(7))
    # The same checkpoint again: nothing to do. Another one under that step: refused.
    assert run_sync(copy_checkpoint(src, dst, "7"))[1].written == 0
    m9, _ = run_sync(copy_checkpoint(src, dst, "7", dst_step_dir="9"))  # to another step directory
    assert m9.step == 9 and m9.checkpoint_id == m.checkpoint_id and same(
        ckptio.restore(url, step=9, backend=dst.backend), state(7))
    MemoryBackend.forget(url)


def test_copy_resumes_keeping_whole_objects(src, tmp_path):
    dst = CheckpointStore(str(tmp_path / "dst"))
    m = run_sync(src.read_manifest("7"))
    out = rekey(m, "7", dst)
    run_sync(copy_objects(src, dst, m, out, [0]))  # an earlier try got one object across, then died
    assert run_sync(dst.committed_steps()) == []
    _, stats = run_sync(copy_checkpoint(src, dst, "7"))
    assert stats.kept == 1 and stats.written == len(m.objects) - 1
    assert same(ckptio.restore(str(tmp_path / "dst"), step=7), state(7))


def test_copy_of_a_corrupt_object_writes_nothing_and_commits_nothing(src, tmp_path):
    m = run_sync(src.read_manifest("7"))
    path = tmp_path / "src" / m.objects[-1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = CheckpointStore(str(tmp_path / "dst"))
    with pytest.raises(IntegrityError):
        run_sync(copy_checkpoint(src, dst, "7"))
    assert run_sync(dst.committed_steps()) == []
    assert not (tmp_path / "dst" / m.objects[-1]).exists()


def test_a_part_copied_by_its_record_lands_where_the_manifests_copy_puts_it(src, tmp_path):
    """#33: a non-coordinator copies its part to the durable tier by its record alone. On a hashed destination
    a key depends on the object's index in the manifest, which the record carries: the keys and bytes are
    those of the manifest's copy, and the copy restores."""
    from ckptio.manage.copying import copy_keys, rekey_one, stored_extents
    from ckptio.tiers.held import part_records

    m = run_sync(src.read_manifest("7"))
    url = f"mem://bypart-{tmp_path.name}"
    dst = CheckpointStore(url, naming=HashedNaming())
    out = rekey(m, "7", dst)
    (part,) = part_records(m, "0" * 12).values()
    assert len(part.objects) == len(m.objects) >= 2 and part.extra["indices"] == list(range(len(m.objects)))
    keys = [rekey_one(k, i, "7", dst) for k, i in zip(part.objects, part.extra["indices"])]
    assert keys == out.objects and len({k.split("/")[0] for k in keys}) > 1  # spread as the manifest's copy
    stats = run_sync(copy_keys(src, dst, list(zip(part.objects, keys, map(stored_extents, part.extra["extents"])))))
    assert stats.written == len(keys)
    run_sync(dst.commit("7", out))
    assert same(ckptio.restore(url, step=7, backend=dst.backend), state(7))
    MemoryBackend.forget(url)


def test_a_restore_without_host_0s_part_takes_the_durable_manifest_under_the_fast_keys(src, tmp_path):
    """Host 0 and its partner lost: no fast tier holds host 0's part, where the job's manifest is (the other
    hosts hold only their own parts, #33). The host that broadcasts the manifest takes the durable tier's,
    its objects named as the fast tiers name them; without a durable copy of that checkpoint it fails plainly."""
    from ckptio.tiers.group import LocalGroup
    from ckptio.tiers.policy import RestorePlan
    from ckptio.tiers.restore import HostTiers
    from ckptio.tiers.rootcast import manifest_to_send as _manifest_to_send

    m = run_sync(src.read_manifest("7"))
    url = f"mem://fallback-{tmp_path.name}"
    dst = CheckpointStore(url, naming=HashedNaming())
    run_sync(copy_checkpoint(src, dst, "7"))
    plan = RestorePlan(7, m.checkpoint_id, 1, 0, True, 2, exceptions={0: ()})  # host 0's part: no holder
    assert plan.holders(0) == ()
    got = _manifest_to_send(HostTiers(LocalGroup(), src, src, dst), plan, lambda w: src)
    assert got.objects == m.objects and got.checkpoint_id == m.checkpoint_id
    with pytest.raises(CheckpointNotFoundError, match="host 0's part .* in no fast tier"):
        _manifest_to_send(HostTiers(LocalGroup(), src, src, None), plan, lambda w: src)
    other = RestorePlan(7, "0123456789ab", 1, 0, True, 2, exceptions={0: ()})
    with pytest.raises(CheckpointNotFoundError, match="durable tier holds checkpoint"):
        _manifest_to_send(HostTiers(LocalGroup(), src, src, dst), other, lambda w: src)
    MemoryBackend.forget(url)


# -- the manager in one process ----------------------------------------------------------


class GatedBackend(WrapperBackend):
    """Writes wait until ``gate`` is set (a durable tier that has stalled)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        await self.inner.write(key, buffers)


def test_manager_tiers_retention_and_fallback(tmp_path):
    durable = CountingBackend(open_backend(str(tmp_path / "durable")))
    policy = TierPolicy(replicate_every=2, fast=Retention(2), durable=Retention(max_to_keep=1, keep_period=4))
    with TieredCheckpointManager(str(tmp_path / "fast"), durable_backend=durable, policy=policy) as m:
        for s in range(1, 7):
            m.save(s, state(s))
        assert m.save(6, state(6)) is None  # already held everywhere
        with pytest.raises(FileExistsError):
            m.save(6, state(6), force=True)
        m.wait_until_finished()
        assert m.tier_steps() == {"fast": [5, 6], "peer": [], "durable": [4, 6]}
        durable.reset()
        assert same(m.restore(), state(6)) and m.last_restore.sources == {0: LOCAL}
        assert durable.calls("read_into") == 0
        assert same(m.restore(tiers=(DURABLE,)), state(6)) and m.last_restore.bytes_from[DURABLE] > 0
        # A look-only restore of an older step changes nothing (a plain one would have the next save
        # retire the newer steps).
        assert same(m.restore(step=4, retire_newer=False), state(4)) and m.last_restore.sources == {0: DURABLE}
    # The host's fast tier is gone: the newest durable checkpoint.
    import shutil

    shutil.rmtree(tmp_path / "fast")
    with TieredCheckpointManager(str(tmp_path / "fast"), str(tmp_path / "durable"), policy=policy) as m:
        assert same(m.restore(), state(6)) and m.last_restore.sources == {0: DURABLE}


@pytest.mark.parametrize("coalesce", [False, True])
def test_replication_waits_only_when_the_queue_is_full(tmp_path, coalesce):
    gated = GatedBackend(open_backend(str(tmp_path / "durable")))
    policy = TierPolicy(replicate_every=1, queue_size=2, coalesce=coalesce, fast=Retention(1), durable=Retention())
    m = TieredCheckpointManager(f"mem://gate-{coalesce}-{tmp_path.name}", durable_backend=gated, policy=policy)
    try:
        t0 = time.perf_counter()
        for s in (1, 2, 3):  # one copy in flight (stalled), two queued: saves go on
            m.save(s, state(s)).result(timeout=30)
        assert time.perf_counter() - t0 < 20
        h = m.save(4, state(4))  # the queue is full: this save's hook waits for room
        with pytest.raises(TimeoutError):
            h.result(timeout=0.5)
        assert run_sync(m.durable.committed_steps()) == []  # nothing half-copied is visible
        assert m.tier_steps()["fast"] == [1, 2, 3, 4]  # queued steps are pinned in the fast tier
        gated.gate.set()
        h.result(timeout=30)
        m.wait_until_finished()
        expect = [1, 3, 4] if coalesce else [1, 2, 3, 4]
        assert run_sync(m.durable.committed_steps()) == expect
        assert m.durable_worker is not None and m.durable_worker.skipped == ([2] if coalesce else [])
        assert same(m.restore(step=3, tiers=(DURABLE,), retire_newer=False), state(3))
    finally:
        gated.gate.set()
        m.close()
        MemoryBackend.forget(f"mem://gate-{coalesce}-{tmp_path.name}")


# -- replica markers: only ckptio's exact names are counted and deleted -----------------------------

LOOKALIKE_MARKS = ["ckptio.replica-of.hxyz", "ckptio.replica-of.h00001.bak", "ckptio.replica-of.h1",
                   "ckptio.replica-of.h000001", "ckptio.replica-of.h00001~"]


def test_replica_mark_names_parse_only_as_written():
    assert replica_mark_key("7", 1) == "7/ckptio.replica-of.h00001"
    assert parse_replica_mark("7/ckptio.replica-of.h00001") == ReplicaMark("7", 1)
    assert parse_replica_mark("7/ckptio.replica-of.h123456") == ReplicaMark("7", 123456)
    for name in LOOKALIKE_MARKS:
        assert parse_replica_mark(f"7/{name}") is None, name
    for key in ["ckptio.replica-of.h00001", "07/ckptio.replica-of.h00001", "7/x/ckptio.replica-of.h00001",
                "h3f/7/ckptio.replica-of.h00001"]:
        assert parse_replica_mark(key) is None, key
    with pytest.raises(ValueError):
        replica_mark_key("", 1)


def test_retiring_a_replica_deletes_its_markers_and_spares_lookalikes(tmp_path):
    """A user's or another tool's file that looks like a marker is neither counted as a replica nor
    deleted."""
    replica = CheckpointStore(str(tmp_path / "peer"))
    for s in (2, 3):
        ckptio.save(replica.url, state(s), step=s).result()
        run_sync(replica.backend.create_if_absent(replica_mark_key(str(s), 1), b""))
    for name in LOOKALIKE_MARKS:
        (tmp_path / "peer" / "3" / name).write_text("not ckptio's")
    own = CheckpointStore(str(tmp_path / "own"))
    held = {(h.step, h.writer) for h in holdings(own, replica, 0)}
    assert held == {(2, 1), (3, 1)}  # the lookalikes name no host that the replica holds

    run_sync(retire_replica(replica, 3))
    left = sorted(os.listdir(tmp_path / "peer" / "3"))
    assert left == sorted(LOOKALIKE_MARKS)  # the marker, the manifest and the objects went; they stayed
    assert run_sync(replica.committed_steps()) == [2]
    assert {(h.step, h.writer) for h in holdings(own, replica, 0)} == {(2, 1)}
    assert same(ckptio.restore(replica.url, step=2), state(2))


def test_a_killed_copy_within_its_lease_at_the_commit_is_cleaned_by_a_later_round(tmp_path, monkeypatch):
    """A restart quicker than the lease: the killed copy's intent still counts as live when the step is
    committed again, so its objects must stay then -- and go at a later round, once it is stale."""
    monkeypatch.setenv("CKPTIO_LEASE_S", "1.0")
    durable = CheckpointStore(str(tmp_path / "durable"))
    killed = new_id()  # an earlier run's copy of step 2, killed after one object: its last beat is now
    run_sync(durable.announce("2", killed, 0, durable.lease_s))
    run_sync(durable.backend.write(f"2/{killed}.h00000-00000", [memoryview(b"half a copy")]))
    policy = TierPolicy(replicate_every=2, fast=Retention(1), durable=Retention(max_to_keep=3))
    with TieredCheckpointManager(str(tmp_path / "fast"), str(tmp_path / "durable"), policy=policy) as m:
        m.save(2, state(2))
        m.wait_until_finished()
        assert (tmp_path / "durable" / "2" / f"{killed}.h00000-00000").exists()  # spared: it may be alive
        deadline = time.monotonic() + 30
        while run_sync(durable.live_saves("2")):  # until the store judges the killed copy dead
            assert time.monotonic() < deadline
            time.sleep(0.05)
        m.save(4, state(4))
        m.wait_until_finished()
        assert m.tier_steps()["durable"] == [2, 4]
    kept = {k.rsplit("/", 1)[-1] for k in run_sync(durable.read_manifest("2")).keys()}
    fence = fence_key("", run_sync(durable.read_manifest("2")).fence)  # the commit's own fence stays with it
    assert set(os.listdir(tmp_path / "durable" / "2")) == kept | {MANIFEST_NAME, fence}
    assert same(ckptio.restore(str(tmp_path / "durable"), step=2), state(2))
