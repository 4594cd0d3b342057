"""``ckptio.CheckpointManager``: periodic saves with retention, like Orbax's.

One save in flight at a time (a new save waits for the previous one);
staging buffers are reused between saves; retention runs on the coordinator
after each commit and deletes by manifest (see :mod:`ckptio.store`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from ckptio.backends import Backend, RetryableError
from ckptio.coord.collective import join_as_failed
from ckptio.coord.distributed import Coordinator, config_for_host, default_coordinator
from ckptio.coord.preemption import Preemption
from ckptio.engine import EngineConfig, Progress, run_sync
from ckptio.engine.layout import Naming
from ckptio.errors import IntegrityError, StepBusyError
from ckptio.manage.best_n import BestMode, BestN, Metric, metrics_of, with_metrics
from ckptio.manage.retention import Retention, SaveInterval
from ckptio.manifest import Manifest
from ckptio.restoring import restore_step
from ckptio.saving.incremental.shadow import Shadows
from ckptio.saving.options import SaveOptions
from ckptio.saving.job import SaveHandle, start_save
from ckptio.saving.writers import sidecar
from ckptio.store import CheckpointStore, StoreOptions, step_dir_of
from ckptio.store.urls import file_in_the_way
from ckptio.system.bufferpool import StagingPool

__all__ = ["CheckpointManager", "SaveFailures"]

OnSaveError = Literal["raise", "warn"]

log = logging.getLogger("ckptio.manager")


@dataclasses.dataclass
class SaveFailures:
    """The failures a manager has seen, counted in both ``on_save_error`` modes.

    Updated on the caller's thread when the manager waits for a save (the next
    :meth:`CheckpointManager.save`, :meth:`~CheckpointManager.wait_until_finished`
    or :meth:`~CheckpointManager.close`).

    Attributes:
        count: saves that failed (none of them committed anything).
        since_last_good: the steps whose save failed since the last save that committed
            (a commit empties it).
        last_good_step: the newest step this manager saw commit (None: none yet).
        last_error: the newest failure (its ``__cause__`` chain included).
        retention: retention runs that failed after their save committed.
    """

    count: int = 0
    since_last_good: list[int] = dataclasses.field(default_factory=list)
    last_good_step: int | None = None
    last_error: BaseException | None = None
    retention: int = 0


def _is_outage(e: BaseException) -> bool:
    """True for storage failing, which ``on_save_error="warn"`` lets pass even before a save starts;
    the caller's mistakes are other types (a bad leaf: TypeError / ValueError; a re-save of a
    committed step: FileExistsError) and raise in every mode. A step busy with another save's
    unconfirmed commit (StepBusyError) is no mistake of the caller's: a restart within a lease."""
    if isinstance(e, StepBusyError):
        return True
    return isinstance(e, (OSError, RetryableError)) and not isinstance(e, FileExistsError)


class CheckpointManager:
    """Saves steps under one root URL and keeps the ones retention asks for.

    Args:
        url: root URL or path; step ``s`` lives in ``<url>/<s>``.
        max_to_keep: keep at most this many newest checkpoints (None: all),
            not counting those kept by ``keep_period``; with ``best_fn``, the best this many.
        keep_period: also keep every step divisible by this, forever.
        save_interval_steps: :meth:`should_save` is true every this many steps.
        best_fn: best-N retention, as Orbax's: ``best_fn(metrics) -> float`` scores the
            ``metrics`` a step was saved with (kept in its manifest, so a restarted job ranks
            old steps from their manifests alone), and the best ``max_to_keep`` scored steps
            are kept. Besides them, the newest committed (whole) step and every ``keep_period``
            step (not ranked) are always kept. A damaged step is neither counted nor deleted.
        best_mode: ``"min"`` keeps the lowest scores (a loss), ``"max"`` the highest.
        keep_checkpoints_without_metrics: with ``best_fn``, steps saved without metrics are
            never deleted (True); with False they rank after every scored step, newest first.
        on_save_error: ``"raise"`` (default): a failed save or retention re-raises at the next
            :meth:`save` / :meth:`wait_until_finished`. ``"warn"``: it is logged with its cause
            and counted in :attr:`save_failures`, nothing of it is committed, and the next save
            goes ahead (a storage outage costs saves, not the run). A save refused before it
            starts for bad input (an unsupported leaf, bad metrics, a re-save of a committed
            step) raises at once in both modes: no retry fixes the caller's mistake. A re-save of
            a step whose earlier save died mid-commit (a restart) is no mistake: the dead commit is
            settled, at once or in the save's background once its lease ends (ckptio.store.resave);
            if that save turns out alive and confirms, this one fails "already committed", and a
            StepBusyError (the wait ran out) counts as a failed save under "warn".
        preemption_signals: the signals :meth:`reached_preemption` counts as a preemption notice
            (handled from its first call on; default SIGTERM).
        incremental: an array whose bytes equal those the previous save of this manager
            committed is not written again: the new step references its objects (docs/incremental.md;
            the first save, and the one after a failure, write in full). With several hosts, each host
            compares and references its own shards, in its own fragment (ckptio.saving.incremental.hosts).
        save_options: how saves run: who writes the objects, tiling, the switch interval
            (:class:`ckptio.saving.options.SaveOptions`).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        save_interval_steps: int = 1,
        best_fn: Callable[[Mapping[str, Metric]], float] | None = None,
        best_mode: BestMode = "min",
        keep_checkpoints_without_metrics: bool = True,
        on_save_error: OnSaveError = "raise",
        coordinator: Coordinator | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
        backend: Backend | None = None,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        incremental: bool = False,
        save_options: SaveOptions | None = None,
    ) -> None:
        self.retention = Retention(max_to_keep, keep_period)
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if on_save_error not in ("raise", "warn"):
            raise ValueError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        # Flat keywords, as Orbax's options; the best-N ones are grouped in one BestN.
        self.best = BestN(best_fn, best_mode, keep_checkpoints_without_metrics) if best_fn is not None else None
        self.on_save_error = on_save_error
        self.save_failures = SaveFailures()
        # The same refusal as ckptio.save: a root that is a file would otherwise fail later, at the
        # first save, as a bare "no such file" deep in the backend.
        problem = file_in_the_way(url) if backend is None else None
        if problem:
            raise NotADirectoryError(problem)
        self.coordinator = coordinator or default_coordinator()
        self.store = CheckpointStore(StoreOptions(
            os.fspath(url), backend=backend, engine_config=config_for_host(engine_config, self.coordinator),
            naming=naming, backend_options=backend_options,
        ))
        self.url = self.store.url
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.save_interval_steps = max(1, save_interval_steps)
        self.interval = SaveInterval(self.save_interval_steps)
        self._pool = StagingPool()
        self.incremental = incremental
        self._base: tuple[str, Manifest] | None = None  # the last commit, which an incremental save reuses
        self._shadows = Shadows() if incremental else None  # what it wrote, for a byte compare
        self.save_options = save_options or SaveOptions()
        sidecar.prestart(self.save_options.writer_name())  # a writer process, if asked for, is up before the first save
        self._pending: SaveHandle | None = None
        self._lock = threading.Lock()
        self._retention_error: BaseException | None = None
        self._preemption_signals = tuple(preemption_signals)
        self._preemption: Preemption | None = None

    # -- queries ---------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return run_sync(self.store.standing_steps())

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest is intact (a damaged newer one is logged and skipped)."""
        steps = run_sync(self.store.intact_steps(newest=1))
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True if ``step`` is on the save interval (or is the preemption step: see
        :meth:`reached_preemption`) and newer than the latest committed step."""
        preempted = self._preemption is not None and step == self._preemption.sync_step
        if not preempted and not self.interval.due(step):
            return False  # no listing for a step off the interval (nor an error from one in an outage)
        latest = self.latest_step()
        return latest is None or step > latest

    def reached_preemption(self, step: int) -> bool:
        """True on every host at the same step once any host got a preemption notice (Orbax's name
        and meaning): save that step then (:meth:`save` saves it even off the interval) and wait
        for it (:meth:`wait_until_finished`) before exiting. Every host calls it every step; when
        no notice came it only reads a flag. A notice is a signal of ``preemption_signals`` from
        the first call on, or :meth:`notify_preemption`. See :mod:`ckptio.coord.preemption`."""
        return self._preemption_watch().reached(step)

    def notify_preemption(self) -> None:
        """Tell the job this host is about to be preempted (for a handler of your own; signal-safe)."""
        self._preemption_watch().notify()

    def _preemption_watch(self) -> Preemption:
        if self._preemption is None:
            self._preemption = Preemption(self.coordinator, signals=self._preemption_signals)
        return self._preemption

    # -- save / restore --------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
        progress: Progress | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` as ``step`` unless :meth:`should_save` says no (``force`` overrides).

        Waits for the previous save to commit first, then returns once staged. ``metrics``
        (names to ints, finite floats or strings) go in the step's manifest for ``best_fn``;
        bad ones raise here, before anything is written, whatever ``on_save_error`` says.
        With ``on_save_error="warn"``, a save that storage fails at its start returns None
        (counted in :attr:`save_failures`); the handle of one that started still raises from
        its own ``result()``, but the manager's waits only log and count its failure.
        """
        metadata = with_metrics(metadata, metrics, self.best.fn if self.best is not None else None)
        self.wait_until_finished()
        try:
            if not force and not self.should_save(step):
                log.info("%s: step %d not saved (off the save interval, or not newer than the latest step %s)",
                         self.url, step, self.latest_step())
                return None
            if force:
                self._warn_if_doomed(step)
        except Exception as e:
            self._outage_or_raise(step, e)
            # The other hosts go on to this step's collectives: joining them as failed keeps every
            # later save of the job in step (see collective.join_as_failed).
            join_as_failed(self.coordinator, f"host {self.coordinator.rank}: {type(e).__name__}: {e}",
                            self.store.where(step_dir_of(step)))
            return None
        try:
            handle = start_save(
                self.store, step, state, metadata=metadata, coordinator=self.coordinator, pool=self._pool,
                progress=progress, on_done=self._after_save, incremental=self.incremental, base=self._base,
                shadows=self._shadows, options=self.save_options,
            )
        except Exception as e:  # start_save has told the other hosts already
            self._outage_or_raise(step, e)
            return None
        self._pending = handle
        return handle

    def _warn_if_doomed(self, step: int) -> None:
        """Logs a forced save that newest-N retention deletes right after its commit."""
        keep = self.max_to_keep
        if keep is None or self.best is not None:
            return  # nothing deleted; or deleted by metrics, which the commit has yet to bring
        if step in self.retention.doomed(sorted({*run_sync(self.store.intact_steps(newest=keep)), step})):
            log.warning("%s: forced save of step %d: retention (max_to_keep=%d) deletes it right after its "
                        "commit, since %d newer steps exist", self.url, step, keep, keep)

    def _failed(self, step: int | None, e: BaseException) -> None:
        """Counts a failed save; with ``on_save_error="warn"`` logs it with its cause, as the caller
        then goes on (with "raise" the caller re-raises it, and the traceback tells)."""
        f = self.save_failures
        f.count += 1
        f.last_error = e
        if step is not None:
            f.since_last_good.append(step)
        if self.on_save_error == "warn":
            log.warning("%s: save of step %s failed; the run goes on (on_save_error='warn'): %d saves failed "
                        "since the last good one (step %s), %d in all: %r", self.url, step,
                        len(f.since_last_good), f.last_good_step, f.count, e, exc_info=e)

    def _outage_or_raise(self, step: int, e: Exception) -> None:
        """For a save that failed before it started: re-raises ``e`` unless it is storage failing and
        ``on_save_error="warn"`` (then it is counted and logged; the caller goes on)."""
        if not _is_outage(e):
            raise e
        self._failed(step, e)
        if self.on_save_error == "raise":
            raise e

    def _after_save(self, handle: SaveHandle) -> None:
        keep = self.max_to_keep
        if handle.state.value != "committed" or self.coordinator.rank != 0 or keep is None:
            return  # nothing to delete: no manifest is read (a keep-everything run keeps thousands)
        try:
            victims = self._best_victims(self.best, keep) if self.best is not None else self._retention_victims(keep)
            for step in run_sync(victims):
                run_sync(self.store.delete(str(step)))
        except BaseException as e:  # surfaced by wait_until_finished; the checkpoint itself is fine
            log.error("%s: retention failed: %r", self.url, e)
            self._retention_error = e

    async def _retention_victims(self, keep: int) -> list[int]:
        """``self.retention.doomed`` of every intact step, reading only the manifests that can matter.

        Only intact steps count as kept, and only intact steps are deleted: a damaged step
        never makes retention delete a good one, and is left for inspection. The newest
        ``keep`` intact steps stay; of the older directories, periodic steps stay without
        their manifests being read, and the rest are deleted if intact.
        """
        dirs = await self.store.step_dirs()
        if len(dirs) <= keep:  # the newest `keep` would be all of them: nothing is older (no manifest read)
            return []
        # A kept step must be whole (a listing per step): a newer step that lost an object must not
        # count, or retention would delete the older step a restore then needs.
        kept = await self.store.intact_steps(newest=keep, among=dirs, whole=True)
        if len(kept) < keep:
            return []
        older = [s for s in dirs if s < kept[0] and not self.retention.periodic(s)]
        return await self.store.intact_steps(among=older) if older else []

    async def _best_victims(self, best: BestN, keep: int) -> list[int]:
        """Intact steps that are neither among the ``keep`` best whole steps (``best.ranked``) nor
        kept regardless: the newest whole step, ``keep_period`` steps, steps without metrics
        (with ``keep_without_metrics``).

        Reads the root manifest of every step but the periodic ones (the metrics are there; no
        data, no fragment) and lists the objects of each ranked step: a step that lost one is
        damaged, so it neither takes a best place nor is deleted.
        """
        dirs = await self.store.step_dirs()
        newest = await self.store.intact_steps(newest=1, among=dirs, whole=True)
        if not newest:
            return []  # nothing restores: delete nothing
        roots = await self.store.intact_roots(among=[s for s in dirs if not self.retention.periodic(s)])
        victims: list[int] = []
        counted = 0
        for step in best.ranked({s: metrics_of(m) for s, m in roots.items()}):
            if not await self._whole(step, roots[step]):
                continue
            if counted < keep:
                counted += 1
            elif step != newest[0]:
                victims.append(step)
        return victims

    async def _whole(self, step: int, root: Manifest) -> bool:
        try:
            await self.store.check_whole(str(step), root)
        except (FileNotFoundError, IntegrityError) as e:
            log.warning("%s: step %d is damaged: retention neither counts nor deletes it: %s", self.url, step, e)
            return False
        return True

    def wait_until_finished(self) -> None:
        """Wait for the save in flight to commit (and its retention to run).

        Its failure, or its retention's, re-raises (``on_save_error="raise"``) or is logged
        and counted in :attr:`save_failures` (``"warn"``).
        """
        handle, self._pending = self._pending, None
        if handle is not None:
            self._base = None  # a failed save leaves no base: the next one writes in full
            try:
                manifest = handle.result()
            except Exception as e:
                if self._shadows is not None:
                    self._shadows.settle(None)
                self._failed(handle.step, e)
                if self.on_save_error == "raise":
                    raise
            else:
                self.save_failures.since_last_good.clear()
                self.save_failures.last_good_step = handle.step
                # Many hosts: each host's base is its own part of the step (ckptio.saving.incremental.hosts).
                mine = handle.own_base if self.coordinator.size > 1 else manifest
                if self.incremental and mine is not None and handle.step is not None:
                    self._base = (step_dir_of(handle.step), mine)
                if self._shadows is not None:
                    self._shadows.settle(mine if self._base is not None else None)
        if self._retention_error is not None:
            err, self._retention_error = self._retention_error, None
            self.save_failures.retention += 1
            if self.on_save_error == "raise":
                raise err
            log.warning("%s: retention failed; the run goes on (on_save_error='warn'), the checkpoint is committed: "
                        "%r", self.url, err, exc_info=err)

    def restore(self, step: int | None = None, target: Any = None, *, progress: Progress | None = None,
                read_once: bool | None = None) -> Any:
        """Restore ``step`` (default: the newest restorable committed) as ``target`` asks (see
        ``ckptio.restore``); with several hosts, every host must call it (one collective decision).

        ``read_once``: each stored byte is read from storage by one host and sent to the others
        that need it (replicated arrays, data-parallel replicas, a new sharding), still verified
        by every host that uses it. The default (None) does so where the job's coordinator moves
        bytes host to host (torch.distributed); over jax.distributed's coordination service,
        which relays every byte through process 0, only when asked (True)."""
        if read_once is None:
            read_once = (bool(getattr(self.coordinator, "bulk_exchange", False)) and self.coordinator.size > 1
                         and not self.store.host_local)  # each host's own disk: nothing shared to read once
        return restore_step(self.store, step, target, progress=progress, coordinator=self.coordinator,
                            read_once=read_once)

    def delete(self, step: int) -> None:
        """Delete one committed checkpoint (coordinator only)."""
        run_sync(self.store.delete(str(step)))

    def sweep_orphans(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """Delete what crashed saves left (see :meth:`CheckpointStore.sweep`); returns the keys deleted."""
        return run_sync(self.store.sweep(grace_seconds, dry_run=dry_run)).deleted

    def close(self) -> None:
        if self._preemption is not None:
            self._preemption.close()
        self.wait_until_finished()
        if self._shadows is not None:
            self._shadows.drop()
        self._pool.clear()
        run_sync(self.store.close())

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
