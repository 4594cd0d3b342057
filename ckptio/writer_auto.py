"""The default writer of a save nobody chose a writer for: the writer process for large JAX saves.

A background save's Python-level work runs under the training process's GIL. A
GIL-bound training thread (a host loop that dispatches steps) holds the GIL
almost all the time, so each time a save thread wants it back -- after every
checksum block, copy or write call that released it -- it waits for the
interpreter's switch interval (5 ms) to force a hand-over. A numpy or torch save
does most of that work inside its stall, while its staging copy runs, before
the step resumes; a JAX save stages nothing (JAX arrays are immutable, so it
references them), so all of it -- 1024 checksum calls per 256 MiB of 8 MiB
shards (32 blocks a shard), a write per 8 MiB -- happens
under the running step. Measured with ``ckptio bench --train --pin --size
256MiB`` on a quiet 2-core VM (notes of issue 35): the in-process JAX save ran
at 0.070-0.079 GiB/s, the same save with the writer process at 0.159-0.182
GiB/s, at the same step slowdown (1.02-1.03x on core).

So when neither ``EngineConfig.writer`` nor ``CKPTIO_WRITER`` names a writer, a
save whose staged arrays are mostly JAX arrays (through the native API or the
Orbax handler), at least :data:`AUTO_MIN_BYTES` of them, on a local POSIX
backend (:class:`ckptio.backends.local.LocalBackend` and its flavours) goes
through the writer process (:mod:`ckptio.sidecar`).
Everything else keeps the in-process writer: numpy and torch state (their
checksums overlap their staging copy), small saves (a process is not worth
it), and other backends (not measured). ``writer="thread"`` (or
``CKPTIO_WRITER=thread``) opts out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckptio.backends.local import LocalBackend

from . import sidecar
from .sidecar import SIDECAR_WRITER
from .staging import StagedArray, nbytes_of
from .store import CheckpointStore
from .writers import Writer, sidecar_possible, writer_asked

__all__ = ["AUTO_MIN_BYTES", "default_writer", "jax_share"]

#: A save needs at least this many bytes of JAX arrays (one default local object) to go to
#: the writer process by default.
AUTO_MIN_BYTES = 64 << 20

log = logging.getLogger("ckptio.writers")
#: Why this process's writer process could not start, once it could not: later saves stay in-process.
_unusable: str | None = None
#: Whether a default save went to the writer process (a death of it since turns the default off).
_used: bool = False


def jax_share(staged: Mapping[str, Any], copied: bool = True) -> tuple[int, int]:
    """``(bytes of JAX arrays, bytes of all arrays)`` this host writes, of a save's staged items.

    ``copied=False`` (a save that references its leaves, as the Orbax handler's does): its
    :class:`~ckptio.staging.Sharded` leaves count as JAX too -- they are the host views of JAX
    arrays the handler made, staged without a copy all the same."""
    jax = total = 0
    for item in staged.values():
        if isinstance(item, StagedArray):
            n = nbytes_of(item)
            total += n
            if item.origin == "jax" or (item.origin == "sharded" and not copied):
                jax += n
    return jax, total


def default_writer(
    store: CheckpointStore, staged: Mapping[str, Any], chosen: Writer, copied: bool = True
) -> Writer:
    """The writer of a save of ``staged`` to ``store``: ``chosen`` (the store's), unless no writer
    was asked for and the save is a large JAX save on a local backend (see the module): then the
    writer process. ``copied``: whether the save snapshots its leaves (see :func:`jax_share`)."""
    if chosen is SIDECAR_WRITER or writer_asked(store.engine.config):
        return chosen
    if not isinstance(store.backend, LocalBackend) or not sidecar_possible(store):
        return chosen
    jax, total = jax_share(staged, copied)
    if jax < AUTO_MIN_BYTES or 2 * jax < total:
        return chosen
    return SIDECAR_WRITER if _writer_process_up() else chosen


def _writer_process_up() -> bool:
    """Whether this process's writer process is (or now starts) up. A default, unlike a writer asked
    for, must not keep failing saves where no such process can run (a frozen or embedded interpreter,
    a process limit, a child that cannot import ckptio, one killed for memory): the first that could
    not start, or that died under a default save, gives one warning, and every later default save
    stays in this process."""
    global _used
    # This process's writer process as it stands (not one shutdown() closed, not a forked parent's),
    # dead: the one a default save went to, or the one that replaced it during that save (a child
    # that died before the save reached it is replaced by the save's own request for one).
    now = sidecar.current()
    if _unusable is None and _used and now is not None and now.dead is not None:
        _give_up(now.dead)
    if _unusable is None:
        proc, _used = sidecar.ensure(), True  # started (again) if none runs or the last one died
        if proc.pid is None and proc.dead is not None:  # ``pid`` waits for the spawn, not the child's imports
            _give_up(proc.dead)
    return _unusable is None


def _give_up(why: str) -> None:
    global _unusable
    _unusable = why
    log.warning("%s: large JAX saves stay in this process (CKPTIO_WRITER=thread silences this)", why)
