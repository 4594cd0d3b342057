"""kill -9 and pauses past the lease during saves, retention, gc, cp and restores: only committed
checkpoints are listed, all restore bit-exact, nothing committed is lost, and a final gc leaves exactly
the kept steps' bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crash_campaign import run_campaign


@pytest.mark.slow
def test_kill_minus_9_campaign(tmp_path):
    result = run_campaign(trials=20, root=str(tmp_path / "ckpt"), seed=1234)
    assert result["trials"] == 20 and result["newest"] >= 2
    assert all(n > 0 for n in result["kills"].values())  # savers/deleters, gc, cp and restorers were all killed
    assert all(n > 0 for n in result["pauses"].values())  # ... and all paused past the lease, then resumed
    assert result["bytes_on_disk"] == result["bytes_of_kept_steps"]


# -- format 2: multi-host saves (tests/scenarios/crash_campaign_multihost.py) -------------------------


@pytest.mark.slow
def test_kill_minus_9_campaign_of_multihost_format2_saves(tmp_path):
    """A few jobs of 2-4 real host processes killed at chosen points of their saves (objects,
    fragments, the root's commit, retention) or at random, beside gc, cp and a restorer."""
    from crash_campaign_multihost import run_campaign as run_multihost

    # The kills format 2 adds: after a host's fragment, during and after the root's commit; then one at random.
    plan = ["fragment-after", "commit-during", "commit-after", "random"]
    result = run_multihost(trials=4, root=str(tmp_path / "ckpt"), seed=3, plan=plan, pause_rate=1.0)
    assert sum(result["pauses"].values()) >= 4, result["pauses"]
    kills = result["kills"]
    assert result["newest"] >= 2 and any(k.startswith("phase:") for k in kills) and any(
        k.startswith("random:") for k in kills), kills
    assert result["restorer"]["restored"] > 0
    assert result["bytes_on_disk"] == result["bytes_of_kept_steps"]


def _fragments(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("ckptio.fragment.*"))


@pytest.mark.parametrize("phase", ["fragment-after", "commit-during", "commit-after"])
def test_a_killed_jobs_fragments_are_swept_only_once_provably_dead(
    tmp_path: Path, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three hosts die together (one process) after writing their fragments, around the root's commit.

    Uncommitted (no root): a sweep at grace 0 spares their fragments and objects while their
    intents are live and takes all of them once the intents are stale. Committed (the root made
    it before the kill): the step is whole and newest, and stale intents never take its fragments.
    Either way the committed step beside it is never touched.
    """
    from crash_campaign_multihost import LEASE_S, check_restored

    import ckptio
    from ckptio.backends.local import TMP_MARK

    root = tmp_path / "ckpt"
    script = str(Path(__file__).with_name("crash_campaign_multihost.py"))
    # The sweeping store's lease too: a killed write's temporary goes once a lease has passed.
    monkeypatch.setenv("CKPTIO_LEASE_S", str(LEASE_S))

    def job(step: int, kill: list[str]) -> int:
        argv = [sys.executable, script, "--role", "threads", "--root", str(root), "--hosts", "3", "--step", str(step),
                "--log", str(tmp_path / f"log{step}"), "--name", f"job{step}", *kill]
        return subprocess.run(argv, env={**os.environ, "CKPTIO_LEASE_S": str(LEASE_S)}, timeout=120).returncode

    def files(step: int) -> dict[Path, int]:
        return {p: p.stat().st_size for p in (root / str(step)).rglob("*") if p.is_file()}

    assert job(1, []) == 0  # committed: its fragments belong to it for as long as it is kept
    victim = "2" if phase == "fragment-after" else "0"  # only the coordinator commits
    assert job(2, ["--rank", victim, "--kill-phase", phase, "--kill-at", "1"]) == -signal.SIGKILL
    # Committed means the commit's fence says so (ckptio.store.fence): a root made just before the kill
    # ("commit-after") is unconfirmed, and goes with the dead attempt.
    made = (root / "2" / "ckptio.manifest.json").exists()
    committed = any(p.read_bytes() == b"commit" for p in (root / "2").glob("ckptio.fence.*"))
    assert made or phase != "commit-after"
    left = _fragments(root / "2")
    intents = sorted((root / "2").glob("ckptio.intent.*"))
    assert left and len(intents) == 3  # every host announced itself; some wrote their fragment
    step1, step2 = files(1), files(2)

    mngr = ckptio.CheckpointManager(root)
    mngr.sweep_orphans(grace_seconds=0)  # the intents are fresh: nothing of step 2 is provably dead
    assert {p: n for p, n in files(2).items() if TMP_MARK not in p.name} == \
        {p: n for p, n in step2.items() if TMP_MARK not in p.name}
    # The lease runs out (as if LEASE_S passed without a heartbeat): the killed attempt is provably dead.
    # Time passes for every file the kill left, the temporary of a write it was in included.
    old = time.time() - LEASE_S - 1
    for p in (root / "2").iterdir():
        os.utime(p, (old, old))
    swept = mngr.sweep_orphans(grace_seconds=0)
    assert files(1) == step1
    if committed:
        assert set(files(2)) == {p for p in step2 if p not in intents and TMP_MARK not in p.name}
        check_restored(ckptio.restore(root), 2)
    else:
        assert {str(p.relative_to(root)) for p in left} <= set(swept) and files(2) == {}
        check_restored(ckptio.restore(root), 1)
    mngr.close()


def test_the_deletion_check_tells_a_live_saves_deletion_from_a_dead_ones() -> None:
    """check_deletions is not vacuous: a deletion during regular heartbeats is caught; after the
    save ended, after its process died, or after its heartbeats stopped for a lease, it is not."""
    from crash_campaign_multihost import LEASE_S, check_deletions

    sid = "0123456789ab"
    t0 = 1000.0
    beats = [{"proc": "0/host1", "op": "intent", "key": f"5/ckptio.intent.{sid}", "lease": LEASE_S,
              "t0": t0 + i * LEASE_S / 4, "t": t0 + i * LEASE_S / 4 + 0.01} for i in range(12)]

    def deletion_at(t: float, *extra: dict) -> list[dict]:
        gc = [{"proc": "0/gc", "op": "pass", "t": t - 0.5},
              {"proc": "0/gc", "op": "delete", "key": f"5/ckptio.fragment.{sid}", "t": t}]
        return sorted([*beats, *extra, *gc], key=lambda e: e.get("t0", e["t"]))

    with pytest.raises(AssertionError, match="was alive"):
        check_deletions(deletion_at(t0 + 2 * LEASE_S), {})
    ended = {"proc": "0/host1", "op": "intent", "key": f"5/ckptio.intent.{sid}", "lease": 0.0,
             "t0": t0 + 1.5 * LEASE_S, "t": t0 + 1.5 * LEASE_S + 0.01}
    assert check_deletions(deletion_at(t0 + 2 * LEASE_S, ended), {})["fragments_deleted"] == 1
    assert check_deletions(deletion_at(t0 + 2 * LEASE_S), {"0/host1": t0 + LEASE_S})["deleted"] == 1
    del beats[4:]  # the heartbeats stop one lease before the deletion: judged dead, rightly
    assert check_deletions(deletion_at(t0 + 3 * LEASE_S), {})["deleted"] == 1
