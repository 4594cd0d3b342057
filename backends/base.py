"""The backend contract: one small async ABC that only moves bytes.

Everything else lives once, above this layer: retries in
:class:`ckptio.backends.retrying.RetryingBackend` (the store wraps its backend
in it; the engine retries its own data reads and writes with the same loop),
concurrency and checksums in :mod:`ckptio.engine`, packing in
:mod:`ckptio.engine.layout`, commit order in :mod:`ckptio.store`.

Contract every backend keeps (the conformance suite shipped as
:mod:`ckptio.testing` checks each point):

* Keys are ``/``-separated relative names (no leading ``/``, no ``.`` or
  ``..`` components, no empty components). :func:`check_key` enforces this;
  listing prefixes pass :func:`check_prefix`, so no listing reaches outside
  the root either.
* :meth:`Backend.write` creates or replaces a whole object from one or more
  buffers, in order, without concatenating them first. A reader never sees a
  partially written object under ``key``: either the old state or the new one.
* :meth:`Backend.write_filling` is a write that may start while its buffers are still being filled,
  front to back: it reads no byte before :meth:`Filling.wait` said it is in. Backends that cannot
  stream keep the default (wait for every byte, then :meth:`Backend.write`).
* :meth:`Backend.read_into` fills caller-owned buffers from a half-open
  :class:`ByteRange`; reading past the end is an error, never a short read.
  :meth:`Backend.read_many` is many such reads in one call (the default: one
  ``read_into`` each).
* :meth:`Backend.create_if_absent` is the commit primitive: it writes a small
  object only if no object has that key, atomically, and raises
  :class:`FileExistsError` otherwise.
* :meth:`Backend.delete_if` (where :attr:`Capabilities.conditional_delete` is declared) is its
  mirror: it deletes an object only if it is still the version a :meth:`Backend.stat` or
  :meth:`Backend.list` named (:attr:`ObjectInfo.version`), atomically, and returns False otherwise.
* Errors leave a backend as builtins (``FileNotFoundError``,
  ``FileExistsError``, ``PermissionError``, ``ValueError``) or as
  :class:`RetryableError`; only the latter is retried. Backends
  translate their native errors once, here at the boundary; the storage
  asking to slow down (HTTP 429, 503 / SlowDown) is :class:`ThrottledError`,
  a RetryableError that a request budget answers by slowing its host down.
* Capabilities are declared data, not discovered by failure: what the storage
  is (:class:`Capabilities`) apart from how checkpoints are best laid out on it
  (:class:`LayoutDefaults`).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "Backend",
    "ByteRange",
    "Capabilities",
    "Filling",
    "LayoutDefaults",
    "ObjectInfo",
    "Read",
    "ReadOnlyBackend",
    "RetryableError",
    "ThrottledError",
    "check_fill",
    "check_key",
    "check_prefix",
    "join_key",
    "own_read_into",
]


class RetryableError(Exception):
    """A transient failure (throttling, reset, timeout, 5xx): the same call may succeed later.

    The only exception class that is retried. ``retry_after`` is a server
    hint in seconds, when the storage gave one.
    """

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ThrottledError(RetryableError):
    """The storage asked this host to slow down (HTTP 429, 503, S3's SlowDown).

    Retried like every RetryableError, but with a patience measured in time rather than in
    attempts (``ckptio.backends.retrying.RetryPolicy.throttle_patience_s``), and it makes a
    request budget (``ckptio.backends.budget``) lower this host's rate. When the patience runs
    out it propagates as itself: a throttled listing is "the storage is throttled", never
    "no checkpoint".
    """

    #: Set by a request budget that saw this error: the budget spaces the retry (its next
    #: slot), so the retry loop adds only a short jitter instead of an exponential backoff.
    paced: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class ByteRange:
    """A half-open byte range ``[start, end)`` of an object."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")

    @classmethod
    def of(cls, start: int, length: int) -> ByteRange:
        return cls(start, start + length)

    @property
    def length(self) -> int:
        return self.end - self.start

    def http_header(self) -> str:
        """HTTP's inclusive ``Range`` header value; the one place that converts.

        An empty range has no HTTP form: callers must not send a request for it.
        """
        if self.length == 0:
            raise ValueError("an empty byte range has no HTTP Range header")
        return f"bytes={self.start}-{self.end - 1}"


#: One read of :meth:`Backend.read_many`: ``(key, range, buffers)``, as :meth:`Backend.read_into` takes them.
Read = tuple[str, ByteRange, Sequence[memoryview]]


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What :meth:`Backend.stat` and :meth:`Backend.list` say of one object."""

    key: str
    size: int
    mtime: float  # seconds since the epoch; orphan sweeps compare it to a grace period
    #: An opaque token naming this version of the object, for :meth:`Backend.delete_if`; "" where
    #: the backend declares no :attr:`Capabilities.conditional_delete`. Two versions of one key
    #: (a re-creation, an overwrite) never share a token, unless the storage names versions by
    #: content (S3's ETag) and both hold the very same bytes.
    version: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What the storage is and how it likes to be driven: facts, declared, not probed by failure.

    How a checkpoint is best laid out on it is policy, not fact: see :class:`LayoutDefaults`.
    """

    read_only: bool = False
    #: ``write`` is atomic per object (temp + rename, or an object store PUT).
    atomic_write: bool = True
    #: ``create_if_absent`` is a real conditional create (not check-then-write).
    conditional_create: bool = True
    #: Completed writes survive a crash without :meth:`Backend.sync`.
    durable_on_close: bool = True
    #: The IO size the storage likes.
    preferred_io_size: int = 8 << 20
    #: Buffer/offset alignment needed for direct IO (1 = none).
    alignment: int = 1
    #: How many requests in flight keep this storage busy.
    concurrency: int = 8
    #: A listing right after a write shows it.
    list_consistent: bool = True
    #: The storage lives in this process's memory: another process (a ckptio.saving.writers.sidecar writer)
    #: opening the same URL would see other objects, so writes stay in this process.
    process_local: bool = False
    #: :meth:`Backend.sweep_temporaries` also takes a keyword ``prefix: str`` and then sweeps
    #: only under it (one step's temporaries, beside other steps' live saves). The store passes
    #: a prefix only to backends that declare this; the others sweep their whole root.
    sweeps_by_prefix: bool = False
    #: :meth:`Backend.delete_if` is a real conditional delete: an object is deleted only if it is
    #: still the version its stat or listing named, and no other client's create, write or delete
    #: lands between that check and the deletion. Without it, ``delete_if`` raises
    #: NotImplementedError and a deleter re-reads just before an unconditional delete.
    conditional_delete: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutDefaults:
    """How a checkpoint's objects are best laid out on this storage: policy, not a storage fact.

    The layout (:mod:`ckptio.engine.layout`) and the save read these where the user chose nothing
    else; a backend's options (``object_size=...``) set them per URL.
    """

    #: The layout packs objects of about this many bytes.
    object_size: int = 64 << 20
    #: Object names should start with a hashed component (object stores).
    hashed_names: bool = False
    #: Spread a checkpoint's objects over this many sub-directories (parallel file systems).
    dir_fanout: int = 0
    #: Store shards of 2+ dimensions as tiles of about this many bytes (ckptio.engine.tiling), so that
    #: a restore onto another sharding reads only what it needs. Shared storage that jobs
    #: restart from on new topologies (object stores, parallel file systems) sets it; 0 keeps
    #: plain C order, for host-local disks, where the restore is nearly always the same layout
    #: and a tiled one pays a copy through scratch (measured: ~20 % slower, ckptio bench --reshard).
    tile_bytes: int = 0


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid relative object key, else raise ValueError naming it."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"object key {key!r} is not a relative '/'-separated name")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"object key {key!r} has an empty, '.' or '..' component")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid listing prefix, else raise ValueError naming it.

    A prefix is a plain string prefix of keys, so its last component may be
    partial or empty (``""``, ``"step_1/sha"``, ``"step_1/"``); every complete
    component before the last ``/`` must be a valid key component, so that no
    listing can name anything outside the backend's root (``"../"``, ``"/etc/"``).
    """
    if not isinstance(prefix, str) or "\\" in prefix or "\x00" in prefix:
        raise ValueError(f"listing prefix {prefix!r} is not a '/'-separated string")
    head, sep, _ = prefix.rpartition("/")
    if sep:
        for part in head.split("/"):
            if part in ("", ".", ".."):
                raise ValueError(f"listing prefix {prefix!r} has an empty, '.' or '..' component")
    return prefix


def check_fill(rng: ByteRange, buffers: Sequence[memoryview]) -> None:
    """ValueError unless ``buffers`` hold exactly ``rng.length`` bytes (read_into's precondition)."""
    have = sum(b.nbytes for b in buffers)  # nbytes, not len(): destinations are often float arrays
    if have != rng.length:
        raise ValueError(f"buffers hold {have} bytes, range [{rng.start}, {rng.end}) needs {rng.length}")


def own_read_into(backend: Backend) -> bool:
    """Whether ``backend`` (an instance) was given its own ``read_into`` (a test's or a bench's
    counter) and no ``read_many`` with it: then its batches are read one ``read_into`` at a time."""
    own = vars(backend)
    return "read_into" in own and "read_many" not in own


def join_key(*parts: str) -> str:
    """Join key components with ``/``, dropping empty ones."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Filling(Protocol):
    """The buffers of a write that are still being filled, front to back (:meth:`Backend.write_filling`).

    Offsets are in the object: byte ``n`` is byte ``n`` of the buffers' concatenation.
    """

    def wait(self, end: int) -> None:
        """Block until bytes ``[0, end)`` are in the buffers; raise if they never will be (the fill
        failed or was abandoned). Called from a backend's IO thread."""

    async def complete(self) -> None:
        """Return once every byte is in; raise as :meth:`wait` does."""


class Backend(abc.ABC):
    """Moves bytes for one kind of storage. Knows nothing about arrays.

    A backend is created from a URL and a small picklable config (see
    :func:`ckptio.backends.open_backend`); all methods are coroutines that
    the engine runs on its own event loop. Implementations do blocking IO in
    threads that release the GIL.
    """

    #: What the storage is; every backend declares it.
    capabilities: Capabilities
    #: How checkpoints are best laid out on it; backends without a preference keep these.
    layout_defaults: LayoutDefaults = LayoutDefaults()
    #: Whether :meth:`read_many` costs less than its reads made one by one (a callers' hint: where
    #: not, they make them one by one, each under its own retry and deadline).
    batches_reads: bool = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The root URL this backend serves; keys are relative to it."""

    @abc.abstractmethod
    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        """Create or replace object ``key`` with the concatenation of ``buffers``."""

    async def write_filling(self, key: str, buffers: Sequence[memoryview], filling: Filling) -> None:
        """:meth:`write` of ``buffers`` that ``filling`` is still filling, front to back.

        A backend that streams (the local one, request by request) starts before the last byte is in
        and reads no byte before ``filling.wait`` passed it; if ``filling`` fails, the write fails and
        leaves no object. This default waits for every byte, then writes.
        """
        await filling.complete()
        await self.write(key, buffers)

    @abc.abstractmethod
    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (whose lengths sum to ``rng.length``) with bytes ``rng`` of ``key``.

        Raises FileNotFoundError if the object is absent and ValueError if the
        range runs past its end.
        """

    @abc.abstractmethod
    async def create_if_absent(self, key: str, data: bytes) -> None:
        """Atomically create ``key`` holding ``data``; FileExistsError if it exists."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Delete ``key``; FileNotFoundError if it is absent."""

    async def delete_if(self, key: str, version: str) -> bool:
        """Delete ``key`` only if it is still the version ``version`` (an :attr:`ObjectInfo.version`
        from :meth:`stat` or :meth:`list`): True if deleted, False if another version stands there
        (nothing changed); FileNotFoundError if no object has that key. Atomic where the backend
        declares :attr:`Capabilities.conditional_delete`; the others raise NotImplementedError.
        """
        raise NotImplementedError(f"{self.url}: {type(self).__name__} has no conditional delete "
                                  "(capabilities.conditional_delete is False)")

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo:
        """Size, mtime and version of ``key``; FileNotFoundError if absent."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a plain string prefix), sorted by key."""

    async def list_children(self, prefix: str = "") -> list[str]:
        """Names of the immediate children under directory ``prefix`` (objects and sub-"directories").

        Object stores override this with a delimiter listing; the default
        derives it from :meth:`list`.
        """
        base = prefix.rstrip("/") + "/" if prefix else ""
        names = {info.key[len(base):].split("/", 1)[0] for info in await self.list(base)}
        return sorted(names)

    async def check_empty_read(self, key: str, rng: ByteRange, what: str) -> None:
        """A zero-length read sends no request, but the object and the offset must still exist.

        For backends whose protocol has no empty read (HTTP ranges): FileNotFoundError
        for a missing object, ValueError for an offset past its end.
        """
        info = await self.stat(key)
        if rng.end > info.size:
            raise ValueError(f"{what}: runs past the end ({info.size} bytes)")

    async def read_many(self, reads: Sequence[Read]) -> None:
        """Each ``(key, rng, buffers)`` of ``reads`` filled as :meth:`read_into` fills it (its errors).

        The first failure propagates, the other reads cancelled: which read failed is not said
        (a caller that must name it reads one by one after). This default makes one
        :meth:`read_into` a read, all at once; a backend whose calls cost more than the bytes
        (a thread hop each) reads many small objects for less in one call and says so
        (:attr:`batches_reads`). A wrapper passes a batch on as one only when it does not change
        :meth:`read_into` (:class:`~ckptio.backends.wrappers.WrapperBackend`), so counting,
        faults and budgets still meet every read.
        """
        tasks = [asyncio.ensure_future(self.read_into(key, rng, buffers)) for key, rng, buffers in reads]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def read(self, key: str) -> bytes:
        """Read a whole (small) object."""
        info = await self.stat(key)
        buf = bytearray(info.size)
        if info.size:
            await self.read_into(key, ByteRange(0, info.size), [memoryview(buf)])
        return bytes(buf)

    async def sweep_temporaries(self, older_than_s: float, *, dry_run: bool = False) -> list[str]:
        """Remove what interrupted writes left outside the key space; return their names.

        Listings never show a write's temporary file (so no orphan sweep by key can
        see it), and a writer killed mid-write leaves one behind, up to an object's
        size. Only those older than ``older_than_s`` go: younger ones may belong to
        a write in progress. Object stores have none (an upload appears whole or
        not at all): the default does nothing. A backend that declares
        :attr:`Capabilities.sweeps_by_prefix` also takes a keyword ``prefix``.
        """
        return []

    async def sync(self) -> None:
        """Make every completed :meth:`write` durable (directory entries included).

        Backends whose writes are durable on close keep this no-op.
        """

    async def close(self) -> None:
        """Release connections, threads and files. The backend stays usable (it reopens lazily)."""

    async def close_loop(self) -> None:
        """Release only what the running event loop holds (before closing a short-lived loop).

        Backends whose connections are bound to a loop (HTTP sessions) override
        this; the backend stays usable from other loops and from this one.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class ReadOnlyBackend(Backend):
    """A backend that serves reads only (an in-memory view over bytes held elsewhere): every
    write, create and delete raises PermissionError naming ``url`` and ``read_only_reason``."""

    read_only_reason = "read-only"

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        raise PermissionError(f"{self.url}: {self.read_only_reason}")

    async def create_if_absent(self, key: str, data: bytes) -> None:
        raise PermissionError(f"{self.url}: {self.read_only_reason}")

    async def delete(self, key: str) -> None:
        raise PermissionError(f"{self.url}: {self.read_only_reason}")

    async def delete_if(self, key: str, version: str) -> bool:
        raise PermissionError(f"{self.url}: {self.read_only_reason}")
