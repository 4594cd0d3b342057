"""Fill a save's staged objects on the calling thread and helper threads, releasing each object's
write as soon as its own bytes are copied.

The staging copy is the part of a save the training step waits for (its stall), and each object's
write waits for that object's bytes. numpy's copy releases the GIL, so a second thread copying
other arrays at the same time halves both: measured on this 2-core VM under load 18, 256 MiB of
8 MiB arrays copied in 0.026-0.028 s by two threads against 0.039-0.066 s by one.

Work is handed out per staged array, in object order, so the first objects' writes start first. An
array that two objects share (a shard split across objects) is copied once, by one thread; an
object is released by whichever thread copies its last array. Helpers are used only where the
calling thread may run on more than one core (``sched_getaffinity``: a training thread pinned to
one core would only share it with its helper) and the state is large enough to pay a thread start.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["HELPER_MIN_BYTES", "MAX_FILLERS", "fill_objects", "fillers_for", "usable_cores"]

#: At most this many threads copy at once (the caller included): past a few, memory bandwidth,
#: not threads, bounds a copy.
MAX_FILLERS = 4
#: Each thread gets at least this many bytes to copy; below it a helper's start costs more than it saves.
HELPER_MIN_BYTES = 32 << 20


def usable_cores() -> int:
    """The cores the calling thread may run on."""
    try:
        return len(os.sched_getaffinity(0))  # the calling thread's own cores
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fillers_for(nbytes: int) -> int:
    """How many threads (the caller included) should copy ``nbytes`` of staged state."""
    return max(1, min(MAX_FILLERS, usable_cores(), nbytes // HELPER_MIN_BYTES))


def fill_objects(
    fill: Callable[[np.ndarray], None],
    objects: Sequence[Sequence[Hashable]],
    arrays: Mapping[Hashable, np.ndarray],
    ready: Sequence[concurrent.futures.Future[None]],
    threads: int,
) -> None:
    """Copy every staged array of ``objects`` (each a list of keys into ``arrays``) with ``fill``,
    and resolve ``ready[i]`` once all of object ``i``'s arrays are copied.

    Runs on the calling thread plus ``threads - 1`` helpers, and returns once every copy is done
    (or raises the first copy's error, after every helper has stopped: no future is resolved
    after this returns or raises). A future already done (a failed write cancelled it) is left.
    """
    order: list[Hashable] = []  # each array once, in the order objects need them
    left = [0] * len(objects)  # per object: its arrays not yet copied
    holders: dict[Hashable, list[int]] = {}  # array -> the objects it is in
    for i, keys in enumerate(objects):
        for k in keys:
            if k not in holders:
                holders[k] = []
                order.append(k)
            if i not in holders[k]:
                holders[k].append(i)
                left[i] += 1
    for i, n in enumerate(left):
        if n == 0:
            _release(ready[i])  # nothing to copy: its bytes are already there
    lock = threading.Lock()
    nxt = [0]
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if errors or nxt[0] >= len(order):
                    return
                k = order[nxt[0]]
                nxt[0] += 1
            try:
                fill(arrays[k])
            except BaseException as e:
                with lock:
                    errors.append(e)
                return
            with lock:
                done = [i for i in holders[k] if _count_down(left, i)]
            for i in done:
                _release(ready[i])

    helpers = [threading.Thread(target=_guarded, args=(work, errors, lock), name="ckptio-stage", daemon=True)
               for _ in range(max(0, min(threads, len(order)) - 1))]
    try:
        for t in helpers:
            t.start()
        work()
    finally:
        for t in helpers:
            if t.ident is not None:
                t.join()
    if errors:
        raise errors[0]


def _count_down(left: list[int], i: int) -> bool:
    left[i] -= 1
    return left[i] == 0


def _release(fut: concurrent.futures.Future[None]) -> None:
    if not fut.done():
        try:
            fut.set_result(None)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile by a failed write
            pass


def _guarded(work: Callable[[], None], errors: list[BaseException], lock: Any) -> None:
    """A helper's body: an error outside ``work``'s own copies still reaches the caller."""
    try:
        work()
    except BaseException as e:  # pragma: no cover - work() records its own copy errors
        with lock:
            errors.append(e)
