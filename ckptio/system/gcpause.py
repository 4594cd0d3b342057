"""Python's cyclic garbage collector held off during ckptio's bookkeeping bursts.

A state of 100k leaves makes a save or restore allocate a few hundred thousand
small containers (records, tuples, requests) in a burst, and each burst sets
off full collections that walk every tracked object in the process -- the
trainer's too: measured at about half of the time of a 100k-leaf save, stall
and restore on this machine. Nothing ckptio builds is cyclic garbage, so
holding collections off for the burst loses nothing; they resume (and catch
up) as soon as the outermost pause ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused"]

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold off automatic collections while inside (nestable, thread-safe).

    Collections resume when the last pause in the process ends, and only if
    they were enabled when the first one began (a caller's own ``gc.disable()``
    is respected).
    """
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
