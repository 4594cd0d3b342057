"""Worker threads that yield the CPU to the training step.

Measured during a background save on this 2-core host (issue 17; per step of
``bench/train.py``'s ~1.3 ms GIL-bound loop, from /proc/self/task/TID/schedstat):
waiting for the GIL cost the step 20-110 us (numpy state) and 150-390 us (jax
state), but waiting in the run queue -- a save's checksum and copy threads
holding the CPU the step wanted -- cost it 200-1700 us. So most of the step's
slowdown is CPU, not GIL: a writer process would not give it back on a
machine this small. Running the save's CPU-heavy threads at a lower priority
helps the run-queue part: a copy loop beside the step slowed it 1.52x at nice
0, 1.11x at nice 5, not measurably at nice 19. But with whole saves on a host
whose cores other processes kept busy, nice 10 cut the save's throughput
(median ~1.1 -> ~0.75 GiB/s) while the step still ran 1.2x slower (its own
on-CPU time grows too: the two vCPUs share memory bandwidth), so the knobs
(``LocalConfig.write_nice``, ``EngineConfig.save_nice``) default to 0 and are
for hosts with idle cores to spare, where the lowered threads lose nothing.

Only the threads doing bulk work that releases the GIL (pwritev, copies,
crc32c) are lowered; the event-loop thread, which runs Python holding the GIL,
keeps its priority, or a lowered thread could sit on the GIL while preempted
(priority inversion) and stall the very step this protects.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["background_pool", "lower_this_thread", "start_workers"]

log = logging.getLogger(__name__)


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread; elsewhere a no-op).

    Lowering a priority is always permitted; it is never raised back, so this
    is only for threads that do background work for their whole life.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return  # elsewhere PRIO_PROCESS with a thread id may name the whole process
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # a sandbox refusing setpriority: run at normal priority
        log.debug("could not lower the priority of thread %d: %s", tid, e)


def background_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose workers run ``nice`` steps below their creator's priority."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_this_thread, initargs=(nice,))


def start_workers(pool: ThreadPoolExecutor, workers: int) -> ThreadPoolExecutor:
    """Start ``workers`` threads of a fresh ``pool`` now, and return it.

    A ThreadPoolExecutor starts a thread on a submit that finds none idle, and ``Thread.start``
    waits until the new thread runs. Inside a cold restore, with both cores busy faulting
    pages and copying, each of those waits took 5-30 ms -- on the IO loop, before each
    next read could be issued: the reads ramped up over ~100 ms (72-184 ms of thread starts
    per 1 GiB restore, issue 17). Started up front, while nothing else runs, they cost
    ~0.2 ms each. Each start is a task that waits until all have started, so that no
    thread is idle when the next submit looks for one. Only an optimisation: if the threads
    do not all come up in time, the pool is returned as it is and starts the rest on demand.
    """
    gate = threading.Barrier(workers + 1)
    try:
        for _ in range(workers):
            pool.submit(gate.wait, _START_TIMEOUT_S)
        gate.wait(_START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        log.debug("%d worker threads did not all start within %.0f s", workers, _START_TIMEOUT_S)
    finally:
        gate.abort()  # releases any starter still waiting (a no-op once all have passed)
    return pool


_START_TIMEOUT_S = 10.0
