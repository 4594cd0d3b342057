"""CPU time a case spends, counted over every thread and process it runs.

A save's cost is not only its wall time: on a training host the cores it burns are
taken from the data loader and the step's dispatch. So every case reports CPU seconds
(user + system) per GiB saved and restored. The count covers

* the worker process, all threads (``getrusage(RUSAGE_SELF)``);
* its descendants that are alive at either end of the window (ckptio's writer sidecar,
  DCP's checkpoint process, multiprocessing helpers): each one's own user + system time
  (psutil), counted from zero for a process that started inside the window. Those times
  come in clock ticks (10 ms), as much as a writer process spends on a 256 MiB save, so
  where Linux gives each thread's exact run time (``/proc/PID/task/TID/schedstat``, ns)
  a process alive at both ends is counted from that instead, unless a thread of it ended
  inside the window (its time is then only in the ticks: they are used);
* children it reaped inside the window (``RUSAGE_CHILDREN``), minus what such a child had
  already spent when the window opened.

A grandchild that starts and ends inside the window and is reaped by its own parent
(not by the worker) is missed; no case here starts such processes.
"""

from __future__ import annotations

import dataclasses
import os
import resource

__all__ = ["CpuSnapshot", "Usage", "snapshot", "spent"]


@dataclasses.dataclass(frozen=True)
class Usage:
    """One live process's CPU seconds: tick-rounded (psutil), and exact per live thread where known."""

    ticks: float
    threads: dict[int, float] | None = None  # thread id -> seconds run (schedstat); None: not available


@dataclasses.dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: this process, its reaped children, each live descendant by (pid, start)."""

    own: float
    reaped: float
    live: dict[tuple[int, float], Usage]


#: A tick-rounded count may trail or lead the exact one by up to a tick at either end of a window.
_TICK_SLACK = 0.025


def _threads(pid: int) -> dict[int, float] | None:
    """Each live thread's exact run time, in seconds (Linux schedstat); None where not readable."""
    out: dict[int, float] = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return out


def _live() -> dict[tuple[int, float], Usage]:
    try:
        import psutil
    except ImportError:
        return {}
    out: dict[tuple[int, float], Usage] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = Usage(t.user + t.system, _threads(p.pid))
        except psutil.Error:
            pass  # it ended between the listing and the look; RUSAGE_CHILDREN has it if it was ours
    return out


def _between(before: Usage, after: Usage) -> float:
    """What a process alive at both ends spent between them: exact where every thread it had at the
    start is still there (and the ticks agree that no thread came and went), else the ticks."""
    ticks = after.ticks - before.ticks
    if before.threads is None or after.threads is None or not before.threads.keys() <= after.threads.keys():
        return ticks
    exact = sum(after.threads.values()) - sum(before.threads.values())
    return exact if ticks <= exact + _TICK_SLACK else ticks


def snapshot() -> CpuSnapshot:
    """The CPU time spent so far by this process and everything it started."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnapshot(own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, _live())


def spent(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """CPU seconds (user + system) spent between two snapshots, by every thread and process."""
    total = after.own - before.own
    reaped = after.reaped - before.reaped
    for key, usage in after.live.items():
        was = before.live.get(key)
        total += usage.ticks if was is None else _between(was, usage)
    # A child alive at the start and reaped since: RUSAGE_CHILDREN holds its whole life.
    gone = sum(usage.ticks for key, usage in before.live.items() if key not in after.live)
    return total + max(0.0, reaped - gone)
