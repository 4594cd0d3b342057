"""The default writer of a save nobody chose a writer for: the writer process for large saves.

A background save's Python-level work runs under the training process's GIL. A
GIL-bound training thread (a host loop that dispatches steps) holds the GIL
almost all the time, so each time a save thread wants it back -- after every
checksum block, copy or write call that released it -- it waits for the
interpreter's switch interval (5 ms) to force a hand-over: 1024 checksum calls
and 128 writes per GiB, most of them while the step runs again (a numpy or
torch save's stall is its staging copy; a JAX save stages nothing, its arrays
being immutable). Measured with ``ckptio bench --train --pin`` on a quiet 2-core
VM (notes of issue 35): at 256 MiB the in-process JAX save ran at 0.070-0.079
GiB/s, through the writer process at 0.159-0.182; at 1 GiB, two runs, the
numpy save lost the step 50-62 ms in-process against 20-24 ms through the
writer process (0.28-0.32 against 0.36-0.39 GiB/s), the torch save 57-64
against 20-27 ms (0.29-0.31 against 0.35-0.40 GiB/s).

So when neither ``SaveOptions.writer`` nor ``CKPTIO_WRITER`` names a writer, a
save that writes at least :data:`AUTO_MIN_BYTES` of arrays from this host (numpy,
torch or JAX; through the native API or the Orbax handler) to a local POSIX
backend (:class:`ckptio.backends.local.LocalBackend` and its flavours) goes
through the writer process (:mod:`ckptio.saving.writers.sidecar`). The choice is made from the
leaves before anything is staged (:func:`array_bytes`), so that a snapshot is
taken straight into the shared memory the writer process reads, not copied there
again. Everything else keeps the in-process writer: small saves (a process is
not worth it), incremental saves (they read shadows and views in this process)
and other backends (not measured). ``ckptio.dcp.Writer`` follows the same rule for
``async_save`` of CPU tensors (its :meth:`~ckptio.dcp.Writer.stage` decides): with
saves' background work under a 0.5 ms switch interval (:mod:`ckptio.engine.gilswitch`), two
interleaved ``--train --pin --size 1GiB`` runs measured 17.6 and 24.0 ms lost per
save through the writer process against 34.8 and 35.8 in-process (step x 1.019,
1.027 against 1.041, 1.044; the stall 87-91 against 160-164 ms: no staged
checksums to wait for), at the same throughput (0.98 against 0.91-1.00 GiB/s);
before that setting it had gained nothing. A synchronous ``dcp.save`` (no staging
copy to put in shared memory) and accelerator tensors (pinned staging, not
measured here) stay in-process. ``writer="thread"`` (or ``CKPTIO_WRITER=thread``)
opts out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ckptio.backends.local import LocalBackend
from ckptio.saving.writers import sidecar
from ckptio.saving.writers.base import Writer, sidecar_possible
from ckptio.saving.writers.sidecar import SIDECAR_WRITER
from ckptio.state.leaves import Sharded, index_to_box, is_jax_array, is_torch_tensor
from ckptio.store import CheckpointStore

__all__ = ["AUTO_MIN_BYTES", "array_bytes", "default_writer", "default_writer_for"]

#: A save needs at least this many bytes of arrays (one default local object) to go to the
#: writer process by default.
AUTO_MIN_BYTES = 64 << 20

log = logging.getLogger("ckptio.writers")
#: Why this process's writer process could not start, once it could not: later saves stay in-process.
_unusable: str | None = None
#: Whether a default save went to the writer process (a death of it since turns the default off).
_used: bool = False


def array_bytes(leaves: Iterable[Any], host: int) -> int:
    """Bytes of the arrays host ``host`` writes of a save's ``leaves``, read from the leaves as
    given: nothing copied, nothing moved off a device. As staging splits them: a JAX array's
    addressable shards of replica 0, a :class:`~ckptio.state.leaves.Sharded` leaf's pieces, and plain
    numpy arrays and torch tensors on host 0 only (replicated: host 0 writes them)."""
    total = 0
    for leaf in leaves:
        if isinstance(leaf, Sharded):
            total += _sharded_bytes(leaf)
        elif is_jax_array(leaf):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.replica_id == 0)
        elif host == 0 and (is_torch_tensor(leaf) or isinstance(leaf, np.ndarray)):
            total += leaf.nelement() * leaf.element_size() if is_torch_tensor(leaf) else leaf.nbytes
    return total


def _sharded_bytes(leaf: Sharded) -> int:
    total = 0
    for index, _ in leaf.pieces:
        try:
            total += leaf.dtype.itemsize * math.prod(index_to_box(index, leaf.shape)[1])
        except (TypeError, ValueError):
            pass  # staging refuses the piece next, naming its pytree path
    return total


def default_writer(store: CheckpointStore, leaves: Sequence[Any], host: int, chosen: Writer, asked: bool) -> Writer:
    """The writer of host ``host``'s save of ``leaves`` (the state's, flattened) to ``store``:
    ``chosen``, unless no writer was ``asked`` for and the save is a large one on a local backend
    (see the module): then the writer process. Called before staging."""
    if chosen is SIDECAR_WRITER or asked:
        return chosen
    return default_writer_for(store, lambda: array_bytes(leaves, host), chosen)


def default_writer_for(store: CheckpointStore, nbytes: Callable[[], int], chosen: Writer) -> Writer:
    """:func:`default_writer` for a save that writes ``nbytes()`` bytes from this host, counted only
    if the store could use the writer process (no writer asked for is the caller's to check)."""
    if not isinstance(store.backend, LocalBackend) or not sidecar_possible(store):
        return chosen
    if nbytes() < AUTO_MIN_BYTES:
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
    log.warning("%s: large saves stay in this process (CKPTIO_WRITER=thread silences this)", why)
