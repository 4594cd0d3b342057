"""The conditional delete on POSIX file systems (local SSD, Hyperdisk ML, Parallelstore over dfuse).

POSIX has no "unlink if unchanged". So the object is compared with the version the caller read
(an lstat: another version standing there is left alone, untouched), then *taken*: renamed,
atomically, to a private temp-marked name beside it (listings skip it). Whatever stood under the
name at that instant is now ours alone, and is compared again with that version
(:func:`file_version`: inode, size and mtime in ns; a rename keeps all three, and a file created
at the name since has another inode or, if the inode number was reused, another mtime). It is
unlinked if it matches; if not, it is put back under its name, never over another object
(``link(2)``, or ``renameat2(RENAME_NOREPLACE)`` where hard links are missing), and the caller
learns that another version stands.

What others see meanwhile. When the versions match, the object vanishes a moment early: it was
being deleted. A newer object that stood there before the first compare is never touched. Only
one that replaced the judged object between the first compare and the take (microseconds) is
taken, and it is then absent from its name for the few system calls until the put-back (an
lstat, a link): a reader then finds nothing there and a concurrent creator of that very name may
win. ckptio deletes a manifest this way only after its tombstone and revocations, so
the creator would have to be a second commit of the same step racing inside those microseconds;
if one does, the object taken is left beside it under its private name and the error is logged.
A process killed inside that window, or paused there for longer than gc's grace, leaves the newer
object under the private name, which the sweep of temporaries removes once the grace has passed
since the take (its ctime; the mtime is the object's own): what remains of the window on POSIX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import stat as stat_mod
import uuid

from ckptio.backends._posix import TMP_MARK, fsync_dir

__all__ = ["TAKEN_MARK", "file_version", "take_if"]

log = logging.getLogger("ckptio.backends.local")

#: Names of objects taken for a conditional delete (temporaries: listings skip them).
TAKEN_MARK = f"{TMP_MARK}taken."
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def file_version(st: os.stat_result) -> str:
    """The version token of a file: what a rename keeps and a new file at the name does not."""
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


def take_if(path: str, version: str, *, hard_links: bool, dir_fsync: bool) -> bool:
    """Delete the file at ``path`` if it is still ``version``; False (and it stays) if not.

    FileNotFoundError if nothing (or a directory) is there; OSErrors are the caller's to translate.
    """
    st = os.lstat(path)
    if stat_mod.S_ISDIR(st.st_mode):
        raise FileNotFoundError(errno.ENOENT, "a directory, not an object", path)
    if file_version(st) != version:
        return False  # another version stands: it is never touched (the common case of a mismatch)
    aside = os.path.join(os.path.dirname(path), f"{TAKEN_MARK}{uuid.uuid4().hex}")
    os.rename(path, aside)  # atomic: what stood there at this instant is now ours alone
    if file_version(os.lstat(aside)) == version:
        os.unlink(aside)
        return True
    _put_back(aside, path, hard_links)
    if dir_fsync:
        fsync_dir(os.path.dirname(path))
    return False


def _put_back(aside: str, path: str, hard_links: bool) -> None:
    """Return the object taken to ``aside`` to ``path``, never over an object created there since."""
    try:
        if hard_links:
            os.link(aside, path)
            os.unlink(aside)
        else:
            _rename_noreplace(aside, path)
    except FileExistsError:
        log.error("%s: another object was created there while the one standing there was set aside "
                  "for a conditional delete; that one is kept as %s", path, aside)


def _rename_noreplace(src: str, dst: str) -> None:
    """``rename(src, dst)`` that fails with FileExistsError if ``dst`` exists.

    ``renameat2(RENAME_NOREPLACE)`` where libc and the file system have it; else a check, then a
    rename (a creator landing between the two would be replaced: logged as the rest is).
    """
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), src)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", dst)
    os.rename(src, dst)


@functools.lru_cache(maxsize=1)
def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``renameat2``, or None where there is none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
