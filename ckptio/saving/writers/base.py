"""Who writes a save's objects: the :class:`Writer` protocol and the in-process writer.

A save stages its bytes, plans its objects, then hands the plans to a writer, which
writes every object and makes them durable (the backend's sync) before it returns
their checksums. Two writers exist:

- :data:`THREAD_WRITER` (:class:`ThreadWriter`): the engine writing from this
  process, on its IO loop;
- :class:`ckptio.saving.writers.sidecar.SidecarWriter`: a writer process per host, fed from
  shared-memory staging (:mod:`ckptio.saving.writers.sidecar`).

The public surface names them by string (``SaveOptions.writer`` or the ``CKPTIO_WRITER``
environment variable); :func:`writer_name` reads that string, and
:func:`ckptio.saving.writers.sidecar.writer_for` maps it, once per save, to a writer object.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Sequence
from typing import Protocol

from ckptio.engine import Progress, WrittenObject, run_sync
from ckptio.engine.layout import ObjectPlan
from ckptio.store import CheckpointStore
from ckptio.system.bufferpool import StagingPool

__all__ = ["ENV", "THREAD_WRITER", "WRITERS", "ThreadWriter", "Writer", "sidecar_possible", "wanted_sidecar",
           "writer_asked", "writer_name"]

log = logging.getLogger("ckptio.sidecar")  # the choice's notes belong with the sidecar's

#: Environment variable that picks the writer when ``SaveOptions.writer`` is None.
ENV = "CKPTIO_WRITER"
#: The writers' names, as ``SaveOptions.writer`` and ``CKPTIO_WRITER`` spell them.
WRITERS = ("thread", "sidecar")

#: ``ready[i]`` resolves once object ``i``'s bytes are staged (a failed staging sets an exception).
Gates = Sequence[concurrent.futures.Future[None]]


class Writer(Protocol):
    """Writes a save's planned objects and makes them durable.

    Contract: :meth:`write` returns only once every object of ``plans`` is written and
    the backend synced (one :class:`~ckptio.engine.WrittenObject` per plan, in order),
    or raises; it starts object ``i`` no earlier than ``ready[i]`` resolves. The save
    commits nothing before it returns, so a writer that fails fails the save.
    """

    #: "thread" or "sidecar" (one of :data:`WRITERS`).
    name: str
    #: Whether it writes its own page-aligned copies of staged memory rather than the memory as it
    #: lies: a save then lays large pieces out aligned in their objects, not in step with their
    #: addresses (:func:`ckptio.engine.layout.pack`'s ``in_place``), so that direct IO needs no bounce.
    copies: bool

    def staging_pool(self, pool: StagingPool | None) -> StagingPool | None:
        """The pool a save stages into, given the caller's ``pool`` (memory this writer can read)."""
        ...

    def write(
        self, store: CheckpointStore, plans: Sequence[ObjectPlan], progress: Progress | None,
        ready: Gates | None, where: str,
    ) -> list[WrittenObject]:
        """Write and sync every object of ``plans``; blocks the calling thread."""
        ...


class ThreadWriter:
    """The engine writing from this process, on its IO loop (the default writer)."""

    name = "thread"
    copies = False

    def staging_pool(self, pool: StagingPool | None) -> StagingPool | None:
        """The caller's pool: the engine reads staged bytes where they are."""
        return pool

    def write(
        self, store: CheckpointStore, plans: Sequence[ObjectPlan], progress: Progress | None,
        ready: Gates | None, where: str,
    ) -> list[WrittenObject]:
        """Write every plan concurrently on the IO loop, then sync the backend."""
        written = run_sync(store.engine.write_objects(plans, progress, ready))
        run_sync(store.io.sync())
        return written


#: The one in-process writer (it holds no state).
THREAD_WRITER = ThreadWriter()


def writer_name(asked: str | None) -> str:
    """The writer asked for: "thread" or "sidecar" (ValueError naming a bad value).

    ``asked`` (``SaveOptions.writer``) first, else the ``CKPTIO_WRITER`` environment variable, else "thread".
    """
    w = asked or os.environ.get(ENV) or "thread"
    if w not in WRITERS:
        src = "SaveOptions.writer" if asked else ENV
        raise ValueError(f"{src}={w!r}: the writer must be one of {', '.join(WRITERS)}")
    return w


def writer_asked(asked: str | None) -> bool:
    """Whether a writer was named (``asked`` or ``CKPTIO_WRITER``): then no default rule
    (:mod:`ckptio.saving.writers.auto`) overrides it."""
    return bool(asked or os.environ.get(ENV))


def sidecar_possible(store: CheckpointStore) -> bool:
    """Whether a writer process can write ``store``'s objects: a backend the store opened from its
    URL (the child opens it again), storage outside this process's memory, and Linux memfd."""
    return store.reopenable and not store.backend.capabilities.process_local and hasattr(os, "memfd_create")


_warned: set[str] = set()


def wanted_sidecar(store: CheckpointStore, asked: str | None = None) -> bool:
    """True if ``store``'s saves go through the sidecar.

    Only a backend the store opened from its URL can be opened again in the
    child, and only storage outside this process's memory is the same there; a
    backend object handed in (a wrapper, a test double) or a process-local one
    (``mem://``) keeps the in-process writer, with a warning once per URL.
    """
    if writer_name(asked) != "sidecar":
        return False
    if not sidecar_possible(store):
        if store.url not in _warned:
            _warned.add(store.url)
            # Asked for by this store's config: worth a warning; by the environment: a note.
            log.log(logging.WARNING if asked else logging.DEBUG,
                    "%s: the sidecar writer needs a backend opened from its URL, storage outside this process "
                    "(not mem://) and Linux memfd; writing in this process instead", store.url)
        return False
    return True
