"""Tiers under failure, with real processes (issue 19): resuming after a fallback or a rollback, a host
lost at every phase of peer replication, and a durable tier that is down, lagging or killed mid-copy.

Each test runs tests/workers/tiers_worker.py in several processes (torch.distributed, gloo); every worker
checks what it restores bit-exact itself and prints one JSON line, which the tests read. Every wait has a
timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

pytest.importorskip("torch")

from ckptio.backends.local import TMP_MARK
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME
from ckptio.manifest.names import fence_key, parse_intent, parse_object
from ckptio.store import CheckpointStore

from tests.tiers.test_tiers_mp import _free_port, kill_mid_copy, run, spawn
from tiers_worker import phases

pytestmark = pytest.mark.slow


def test_resume_after_a_fallback_replicates_the_new_timeline(tmp_path):
    """Host 2 and its partner (host 3) are lost: every host restores step 4 from the durable tier.
    The survivors still hold step 5 and partners' replicas of it (the abandoned timeline); training
    goes on from 4 and saves 5 and 6 again: every save happens, peer replication raises nothing, and a
    later restore returns the new step 6."""
    root = str(tmp_path)
    common = ["--every", "2", "--keep", "2"]
    run(4, "save", root, "--steps", "1,2,3,4,5", *common)
    shutil.rmtree(tmp_path / "fast" / "r2")
    shutil.rmtree(tmp_path / "fast" / "r3")
    got = run(4, "resume", root, "--expect-step", "4", "--steps", "5,6", "--gen", "1", *common)
    assert all(r["error"] is None for r in got.values()), got
    assert all(r["saved"] == [5, 6] for r in got.values()), got
    assert all(r["tiers"]["peer"] == [6] and r["tiers"]["fast"] == [5, 6] for r in got.values()), got
    # Lose host 1 now: its shards of the new step 6 come from its partner's replica, not step 4.
    shutil.rmtree(tmp_path / "fast" / "r1")
    got = run(4, "restore", root, "--expect-step", "6", "--gen", "1", *common)
    assert got[1]["sources"]["1"] == "peer", got


def test_rollback_resave_replaces_the_abandoned_steps(tmp_path):
    """restore(step=2) then training 3 and 4 again with other data: the re-saves are never skipped
    (every host still held 3 and 4 of the abandoned run), the durable tier's abandoned step 4 is
    replaced, and a later crash restores the new step 4 -- never the abandoned one."""
    root = str(tmp_path)
    common = ["--every", "2", "--keep", "2"]
    saved = run(2, "save", root, "--steps", "1,2,3,4", *common)
    assert saved[0]["tiers"]["durable"] == [2, 4] and saved[0]["tiers"]["fast"] == [3, 4]
    got = run(2, "resume", root, "--restore-step", "2", "--expect-step", "2", "--steps", "3,4", "--gen", "1",
              *common)
    assert all(r["error"] is None and r["saved"] == [3, 4] for r in got.values()), got
    assert got[0]["tiers"]["durable"] == [2, 4], got
    # The newest step, bit-exact as re-trained (generation 1), from the fast tiers and from the durable one.
    run(2, "restore", root, "--expect-step", "4", "--gen", "1", *common)
    shutil.rmtree(tmp_path / "fast")
    got = run(2, "restore", root, "--expect-step", "4", "--gen", "1", *common)
    assert all(r["sources"] == {"0": "durable", "1": "durable"} for r in got.values()), got


#: The loss bound: a host lost during the replication of step N (its fast tier and the replicas it kept
#: gone) costs at most the steps since the newest step replicated to its partner -- here N-1, since
#: each step is replicated before the next is saved. The job restores N-1 or N, never older.
@pytest.mark.parametrize("phase", list(phases(3)))
def test_a_host_lost_at_any_replication_phase_loses_at_most_the_unreplicated_steps(tmp_path, phase):
    root = str(tmp_path)
    world, victim, n = 3, 1, 3
    # No durable copies: falling back to the durable tier would hide a lost fast-tier step.
    common = ["--every", "0", "--keep", "1"]
    procs = spawn(world, range(world), "phasekill", root, "--steps", ",".join(map(str, range(1, n + 1))),
                  "--victims", str(victim), "--phase", phase, *common, port=_free_port())
    try:
        try:
            rc = procs[victim].wait(timeout=150)
        except Exception:
            pytest.fail(f"the victim never reached phase {phase}")
        assert rc == -signal.SIGKILL, procs[victim].communicate()[0][-3000:]
    finally:
        for p in procs:  # the whole job goes down with the node (a job restart); survivors keep their SSDs
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.communicate()
    shutil.rmtree(tmp_path / "fast" / f"r{victim}")  # the node is replaced: its SSD is empty
    got = run(world, "restore", root, *common)
    steps = {r["step"] for r in got.values()}
    assert len(steps) == 1, got  # every host at one step (each checked its shards bit-exact)
    assert steps <= {n - 1, n}, (phase, got)
    assert all(r["durable_reads"] == 0 for r in got.values()), got
    assert got[victim]["sources"][str(victim)] == "peer", got


def test_a_durable_tier_down_for_a_whole_run_is_reported_retried_and_caught_up(tmp_path):
    """Every durable write fails for a whole run: training goes on; each failed round is retried with
    backoff (never skipped for a newer step); the lag is readable and grows; the next healthy run
    copies every step the durable retention keeps -- not only the newest."""
    root = str(tmp_path)
    common = ["--every", "2", "--keep", "1"]
    got = run(2, "durabledown", root, "--steps", "1,2,3,4,5,6,7,8", *common)
    for r in got.values():
        behind = [lag[0] for lag in r["lags"]]
        assert behind[-1] >= 3 and behind == sorted(behind), r  # steps 2, 4, 6, 8 not there, and growing
        assert r["owed"] and set(r["owed"]) <= {2, 4, 6, 8}, r
        assert r["error"] and "durable copy" in r["error"], r
        assert r["tiers"]["durable"] == []
        # The owed steps stayed in the fast tier (beyond its retention of 1) for the retries.
        assert set(r["owed"]) <= set(r["tiers"]["fast"]), r
    got = run(2, "copyresume", root, *common)
    # The durable retention (newest 3 by default) keeps 4, 6, 8: all three arrive, oldest first.
    assert got[0]["tiers"]["durable"] == [4, 6, 8], got
    assert got[0]["copied"] == [4, 6, 8], got


def test_a_killed_copys_objects_are_cleaned_when_the_step_completes(tmp_path):
    """A durable copy of step 2 is killed midway (objects without a manifest). A new run (fresh fast
    tiers, new data) saves step 2 again: once it is committed in the durable tier, nothing of the
    killed copy is left beside it -- no object, no intent, no temporary of a write it was in."""
    root = str(tmp_path)
    env = {"CKPTIO_LEASE_S": "1.0"}  # a dead copy's intent goes stale within a second, not two minutes
    args = ["--steps", "1,2", "--every", "2", "--arrays", "3", "--object-size", str(16 << 10)]
    kill_mid_copy(tmp_path, args, env)
    durable = CheckpointStore(str(tmp_path / "durable"))
    left = [k for k in os.listdir(tmp_path / "durable" / "2") if parse_object(k)]
    assert left, "some objects should have arrived before the kill"
    # What a write killed between its temporary file and the rename leaves (invisible to listings).
    killed_write = tmp_path / "durable" / "2" / f"{TMP_MARK}0123456789abcdef"
    killed_write.write_bytes(b"half an object")
    os.utime(killed_write, (time.time() - 3600, time.time() - 3600))
    # The property the cleanup relies on: the killed copy is a dead attempt as the store judges it
    # (its intents stopped beating), whatever the machine's load made of the time since the kill.
    deadline = time.monotonic() + 60
    while run_sync(durable.live_saves("2")):
        assert time.monotonic() < deadline, "the killed copy's intents never went stale"
        time.sleep(0.1)
    shutil.rmtree(tmp_path / "fast")
    run(2, "save", root, *args, "--gen", "1", env=env)
    m = run_sync(durable.read_manifest("2"))
    names = set(os.listdir(tmp_path / "durable" / "2"))
    own = {MANIFEST_NAME, *([fence_key("", m.fence)] if m.fence else [])}  # the commit's fence is its own
    extra = {k for k in names if f"2/{k}" not in set(m.keys()) and k not in own}  # keys: objects and fragments
    assert not extra, f"left beside the committed step: {sorted(extra)}"
    assert not [k for k in names if parse_intent(k)]
    assert not set(left) & {k.rsplit("/", 1)[-1] for k in m.objects}  # the new run's objects, not the old
    run_sync(durable.close())


def test_a_restore_whose_planning_fails_on_one_host_fails_every_host_alike(tmp_path):
    """#33: host 1's target does not fit the checkpoint, so the restore's planning fails there only. It
    still takes part in the fetch's status round: no host waits forever in an exchange host 1 skipped,
    and every host raises the same error, naming host 1 and why."""
    root = str(tmp_path)
    common = ["--every", "0", "--keep", "1"]
    run(3, "save", root, "--steps", "1,2", *common)
    got = run(3, "badtarget", root, "--victims", "1", *common)
    errors = {r["error"] for r in got.values()}
    assert len(got) == 3 and len(errors) == 1 and None not in errors, got
    (error,) = errors
    assert "host 1: planning its reads:" in error and "host 0:" not in error and "host 2:" not in error, error
