"""CPU time a case spends, counted over every thread and process it runs.

A save's cost is not only its wall time: on a training host the cores it burns are
taken from the data loader and the step's dispatch. So every case reports CPU seconds
(user + system) per GiB saved and restored. The count covers

* the worker process, all threads (``getrusage(RUSAGE_SELF)``);
* its descendants that are alive at either end of the window (ckptio's writer sidecar,
  DCP's checkpoint process, multiprocessing helpers): each one's own user + system time
  (psutil), counted from zero for a process that started inside the window;
* children it reaped inside the window (``RUSAGE_CHILDREN``), minus what such a child had
  already spent when the window opened.

A grandchild that starts and ends inside the window and is reaped by its own parent
(not by the worker) is missed; no case here starts such processes.
"""

from __future__ import annotations

import dataclasses
import resource

__all__ = ["CpuSnapshot", "snapshot", "spent"]


@dataclasses.dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: this process, its reaped children, each live descendant by (pid, start)."""

    own: float
    reaped: float
    live: dict[tuple[int, float], float]


def _live() -> dict[tuple[int, float], float]:
    try:
        import psutil
    except ImportError:
        return {}
    out: dict[tuple[int, float], float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            pass  # it ended between the listing and the look; RUSAGE_CHILDREN has it if it was ours
    return out


def snapshot() -> CpuSnapshot:
    """The CPU time spent so far by this process and everything it started."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnapshot(own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, _live())


def spent(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """CPU seconds (user + system) spent between two snapshots, by every thread and process."""
    total = after.own - before.own
    reaped = after.reaped - before.reaped
    for key, cpu in after.live.items():
        total += cpu - before.live.get(key, 0.0)
    # A child alive at the start and reaped since: RUSAGE_CHILDREN holds its whole life.
    gone = sum(cpu for key, cpu in before.live.items() if key not in after.live)
    return total + max(0.0, reaped - gone)
