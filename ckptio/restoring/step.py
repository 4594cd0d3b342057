"""Restoring a step: pick it (the newest restorable one, as one decision across hosts), restore it, fall back.

A step that turns out not to restore (an object missing or damaged, a
damaged manifest, a deletion racing the restore) is logged and the next
newest is tried, when the caller asked for the newest; with several hosts,
host 0 picks and every host learns whether every host restored it.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptio.backends.budget import alone
from ckptio.coord.distributed import (
    Coordinator, SingleProcess, broadcast_from_root, gather_to_root, join_errors,
)
from ckptio.coord.waits import waiting_for
from ckptio.engine import Progress, run_sync
from ckptio.errors import CheckpointNotFoundError, CkptioError, IntegrityError, ManifestError
from ckptio.manifest import ArrayItem, Manifest
from ckptio.restoring.agreement import can_read_once, kind_of, of_kind
from ckptio.restoring.boxexchange import restore_exchange
from ckptio.restoring.executor import restore_checkpoint
from ckptio.store import CheckpointStore
from ckptio.system import gcpause as _gc

__all__ = ["restore_step"]

log = logging.getLogger("ckptio.restore")


def restore_step(store: CheckpointStore, step: int | None, target: Any = None, *,
                 progress: Progress | None = None, coordinator: Coordinator | None = None,
                 read_once: bool | str = False) -> Any:
    """Restore ``step`` (None: the newest restorable committed step) of ``store``.

    With ``step=None``, a step that turns out not to restore -- an object or a
    fragment missing, short or failing its checksums, a damaged or unreadable
    manifest, or a deletion racing the restore -- is logged by name and the
    next newest is restored instead. With a ``coordinator`` of several hosts
    (every host must call this) that is one collective decision: host 0 picks
    the step, every host tries it, and if any host fails every host moves on,
    so all restore the same step. With ``step=N`` the failure is raised,
    naming what is missing.

    ``read_once=True`` or ``"exchange"`` (every host must pass the same): each stored byte some
    target needs is read from storage by one host, where the coordinator exchanges bytes
    (:func:`~ckptio.restoring.agreement.can_read_once`), by logical-box exchange
    (:mod:`ckptio.restoring.boxexchange`): arrays no two hosts share (same layout, N -> N/2,
    N -> 2N) each host reads itself, the others are read by the host responsible for their
    fragments and sent; elsewhere every host reads what it needs, as without it.
    """
    coord = coordinator or SingleProcess()
    # Who this host is, for per-host items: the coordinator's, else the job's default one's (a
    # restore called without a coordinator in a multi-process job still gives each host its own).
    host = (coord.rank, coord.size) if coordinator is not None else None
    # A host-local store's objects are seen only by the host that wrote them: nobody reads for others.
    once = bool(read_once) and can_read_once(coord) and not store.host_local
    if read_once and not once and coord.size > 1:
        log.warning("read_once: %s; every host reads what it needs", "the store is host-local" if store.host_local
                    else f"{type(coord).__name__} does not exchange bytes")
    with _gc.paused():  # the caller waits anyway: no collections in the middle of the burst
        return _restore_step(store, step, target, progress, coord, once, host)


#: What makes a step not restore (as opposed to a bad target or a storage outage).
_LOST = (FileNotFoundError, IntegrityError, ManifestError, PermissionError)


def _restore_step(
    store: CheckpointStore, step: int | None, target: Any, progress: Progress | None, coord: Coordinator,
    once: bool, host: tuple[int, int] | None,
) -> Any:
    tried: list[int] = []
    first: BaseException | None = None  # what the newest step failed with: raised if nothing older restores
    many = step is None and coord.size > 1
    while True:
        try:
            step_dir, manifest = _pick(store, step, tried, coord) if many else run_sync(
                store.resolve_manifest(step, skip=tried, shards=False))
        except CheckpointNotFoundError as e:
            if first is None:
                raise
            raise first from e
        failure: BaseException | None = None
        fatal = False  # a failure that another step would not mend (a bad target, an outage)
        out: Any = None
        try:
            if once:
                out = restore_exchange(store, manifest, step_dir, target, coord, progress=progress)
            else:
                out = restore_checkpoint(store, manifest, step_dir, target, progress=progress, host=host)
        except CheckpointNotFoundError as e:  # the target names an item the checkpoint lacks: not damage
            if not many:
                raise
            failure, fatal = e, True
        except _LOST as e:
            failure = _lost(store, step, step_dir, manifest, e)
        except BaseException as e:
            if not many:
                raise
            failure, fatal = e, True
        if many:  # every host learns whether every host restored this step, even after a failure
            mine = None if failure is None else (fatal, f"host {coord.rank}: {type(failure).__name__}: {failure}")
            # The wait covers the others' reads: about their share of the checkpoint each.
            share = sum(i.nbytes for i in manifest.items.values() if isinstance(i, ArrayItem)) // coord.size
            with waiting_for(f"restore of step {step_dir}: every host's outcome",
                             store.engine.config.collective_deadline_s(share)):
                reports = gather_to_root(coord, mine)
                verdict = broadcast_from_root(coord, None if reports is None else (
                    any(r[0] for r in reports if r), join_errors([r[1] for r in reports if r])))
            if fatal:
                raise failure  # type: ignore[misc]
            if verdict[1] and failure is None:
                failure = CheckpointNotFoundError(f"{store.where(step_dir)}: not restored on every host: {verdict[1]}")
            if verdict[0]:
                raise failure  # type: ignore[misc]
        if failure is None:
            return out
        if step is not None or not step_dir:
            raise failure
        log.warning("%s: step %s does not restore (%s); restoring the next newest step",
                    store.url, step_dir, failure)
        first = first or failure
        tried.append(int(step_dir))


def _pick(store: CheckpointStore, step: int | None, tried: list[int], coord: Coordinator) -> tuple[str, Manifest]:
    """Host 0's choice of the step to try, read on every host (one decision for the whole job).

    Host 0's failure reaches every host as its own kind: only "no checkpoint" says there is
    none; a throttled or failing listing stays an outage (a job that took it for "no checkpoint"
    would start from scratch over its checkpoints).
    """
    choice: dict[str, Any] = {}
    if coord.rank == 0:
        try:
            with alone(store.engine.backend):  # every other host waits for this choice
                choice = {"step_dir": run_sync(store.resolve_manifest(step, skip=tried, shards=False))[0]}
        except BaseException as e:  # every host must raise it, not wait for a choice
            choice = {"error": f"{type(e).__name__}: {e}", "kind": kind_of(e)}
    with waiting_for(f"choice of the step to restore from {store.url}", store.engine.config.collective_deadline_s()):
        choice = broadcast_from_root(coord, choice)
    if "error" in choice:
        raise of_kind(choice.get("kind", ""), f"{store.url}: host 0 could not pick the step to restore: {choice['error']}",
                      CkptioError)
    return choice["step_dir"], run_sync(store.read_manifest(choice["step_dir"], shards=False))


def _lost(store: CheckpointStore, step: int | None, step_dir: str, manifest: Manifest, e: BaseException
          ) -> BaseException:
    """The error to report for a restore of ``step_dir`` that failed with ``e``: a deletion that
    raced the restore is said to be one."""
    if not step_dir or run_sync(_still_there(store, step_dir, manifest.checkpoint_id)):
        return e  # the checkpoint is there: a missing or damaged object is damage, not a race
    gone = CheckpointNotFoundError(f"{store.where(step_dir)}: step {step_dir} was deleted while being restored")
    gone.__cause__ = e
    return gone


async def _still_there(store: CheckpointStore, step_dir: str, checkpoint_id: str) -> bool:
    try:
        return (await store.read_manifest(step_dir, shards=False)).checkpoint_id == checkpoint_id
    except (FileNotFoundError, ValueError, IntegrityError):
        return False
