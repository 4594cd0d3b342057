"""Parallelstore: DAOS through dfuse, a POSIX parallel file system.

Why these defaults:

* Large IO (objects of 256 MiB) and many files in flight (16 threads):
  DAOS spreads each file over many targets and rewards bandwidth-sized
  requests; many small files are the classic parallel-FS slowdown.
* Few metadata operations: objects are packed, and a checkpoint's files go
  into ``dir_fanout`` sub-directories so no single directory serialises
  creates.
* fsync policy: files are fsync'd (dfuse may cache writes on the client),
  but directories are not -- dfuse forwards metadata operations to DAOS
  synchronously, so a directory fsync only costs a round trip.
* No hard links in DFS (and dfuse refuses ``RENAME_NOREPLACE``): the commit is
  an O_EXCL lock file plus rename. A lock left without its object by a
  committer that died in between is taken over after ``lock_stale_s``.
* The kernel FUSE path costs a context switch per request; the DAOS
  interception libraries (``libioil`` for read/write, ``libpil4dfs`` for
  metadata too) bypass it when preloaded. :meth:`ParallelstoreBackend.diagnostics`
  reports which is active, and a warning says how to enable it when none is.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ckptio.backends._mounts import MOUNTINFO, MountInfo, find_mount
from ckptio.backends.local import LocalBackend, LocalConfig

__all__ = ["ParallelstoreBackend", "interception_library", "is_dfuse"]

log = logging.getLogger("ckptio.backends.parallelstore")

# dfuse's O_DIRECT semantics depend on its caching mode; large buffered IO is the documented path.
PARALLELSTORE_DEFAULTS = LocalConfig(threads=16, object_size=256 << 20, dir_fsync=False, link_commit=False,
                                     dir_fanout=16, direct=False, tile_bytes=1 << 20)
_INTERCEPTION = ("libpil4dfs", "libioil")


def is_dfuse(mount: MountInfo | None) -> bool:
    return mount is not None and (mount.fstype.startswith("fuse.dfuse") or mount.fstype == "fuse.daos"
                                  or mount.source.startswith("dfuse"))


def interception_library(environ: dict[str, str] | None = None) -> str | None:
    """Which DAOS interception library LD_PRELOAD activates, if any."""
    preload = (environ if environ is not None else os.environ).get("LD_PRELOAD", "")
    for lib in _INTERCEPTION:
        if lib in preload:
            return lib
    return None


class ParallelstoreBackend(LocalBackend):
    """``pstore:///mnt/parallelstore/run1``: the local backend tuned for dfuse."""

    def __init__(
        self,
        url: str,
        config: LocalConfig | None = None,
        *,
        mountinfo: str = MOUNTINFO,
        environ: dict[str, str] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, config or PARALLELSTORE_DEFAULTS, **options)
        self.mount = find_mount(self.root, mountinfo)
        self._environ = environ
        diag = self.diagnostics()
        if diag["dfuse"] and diag["interception"] is None:
            log.warning("%s: %s", self.url, diag["hint"])

    def diagnostics(self) -> dict[str, Any]:
        """Whether the root is on dfuse, which interception library is preloaded, and a hint."""
        dfuse = is_dfuse(self.mount)
        lib = interception_library(self._environ)
        hint = None
        if dfuse and lib is None:
            hint = ("no DAOS interception library is preloaded: IO goes through the kernel FUSE path. "
                    "Set LD_PRELOAD=/usr/lib64/libpil4dfs.so (or libioil.so) for the training process.")
        elif not dfuse:
            hint = "this path is not on a dfuse mount: Parallelstore defaults apply but no DAOS is involved"
        return {"dfuse": dfuse, "mount_point": self.mount.mount_point if self.mount else None,
                "fstype": self.mount.fstype if self.mount else None, "interception": lib, "hint": hint}
