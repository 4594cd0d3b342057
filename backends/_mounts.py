"""Which mount a path lives on, from /proc/self/mountinfo (injectable for tests)."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["MountInfo", "find_mount"]

MOUNTINFO = "/proc/self/mountinfo"


@dataclasses.dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fstype: str
    source: str
    options: frozenset[str]  # per-mount and super-block options together

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def parse_mountinfo(text: str) -> list[MountInfo]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        opts = set(fields[5].split(","))
        if len(tail) >= 3:
            opts |= set(tail[2].split(","))
        mounts.append(MountInfo(_unescape(fields[4]), tail[0], _unescape(tail[1]), frozenset(opts)))
    return mounts


def find_mount(path: str, mountinfo: str = MOUNTINFO) -> MountInfo | None:
    """The mount holding ``path`` (the longest mount point that prefixes it; the last one mounted wins)."""
    try:
        with open(mountinfo) as f:
            mounts = parse_mountinfo(f.read())
    except OSError:
        return None
    path = os.path.realpath(path)
    best: MountInfo | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if path == mp or path.startswith(mp if mp == "/" else mp + "/"):
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best
