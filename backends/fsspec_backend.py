"""Any fsspec filesystem as a backend (``fsspec+<protocol>://<root>``): S3, Azure, ... through one adapter.

When to use it
--------------
For object stores ckptio has no native backend for: ``fsspec+s3://bucket/prefix``
(s3fs), ``fsspec+az://container/prefix`` (adlfs), and whatever else has an
fsspec implementation installed. The native backends stay the first choice
where they exist (``gs://``, local paths, ``mem://``): ckptio's GCS backend
uploads from the caller's buffers and streams reads straight into them, while
fsspec's API takes and returns whole ``bytes``, so this adapter

* joins a write's buffers into one ``bytes`` object first (one copy:
  ``pipe_file`` takes bytes, and a single-buffer write of an immutable
  ``bytes`` object is passed as is), and
* copies every ranged read from the ``bytes`` that ``cat_file`` returns into
  the destination buffers (one copy);

and the filesystems retry internally (gcsfs, s3fs), under the engine's own
retries. The ``fsspec+`` prefix keeps a plain ``gs://`` URL on the native
backend: ``fsspec+gs://`` is there to compare the two, not to replace one.

How it drives fsspec
--------------------
* Filesystems with an async implementation (``fs.async_impl``: gcsfs, s3fs,
  adlfs) are called through their coroutines (``_pipe_file``, ``_cat_file``,
  ...). Their HTTP sessions are bound to an event loop, so there is one
  filesystem instance per running loop (``asynchronous=True, loop=...,
  skip_instance_cache=True``), made on first use and closed when its loop
  shuts down or :meth:`FsspecBackend.close` is called. Sync filesystems
  (memory, local) are called in worker threads (``asyncio.to_thread``).
* Listing caches are off (``use_listings_cache=False``) unless the caller's
  ``storage_options`` say otherwise: a cached listing would hide another
  host's writes, and the commit protocol reads what others wrote.
* The commit primitive: ``pipe_file(..., mode="create")``. Where that is a
  real server-side conditional create -- gcsfs (``ifGenerationMatch=0``),
  s3fs (``If-None-Match: *``, S3 since 2024), and the process-local memory
  filesystem (under a process-wide lock) -- ``capabilities.conditional_create``
  is True. Elsewhere the backend checks, then writes (still with
  ``mode="create"`` if the filesystem takes it), declares
  ``conditional_create=False``, and two committers racing in the gap between
  the check and the write can both "win": the later one silently replaces
  the earlier marker. An S3-compatible store that ignores ``If-None-Match``
  needs ``conditional_create=False`` in the config for the same fallback.
* The conditional delete (``delete_if``): S3 only, where DeleteObject takes ``If-Match: <ETag>``
  (general purpose buckets, since 2024; s3fs's ``rm_file`` does not pass it, so the backend calls
  s3fs's ``_call_s3`` itself). The version is the ETag, a digest of the bytes: two stores of the
  same bytes are not told apart, which a deleter that judged those bytes does not need. An
  S3-compatible store that ignores ``If-Match`` on DELETE needs ``conditional_delete=False``.
  Other protocols declare no conditional delete.
* Reading past the end raises ValueError: fsspec clips a range at the end of
  the object without saying so, so the length that came back is checked.
* Deleting checks that the object exists first: S3's DELETE succeeds on a
  missing key, and the contract wants FileNotFoundError.
* Errors are translated once, in :func:`translate_error` (:mod:`._fsspec_clients`), into the builtins
  of the contract or :class:`RetryableError`, with the URL and key named.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from ckptio.backends._fsspec_clients import close_filesystem, http_status, translate_error
from ckptio.backends._perloop import PerLoop
from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, LayoutDefaults, ObjectInfo, RetryableError, check_fill, check_key,
    check_prefix,
)
from ckptio.system.bytes import scatter_bytes

__all__ = ["FsspecBackend", "FsspecConfig", "translate_error"]

SCHEME_PREFIX = "fsspec+"


@dataclasses.dataclass(frozen=True)
class FsspecConfig:
    """Options of the fsspec backend (picklable if ``storage_options`` is)."""

    #: Keyword arguments of the filesystem's constructor (credentials, ``endpoint_url``, ...).
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    #: Target object size for the layout.
    object_size: int = 64 << 20
    preferred_io_size: int = 16 << 20
    #: Requests in flight (the engine's concurrency); s3fs's connection pool holds 10 unless
    #: ``storage_options={"config_kwargs": {"max_pool_connections": N}}`` says more.
    concurrency: int = 16
    #: None: from what is known of the protocol (see the module docstring); False forces check-then-write.
    conditional_create: bool | None = None
    #: None: from the protocol (S3: DeleteObject with If-Match); False declares no conditional delete.
    conditional_delete: bool | None = None
    #: Object names start with a hashed component; None: True except for local files.
    hashed_names: bool | None = None

    def __post_init__(self) -> None:
        # A private copy: the dataclass is frozen, the caller's dict is not.
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        managed = {"asynchronous", "loop", "skip_instance_cache"} & set(self.storage_options)
        if managed:
            raise ValueError(f"storage_options may not set {sorted(managed)}: the backend manages them")
        if self.object_size <= 0 or self.preferred_io_size <= 0 or self.concurrency <= 0:
            raise ValueError("object_size, preferred_io_size and concurrency must be positive")


@dataclasses.dataclass(frozen=True)
class _Traits:
    """What ckptio knows of one fsspec protocol; declared here, not probed by failure."""

    #: ``pipe_file(mode="create")`` is an atomic conditional create on the server.
    atomic_create: bool = False
    #: Whole-object PUTs (a reader sees the old or the new object) and durable once acknowledged.
    object_store: bool = True
    #: The storage lives in this process: a process-wide lock makes check-then-write atomic.
    process_local: bool = False
    #: DeleteObject takes ``If-Match: <ETag>`` through s3fs's ``_call_s3`` (the conditional delete).
    etag_delete: bool = False
    #: Constructor options the backend needs unless the caller's ``storage_options`` say otherwise.
    defaults: tuple[tuple[str, Any], ...] = ()


_OBJECT_STORE_CREATE = _Traits(atomic_create=True)
_S3 = _Traits(atomic_create=True, etag_delete=True)
_LOCAL = _Traits(object_store=False, defaults=(("auto_mkdir", True),))
_TRAITS: dict[str, _Traits] = {
    "gs": _OBJECT_STORE_CREATE,  # gcsfs: ifGenerationMatch=0
    "gcs": _OBJECT_STORE_CREATE,
    "s3": _S3,  # s3fs: If-None-Match: * (put and complete-multipart); If-Match on DeleteObject
    "s3a": _S3,
    "memory": _Traits(atomic_create=True, process_local=True),
    # Local files: written in place (no temp + rename), no fsync through fsspec; parents made on write.
    "file": _LOCAL,
    "local": _LOCAL,
}
#: Unknown protocols are taken for object stores without a known conditional create.
_UNKNOWN = _Traits()

#: Serialises create-if-absent (and writes) on process-local filesystems.
_PROCESS_LOCK = threading.Lock()


def split_fsspec_url(url: str) -> tuple[str, str]:
    """``"fsspec+s3://b/p/"`` -> ``("s3", "b/p")``; ValueError for anything else."""
    scheme, sep, rest = url.partition("://")
    protocol = scheme.lower().removeprefix(SCHEME_PREFIX)
    if not sep or not scheme.lower().startswith(SCHEME_PREFIX) or not protocol or "::" in protocol:
        raise ValueError(f"fsspec backend URL must look like fsspec+<protocol>://<root>, got {url!r}")
    rest = rest.rstrip("/")
    if not rest.strip("/"):
        raise ValueError(f"fsspec URL {url!r} names no root (a bucket, a directory)")
    return protocol, rest


def _filesystem_class(protocol: str, url: str) -> type[Any]:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ImportError(f"{url}: the fsspec backend needs fsspec (pip install 'ckptio[fsspec]')") from e
    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ImportError(f"{url}: fsspec protocol {protocol!r} needs a package: {e}") from e
    except ValueError as e:
        raise ValueError(f"{url}: {e}") from e


def _takes(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` has an explicit parameter ``name`` (``**kwargs`` does not count)."""
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


class FsspecBackend(Backend):
    """Objects under a root path of one fsspec filesystem; keys are paths relative to the root."""

    def __init__(self, url: str = "", config: FsspecConfig | None = None, **options: Any) -> None:
        self.config = dataclasses.replace(config or FsspecConfig(), **options)
        self.protocol, rest = split_fsspec_url(url)
        self._url = f"{SCHEME_PREFIX}{self.protocol}://{rest}"
        self._fs_class = _filesystem_class(self.protocol, self._url)
        self._root = self._fs_class._strip_protocol(f"{self.protocol}://{rest}").rstrip("/")
        if not self._root.strip("/"):
            raise ValueError(f"fsspec URL {url!r} names no root (a bucket, a directory)")
        self._async = bool(getattr(self._fs_class, "async_impl", False))
        cfg = self.config
        traits = _TRAITS.get(self.protocol, _UNKNOWN)
        self._process_local = traits.process_local
        self._fs_defaults = dict(traits.defaults)
        # Method names are the sync API's; the async API prefixes them with "_".
        self._pipe_takes_mode = _takes(self._method_of_class("pipe_file"), "mode")
        self._find_takes_prefix = _takes(self._method_of_class("find"), "prefix")
        atomic = traits.atomic_create and (self._pipe_takes_mode or traits.process_local)
        if cfg.conditional_create is not None:
            atomic = atomic and cfg.conditional_create  # a config may only give the guarantee up
        self._atomic_create = atomic
        self._etag_delete = traits.etag_delete and self._async and cfg.conditional_delete is not False
        self._filesystems = PerLoop(self._new_filesystem, close_filesystem) if self._async else None
        self._sync_fs: Any = None
        self._sync_fs_lock = threading.Lock()
        self.capabilities = Capabilities(
            atomic_write=traits.object_store,
            conditional_create=atomic,
            durable_on_close=traits.object_store,
            preferred_io_size=cfg.preferred_io_size,
            concurrency=cfg.concurrency,
            list_consistent=True,  # S3 (since 2020), GCS, Azure: strong read-after-write and list
            process_local=traits.process_local,
            conditional_delete=self._etag_delete,
        )
        self.layout_defaults = LayoutDefaults(
            object_size=cfg.object_size,
            hashed_names=traits.object_store if cfg.hashed_names is None else cfg.hashed_names,
            tile_bytes=(1 << 20) if traits.object_store else 0,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Filesystems and their sessions do not travel: another process makes its own.
        return (type(self), (self._url, self.config))

    @property
    def url(self) -> str:
        return self._url

    # -- the filesystem and the one call path --------------------------------------

    def _method_of_class(self, name: str) -> Callable[..., Any]:
        cls = self._fs_class
        return getattr(cls, "_" + name) if self._async else getattr(cls, name)

    def _new_filesystem(self, loop: asyncio.AbstractEventLoop | None) -> Any:
        options = {"use_listings_cache": False, **self._fs_defaults, **self.config.storage_options}
        if loop is not None:
            return self._fs_class(asynchronous=True, loop=loop, skip_instance_cache=True, **options)
        return self._fs_class(skip_instance_cache=True, **options)

    async def _filesystem(self) -> Any:
        if self._filesystems is not None:
            return await self._filesystems.get()
        if self._sync_fs is None:
            with self._sync_fs_lock:
                if self._sync_fs is None:
                    self._sync_fs = self._new_filesystem(None)
        return self._sync_fs

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``: the coroutine ``_<name>`` of an async filesystem, else in a thread."""
        fs = await self._filesystem()
        if self._async:
            return await getattr(fs, "_" + name)(*args, **kwargs)
        return await asyncio.to_thread(getattr(fs, name), *args, **kwargs)

    @contextlib.asynccontextmanager
    async def _translating(self, what: str) -> AsyncIterator[None]:
        try:
            yield
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:
            translated = translate_error(e, what)
            if translated is e:
                raise
            raise translated from e

    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    # -- writing -------------------------------------------------------------------

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        path = self._path(key)
        data = _one_bytes(buffers)
        async with self._translating(f"{self._url}: writing {key!r}"):
            if self._process_local:
                await self._call_locked(lambda fs: fs.pipe_file(path, data))
            else:
                await self._call("pipe_file", path, data)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        data = bytes(data)
        what = f"{self._url}: creating {key!r}"
        mode = {"mode": "create"} if self._pipe_takes_mode else {}
        async with self._translating(what):
            if self._process_local:
                await self._call_locked(lambda fs: _check_then_pipe(fs, path, data, mode, what))
                return
            if not self._atomic_create and await self._exists(path, what):
                # Not atomic: a committer between this check and the write below also "wins".
                raise FileExistsError(f"{what}: object exists")
            await self._call("pipe_file", path, data, **mode)

    async def _call_locked(self, body: Callable[[Any], None]) -> None:
        """Run ``body(fs)`` in a thread under the process-wide lock (process-local filesystems)."""
        fs = await self._filesystem()

        def locked() -> None:
            with _PROCESS_LOCK:
                body(fs)

        await asyncio.to_thread(locked)

    # -- reading ---------------------------------------------------------------------

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        path = self._path(key)
        check_fill(rng, buffers)
        what = f"{self._url}: reading {key!r} [{rng.start}, {rng.end})"
        if rng.length == 0:  # cat_file of an empty range reads the whole object on some filesystems
            return await self.check_empty_read(key, rng, what)
        async with self._translating(what):
            # Keywords: s3fs's second positional parameter is version_id, not start.
            data = await self._call("cat_file", path, start=rng.start, end=rng.end)
        if len(data) != rng.length:
            # fsspec clips a range at the object's end instead of failing.
            raise ValueError(f"{what}: runs past the end (got {len(data)} of {rng.length} bytes)")
        scatter_bytes(memoryview(data), buffers)

    # -- metadata --------------------------------------------------------------------

    async def _info(self, path: str, what: str) -> dict[str, Any]:
        async with self._translating(what):
            info = await self._call("info", path)
        if info.get("type") != "file":  # a "directory": a prefix of keys, no object
            raise FileNotFoundError(f"{what}: no such object (a directory)")
        return info

    async def _exists(self, path: str, what: str) -> bool:
        try:
            await self._info(path, what)
        except FileNotFoundError:
            return False
        return True

    async def stat(self, key: str) -> ObjectInfo:
        info = await self._info(self._path(key), f"{self._url}: stat of {key!r}")
        return ObjectInfo(key, int(info["size"]), _mtime(info), self._version(info))

    def _version(self, info: Mapping[str, Any]) -> str:
        return str(info.get("ETag") or "") if self._etag_delete else ""

    async def delete_if(self, key: str, version: str) -> bool:
        if not self._etag_delete:
            return await super().delete_if(key, version)
        path = self._path(key)
        what = f"{self._url}: deleting {key!r} if unchanged"
        fs = await self._filesystem()
        bucket, name, _ = fs.split_path(path)
        async with self._translating(what):
            try:
                await fs._call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=version)
            except Exception as e:
                status = http_status(e)
                if status == 412:
                    return False  # another version (other bytes) stands there
                if status == 409:  # a concurrent PUT or DELETE of the key won: ask again
                    raise RetryableError(f"{what}: HTTP 409 (a concurrent change): {e}") from e
                raise
            finally:
                fs.invalidate_cache(path)
        return True

    async def delete(self, key: str) -> None:
        path = self._path(key)
        what = f"{self._url}: deleting {key!r}"
        await self._info(path, what)  # S3 deletes a missing key without complaint
        async with self._translating(what):
            await self._call("rm_file", path)

    async def list_children(self, prefix: str = "") -> list[str]:
        # Trailing slashes are forgiven ("a/" is "a"); the rest is checked like a listing prefix.
        rel = check_prefix(prefix.rstrip("/") + "/").rstrip("/") if prefix else ""
        base = f"{self._root}/{rel}" if rel else self._root
        async with self._translating(f"{self._url}: listing children of {prefix!r}"):
            try:
                entries = await self._call("ls", base, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                entries = []
        cut = len(base) + 1
        names = set()
        for entry in entries:
            name = self._fs_class._strip_protocol(entry["name"]).rstrip("/")
            # ls of an object lists the object itself: it is no child of itself.
            if name.startswith(base + "/"):
                names.add(name[cut:].split("/", 1)[0])
        names.discard("")
        return sorted(names)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        directory, _, partial = prefix.rpartition("/")
        base = f"{self._root}/{directory}" if directory else self._root
        kwargs: dict[str, Any] = {"withdirs": False, "detail": True}
        if partial and self._find_takes_prefix:
            kwargs["prefix"] = partial  # filtered by the server (gcsfs, s3fs)
        async with self._translating(f"{self._url}: listing {prefix!r}"):
            try:
                found = await self._call("find", base, **kwargs)
            except FileNotFoundError:
                found = {}
        root = self._root + "/"
        out = []
        for name, info in found.items():
            path = self._fs_class._strip_protocol(name)
            key = path[len(root) :] if path.startswith(root) else ""
            # Directory placeholders ("dir/") and entries outside the prefix are no keys here.
            if key and key.startswith(prefix) and info.get("type", "file") == "file":
                out.append(ObjectInfo(key, int(info.get("size") or 0), _mtime(info), self._version(info)))
        out.sort(key=lambda i: i.key)
        return out

    # -- lifetime --------------------------------------------------------------------

    async def close_loop(self) -> None:
        """Close only the running loop's filesystem (before closing a short-lived loop by hand)."""
        if self._filesystems is not None:
            await self._filesystems.close_current()

    async def close(self) -> None:
        """Close every loop's filesystem; the backend stays usable (filesystems are remade lazily)."""
        if self._filesystems is not None:
            await self._filesystems.close_all()


def _one_bytes(buffers: Sequence[memoryview]) -> bytes:
    """The concatenation of ``buffers`` as one ``bytes`` (what ``pipe_file`` takes), copied once."""
    if len(buffers) == 1:
        view = buffers[0] if isinstance(buffers[0], memoryview) else memoryview(buffers[0])
        if isinstance(view.obj, bytes) and view.nbytes == len(view.obj) and view.contiguous:
            return view.obj  # immutable and whole already: no copy at all
        return view.tobytes()
    return b"".join(buffers)


def _check_then_pipe(fs: Any, path: str, data: bytes, mode: dict[str, str], what: str) -> None:
    """Create-if-absent on a process-local filesystem; the caller holds the process lock."""
    if fs.exists(path):
        raise FileExistsError(f"{what}: object exists")
    fs.pipe_file(path, data, **mode)


#: Where filesystems keep an object's modification time, in order of preference.
_MTIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "created", "timeCreated")


def _mtime(info: Mapping[str, Any]) -> float:
    """Seconds since the epoch from a filesystem's info dict.

    An unknown age counts as new: an orphan sweep deletes objects older than a
    grace period, and must never take what might be a running save's object.
    """
    for field in _MTIME_FIELDS:
        value = info.get(field)
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
                return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
    return time.time()
