"""``ckptio bench --train --pin``: the training thread on one core, everything else on the others.

On a 2-core VM a background save slows the training thread mostly by taking its core
(py-spy: run-queue waits up to 1.7 ms against GIL waits of 20-390 us in a 1.3 ms
step). A training host has tens of cores to spare and runs the step on the
accelerator, so what a save costs there is what is left once the cores are not
shared: the GIL, memory bandwidth, caches. Pinning the step thread to one core and
every other thread and process of the case (the library's threads, ckptio's writer
sidecar, DCP's checkpoint process, the anchors' writers) to the rest measures that.

Affinity is per thread on Linux (``sched_setaffinity`` on a thread's native id) and a
new thread or process inherits its creator's, so: after the case's setup every thread
and descendant goes to the "rest" cores (:func:`pin_all`); around each timed window of
steps the stepping thread moves to its own core and anything started since is swept
to the rest again (:func:`training_core`). Other processes on the machine are not
ours to move: on a shared machine they still run on both cores.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["Cores", "pin_all", "plan", "training_core"]


class Cores:
    """The core of the training thread and the cores of everything else."""

    def __init__(self, train: set[int], rest: set[int]) -> None:
        self.train, self.rest = frozenset(train), frozenset(rest)

    def to_json(self) -> dict[str, list[int]]:
        return {"train": sorted(self.train), "rest": sorted(self.rest)}


def plan() -> Cores:
    """The first core this process may run on for the step thread, the others for the rest.

    Raises ``ValueError`` where there is no second core to put the rest on.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"--pin needs at least 2 cores; this process may use {cores}")
    return Cores({cores[0]}, set(cores[1:]))


def _set(tid: int, cores: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(tid, cores)
    except (ProcessLookupError, PermissionError):
        pass  # the thread ended since the listing (or is not ours to move)


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _descendants() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def pin_all(cores: Cores, *, skip: int | None = None) -> int:
    """Every thread of this process (but ``skip``) and of its descendants onto ``cores.rest``;
    returns how many threads were moved."""
    moved = 0
    for pid in [os.getpid(), *_descendants()]:
        for tid in _tasks(pid):
            if tid != skip:
                _set(tid, cores.rest)
                moved += 1
    return moved


@contextlib.contextmanager
def training_core(cores: Cores | None) -> Iterator[None]:
    """Run the block with the calling thread alone on ``cores.train`` (a no-op for None).

    Everything else the case runs, including threads and processes started since the last
    sweep, is put on ``cores.rest`` first; the calling thread goes back to the rest after.
    """
    if cores is None:
        yield
        return
    me = threading.get_native_id()
    pin_all(cores, skip=me)
    _set(me, cores.train)
    try:
        yield
    finally:
        _set(me, cores.rest)
