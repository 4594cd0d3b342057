"""Local-disk backend (node-local SSD, or any POSIX file system).

Writes go to a temporary file beside the target with ``pwritev`` from a
thread pool (zero-copy, GIL released), are fsync'd, then renamed into place,
so a reader sees an object whole or not at all. Directory entries are made
durable in :meth:`LocalBackend.sync` (one fsync per touched directory, not
per file). ``create_if_absent`` uses ``link(2)``, which fails atomically if
the name exists. Optional ``O_DIRECT`` bypasses the page cache for the
aligned bulk of each object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import stat as stat_mod
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckptio.backends._direct import mostly_unaligned, read_direct, write_direct
from ckptio.backends._local_config import LocalConfig
from ckptio.backends._posix import (
    TMP_MARK, fsync_dir, preadv_all, pwritev_all, translate_os_errors, unlink_quietly,
)
from ckptio.backends._posix_commit import LOCK_PREFIX, lock_path, rename_exclusive
from ckptio.backends._posix_conditional import TAKEN_MARK, file_version, take_if
from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, Filling, LayoutDefaults, ObjectInfo, Read, check_fill, check_key,
    check_prefix, own_read_into,
)
from ckptio.system.poolshelf import PoolSlot

__all__ = ["TMP_MARK", "LocalBackend", "LocalConfig"]

T = TypeVar("T")

_DIRECT_MIN = 1 << 20
#: Tries to create a temp file while concurrent deletes keep removing its empty directory.
_MKDIR_ATTEMPTS = 20


def _write_buffered(fd: int, buffers: Sequence[memoryview], filling: Filling | None) -> None:
    """``buffers`` through the page cache, once ``filling`` (if any) has every byte in."""
    if filling is not None:
        filling.wait(sum(b.nbytes for b in buffers))
    pwritev_all(fd, buffers, 0)


class LocalBackend(Backend):
    """Objects are files under a root directory; keys are relative paths."""

    def __init__(self, url: str, config: LocalConfig | None = None, **options: Any) -> None:
        self.config = dataclasses.replace(config or LocalConfig(), **options)
        path = url.split("://", 1)[1] if "://" in url else url
        if not path:
            raise ValueError(f"local backend URL {url!r} names no directory")
        self.root = os.path.abspath(path)
        self._url = url
        # Taken on first use (threads started at once, not one per submit inside a burst of reads), again
        # after close(); closing parks them for the next backend (ckptio.system.poolshelf).
        self._pool = PoolSlot("ckptio-posix", self.config.threads, started=True)
        self._write_pool = PoolSlot("ckptio-posix-w", self.config.threads, nice=self.config.write_nice)  # bulk writes
        self._dirty_dirs: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._direct_ok = True
        self.capabilities = self._capabilities()
        self.layout_defaults = self._layout_defaults()

    def _capabilities(self) -> Capabilities:
        return Capabilities(
            durable_on_close=False,  # directory entries need sync(); without fsync nothing is durable
            preferred_io_size=8 << 20,
            alignment=self.config.alignment if self.config.direct else 1,
            concurrency=self.config.threads,
            conditional_delete=True,  # take (rename aside), compare, unlink or put back: _posix_conditional
        )

    def _layout_defaults(self) -> LayoutDefaults:
        cfg = self.config
        return LayoutDefaults(
            object_size=cfg.object_size, dir_fanout=cfg.dir_fanout, tile_bytes=cfg.tile_bytes
        )

    @property
    def url(self) -> str:
        return self._url

    def path(self, key: str) -> str:
        """The file path of ``key`` (validated: it cannot escape the root, not even through a link)."""
        path = os.path.join(self.root, check_key(key))
        self._refuse_links(key)
        return path

    def _refuse_links(self, key: str) -> None:
        """PermissionError if any component of ``key`` below the root is a symbolic link.

        A linked step directory (``ROOT/5 -> /elsewhere/5``) would let a
        retention or gc delete, and a restore read, files outside the root.
        """
        cur = self.root
        for part in key.split("/"):
            cur = os.path.join(cur, part)
            try:
                if stat_mod.S_ISLNK(os.lstat(cur).st_mode):
                    raise PermissionError(
                        f"{self._url}: {key!r} passes through the symbolic link {cur!r}; ckptio never "
                        "follows links below a checkpoint root"
                    )
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing further exists to be a link (a write creates real directories)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool.get(), fn, *args)

    async def _run_write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a bulk write on the lower-priority write threads (reads keep full priority:
        a restore is what the job waits for)."""
        return await asyncio.get_running_loop().run_in_executor(self._write_pool.get(), fn, *args)

    # -- writing ---------------------------------------------------------

    def _mark_dirty(self, directory: str) -> None:
        with self._dirty_lock:
            self._dirty_dirs.add(directory)

    def _makedirs(self, directory: str) -> None:
        if os.path.isdir(directory):
            return
        os.makedirs(directory, exist_ok=True)
        # New directory entries must reach the disk too: mark every ancestor up to the root.
        d = directory
        while len(d) > len(self.root):
            d = os.path.dirname(d)
            self._mark_dirty(d)

    def _write_tmp(self, path: str, buffers: Sequence[memoryview], filling: Filling | None = None) -> str:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f"{TMP_MARK}{uuid.uuid4().hex}")
        for attempt in range(_MKDIR_ATTEMPTS):
            try:
                self._makedirs(directory)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except (FileNotFoundError, FileExistsError) as e:
                # A concurrent delete emptied and removed a directory on our path between
                # makedirs and open, or inside makedirs (whose mkdir then saw it exist, and its
                # isdir check no longer did); it may do so more than once. A file in the way
                # stays an error.
                if attempt == _MKDIR_ATTEMPTS - 1 or (isinstance(e, FileExistsError) and os.path.lexists(directory)
                                                      and not os.path.isdir(directory)):
                    raise
        try:
            if self._use_direct(sum(b.nbytes for b in buffers)) and (  # torch's unaligned memory: page cache
                    self.config.direct_unaligned or not mostly_unaligned(buffers, self.config.alignment)):
                try:
                    self._write_direct(tmp, fd, buffers, filling)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self._direct_ok:
                        raise
                    # This file system refuses O_DIRECT (tmpfs, some FUSE): buffered IO from now on.
                    self._direct_ok = False
                    _write_buffered(fd, buffers, filling)
            else:
                _write_buffered(fd, buffers, filling)
            # The clock's own nanoseconds, not the file system's timestamp tick: a version token
            # (_posix_conditional.file_version) must tell this file from one that reused its inode.
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            if self.config.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _write_direct(self, tmp: str, fd: int, buffers: Sequence[memoryview],
                      filling: Filling | None) -> None:
        """The aligned bulk through an O_DIRECT descriptor (:func:`write_direct`), the final partial block through ``fd``."""
        dfd = os.open(tmp, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            write_direct(dfd, fd, buffers, self.config.alignment, None if filling is None else filling.wait)
        finally:
            os.close(dfd)

    def _write(self, key: str, buffers: Sequence[memoryview], filling: Filling | None = None) -> None:
        path = self.path(key)
        with translate_os_errors(f"{self._url}: writing {key!r}"):
            tmp = self._write_tmp(path, buffers, filling)
            try:
                os.replace(tmp, path)
            except BaseException:
                unlink_quietly(tmp)
                raise
        self._mark_dirty(os.path.dirname(path))

    def _refuse_if_read_only(self, key: str) -> None:
        if self.capabilities.read_only:
            raise PermissionError(self.read_only_message(key))

    def read_only_message(self, key: str) -> str:
        """Why writing ``key`` is refused; flavours explain their own read-only phase."""
        return f"{self._url}: cannot modify {key!r}: the storage is read-only"

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        self._refuse_if_read_only(check_key(key))
        await self._run_write(self._write, key, buffers)

    async def write_filling(self, key: str, buffers: Sequence[memoryview], filling: Filling) -> None:
        """Streams: each request goes out once ``filling`` has its bytes (:func:`write_direct`'s gate)."""
        if "write" in vars(self):  # a write of this instance's own (a test's counter) sees every write
            await super().write_filling(key, buffers, filling)
            return
        self._refuse_if_read_only(check_key(key))
        await self._run_write(self._write, key, buffers, filling)

    def _create_if_absent(self, key: str, data: bytes) -> None:
        path = self.path(key)
        with translate_os_errors(f"{self._url}: creating {key!r}"):
            tmp = self._write_tmp(path, [memoryview(data)])
            try:
                if self.config.link_commit:
                    os.link(tmp, path)  # atomic, and fails if the name exists
                else:
                    rename_exclusive(tmp, path, self.config.lock_stale_s)
            finally:
                unlink_quietly(tmp)
            if self.config.fsync and self.config.dir_fsync:
                fsync_dir(os.path.dirname(path))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        self._refuse_if_read_only(check_key(key))
        await self._run(self._create_if_absent, key, data)

    def _sync(self) -> None:
        with self._dirty_lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        if not (self.config.fsync and self.config.dir_fsync):
            return
        for d in sorted(dirs, key=len, reverse=True):
            with translate_os_errors(f"{self._url}: fsync of directory {d!r}"):
                try:
                    fsync_dir(d)
                except FileNotFoundError:
                    pass  # deleted since: nothing left to make durable

    async def sync(self) -> None:
        await self._run(self._sync)

    # -- reading ---------------------------------------------------------

    def _read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        check_fill(rng, buffers)
        with translate_os_errors(f"{self._url}: reading {key!r}"):
            fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat_mod.S_ISREG(st.st_mode):  # open(2) succeeds on a directory
                    raise FileNotFoundError(f"{self._url}: {key!r} is a directory, not an object")
                size = st.st_size
                if rng.end > size:
                    raise ValueError(
                        f"{self._url}: range [{rng.start}, {rng.end}) of {key!r} runs past its end ({size} bytes)"
                    )
                if self.config.readahead_hint and rng.length >= (1 << 20):
                    os.posix_fadvise(fd, rng.start, rng.length, os.POSIX_FADV_SEQUENTIAL)
                    os.posix_fadvise(fd, rng.start, rng.length, os.POSIX_FADV_WILLNEED)
                if self.config.direct_reads and self._use_direct(rng.length):
                    self._read_direct(key, fd, rng, buffers)
                else:
                    preadv_all(fd, buffers, rng.start)
            except EOFError as e:
                raise ValueError(f"{self._url}: {key!r} shrank while being read: {e}") from e
            finally:
                os.close(fd)

    def _read_direct(self, key: str, fd: int, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        """What :func:`read_direct` can take straight from the device, the rest through the page cache."""
        dfd = os.open(self.path(key), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            read_direct(dfd, fd, rng.start, buffers, self.config.alignment)
        finally:
            os.close(dfd)

    def _use_direct(self, nbytes: int) -> bool:
        """O_DIRECT for bulk IO only (small files gain nothing), and only where the file system takes it."""
        return self.config.direct and self._direct_ok and nbytes >= _DIRECT_MIN

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._run(self._read_into, key, rng, buffers)

    @property  # type: ignore[override]
    def batches_reads(self) -> bool:
        return type(self).read_into is LocalBackend.read_into and not own_read_into(self)

    async def read_many(self, reads: Sequence[Read]) -> None:
        """The reads one after another on one IO thread: a thread hop per batch, not per read (what
        small objects cost, page-cached). A subclass's or an instance's own ``read_into`` is called
        per read instead."""
        if not self.batches_reads:
            await super().read_many(reads)
            return
        await self._run(self._read_all, reads)

    def _read_all(self, reads: Sequence[Read]) -> None:
        for key, rng, buffers in reads:
            self._read_into(key, rng, buffers)

    # -- metadata --------------------------------------------------------

    def _delete(self, key: str) -> None:
        path = self.path(key)
        with translate_os_errors(f"{self._url}: deleting {key!r}"):
            try:
                os.unlink(path)
            except IsADirectoryError:
                raise FileNotFoundError(f"{self._url}: {key!r} is a directory, not an object") from None
        self._after_unlink(path)

    def _delete_if(self, key: str, version: str) -> bool:
        path = self.path(key)
        with translate_os_errors(f"{self._url}: deleting {key!r} if unchanged"):
            cfg = self.config
            if not take_if(path, version, hard_links=cfg.link_commit, dir_fsync=cfg.fsync and cfg.dir_fsync):
                return False
        self._after_unlink(path)
        return True

    def _after_unlink(self, path: str) -> None:
        """What deleting the object at ``path`` leaves to tidy: its commit lock, emptied directories."""
        if not self.config.link_commit:
            unlink_quietly(lock_path(path))
        self._mark_dirty(os.path.dirname(path))
        # Remove directories the deletion emptied, up to (not including) the root.
        d = os.path.dirname(path)
        while len(d) > len(self.root):
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)
            self._mark_dirty(d)

    def _sweep_temporaries(self, older_than_s: float, dry_run: bool) -> list[str]:
        now = time.time()
        out: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if TMP_MARK not in name:
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                # An object taken aside for a conditional delete keeps its own mtime: its age is the take's.
                age = now - (st.st_ctime if name.startswith(TAKEN_MARK) else st.st_mtime)
                if name.startswith(LOCK_PREFIX) and ".stale-" not in name:
                    # A commit lock guards its object for good; without one it is a dead
                    # committer's only once a takeover would also treat it as stale.
                    guarded = os.path.exists(os.path.join(dirpath, name[len(LOCK_PREFIX) :]))
                    if guarded or age < max(older_than_s, self.config.lock_stale_s):
                        continue
                elif age < older_than_s:
                    continue
                out.append(os.path.relpath(path, self.root).replace(os.sep, "/"))
                if not dry_run:
                    unlink_quietly(path)  # nothing to make durable: a lost unlink is redone next time
        return sorted(out)

    async def sweep_temporaries(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        if self.capabilities.read_only:
            return []  # a read-only attachment sweeps nothing; the writer's phase does
        return await self._run(self._sweep_temporaries, older_than_s, dry_run)

    async def delete(self, key: str) -> None:
        self._refuse_if_read_only(check_key(key))
        await self._run(self._delete, key)

    async def delete_if(self, key: str, version: str) -> bool:
        self._refuse_if_read_only(check_key(key))
        return await self._run(self._delete_if, key, version)

    def _stat(self, key: str) -> ObjectInfo:
        path = self.path(key)
        with translate_os_errors(f"{self._url}: stat of {key!r}"):
            st = os.stat(path)
        if not stat_mod.S_ISREG(st.st_mode):
            raise FileNotFoundError(f"{self._url}: {key!r} is a directory, not an object")
        return ObjectInfo(key, st.st_size, st.st_mtime, file_version(st))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._run(self._stat, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        check_prefix(prefix)  # "../" would otherwise walk (and report) the root's parent
        # Walk only the deepest directory that the prefix pins down.
        start = os.path.join(self.root, os.path.dirname(prefix)) if "/" in prefix else self.root
        out: list[ObjectInfo] = []
        if os.path.islink(start) or (start != self.root and self._has_link(start)):
            return []  # never list through a link (os.walk below does not descend into links either)
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in filenames:
                key = rel_dir + name
                if TMP_MARK in name or not key.startswith(prefix):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while listing
                if stat_mod.S_ISREG(st.st_mode):  # links are not objects
                    out.append(ObjectInfo(key, st.st_size, st.st_mtime, file_version(st)))
        out.sort(key=lambda i: i.key)
        return out

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._run(self._list, prefix)

    def _list_children(self, prefix: str) -> list[str]:
        if prefix:  # the whole prefix names a directory here, so all of it must be a valid key
            check_prefix(prefix.rstrip("/") + "/")
        directory = os.path.join(self.root, prefix.strip("/")) if prefix.strip("/") else self.root
        if directory != self.root and self._has_link(directory):
            return []
        try:
            return sorted(e.name for e in os.scandir(directory) if TMP_MARK not in e.name and not e.is_symlink())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _has_link(self, path: str) -> bool:
        try:
            self._refuse_links(os.path.relpath(path, self.root).replace(os.sep, "/"))
        except PermissionError:
            return True
        return False

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self._run(self._list_children, prefix)

    async def close(self) -> None:
        self._pool.release()  # calls in flight finish; parked for the next backend, or shut down
        self._write_pool.release()
