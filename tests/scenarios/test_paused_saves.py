"""A saver paused past its lease while gc runs must never leave a committed step that does not restore.

Issue #30 item 1: a lease alone cannot tell "dead" from "paused" (VM pause, swap, a stopped
container). A saver stopped (SIGSTOP) between its commit's object check and the manifest's
creation, for longer than its lease, is judged dead by ``ckptio gc --grace 0``, which deletes its
objects; once resumed it still creates the manifest: ``ckptio ls`` says committed, ``restore``
raises FileNotFoundError, and under ``CheckpointManager(max_to_keep=1)`` retention then deletes
the last good step.

Each test runs a real saver process (tests/workers/paused_save_worker.py), stops it, lets the lease run
out, runs gc at grace 0, resumes it, and then audits the root with nothing running. The paused
save may fail (raise): that is the right outcome. What must never happen is

* a step that ``committed_steps()`` / ``ckptio ls`` lists as committed and that does not restore
  bit-exact, or
* the loss of a restorable step that retention did not ask to delete: the plain API keeps every
  step; ``max_to_keep=1`` may replace the newest restorable step only by a newer restorable one.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from paths import WORKERS
from paused_save_worker import check_format1

#: The savers' lease: short, so that a pause outlives it in a fraction of a second more.
LEASE_S = 1.0
#: How long a pause lasts past the lease: the last heartbeat came up to a quarter lease before it.
PAUSE_MARGIN_S = 0.4
WORKER = str(WORKERS / "paused_save_worker.py")
#: Each storage call of the randomly paused savers takes this long, as on an object store: on a
#: local disk the commit is a few milliseconds of a save and a random pause would rarely land there.
STORE_LATENCY_S = 0.02


class Saver:
    """The worker process, driven line by line; its events are read by a thread (no blocking pipe)."""

    def __init__(self, root: Path, api: str, hosts: int, *, stall_at_commit: int = 0, latency: float = 0.0) -> None:
        self.go = root.parent / f"go-{root.name}"
        argv = [sys.executable, WORKER, "--root", str(root), "--api", api, "--hosts", str(hosts),
                "--stall-at-commit", str(stall_at_commit), "--go", str(self.go), "--latency", str(latency)]
        self.err_path = root.parent / f"saver-{root.name}.err"
        with open(self.err_path, "wb") as err:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                      env={**os.environ, "CKPTIO_LEASE_S": str(LEASE_S)})
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", timeout=60)

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def expect(self, *events: str, timeout: float = 60.0) -> dict[str, Any]:
        try:
            got = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the saver sent none of {events} in {timeout}s; stderr: {self.stderr()}") from None
        assert got["event"] in events, f"expected {events}, got {got}; stderr: {self.stderr()}"
        return got

    def stderr(self) -> str:
        return self.err_path.read_text()[-3000:] if self.err_path.exists() else ""

    def save(self) -> None:
        """Start the next step's save (its events follow)."""
        assert self.p.stdin is not None
        self.p.stdin.write(b"save\n")
        self.p.stdin.flush()

    def outcome(self) -> dict[str, Any]:
        """The end of the save in progress: its ``ok`` or ``failed`` event."""
        got = self.expect("start", "ok", "failed")
        return self.expect("ok", "failed") if got["event"] == "start" else got

    def stop(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)
        wait_stopped(self.p.pid)

    def resume(self) -> None:
        self.go.touch()  # a stall at the commit goes on once the process runs again
        os.kill(self.p.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.p.poll() is None:
            self.resume()  # a stopped process would take the SIGKILL only once continued on some kernels
            self.p.kill()
        self.p.wait(30)


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped (state T): none runs, the heartbeat's neither."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass  # a thread that just ended
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def gc(root: Path, *, cli: bool) -> dict[str, Any]:
    """``ckptio gc ROOT --grace 0`` (as a separate process) or ``CheckpointStore(root).sweep(0)`` here."""
    if cli:
        out = subprocess.run([sys.executable, "-c", "import sys, ckptio.cli; sys.exit(ckptio.cli.main())",
                              "gc", "--grace", "0", "--json", str(root)], capture_output=True, text=True,
                             env={**os.environ, "CKPTIO_LEASE_S": str(LEASE_S)}, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        return {"deleted": report["objects"] + report["temporaries"] + report["intents"],
                "spared_in_flight": report["spared_in_flight"]}
    from ckptio.engine import run_sync
    from ckptio.store import CheckpointStore

    store = CheckpointStore(root)
    store.lease_s = LEASE_S  # a temporary goes only once a lease passed without a byte written (gc's rule)
    try:
        report = run_sync(store.sweep(0))
    finally:
        run_sync(store.close())
    return {"deleted": report.deleted, "spared_in_flight": report.spared_in_flight}


def pause_through_gc(saver: Saver, root: Path, *, cli: bool = False) -> dict[str, Any]:
    """The saver is stopped already: let its lease run out, gc at grace 0, resume it."""
    time.sleep(LEASE_S + PAUSE_MARGIN_S)
    try:
        return gc(root, cli=cli)
    finally:
        saver.resume()


def committed_per_ls(root: Path) -> list[int]:
    """The steps ``ckptio ls`` calls committed."""
    out = subprocess.run([sys.executable, "-c", "import sys, ckptio.cli; sys.exit(ckptio.cli.main())",
                          "ls", "--json", str(root)], capture_output=True, text=True, timeout=60)
    if out.returncode == 3:  # nothing under the root at all
        return []
    assert out.returncode == 0, out.stdout + out.stderr
    return [r["step"] for r in json.loads(out.stdout) if r["committed"]]


class Audit:
    """What the root offers between saves, checked against what it offered before."""

    def __init__(self, root: Path, hosts: int, api: str) -> None:
        self.root, self.hosts, self.api = root, hosts, api
        self.restorable: set[int] = set()
        self.findings: list[str] = []
        self._broken: set[int] = set()  # reported once: a broken step stays broken

    def restores(self, step: int) -> str | None:
        """None if ``step`` restores bit-exact, else why not."""
        import ckptio

        try:
            got = ckptio.restore(str(self.root), step=step)
            if self.hosts == 1:
                check_format1(got, step)
            else:
                from crash_campaign_multihost import check_restored

                check_restored(got, step)
        except Exception as e:  # noqa: BLE001 -- any failure to restore a committed step is the finding
            return f"{type(e).__name__}: {e}"[:300]
        return None

    def check(self, when: str, *, ls: bool = False) -> None:
        """Every committed step restores; no restorable step was lost beyond what retention asked."""
        from ckptio.engine import run_sync
        from ckptio.store import CheckpointStore

        store = CheckpointStore(str(self.root))
        try:
            committed = run_sync(store.committed_steps()) if self.root.exists() else []
        finally:
            run_sync(store.close())
        if ls:
            assert committed_per_ls(self.root) == committed
        now: set[int] = set()
        for step in committed:
            why = self.restores(step)
            if why is None:
                now.add(step)
            elif step not in self._broken:
                self._broken.add(step)
                self.findings.append(f"{when}: step {step} is listed as committed but does not restore: {why}")
        if self.api == "save":  # nothing asked for any deletion
            lost = sorted(self.restorable - now)
        else:  # max_to_keep=1: the newest restorable step may only give way to a newer restorable one
            newest = max(self.restorable, default=None)
            lost = [newest] if newest is not None and max(now, default=-1) < newest else []
        if lost:
            self.findings.append(f"{when}: restorable steps lost: {lost} (restorable now: {sorted(now)}, "
                                 f"committed now: {committed})")
        self.restorable = now

    def assert_clean(self) -> None:
        assert not self.findings, "paused saves broke the root:\n  " + "\n  ".join(self.findings)


def _params() -> list[Any]:
    return [pytest.param(api, hosts, id=f"{api}-format{1 if hosts == 1 else 2}")
            for api in ("save", "manager") for hosts in (1, 3)]


# -- (b) a stall exactly between the commit's object check and the manifest's creation ------------------


@pytest.mark.parametrize(("api", "hosts"), _params())
def test_a_save_paused_between_its_object_check_and_its_manifest_never_commits_a_broken_step(
    tmp_path: Path, api: str, hosts: int
) -> None:
    """Step 1 commits; step 2's coordinator stalls right before creating the manifest (its objects
    were just checked) and the process is stopped there, the lease runs out, gc at grace 0 takes the "dead" save's objects,
    then it resumes. Step 2 must fail -- or restore, if gc spared it -- and step 1 must survive
    unless a restorable step 2 replaced it."""
    root = tmp_path / "ckpt"
    audit = Audit(root, hosts, api)
    saver = Saver(root, api, hosts, stall_at_commit=2)
    try:
        saver.save()
        assert saver.outcome()["event"] == "ok", saver.stderr()
        audit.check("after step 1")
        assert audit.restorable == {1}
        saver.save()
        saver.expect("start")
        assert saver.expect("stalled", timeout=60)["step"] == 2
        saver.stop()
        swept = pause_through_gc(saver, root, cli=hosts == 1)
        result = saver.outcome()
        # Audited before the next save: under max_to_keep=1 its retention would delete a broken step 2.
        audit.check(f"after the paused step 2 ({result['event']}; gc deleted {len(swept['deleted'])} keys)",
                    ls=True)
        saver.save()  # the job goes on: one more step after the paused one
        after = saver.outcome()
    finally:
        saver.close()
    audit.check(f"after step 3 ({after['event']})")
    audit.assert_clean()


# -- (a) pauses at random points of saves ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("api", "hosts"), _params())
def test_saves_paused_at_random_points_never_commit_a_broken_step(tmp_path: Path, api: str, hosts: int) -> None:
    """Each round stops the saver at a random moment of a save (its objects' writes, the check,
    the commit, retention), lets the lease run out, runs gc at grace 0, resumes, and audits.

    The moment is drawn over the whole save, measured from unpaused saves, so only some rounds
    land between the commit's check and its manifest: the exact stall is the test above."""
    root = tmp_path / "ckpt"
    rnd = random.Random(f"{api}-{hosts}")
    audit = Audit(root, hosts, api)
    saver = Saver(root, api, hosts, latency=STORE_LATENCY_S)
    rounds = 8
    outcomes: dict[str, int] = {}
    try:
        durations = []
        for _ in range(2):  # unpaused saves: how long a save takes here
            saver.save()
            done = saver.outcome()
            assert done["event"] == "ok", done
            durations.append(done["seconds"])
        audit.check("after the unpaused saves")
        typical = statistics.median(durations)
        for r in range(rounds):
            saver.save()
            saver.expect("start")
            time.sleep(rnd.uniform(0.0, typical))
            saver.stop()
            swept = pause_through_gc(saver, root, cli=False)
            done = saver.outcome()
            outcomes[done["event"]] = outcomes.get(done["event"], 0) + 1
            audit.check(f"round {r}: step {done['step']} {done['event']} after a pause at a random point "
                        f"(gc deleted {len(swept['deleted'])} keys)")
    finally:
        saver.close()
    audit.check("at the end", ls=True)
    audit.assert_clean()
