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

Each step's wall time is compared with its own CPU time. A shared VM's core
speed drifts by ±30 % within seconds (measured: one idle thread's step took
2.0-3.5 ms from one 0.3 s window to the next), far more than the 5 % a save
may cost, so a plain "step during ÷ step before" of two different windows
measures the drift: a save that only sleeps scored 0.89-1.30x. What a save
does to the training thread -- GIL waits, waits for a core -- is wall time
the thread spends not running; the ratio of wall to CPU time cancels the
drift (the sleeping save: 0.98-1.01x). The plain ratio is kept as
``train_busy_s / train_idle_s`` for reference.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ckptio.bench.pinning import Cores, training_core

__all__ = ["during", "idle", "lost_s", "slowdown", "slowdown_on_core", "step", "windowed"]

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


def idle(duration_s: float = 0.3, cores: Cores | None = None) -> dict[str, float]:
    """Step times with nothing else running (at least 20 steps), on ``cores.train`` if given.

    Returns ``{"train_idle_s": mean wall time per step, "train_idle_cpu_s": mean CPU time}``.
    """
    times: list[float] = []
    with training_core(cores):
        cpu0, runq0 = time.thread_time(), _runq_s()
        end = time.perf_counter() + duration_s
        while len(times) < 20 or time.perf_counter() < end:
            times.append(_timed_step())
        cpu, runq = time.thread_time() - cpu0, _runq_s() - runq0
    return {"train_idle_s": statistics.fmean(times), "train_idle_cpu_s": cpu / len(times),
            "train_idle_runq_s": runq / len(times)}


def slowdown(sample: dict[str, Any]) -> float | None:
    """A save's "train step ×": wall per CPU second of a step during the save ÷ the same when idle.

    None when the sample has no steps timed during a save (a synchronous save).
    """
    busy, busy_cpu = sample.get("train_busy_s"), sample.get("train_cpu_s")
    idle_wall, idle_cpu = sample.get("train_idle_s"), sample.get("train_idle_cpu_s")
    if not (busy and busy_cpu and idle_wall and idle_cpu):
        return None
    return (busy / busy_cpu) / (idle_wall / idle_cpu)


def slowdown_on_core(sample: dict[str, Any]) -> float | None:
    """:func:`slowdown` with each step's waits for a core taken out, during and idle.

    Under ``--pin`` the case's own threads run on other cores, so what the step thread still
    waits for a core for is other processes' doing (a shared machine's neighbours), not the
    save's: this figure leaves it out and keeps the GIL's waits. Unpinned it would also leave
    out the save's own competition for the core, so read it with ``--pin`` only.
    """
    if slowdown(sample) is None or sample.get("train_runq_s") is None or sample.get("train_idle_runq_s") is None:
        return None
    busy = sample["train_busy_s"] - sample["train_runq_s"]
    idle_wall = sample["train_idle_s"] - sample["train_idle_runq_s"]
    return (busy / sample["train_cpu_s"]) / (idle_wall / sample["train_idle_cpu_s"])


def lost_s(sample: dict[str, Any]) -> float | None:
    """Training-thread time one save cost: steps x (wall - CPU x the idle wall-per-CPU ratio)."""
    if slowdown(sample) is None:
        return None
    per_cpu_idle = sample["train_idle_s"] / sample["train_idle_cpu_s"]
    return sample["train_steps"] * (sample["train_busy_s"] - sample["train_cpu_s"] * per_cpu_idle)


def during(wait: Callable[[], Any], cores: Cores | None = None, window_s: float | None = None,
           on_done: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``wait`` (a save's ``result``) in a thread and training steps here until it returns.

    With ``cores`` (``--pin``) the steps run alone on ``cores.train`` and everything else,
    the waiting thread included, on ``cores.rest`` (see :mod:`ckptio.bench.pinning`).
    ``on_done`` runs in the waiting thread the moment ``wait`` returns (the worker reads its
    clock there, so a window that outlasts the save is not billed to it); keep it to a few
    bytecodes: that thread must win the GIL from the steps for each.

    Returns ``{"train_busy_s": mean step time, "train_cpu_s": its mean CPU time,
    "train_max_s": the longest step, "train_steps": n, "train_blocked_s": ...}``; re-raises what ``wait`` raised. The mean, not
    the median: a step now and then held up for a whole GIL switch interval is exactly the
    cost to see. ``train_blocked_s`` is the mean per step of the time the thread neither ran
    nor waited for a core: waiting for the GIL, mostly. That part is the save's own doing
    even on a loaded host, where the rest of a slowdown is other processes' CPU.

    With ``window_s`` the steps go on until ``window_s`` seconds from the save's start (or its
    end, if later), and the same figures over that whole window come back as
    ``train_window_*``: every case's loss spread over one length of training time, so a save
    that finishes sooner is not scored worse for packing the same loss into less time.
    """
    failure: list[BaseException] = []

    def waiter() -> None:
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            failure.append(e)
        finally:
            if on_done is not None:
                on_done()

    t0 = time.perf_counter()
    thread = threading.Thread(target=waiter, name="bench-save-wait", daemon=True)
    thread.start()  # before the pin: it inherits this thread's (the rest's) cores
    with training_core(cores):
        cpu0, runq0 = time.thread_time(), _runq_s()
        times = [_timed_step()]  # at least one: the step the save's background work started under
        while thread.is_alive():
            times.append(_timed_step())
        saving = _step_figures(times, time.thread_time() - cpu0, _runq_s() - runq0, "train")
        if window_s is not None:
            end = t0 + window_s
            while time.perf_counter() < end:
                times.append(_timed_step())
            window = _step_figures(times, time.thread_time() - cpu0, _runq_s() - runq0, "train_window")
            saving.update(window, train_window_s=time.perf_counter() - t0)
    thread.join()
    if failure:
        raise failure[0]
    return saving


def _step_figures(times: list[float], cpu: float, runq: float, prefix: str) -> dict[str, Any]:
    blocked = max(0.0, sum(times) - cpu - runq) / len(times)
    return {f"{prefix}_busy_s": statistics.fmean(times), f"{prefix}_cpu_s": cpu / len(times),
            f"{prefix}_max_s": max(times), f"{prefix}_steps": len(times), f"{prefix}_blocked_s": blocked,
            f"{prefix}_runq_s": runq / len(times)}


def windowed(sample: Mapping[str, Any]) -> dict[str, Any] | None:
    """``sample`` with its ``train_window_*`` figures in place of the in-save ones (None without
    a window), for :func:`slowdown`, :func:`lost_s` and :func:`slowdown_on_core` to read."""
    if "train_window_busy_s" not in sample:
        return None
    out = dict(sample)
    for k in ("busy_s", "cpu_s", "max_s", "steps", "blocked_s", "runq_s"):
        out[f"train_{k}"] = sample[f"train_window_{k}"]
    return out
