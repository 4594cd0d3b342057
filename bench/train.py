"""A stand-in for a training loop's host thread, to measure what a background save costs it.

On an accelerator the training step runs on the device; the host thread that
shares the process with the checkpoint library dispatches it: Python
bytecode that needs the GIL (tracing caches, pytree flattening, data-loader
bookkeeping). A save that holds the GIL while it copies, hashes or encodes
-- or that keeps every core busy -- makes that thread late, and a late
dispatch is an idle accelerator. :func:`step` is such a thread's work in
miniature (pure Python, ~1 ms); ``ckptio bench --train`` times it with the
process otherwise idle and again while each asynchronous save finishes in
the background, and reports the ratio ("train step ×": 1.0 = unaffected).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["during", "idle_step_s", "step"]

_STEP_ITERS = 20_000  # ~1 ms of bytecode on a current x86 core


def step() -> int:
    """One host-side training step: GIL-bound Python work of fixed size."""
    acc = 0
    for i in range(_STEP_ITERS):
        acc ^= i * 2654435761 & 0xFFFF
    return acc


def _runq_s() -> float:
    """Seconds this thread has waited for a core so far (Linux schedstat; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _timed_step() -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def idle_step_s(duration_s: float = 0.3) -> float:
    """Mean step time with nothing else running (at least 20 steps)."""
    times: list[float] = []
    end = time.perf_counter() + duration_s
    while len(times) < 20 or time.perf_counter() < end:
        times.append(_timed_step())
    return statistics.fmean(times)


def during(wait: Callable[[], Any]) -> dict[str, Any]:
    """Run ``wait`` (a save's ``result``) in a thread and training steps here until it returns.

    Returns ``{"train_busy_s": mean step time, "train_max_s": the longest step,
    "train_steps": n, "train_blocked_s": ...}``; re-raises what ``wait`` raised. The mean, not
    the median: a step now and then held up for a whole GIL switch interval is exactly the
    cost to see. ``train_blocked_s`` is the mean per step of the time the thread neither ran
    nor waited for a core: waiting for the GIL, mostly. That part is the save's own doing
    even on a loaded host, where the rest of a slowdown is other processes' CPU.
    """
    failure: list[BaseException] = []

    def waiter() -> None:
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failure.append(e)

    thread = threading.Thread(target=waiter, name="bench-save-wait", daemon=True)
    thread.start()
    cpu0, runq0 = time.thread_time(), _runq_s()
    times = [_timed_step()]  # at least one: the step the save's background work started under
    while thread.is_alive():
        times.append(_timed_step())
    cpu, runq = time.thread_time() - cpu0, _runq_s() - runq0
    thread.join()
    if failure:
        raise failure[0]
    blocked = max(0.0, sum(times) - cpu - runq) / len(times)
    return {"train_busy_s": statistics.fmean(times), "train_max_s": max(times), "train_steps": len(times),
            "train_blocked_s": blocked}
