"""A step whose save died (or stalls) between its manifest and its fence claim can be saved again at once.

Issue #34 (complete resume): a loop SIGKILLed between step s's manifest and its fence claim
resumes from the step before and saves s again, usually within the dead save's lease. That
re-save must neither crash the loop nor block the training thread: the dead commit is settled as
gc would settle it (once its lease ends) and the re-save commits; a writer that was only slow and
confirms first wins, and the re-save fails "already committed" -- never two commits.

Each test runs a real saver process (tests/workers/resave_worker.py) that commits a good step, then
stalls its next save between manifest and fence claim; the test kills it or lets it go, and
re-saves that step from this process through ``CheckpointManager``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from crash_campaign import same_state, state_for  # noqa: E402
from paths import WORKERS  # noqa: E402
from resave_worker import STATE_OFFSET  # noqa: E402

import ckptio  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402
from ckptio.store.fence import writers_of  # noqa: E402

#: The savers' lease (theirs and this process's): long enough that a re-save started right after
#: the stall meets a live (or not provably dead) commit, short enough to wait out.
LEASE_S = 3.0
GOOD, STEP = 1, 2


class Saver:
    """The worker process; its JSON events are read by a thread (no blocking pipe)."""

    def __init__(self, root: Path, stall_at: str = "claim") -> None:
        self.go = root.parent / "go"
        argv = [sys.executable, str(WORKERS / "resave_worker.py"), "--root", str(root), "--good", str(GOOD),
                "--step", str(STEP), "--go", str(self.go), "--stall-at", stall_at]
        self.err = root.parent / "saver.err"
        with open(self.err, "wb") as err:
            self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                      env={**os.environ, "CKPTIO_LEASE_S": str(LEASE_S)})
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def expect(self, event: str, timeout: float = 90.0) -> dict[str, Any]:
        try:
            got = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {event!r} from the saver in {timeout}s; stderr: {self.err.read_text()}") from None
        assert got["event"] == event, f"expected {event!r}, got {got}; stderr: {self.err.read_text()}"
        return got

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


@pytest.fixture
def stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """A saver whose save of STEP has created its manifest and not claimed its fence (indirect
    parameter: where it stalls, see tests/workers/resave_worker.py; default "claim")."""
    monkeypatch.setenv("CKPTIO_LEASE_S", str(LEASE_S))
    root = tmp_path / "run"
    saver = Saver(root, getattr(request, "param", "claim"))
    try:
        saver.expect("ready")
        saver.expect("stalled")
        yield root, saver
    finally:
        saver.stop()


def _audit(root: Path, want_state: int, *, sweep: bool = False) -> None:
    """STEP is committed once, restores bit-exact as ``state_for(want_state)``, GOOD is intact, and
    (after gc, with ``sweep``: a failed save leaves its objects to it) no object of another save is
    left in STEP beside the committed one's."""
    mngr = ckptio.CheckpointManager(root)
    try:
        if sweep:
            mngr.sweep_orphans(grace_seconds=0)
        assert mngr.all_steps() == [GOOD, STEP]
        assert not same_state(mngr.restore(GOOD), GOOD)
        got = mngr.restore(STEP)
        assert got["step"] == want_state and not same_state(got, want_state)
        store = mngr.store
        manifest = run_sync(store.read_manifest(str(STEP)))
        keys = [str(p.relative_to(root)) for p in (root / str(STEP)).rglob("*") if p.is_file()]
        assert writers_of(keys, store.naming) == writers_of(manifest.keys(), store.naming)
    finally:
        mngr.close()


@pytest.mark.parametrize("when", ["at_once", "after_lease"])
def test_resave_after_a_kill_between_manifest_and_fence(stalled: Any, caplog: pytest.LogCaptureFixture,
                                                        when: str) -> None:
    """The killed save's commit is settled (at once if its lease is over, else by the re-save's
    background part once it is), and the re-save commits the new state."""
    root, saver = stalled
    killed = time.monotonic()
    saver.p.send_signal(signal.SIGKILL)
    saver.stop()
    if when == "after_lease":
        time.sleep(LEASE_S * 1.25 + 0.5)  # its last heartbeat is at most a quarter lease older than the kill
    mngr = ckptio.CheckpointManager(root)
    try:
        assert mngr.latest_step() == GOOD  # the dead commit never counts
        # On a loaded machine "at once" may come after the lease: then the re-save may settle at once.
        surely_live = time.monotonic() - killed < LEASE_S * 0.4  # a second to spare for the check
        with caplog.at_level(logging.INFO, logger="ckptio.store"):
            handle = mngr.save(STEP, state_for(STEP), force=True)  # raised FileExistsError before #34
            assert handle is not None
            mngr.wait_until_finished()
        assert handle.result() is not None
        deferred = any("waits for it to confirm" in r.getMessage() for r in caplog.records)
        if when == "after_lease" or surely_live:
            assert deferred == (when == "at_once"), [r.getMessage() for r in caplog.records]
        assert any("died before confirming its commit" in r.getMessage() for r in caplog.records)
    finally:
        mngr.close()
    # "At once", the dead save's objects may be younger than the lease when its commit is settled
    # (written after its manifest's timestamp; slow under load): gc's grace spares them, and they
    # are the next sweep's. After the lease they are always taken by the settling itself.
    _audit(root, STEP, sweep=when == "at_once")


@pytest.mark.parametrize("on_save_error", ["raise", "warn"])
def test_a_slow_writer_that_confirms_wins(stalled: Any, on_save_error: str) -> None:
    """A writer paused (SIGSTOP, shorter than its lease) that wakes and confirms keeps its commit;
    the re-save, accepted meanwhile, fails "already committed" ("warn": counted, never raised)."""
    root, saver = stalled
    mngr = ckptio.CheckpointManager(root, on_save_error=on_save_error)  # type: ignore[arg-type]
    try:
        handle = mngr.save(STEP, state_for(STEP), force=True)
        assert handle is not None  # accepted: its commit waits for the other save
        saver.p.send_signal(signal.SIGSTOP)
        time.sleep(LEASE_S / 8)
        saver.p.send_signal(signal.SIGCONT)
        saver.go.touch()
        assert saver.expect("ok")["event"] == "ok"
        if on_save_error == "raise":
            with pytest.raises(FileExistsError, match="already committed"):
                mngr.wait_until_finished()
        else:
            mngr.wait_until_finished()  # never raises
            assert mngr.save_failures.count == 1 and mngr.save_failures.since_last_good == [STEP]
        with pytest.raises(FileExistsError, match="already committed"):
            handle.result()
    finally:
        mngr.close()
    _audit(root, STEP + STATE_OFFSET, sweep=True)


def test_two_hosts_resave_after_a_kill(stalled: Any) -> None:
    """With two hosts (threads joined by tests/support/hosts.py), host 1 does not refuse the step that host 0
    settles: an unconfirmed commit is host 0's to wait for, and the re-save commits on both."""
    from crash_campaign_multihost import check_restored, host_state
    from hosts import on_hosts

    root, saver = stalled
    saver.p.send_signal(signal.SIGKILL)
    saver.stop()

    def host(rank: int, coord: Any) -> str:
        mngr = ckptio.CheckpointManager(root, coordinator=coord)
        try:
            handle = mngr.save(STEP, host_state(STEP, rank, 2), force=True)
            assert handle is not None
            mngr.wait_until_finished()
            return handle.state.value
        finally:
            mngr.close()

    assert on_hosts(2, host) == ["committed", "committed"]
    check_restored(ckptio.restore(str(root), step=STEP), STEP)
    mngr = ckptio.CheckpointManager(root)
    try:
        assert mngr.all_steps() == [GOOD, STEP]
    finally:
        mngr.close()


@pytest.mark.parametrize("stalled", ["claim", "revocations"], indirect=True)
def test_a_writer_paused_past_its_lease_loses_and_harms_nothing(stalled: Any) -> None:
    """A writer stopped (SIGSTOP) past its lease after its manifest (before listing revocations, or
    before its fence claim) is settled by the re-save, which commits; once resumed, the writer fails
    (revoked) and the re-save's commit stands."""
    root, saver = stalled
    saver.p.send_signal(signal.SIGSTOP)
    try:
        mngr = ckptio.CheckpointManager(root)
        try:
            handle = mngr.save(STEP, state_for(STEP), force=True)
            assert handle is not None
            mngr.wait_until_finished()
            assert handle.state.value == "committed"
        finally:
            mngr.close()
    finally:
        saver.p.send_signal(signal.SIGCONT)
    saver.go.touch()
    got = saver.expect("failed")
    assert "SaveRevokedError" in got["error"], got
    # Whether the re-save's settling took the stopped writer's objects depends on how stale its
    # intent looked at that moment (a loaded machine: it may still look live, and a live save's
    # objects are spared); either way what it left is gc's once its lease is over.
    time.sleep(LEASE_S * 1.25 + 0.5)
    _audit(root, STEP, sweep=True)


def test_gc_settling_the_same_dead_commit_spares_the_resave_that_followed(stalled: Any) -> None:
    """gc judges the killed save's commit dead; while it deletes that save's objects, a re-save settles
    the step itself and commits: gc must not then delete the manifest key, now the re-save's."""
    import asyncio

    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import WrapperBackend
    from ckptio.store import CheckpointStore

    root, saver = stalled
    saver.p.send_signal(signal.SIGKILL)
    saver.stop()
    time.sleep(LEASE_S * 1.25 + 0.5)  # dead by gc's rule
    resaved: list[str] = []
    started: list[str] = []

    def resave() -> None:
        mngr = ckptio.CheckpointManager(root)
        try:
            handle = mngr.save(STEP, state_for(STEP), force=True)
            assert handle is not None
            mngr.wait_until_finished()
            resaved.append(handle.state.value)
        finally:
            mngr.close()

    class ResaveDuringGc(WrapperBackend):
        async def delete(self, key: str) -> None:
            if not started and key.startswith(f"{STEP}/") and "ckptio." not in key:  # the dead save's first object
                started.append(key)
                await asyncio.to_thread(resave)
            await super().delete(key)

    store = CheckpointStore(str(root), backend=ResaveDuringGc(open_backend(str(root))))
    try:
        run_sync(store.sweep(0))
    finally:
        run_sync(store.close())
    assert resaved == ["committed"]
    _audit(root, STEP)
