"""Whether another process could take a POSIX record lock (``lockf``) on a file now: this process's
own lockf is invisible to itself, so the question goes to a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["locked_elsewhere"]

_PROBE = ("import fcntl, sys\n"
          "try:\n"
          "    fcntl.lockf(int(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
          "    print('free')\n"
          "except OSError:\n"
          "    print('held')\n")


def locked_elsewhere(fd: int) -> bool:
    """True if a process other than the caller's children holds a lockf on the file behind ``fd``
    (the caller itself, typically), so that a new process cannot take it."""
    probe = subprocess.run([sys.executable, "-c", _PROBE, str(fd)], pass_fds=[fd], capture_output=True,
                           text=True, check=True, timeout=120)
    return probe.stdout.strip() == "held"
