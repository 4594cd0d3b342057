"""``TieredCheckpointManager``: every save to the fast tier, replicas to a partner, every K-th to the durable tier.

Layout (per host; the fast tier is host-local, e.g. ``/mnt/ssd/run1`` or
``mem://run1``)::

    <fast_url>/<step>/...           this host's objects + its commit record (ckptio.tiers.held: what a
                                    restart scans; a non-coordinator's part is committed by it alone)
                                    + on host 0 only, the job's manifest: a format-2 root and every
                                    host's fragment (ckptio.saving.carried_fragments: carried in the save's gather)
    <peer_url>/<step>/...           a partner's latest snapshot: its objects, its record (host 0's: the
                                    manifest), a marker
    <durable_url>/<step>/...        every K-th checkpoint, whole, with its own manifest (host 0 commits)

A save is the core save (stage -> write -> gather -> commit by host 0) into
each host's fast tier; then the step is made to stand in every host's fast
tier (:mod:`ckptio.tiers.fastcommit`: host 0 sends each host its checkpoint id
and fragment base, and each host commits its own part's record), the step is queued for the peer and
durable replicators, and the fast tier's retention runs. ``result()`` on the
handle returns when all of that is done -- the replication itself runs in
the background.

A restore is collective: every host reports what it holds to host 0, which
plans (:func:`ckptio.tiers.policy.plan_restore`) and broadcasts the compact
plan, and the
core restore's read plan is routed: peers send the objects a host lacks, the
rest is read from the host's own fast tier or the durable tier, every
checksum checked (:mod:`ckptio.tiers.restore`). A restore
deletes nothing: the steps newer than the one restored are retired by the
first save after it, when training has moved on from the restored step.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from ckptio.backends import Backend
from ckptio.coord.distributed import Coordinator, SingleProcess, TorchCoordinator, join_errors
from ckptio.engine import EngineConfig, Progress, run_sync
from ckptio.saving.options import SaveOptions
from ckptio.saving.job import SaveHandle, start_save
from ckptio.saving.savestate import SaveState
from ckptio.store import CheckpointStore
from ckptio.system.bufferpool import StagingPool
from ckptio.tiers.durable import durable_recovery, durable_round
from ckptio.tiers.fastcommit import commit_everywhere
from ckptio.tiers.group import LocalGroup, PeerGroup, TorchGroup, refuse_other_multihost, torch_world
from ckptio.tiers.peer import holdings, retire_replica
from ckptio.tiers.peerround import replicate_to_partner
from ckptio.tiers.policy import TIERS, Holding, TierPolicy
from ckptio.tiers.replicator import Lag, Pins, ReplicationError, ReplicationWorker
from ckptio.tiers.restore import HostTiers, RestoreReport, restore_from_tiers

__all__ = ["RestoreReport", "TieredCheckpointManager"]

log = logging.getLogger("ckptio.tiers")

#: This host's record (in its fast tier's root) of each host's newest step replicated to its partner.
#: Not a name ckptio.manifest.names proves deletable: no deleter ever touches it; it is replaced whole.
REPLICATED_RECORD = "ckptio.tiers.replicated.json"


class TieredCheckpointManager:
    """Checkpoints in a host-local fast tier, a partner's replica, and a durable tier.

    Every host of the job constructs one at the same point (it creates
    dedicated gloo groups when ``torch.distributed`` is initialized) and
    calls :meth:`save` / :meth:`restore` at the same points, like the core
    save. One save is in flight at a time.

    Args:
        fast_url: this host's fast tier (host RAM ``mem://...`` or a local SSD path).
        durable_url: the durable tier (``gs://...`` or any URL); None for none.
        policy: replication, queues and retention (:class:`TierPolicy`).
        peer_url: where this host keeps partners' replicas (default ``<fast_url>/peer``).
        fast_backend, durable_backend: override the backend the URL would pick (e.g. a wrapped one).
        fast_options, durable_options: backend options for the URLs.
        engine_config: the engines' knobs.
        save_options: how the fast tier's saves run (:class:`ckptio.saving.options.SaveOptions`).
    """

    def __init__(
        self,
        fast_url: str | os.PathLike[str],
        durable_url: str | os.PathLike[str] | None = None,
        *,
        policy: TierPolicy | None = None,
        peer_url: str | os.PathLike[str] | None = None,
        fast_backend: Backend | None = None,
        durable_backend: Backend | None = None,
        fast_options: dict[str, Any] | None = None,
        durable_options: dict[str, Any] | None = None,
        engine_config: EngineConfig | None = None,
        save_options: SaveOptions | None = None,
    ) -> None:
        self.policy = policy or TierPolicy()
        self.save_options = save_options
        # Group creation is collective: the same four, in the same order, on every host.
        self.coordinator: Coordinator
        if torch_world() is not None:
            self.coordinator = TorchCoordinator()
            self._control: PeerGroup = TorchGroup()
            peer_group: PeerGroup = TorchGroup()
            durable_group: PeerGroup = TorchGroup()
        else:
            refuse_other_multihost()
            self.coordinator = SingleProcess()
            self._control = peer_group = durable_group = LocalGroup()
        self.rank, self.size = self._control.rank, self._control.size
        # host_local: each host holds its own part only
        self.fast = CheckpointStore(fast_url, backend=fast_backend, engine_config=engine_config,
                                    backend_options=fast_options, host_local=True)
        self.replica = CheckpointStore(os.fspath(peer_url) if peer_url is not None else _sub_url(self.fast.url, "peer"),
                                       engine_config=engine_config, host_local=True)
        self.durable: CheckpointStore | None = None
        if durable_url is not None or durable_backend is not None:
            url = os.fspath(durable_url) if durable_url is not None else durable_backend.url  # type: ignore[union-attr]
            self.durable = CheckpointStore(url, backend=durable_backend, engine_config=engine_config,
                                           backend_options=durable_options)
        self.pins = Pins()
        self._retention_lock = threading.Lock()  # the save's thread and the replicators' threads run it
        self._pool = StagingPool()
        self._pending: SaveHandle | None = None
        self._hook_error: BaseException | None = None
        self.last_restore: RestoreReport | None = None
        # Set by a restore only once it succeeded on every host, cleared only by a retirement that succeeded
        # on every host: so every host holds the same value, and the next save agrees on retiring or not.
        self._resumed_from: int | None = None
        pol = self.policy
        if pol.peer_replication and self.size > 1 and pol.partner_offset % self.size == 0:
            raise ValueError(f"partner_offset {pol.partner_offset} makes every host its own partner "
                             f"among {self.size} hosts")
        #: Per host: the newest step whose replica is marked complete on its partner (the same on
        #: every host). Each host's fast tier keeps its own copy of these steps (see _fast_retention).
        self._replicated: dict[int, int] = self._load_replicated()
        self.peer_worker: ReplicationWorker | None = None
        if pol.peer_replication and self.size > 1:
            self.peer_worker = ReplicationWorker(
                "peer", peer_group,
                lambda s: replicate_to_partner(peer_group, self.fast, self.replica, s, pol.partner_offset,
                                               on_marked=lambda srcs: self._note_replicated(s, srcs)),
                queue_size=pol.queue_size, coalesce=True, pins=self.pins, after_round=self._fast_retention,
                lag_warn_steps=max(pol.lag_warn_steps, pol.queue_size + 1),
            )
        self.durable_worker: ReplicationWorker | None = None
        if self.durable is not None and pol.replicate_every > 0:
            durable = self.durable
            # Durable steps still holding a killed copy's leftovers (only the worker's thread uses it).
            unclean: set[int] = set()
            self.durable_worker = ReplicationWorker(
                "durable", durable_group,
                lambda s: durable_round(durable_group, self.fast, durable, s, pol, unclean),
                queue_size=pol.queue_size, coalesce=pol.coalesce, pins=self.pins,
                prologue=lambda: durable_recovery(durable_group, self.fast, durable, pol),
                after_round=self._fast_retention, retry_backoff=pol.backoff, max_backlog=pol.max_backlog,
                lag_warn_steps=pol.lag_warn_steps,
            )

    # -- queries (this host's view; no collectives) ------------------------

    def tier_steps(self) -> dict[str, list[int]]:
        """Committed steps per tier as this host sees them: its fast tier, its replicas, the durable tier."""
        return {
            "fast": run_sync(self.fast.committed_steps()),
            "peer": run_sync(self.replica.committed_steps()),
            "durable": run_sync(self.durable.committed_steps()) if self.durable is not None else [],
        }

    def holdings(self) -> list[Holding]:
        """What this host could serve at a restore (own complete copies and partners' replicas)."""
        return holdings(self.fast, self.replica, self.rank)

    @property
    def durable_lag(self) -> Lag | None:
        """How far the durable tier is behind this host's fast tier (None without one).

        ``steps`` saved for the durable tier are not there yet (queued, being
        copied, or failed and waiting for a retry); the oldest was committed in
        the fast tier ``seconds`` ago. A trainer can read it every step; each
        failed round and each save while ``policy.lag_warn_steps`` or more are
        behind also logs a warning.
        """
        return self.durable_worker.lag() if self.durable_worker is not None else None

    @property
    def replication_lag(self) -> Lag | None:
        """How far the partners' replicas are behind this host's fast tier (None without peer replication).

        ``steps`` committed here are not yet replicated to the partner (queued or in a round); with
        ``policy.replica_before_save`` (the default) that is at most the step just saved, so a lost
        host costs at most one save interval. ``last_done`` is the newest step whose round finished.
        """
        return self.peer_worker.lag() if self.peer_worker is not None else None

    @property
    def replicated_steps(self) -> dict[int, int]:
        """Per host, the newest step whose replica is marked complete on its partner."""
        with self._retention_lock:
            return dict(self._replicated)

    @property
    def resumed_from(self) -> int | None:
        """The step training resumed from at the last restore, while the next save is still to retire the
        steps newer than it (None: no restore since the last save, or only ``retire_newer=False`` ones)."""
        return self._resumed_from

    def _load_replicated(self) -> dict[int, int]:
        """The record a previous run of this host left (missing or unreadable: nothing known)."""
        try:
            doc = json.loads(run_sync(self.fast.io.read(REPLICATED_RECORD)))
            return {int(k): int(v) for k, v in doc["replicated"].items()}
        except FileNotFoundError:
            return {}
        except Exception as e:  # noqa: BLE001 -- a bad record only means less is protected until the next round
            log.warning("%s: unreadable %s, ignored: %r", self.fast.url, REPLICATED_RECORD, e)
            return {}

    def _note_replicated(self, step: int, sources: list[int]) -> None:
        """After a peer round: ``sources``' replicas of ``step`` are marked; record it, then retention may go on."""
        with self._retention_lock:
            for src in sources:
                self._replicated[src] = max(step, self._replicated.get(src, -1))
            self._save_replicated()

    def _save_replicated(self) -> None:
        """Persist the record in the fast tier (one small object, replaced whole), for the next run."""
        data = memoryview(json.dumps({"replicated": {str(k): v for k, v in self._replicated.items()}}).encode())
        try:
            run_sync(self.fast.io.write(REPLICATED_RECORD, [data]))
        except Exception as e:  # noqa: BLE001 -- in memory it still protects; a restart knows less
            log.warning("%s: cannot write %s: %r", self.fast.url, REPLICATED_RECORD, e)

    # -- save -------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
        progress: Progress | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` as ``step`` to the fast tier (collective); returns once staged.

        Waits for the previous save's hooks first and, with ``policy.replica_before_save``
        (the default), for the previous step's peer round. Returns None for a step off
        ``save_interval_steps`` or one every host already holds (``force``:
        raise FileExistsError for the latter). A stale copy of ``step`` on
        some hosts only (left by a crash between commits) is deleted first.

        The first save after a :meth:`restore` (that is not off the interval)
        first retires the steps newer than the restored one from every tier
        (see :meth:`restore`); should that fail, it raises OSError on every
        host and the next save tries again.
        """
        self._wait_save()
        if not force and not self.policy.interval.due(step):
            return None
        if self.peer_worker is not None and self.policy.replica_before_save:
            # The loss bound: the previous step is replicated (or its round failed) before this one begins.
            self.peer_worker.wait()
        if self._resumed_from is not None:
            # Before the check below: a re-saved step number of the abandoned timeline must not count as held.
            with self._replicators_paused():
                self._retire_newer(self._resumed_from)
            self._resumed_from = None
        try:
            has: bool | str = run_sync(self.fast.is_committed(str(step)))
        except Exception as e:  # still take part in the gather, so that every host fails alike
            has = f"host {self.rank}: {type(e).__name__}: {e}"
        # Host 0 alone sees every host's answer; the others receive only its verdict.
        everyone = self._control.gather(has)
        verdict: dict[str, Any] = {"error": None, "all": False}
        if everyone is not None:
            errors = [h for h in everyone if isinstance(h, str)]
            verdict = {"error": join_errors(errors) if errors else None, "all": all(everyone)}
        verdict = self._control.broadcast(verdict)
        if verdict["error"]:
            raise OSError(f"save of step {step}: cannot read the fast tier: {verdict['error']}")
        if verdict["all"]:
            if force:
                raise FileExistsError(f"step {step} is already committed in every host's fast tier")
            return None
        if has:
            log.warning("%s: step %d is committed here but not on every host; deleting the stale copy",
                        self.fast.url, step)
            run_sync(self.fast.delete(str(step)))
        handle = start_save(
            self.fast, step, state, metadata=metadata, coordinator=self.coordinator, pool=self._pool,
            progress=progress, on_done=self._after_save, options=self.save_options,
        )
        self._pending = handle
        return handle

    def _after_save(self, handle: SaveHandle) -> None:
        """On every host, in the save's thread: the fast tier's commit everywhere, queue replication, retention."""
        if handle.state != SaveState.COMMITTED or handle.step is None:
            return  # the same verdict on every host: nobody runs a collective below
        step = handle.step
        error = commit_everywhere(self._control, self.fast, step, handle.part, handle.part_bases)
        if error is not None:  # this host then does not hold the step; restore plans around it
            self._hook_error = error
        # Queue on every host alike, held or not: the workers' rounds are collective.
        if self.peer_worker is not None:
            self.peer_worker.submit(step)
        if self.durable_worker is not None and self.policy.replicates(step):
            self.durable_worker.submit(step)
        try:
            self._fast_retention()
        except BaseException as e:
            log.error("%s: fast-tier retention failed: %r", self.fast.url, e)
            self._hook_error = e

    def _fast_retention(self) -> None:
        """Delete this host's fast-tier steps beyond its retention, except those a replicator still needs
        and the newest replicated step of every host.

        Runs after each save and after each replication round (which may have unpinned a step).
        Keeping its own copy of each host's newest replicated step is what bounds a host loss: the
        lost host's shards of that step are on its partner, everyone else's here, so the job
        restores it at worst -- never an older step, never the durable tier.
        """
        with self._retention_lock:
            steps = run_sync(self.fast.committed_steps())
            keep = self.pins.snapshot() | set(self._replicated.values())
            for s in self.policy.fast.doomed(steps, keep):
                run_sync(self.fast.delete(str(s)))

    def _wait_save(self) -> None:
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.result()
        if self._hook_error is not None:
            err, self._hook_error = self._hook_error, None
            raise err

    def wait_until_finished(self) -> None:
        """Wait for the save in flight and for both replicators to work off their queues.

        Re-raises the save's failure, then a ReplicationError for any round that failed since the last call.
        """
        self._wait_save()
        errors: list[BaseException] = []
        for w in (self.peer_worker, self.durable_worker):
            if w is not None:
                w.wait()
                errors += w.take_errors()
        if errors:
            raise ReplicationError("; ".join(f"{type(e).__name__}: {e}" for e in errors)) from errors[0]

    # -- restore ------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        tiers: Collection[str] = TIERS,
        progress: Progress | None = None,
        retire_newer: bool = True,
    ) -> Any:
        """Restore the newest checkpoint complete in some tier (or ``step``), as ``target`` asks (collective).

        Each host reads each writer's objects from the fastest place that has
        them: itself, a peer (sent over the job's gloo group), the durable
        tier. ``tiers`` limits the places (e.g. ``("durable",)``). Every byte
        is checked against its checksum. :attr:`last_restore` says what came
        from where.

        A restore deletes nothing: every step in every tier stays, and stays
        restorable, so a restore of an older step to inspect or evaluate it
        costs no checkpoint. Once every host has restored the step, training
        is taken to resume from it (:attr:`resumed_from`): the first save
        after the restore, before it writes anything, retires the steps newer
        than it -- an abandoned timeline, after a fallback or a rollback --
        from every host's fast tier, its partners' replicas and the durable
        tier, and drops them from the replication queues, so that training
        re-saves those step numbers as new checkpoints. A later restore
        replaces the step resumed from (restoring the newest step again
        leaves nothing to retire). ``retire_newer=False``: a look-only
        restore, for training that goes on from its own state; the next save
        retires nothing on its account (an earlier restore's resume stands).
        """
        self._wait_save()
        # A replica must not be read while a peer round replaces it, nor the holdings change while the
        # hosts plan from them.
        with self._replicators_paused():
            restored, out = self._restore(step, target, tiers, progress)
        if retire_newer:
            self._resumed_from = restored
        return out

    @contextmanager
    def _replicators_paused(self) -> Iterator[None]:
        """Both replicators hold still (after their current round) inside (collective, like their rounds)."""
        workers = [w for w in (self.peer_worker, self.durable_worker) if w is not None]
        for w in workers:
            w.pause()
        try:
            yield
        finally:
            for w in workers:
                w.resume()

    def _restore(
        self, step: int | None, target: Any, tiers: Collection[str], progress: Progress | None
    ) -> tuple[int, Any]:
        """The step restored (the same on every host, or an error on every host) and what it restored."""
        report, out = restore_from_tiers(HostTiers(self._control, self.fast, self.replica, self.durable),
                                         step, target, tiers, progress)
        self.last_restore = report
        log.info("restored step %d on host %d in %.3fs: %s", report.step, self.rank, report.seconds,
                 report.bytes_from)
        return report.step, out

    def _retire_newer(self, head: int) -> None:
        """Collective, with the replicators paused: make ``head`` (the step resumed from) the newest step.

        Run by the first save after a restore, on every host alike. Each host
        deletes its own fast-tier and replica steps newer than ``head`` and
        drops them from its replication queues; host 0 deletes the durable
        tier's. Deletion goes through the stores (ckptio's names only, never a live save's objects).
        """
        error: str | None = None
        try:
            for w in (self.peer_worker, self.durable_worker):
                if w is not None:
                    w.drop_newer(head)
            with self._retention_lock:
                if any(v > head for v in self._replicated.values()):
                    self._replicated = {k: v for k, v in self._replicated.items() if v <= head}
                    self._save_replicated()
                for s in run_sync(self.replica.step_dirs()):
                    if s > head:
                        run_sync(retire_replica(self.replica, s))
                for s in run_sync(self.fast.step_dirs()):
                    if s > head:
                        run_sync(self.fast.delete(str(s)))
            if self.rank == 0 and self.durable is not None:
                for s in run_sync(self.durable.step_dirs()):
                    if s > head:
                        run_sync(self.durable.delete(str(s)))
        except Exception as e:  # noqa: BLE001 -- reported on every host below
            error = f"host {self.rank}: {type(e).__name__}: {e}"
        errors = self._control.gather(error)
        verdict = self._control.broadcast(join_errors([e for e in errors if e]) if errors is not None else None)
        if verdict:
            # A leftover newer step would be skipped as "already committed" by the save of that number,
            # so nothing is saved: on every host alike, and the next save tries again.
            raise OSError(f"training resumed from step {head}, but retiring the newer steps failed: {verdict}")
        log.info("step %d is the head: newer steps retired on host %d", head, self.rank)

    # -- closing ------------------------------------------------------------

    def close(self) -> None:
        """Wait for everything queued (collective, like a save), stop the replicators, close the stores."""
        try:
            self.wait_until_finished()
        finally:
            for w in (self.peer_worker, self.durable_worker):
                if w is not None:
                    w.close()
            self._pool.clear()
            for s in (self.fast, self.replica, self.durable):
                if s is not None:
                    run_sync(s.close())

    def __enter__(self) -> TieredCheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sub_url(url: str, name: str) -> str:
    """``url`` + ``/name`` (URLs and paths alike)."""
    return url.rstrip("/") + "/" + name
