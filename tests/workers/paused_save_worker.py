"""A saver process that tests/scenarios/test_paused_saves.py pauses (SIGSTOP) while gc runs, then resumes.

It saves one step per ``save`` line read from stdin, so that the test can check the root between
saves with nothing else running, and prints one JSON line per event on stdout:

* ``{"event": "ready"}`` once it can take commands;
* ``{"event": "start", "step": s}`` when a save begins;
* ``{"event": "stalled", "step": s, "key": k}`` (only with ``--stall-at-commit N``): the
  coordinator's Nth commit has checked the save's objects and is about to create the manifest
  ``k``; it waits there until the file ``--go`` exists (the test stops the process meanwhile).
  That is the window of issue #30 item 1;
* ``{"event": "ok" | "failed", "step": s, "error": ..., "seconds": ...}`` when it ends.

``--hosts 1`` saves format 1 (one process, no coordinator); ``--hosts N`` (N >= 2) saves format 2
(a root manifest and one fragment per host) with N simulated hosts as threads of this process,
joined by tests/support/hosts.py's thread group, as tests/manifest/test_fragments.py does. ``--api save`` uses
``ckptio.save(...).result()``; ``--api manager`` a ``CheckpointManager(max_to_keep=1)`` per host.

    python tests/workers/paused_save_worker.py --root DIR --api manager --hosts 1 [--stall-at-commit 2 --go FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "support"), os.path.join(TESTS, "scenarios")]  # hosts; crash_campaign*

#: Objects of 1 MiB: a step has several, and gc has something to take from a paused save.
OBJECT_SIZE = 1 << 20
#: Retention of the manager API: one, so that a broken commit makes it delete the only good step.
MAX_TO_KEEP = 1


def check_format1(got: Any, step: int) -> None:
    """``got`` (a whole restore) is crash_campaign's state of ``step``, bit-exact."""
    from crash_campaign import same_state

    bad = same_state(got, step)
    assert not bad, bad


def _emit(event: str, **fields: Any) -> None:
    # One lock for every host thread: two JSON lines must never interleave on the test's pipe.
    with _out_lock:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


_out_lock = threading.Lock()


def stalling_backend(inner: Any, stall_at: int, go: str) -> Any:
    """``inner``, whose ``stall_at``-th manifest creation first waits for the file ``go`` (0: never).

    A wrapper, not a flag in the library: the commit has already checked the objects when it
    creates the manifest, so a stall here is one exactly between the check and the commit point.
    The test stops the whole process (SIGSTOP) while it waits here, the heartbeat thread with it.
    Waiting for a file rather than stopping itself: a process that SIGSTOPs itself may run on for
    a moment in this thread (the kernel stops the process through another thread), long enough
    for the create to begin.
    """
    from ckptio.backends.wrappers import WrapperBackend
    from ckptio.manifest import MANIFEST_NAME

    class StallBeforeManifest(WrapperBackend):
        commits = 0

        async def create_if_absent(self, key: str, data: bytes) -> None:
            if key.rpartition("/")[2] == MANIFEST_NAME:
                self.commits += 1
                if self.commits == stall_at:
                    _emit("stalled", step=int(key.partition("/")[0] or -1), key=key)
                    while not os.path.exists(go):  # blocks this loop on purpose: nothing may go on
                        time.sleep(0.005)
            await super().create_if_absent(key, data)

    return StallBeforeManifest(inner)


class Host:
    """One host of the job: saves the steps it is told to, through the chosen API."""

    def __init__(self, a: argparse.Namespace, rank: int, coord: Any) -> None:
        import ckptio
        from ckptio.backends import open_backend

        self.a, self.rank, self.coord = a, rank, coord
        # Only the coordinator commits: it alone carries the stop (a peer's manifests are fragments).
        inner = open_backend(a.root, object_size=OBJECT_SIZE)
        if a.latency:
            # An object store's round trips: every call of a save takes about as long as on one,
            # the commit's too, so that a pause at a random moment lands in the commit as often.
            from ckptio.backends.wrappers import LatencyBackend

            inner = LatencyBackend(inner, a.latency, jitter=a.latency / 2, seed=rank)
        self.backend = stalling_backend(inner, a.stall_at_commit if rank == 0 else 0, a.go)
        self.mngr = (ckptio.CheckpointManager(a.root, max_to_keep=MAX_TO_KEEP, coordinator=coord,
                                              backend=self.backend) if a.api == "manager" else None)

    def state(self, step: int) -> Any:
        if self.a.hosts == 1:
            from crash_campaign import state_for

            return state_for(step)
        from crash_campaign_multihost import host_state

        return host_state(step, self.rank, self.a.hosts)

    def save(self, step: int) -> None:
        import ckptio

        if self.mngr is not None:
            # force: no host may skip a step the others save (should_save reads the root on each)
            self.mngr.save(step, self.state(step), force=True)
            self.mngr.wait_until_finished()
        else:
            ckptio.save(self.a.root, self.state(step), step=step, coordinator=self.coord,
                        backend=self.backend).result()


def serve(a: argparse.Namespace) -> None:
    """One thread per host; each ``save`` line from stdin makes every host save the next step."""
    from hosts import _ThreadGroup

    group = _ThreadGroup(a.hosts) if a.hosts > 1 else None
    inboxes: list[queue.Queue[int | None]] = [queue.Queue() for _ in range(a.hosts)]
    done: queue.Queue[tuple[int, int, BaseException | None, float]] = queue.Queue()

    def host(rank: int) -> None:
        h = Host(a, rank, group.member(rank) if group is not None else None)
        while (step := inboxes[rank].get()) is not None:
            t0 = time.monotonic()
            try:
                h.save(step)
                err: BaseException | None = None
            except Exception as e:  # the verdict of a save is the test's to judge
                err = e
            done.put((rank, step, err, time.monotonic() - t0))

    threads = [threading.Thread(target=host, args=(r,), daemon=True) for r in range(a.hosts)]
    for t in threads:
        t.start()
    step = a.first_step
    _emit("ready")
    for line in sys.stdin:
        if line.strip() != "save":
            break
        _emit("start", step=step)
        for box in inboxes:
            box.put(step)
        results = [done.get() for _ in range(a.hosts)]
        errors = [f"host {r}: {type(e).__name__}: {e}" for r, _, e, _ in sorted(results, key=lambda x: x[0])
                  if e is not None]
        seconds = max(s for *_, s in results)
        if errors:
            _emit("failed", step=step, error="; ".join(errors)[:2000], seconds=seconds)
        else:
            _emit("ok", step=step, seconds=seconds)
        step += 1
    for box in inboxes:
        box.put(None)
    for t in threads:
        t.join(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--api", choices=["save", "manager"], default="save")
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--first-step", type=int, default=1)
    ap.add_argument("--stall-at-commit", type=int, default=0,
                    help="before the Nth manifest's creation, wait until the file --go exists")
    ap.add_argument("--go", default="")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every storage call")
    serve(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
