"""A shorter interpreter switch interval while a save's background work runs.

Why: a background save's commit is a chain of short steps -- ~90 system calls that release the
GIL (listing the step directory, ``lstat`` per path component, ``fsync``) and ~25 hops between
the save's thread, the IO loop and its executor. Each step must take the GIL back before it goes
on. Beside a training step that holds the GIL for milliseconds at a time, it gets it only when
the interpreter forces a hand-over, every switch interval (``sys.getswitchinterval()``, 5 ms by
default): ~110 waits of ~5 ms, half a second of a 2 s pinned 1 GiB save, spent neither on the
CPU nor on the disk. At 0.5 ms the same commit takes 26-39 ms instead of 0.5-0.6 s, and the step
loses less per save, not more (issue 35's notes have the runs).

The interval is one setting for the whole process, so ckptio changes it only while one of its
saves runs in the background (:func:`shortened`), never lengthens it, and puts back the value it
found when the last such save ends -- unless somebody else changed it meanwhile, whose value then
stands; a process forked meanwhile starts with the value found. ``SaveOptions.gil_switch_s``
(else the ``CKPTIO_GIL_SWITCH_S`` environment variable) sets it; ``0`` turns it off.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator

__all__ = ["DEFAULT_S", "ENV", "interval_for", "shortened"]

ENV = "CKPTIO_GIL_SWITCH_S"
#: The interval a save's background work runs under when nothing names one (seconds).
DEFAULT_S = 0.0005


def interval_for(value: float | None, source: str = "gil_switch_s") -> float | None:
    """The switch interval asked for while a save runs, in seconds; None: leave it.

    ``value`` (named ``source`` in errors: ``SaveOptions.gil_switch_s``) first, else
    ``CKPTIO_GIL_SWITCH_S``, else :data:`DEFAULT_S`; ``0`` means leave the interval alone.
    ValueError names the setting for a value that is not a number of seconds >= 0.
    """
    if value is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_S
        source, value = ENV, raw
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r}: the switch interval must be a number of seconds (0: leave it)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{source}={value!r}: the switch interval must be a finite number of seconds >= 0")
    return seconds or None


_lock = threading.Lock()
_holders = 0
#: While any save holds the interval: the value found before the first one (to put back), and
#: the value ckptio set (None: it set none, the process's was already as short).
_found: float | None = None
_set: float | None = None


def _after_fork_in_child() -> None:
    """A child forked while a save ran has no save thread to put the interval back: do it now."""
    global _lock, _holders, _found, _set
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _holders and _set is not None and _found is not None and sys.getswitchinterval() == _set:
        sys.setswitchinterval(_found)
    _holders, _found, _set = 0, None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def shortened(seconds: float | None) -> Iterator[None]:
    """Run the block with the process's switch interval at most ``seconds`` (None: untouched).

    Saves may overlap (a manager's save and a DCP save, two stores): the first shortens, the last
    puts back what the first found, and the shortest asked for stands meanwhile. A value somebody
    else set while a save ran is left as they set it.
    """
    global _holders, _found, _set
    if seconds is None:
        yield
        return
    with _lock:
        current = sys.getswitchinterval()
        if _holders == 0:
            _found, _set = current, None
        if seconds < current and (_holders == 0 or _set is None or current == _set):
            sys.setswitchinterval(seconds)
            _set = sys.getswitchinterval()  # as the interpreter rounds it
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                if _set is not None and _found is not None and sys.getswitchinterval() == _set:
                    sys.setswitchinterval(_found)
                _found = _set = None
