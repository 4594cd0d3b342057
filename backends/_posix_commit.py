"""The commit without hard links (Parallelstore's DFS has none): an O_EXCL lock file, then a rename.

Whoever creates the lock file renames its object into place; the lock stays beside the object
(so a later creator fails too) until the object is deleted. A lock whose committer died between
lock and rename is taken over once it is older than ``LocalConfig.lock_stale_s``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid

from ckptio.backends._posix import TMP_MARK, unlink_quietly

__all__ = ["LOCK_PREFIX", "lock_path", "rename_exclusive", "take_over_stale_lock"]

log = logging.getLogger("ckptio.backends.local")

EXCL_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
#: Lock files carry the temporary mark, so listings skip them.
LOCK_PREFIX = f"{TMP_MARK}lock."


def lock_path(path: str) -> str:
    """The lock file of a lock-and-rename commit; a temp-marked name, so listings skip it."""
    return os.path.join(os.path.dirname(path), LOCK_PREFIX + os.path.basename(path))


def age_s(path: str) -> float:
    """Seconds since ``path`` was last modified."""
    return time.time() - os.stat(path).st_mtime


def rename_exclusive(tmp: str, path: str, stale_s: float) -> None:
    """No-replace rename without hard links: whoever creates the lock file (O_EXCL) renames.

    The lock stays after the rename, so a later creator fails too; delete() removes it
    with the object. A lock without an object that is older than ``stale_s`` (``LocalConfig.lock_stale_s``) was
    left by a committer that died between its lock and its rename: it is taken over,
    else that key could never be committed again. (What this cannot exclude: a
    committer stalled for longer than ``lock_stale_s`` inside that window.)
    """
    lock = lock_path(path)
    try:
        fd = os.open(lock, EXCL_CREATE, 0o644)
    except FileExistsError:
        if os.path.exists(path) or not take_over_stale_lock(lock, stale_s):
            raise
        fd = os.open(lock, EXCL_CREATE, 0o644)  # FileExistsError: another taker was first
    os.close(fd)
    if os.path.exists(path):
        raise FileExistsError(errno.EEXIST, "exists", path)
    os.rename(tmp, path)

def take_over_stale_lock(lock: str, stale_s: float) -> bool:
    """Move a dead committer's lock aside; False if it is recent (someone may be committing)."""
    try:
        if age_s(lock) < stale_s:
            return False
    except FileNotFoundError:
        return True  # gone meanwhile: O_EXCL decides who commits
    aside = f"{lock}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(lock, aside)  # atomic: of several takers, one moves it
    except FileNotFoundError:
        return True
    try:
        # Another taker may have moved the stale lock and made a fresh one between our
        # stat and our rename: then we moved a live lock, and we must not commit.
        live = age_s(aside) < stale_s
    finally:
        unlink_quietly(aside)
    if live:
        raise FileExistsError(errno.EEXIST, "another committer holds the commit lock", lock)
    log.warning("%s: took over a commit lock older than %.0f s (its committer died)",
                lock, stale_s)
    return True
