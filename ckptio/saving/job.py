"""A save, from staging to commit: :class:`SaveJob`, one method per phase.

``start_save`` stages on the calling thread (the only part the training
step waits for), then the save's own thread has the writer write every
object (``written``), gathers every host's record, and the coordinator
commits the manifest (``committed``). The handle the caller holds and the
save's options are :mod:`ckptio.saving.handle`; the collective verdict every host
joins, even after a failure, is :mod:`ckptio.coord.collective`; who writes the
objects is a :class:`ckptio.saving.writers.base.Writer`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.backends.budget import alone
from ckptio.coord.collective import collective_verdict, failed_record, join_as_failed
from ckptio.coord.distributed import Coordinator, SingleProcess
from ckptio.coord.waits import waiting_for
from ckptio.engine import Progress, WrittenObject, gilswitch, run_sync, submit
from ckptio.engine.layout import ObjectPlan, pack, pieces_of
from ckptio.errors import SaveFailedError
from ckptio.manifest import Manifest, merge_records
from ckptio.manifest.builder import host_record as _host_record
from ckptio.saving.fillers import fill_objects, fillers_for
from ckptio.saving.devicecopy import DeviceStaging
from ckptio.saving.handle import SaveHandle
from ckptio.saving.options import SaveOptions
from ckptio.saving.recording import Recording, recording_for
from ckptio.saving.incremental.plan import Reuse, pin_bases, plan_reuse, settle_views
from ckptio.saving.incremental.shadow import Shadows
from ckptio.saving.savestate import SaveState
from ckptio.saving.staging import PACK_MAX_BYTES, LeafPacker, StagingArea, stage_leaves
from ckptio.saving.summedfill import staging_fill
from ckptio.saving.writers.auto import default_writer
from ckptio.saving.writers.base import Writer
from ckptio.state.leaves import LeafPack
from ckptio.state.tree import flatten_named
from ckptio.store import CheckpointStore, step_dir_of
from ckptio.store.transaction import WriteTransaction, new_id
from ckptio.store.resave import wait_bound
from ckptio.system import gcpause as _gc
from ckptio.system.bufferpool import StagingPool

__all__ = ["SaveHandle", "SaveJob", "SaveOptions", "merge_records", "start_save"]

log = logging.getLogger("ckptio.save")


async def _step_is_clear(store: CheckpointStore, step_dir: str, *, coordinator: bool) -> bool:
    """True if this host's checks of ``step_dir`` before a save find nothing to do there.

    The coordinator's: no tombstone and no manifest (else ``prepare_save`` has work: an interrupted
    deletion to finish, a committed step to refuse, an unconfirmed commit to settle or wait for).
    The others': no commit that stands -- an unconfirmed one is host 0's to settle or wait for, and
    refusing it here would fail a save host 0 lets go ahead (its verdict fails every host anyway
    if host 0 refuses).
    """
    if coordinator:
        return await store.step_is_clear(step_dir)
    return not await store.commit_stands(step_dir)


def start_save(
    store: CheckpointStore,
    step: int | None,
    state: Any,
    **kwargs: Any,
) -> SaveHandle:
    """Stage ``state`` now and write + commit it in the background; returns once staged.

    Keywords: ``metadata``, ``coordinator``, ``copy``, ``pool``, ``progress``, ``on_done``
    and ``options`` (:class:`SaveJob`). Raises on the calling thread what refuses the save
    (bad input, a committed step), after telling the other hosts; every later failure
    reaches the caller through :meth:`SaveHandle.result`.
    """
    with _gc.paused():  # the caller waits for staging anyway: no collections mid-burst
        return SaveJob(store, step, **kwargs).stage(state)


class SaveJob:
    """One host's part of one save, in named phases.

    - :meth:`stage` (the calling thread, the only part the training step waits for):
      validate and stage the state, plan its objects, begin its write transaction (announce the save),
      then fill each object's buffers and let its write start;
    - on the save's own thread, :meth:`run`: :meth:`write` (the writer),
      :meth:`record` (this host's record, or its fragment with many hosts),
      :meth:`verdict` (the gather and the verdict, ``collective_verdict``: every host
      joins it, even after a failure), :meth:`commit` (inside the verdict, on the
      coordinator only) and :meth:`finish` (the hook, then the handle).

    A job runs once; its handle (:attr:`handle`) is what the caller holds.
    """

    # What the stage phase makes, for the phases after it (all set before the save's thread starts).
    structure: Any
    staged: dict[str, Any]
    packs: list[LeafPack]
    arrays: dict[tuple[str, int], np.ndarray]
    save_id: str
    plans: list[ObjectPlan]
    ready: list[concurrent.futures.Future[None]]
    head: dict[str, Any]
    tx: WriteTransaction

    def __init__(
        self,
        store: CheckpointStore,
        step: int | None,
        *,
        metadata: dict[str, Any] | None = None,
        coordinator: Coordinator | None = None,
        copy: bool = True,
        pool: StagingPool | None = None,
        progress: Progress | None = None,
        on_done: Callable[[SaveHandle], None] | None = None,
        options: SaveOptions | None = None,
        incremental: bool = False,
        base: tuple[str, Manifest] | None = None,
        shadows: Shadows | None = None,
    ) -> None:
        self._t0 = time.perf_counter()
        #: An incremental save's base (step directory, its committed manifest; None: digests only)
        #: and, once staged, what it takes from it; the manager's shadows (ckptio.saving.incremental).
        self.incremental, self.base, self.shadows = incremental, base, shadows
        self.reuse: Reuse | None = None
        self.store, self.step, self.metadata = store, step, metadata or {}
        self.coord: Coordinator = coordinator or SingleProcess()
        self.copy, self.progress, self.on_done = copy, progress, on_done
        self.options = options = options or SaveOptions()
        # Read here, on the caller's thread: a bad setting refuses the save before anything is staged.
        self.gil_switch = options.gil_interval()
        self.writer: Writer = options.writer_for(store)
        # No writer asked for: it may still follow the state (ckptio.saving.writers.auto), and its pool.
        self._pool = pool
        self.step_dir = step_dir_of(step)
        self.where = store.where(self.step_dir)
        self.handle = SaveHandle(self.where, step)
        # The save's buffers: snapshots of mutable leaves (with ``copy``) and packs of small ones
        # (always: a pack is one copy of bytes that are tiny next to the per-leaf work it saves).
        # A writer process reads staged bytes from shared memory: they are staged there, no later copy.
        self.area = StagingArea(self.writer.staging_pool(pool))
        # One host: its record is the manifest. Many: a fragment each, or carried in the gather where
        # the store is host-local (ckptio.saving.recording): chosen once, here.
        self.recording: Recording = recording_for(self.coord.size, store.host_local)
        self.deferred: list[Callable[[], None]] = []  # the structure's bulk, built by the save's thread
        #: The device snapshots' fill behind the step (:meth:`_fill_later`), and its stop.
        self._later: threading.Thread | None = None
        self._stop = threading.Event()
        self.manifest: Manifest | None = None
        #: Set on the coordinator when the step is busy (ckptio.store.resave): the latest
        #: ``time.time()`` its commit waits until for the other save to confirm or be settled.
        self.busy_until: float | None = None
        #: Whether this host's checks of the step find nothing to do (:func:`_step_is_clear`):
        #: :meth:`_plan` starts them, :meth:`_announce` acts on them.
        self._clear: concurrent.futures.Future[bool]

    # -- stage: the calling thread ---------------------------------------------

    def stage(self, state: Any) -> SaveHandle:
        """Stage ``state`` and start the save's thread; returns the handle once staged.

        The job keeps no reference to ``state``: only to what it staged.
        """
        self._refusable(lambda: self._plan(state))
        self._layout()
        self._refusable(self._announce)
        self._fill()
        self.handle.stage_seconds = time.perf_counter() - self._t0
        log.info("%s: staged %d objects (%.3fs)", self.where, len(self.plans), self.handle.stage_seconds)
        return self.handle

    def _refusable(self, phase: Callable[[], None]) -> None:
        """Run ``phase``; if it refuses the save, free the buffers and tell the other hosts first."""
        try:
            phase()
        except BaseException as e:
            self.area.release()
            join_as_failed(self.coord, failed_record(self.coord.rank, e)["error"], self.where)
            raise

    def _plan(self, state: Any) -> None:
        """Check every leaf before the first byte is written (nothing to clean up on bad input)."""
        store, rank = self.store, self.coord.rank
        names, values, self.structure = flatten_named(state, deferred=self.deferred)
        if not self.incremental:  # incremental: in-process (shadows, views)
            writer = default_writer(store, values, rank, self.writer, self.options.writer_asked)
            if writer is not self.writer:  # nothing staged yet: stage where that writer reads
                self.writer = writer
                self.area = StagingArea(writer.staging_pool(self._pool))
        defaults = store.backend.layout_defaults
        packer = None
        if rank == 0:  # only host 0 writes plain (replicated) arrays
            packer = LeafPacker(self.area, min(PACK_MAX_BYTES, store.engine.config.block_size, defaults.object_size),
                                defaults.object_size)
        # JAX arrays: a device copy now, their bytes moved to the host behind the step (copy=False: the
        # caller promises they stay, so none); ckptio.saving.devicecopy.
        self.device = DeviceStaging(self.options.device_snapshot if self.copy else "none", self.area)
        self.staged, self.packs = stage_leaves(
            names, values, rank, self.area if self.copy else None, self.options.layout.tile_bytes_for(defaults),
            packer, placeholders=not self.recording.tables, device=self.device)
        self.device.settle()
        if self.incremental and not store.host_local and self.step is not None:
            self.reuse = plan_reuse(self.staged, self.area.source_of, self.base, self.shadows)
        # Checked while the save announces itself (:meth:`_announce`), not before: under a request
        # budget a read and a write take separate slots, so the checks cost no round of their own.
        self._clear = submit(_step_is_clear(store, self.step_dir, coordinator=rank == 0))

    def _layout(self) -> None:
        """Plan the objects, name them, and write the manifest's head."""
        store, coord = self.store, self.coord
        pieces, self.arrays = pieces_of(self.staged, self.packs, store.engine.config.block_size)
        if self.reuse is not None:  # unchanged items: neither copied nor written; views: decided later
            later = self.reuse.items | self.reuse.deferred
            pieces = [p for p in pieces if p.item not in later or p.shard < 0]
            self.area.forget([data for name in self.reuse.items for _o, _s, data in self.staged[name].shards])
        self.save_id = save_id = new_id()
        self.plans = self._pack(pieces, 0)
        # Each object's write starts as soon as its own bytes are staged.
        self.ready = [concurrent.futures.Future() for _ in self.plans]
        self.head = {
            "format": "ckptio", "version": 1, "step": self.step, "checkpoint_id": save_id, "fence": new_id(),
            "created": time.time(), "block_size": store.engine.config.block_size, "num_hosts": coord.size,
            "tree": self.structure, "metadata": self.metadata,
        }

    def _pack(self, pieces: list[Any], first: int) -> list[ObjectPlan]:
        """``pieces`` packed into objects numbered from ``first``."""
        store, coord, save_id = self.store, self.coord, self.save_id
        return pack(
            pieces,
            object_size=store.backend.layout_defaults.object_size,
            align=store.backend.capabilities.alignment,
            in_place=not self.writer.copies,
            key_for=lambda n: store.naming.object_key(self.step_dir, save_id, coord.rank, coord.size, first + n),
        )

    def _lay_out_views(self) -> None:
        """The save's thread: settle the views an incremental save deferred (:func:`settle_views`)
        and lay out the ones it writes after the rest (their bytes need no copy: ready at once)."""
        if self.reuse is None or not self.reuse.views:
            return
        late = settle_views(self.reuse, self.staged)
        if not late:
            return
        pieces, arrays = pieces_of({name: self.staged[name] for name in late}, (), self.store.engine.config.block_size)
        plans = self._pack(pieces, len(self.plans))
        ready: list[concurrent.futures.Future[None]] = [concurrent.futures.Future() for _ in plans]
        for fut in ready:
            fut.set_result(None)
        # New lists, not appended to: the calling thread may still be filling from the old ones.
        self.plans, self.ready, self.arrays = [*self.plans, *plans], [*self.ready, *ready], {**self.arrays, **arrays}

    def _announce(self) -> None:
        """Announced before the first object: deleters spare a live save's objects, whatever their age.

        The intent is written while the step's checks (:func:`_step_is_clear`) run. Where they find
        something, this save's intent -- all it wrote yet -- is retired: a non-coordinator refuses
        the committed step; host 0 prepares the step as it would before any intent of this save
        (finishing an interrupted deletion, settling a dead save's commit), then announces again.
        """
        self.tx = self._begin()
        try:
            clear = self._clear.result()
            if not clear and self.coord.rank != 0:
                raise FileExistsError(f"checkpoint {self.where} is already committed")
        except BaseException:
            self.tx.end(ok=True)
            raise
        if clear:
            return
        self.tx.end(ok=True)
        # A commit whose save may be alive makes this save busy: it writes, and waits before its
        # commit (ckptio.store.resave).
        if run_sync(self.store.prepare_save(self.step_dir, defer=True)):
            self.busy_until = time.time() + wait_bound(self.store.lease_s)
        self.tx = self._begin()

    def _begin(self) -> WriteTransaction:
        try:  # the step's checks run beside it (_announce): not prepared here
            return self.store.begin_save(self.step_dir, self.save_id, host=self.coord.rank, prepare=False)
        except BaseException:
            self._clear.exception()  # the checks end before the refusal is reported
            raise

    def _fill(self) -> None:
        """Fill every object's buffers in order, releasing each object's write once they are."""
        area, ready = self.area, self.ready
        thread = threading.Thread(target=self.run, name=f"ckptio-save-{self.step}", daemon=True)
        try:
            area.prefault()
            # Packs first, before the writer starts: copying thousands of small arrays holds the GIL,
            # and the writer's per-member checksums would contend for it inside the step's stall.
            for p in self.packs:
                area.fill(p.buffer)
            # Each object's write is released once its own arrays are copied (a failed write cancels
            # the objects still waiting for theirs); large states are copied by helpers too. Taken
            # before the save's thread starts: it may lay out more objects (an incremental save's views).
            objects, arrays = [[(e.item, e.shard) for e in plan.extents] for plan in self.plans], self.arrays
            copies = (arrays[k] for k in {k for keys in objects for k in keys})
            threads = fillers_for(sum(a.nbytes for a in copies if area.source_of(a) is not a))  # copy=False: none
            fill = staging_fill(area, self.plans, arrays, self.store.engine.config.block_size, threads)
            later = {k for keys in objects for k in keys if area.on_device(arrays[k])}
            thread.start()
            if later:  # device snapshots: the host's copies now, theirs behind the step
                now = [[k for k in keys if k not in later] for keys in objects]
                fill_objects(fill, now, arrays, [concurrent.futures.Future() for _ in now], threads)
                self._later = threading.Thread(target=self._fill_later, args=(fill, objects, arrays, later),
                                               name=f"ckptio-d2h-{self.step}", daemon=True)
                self._later.start()
                return
            fill_objects(fill, objects, arrays, ready, threads)
            area.fill_all()  # zero-byte pieces belong to no object
        except BaseException as e:
            for fut in ready:
                if not fut.done():
                    fut.set_exception(SaveFailedError(f"{self.where}: staging failed: {e!r}"))
            if thread.ident is None:
                thread.start()  # it fails the save, tells the other hosts and releases the buffers
            raise

    def _fill_later(self, fill: Callable[[Any], None], objects: list[list[Any]], arrays: dict[Any, Any],
                    later: set[Any]) -> None:
        """The device snapshots' bytes to the host, in object order, each object's write released once
        its last array is in; each copy's device-to-host transfer starts while the one before is staged."""
        order = list(dict.fromkeys(k for keys in objects for k in keys if k in later))
        after = {id(arrays[k]): arrays[n] for k, n in zip(order, order[1:])}

        def fill_next(out: Any) -> None:
            if self._stop.is_set():
                raise SaveFailedError(f"{self.where}: stopped (the save failed)")
            if id(out) in after:
                self.area.prefetch(after[id(out)])
            fill(out)

        threads = min(2, fillers_for(sum(arrays[k].nbytes for k in order)))
        try:
            fill_objects(fill_next, objects, arrays, self.ready, threads)
            self.area.fill_all()
        except BaseException as e:
            for fut in self.ready:
                if not fut.done():
                    fut.set_exception(SaveFailedError(f"{self.where}: staging failed: {e!r}"))

    # -- the save's thread -----------------------------------------------------

    def run(self) -> None:
        """Write, record, join the verdict (committing on the coordinator), finish -- under a short
        switch interval (``ckptio.engine.gilswitch``: each of the chain's steps waits for the GIL)."""
        with gilswitch.shortened(self.gil_switch):
            self._run()

    def _run(self) -> None:
        failure: BaseException | None = None
        try:
            record = self.record(self.write())
            if self.reuse is not None and self.shadows is not None:  # written: the copies outlive the area
                self.shadows.offer(self.save_id, self.reuse.kept(), self.reuse.written_private(), self.staged,
                                   self.area)
        except BaseException as e:  # every host must still join the gather, or the others hang
            log.error("%s: host %d failed to write: %r", self.where, self.coord.rank, e)
            record, failure = failed_record(self.coord.rank, e), e
        finally:
            self._stop.set()  # a background fill still running stops at its next array
            if self._later is not None:
                self._later.join()
            self.area.release()
        outcome = self.verdict(record, failure)
        self.area.settle()  # new pool buffers into huge pages: after the commit, before result() resolves
        self.finish(outcome)

    def write(self) -> list[WrittenObject]:
        """Build the structure's deferred bulk, then have the writer write and sync every object.

        An incremental save pins its bases meanwhile: only its commit references their objects,
        and its own objects' writes do not touch them (docs/incremental.md, R1 and R2)."""
        self._lay_out_views()
        pinning = None
        if self.reuse is not None and self.reuse.items:
            pinning = submit(pin_bases(self.store, self.step_dir, self.save_id, self.reuse))
        try:
            with _gc.paused():
                for build in self.deferred:
                    build()
            written = self.writer.write(self.store, self.plans, self.progress, self.ready, self.where)
        finally:
            if pinning is not None:  # settled before the save goes on or fails: no pin made behind its back
                concurrent.futures.wait([pinning])
        if pinning is not None:
            pinning.result()
        return written

    def record(self, written: list[WrittenObject]) -> dict[str, Any]:
        """This host's record for the gather: its part of the manifest or, with many hosts, its
        fragment's summary (the fragment written and this host's objects checked first)."""
        rank = self.coord.rank
        with _gc.paused():
            record = _host_record(self.staged, self.plans, written, rank, include_values=rank == 0, packs=self.packs,
                                  tables=self.recording.tables)
        record = self.recording.record(self, record)
        self.handle.state = SaveState.WRITTEN
        log.info("%s: host %d written (%d objects)", self.where, rank, len(self.plans))
        return record

    def commit(self, records: list[dict[str, Any]]) -> None:
        """The coordinator's phase: every host's record as one manifest, committed."""
        with _gc.paused():
            manifest, data = self.recording.manifest(self, records)
        # Every other host waits on this commit in the verdict: their request shares are ours.
        with alone(self.store.engine.backend):
            if self.busy_until is not None:
                run_sync(self.store.wait_step_free(self.step_dir, self.busy_until))
            self.tx.commit(manifest, data)
        self.manifest = manifest

    def verdict(
        self, record: dict[str, Any], failure: BaseException | None,
    ) -> tuple[Manifest | None, BaseException | None]:
        """Send ``record`` to the gather and join the verdict (the coordinator runs :meth:`commit`
        if every host wrote), then end its write transaction: the save's outcome, as ``(manifest on the
        coordinator, error)``. ``failure`` is this host's own error, raised in the verdict's place."""
        try:
            # The others may still be writing (and host 0 committing): the wait covers that IO.
            nbytes = sum(p.size for p in self.plans) if hasattr(self, "plans") else 0
            deadline = self.store.engine.config.collective_deadline_s(nbytes)
            with waiting_for(f"commit of step {self.step}", deadline):
                verdict = collective_verdict(self.coord, record, self.commit)
            if not verdict.ok:
                raise failure or SaveFailedError(f"{self.where}: save failed: {verdict.error}")
            self.tx.end(ok=True)
            self.handle.state = SaveState.COMMITTED
            log.info("%s: committed", self.where)
            return (self.manifest if self.coord.rank == 0 else None, None)
        except BaseException as e:
            self.tx.end(ok=False)  # dead at once: marks this attempt's objects as a dead save's
            self.handle.state = SaveState.FAILED
            return (None, e)

    def finish(self, outcome: tuple[Manifest | None, BaseException | None]) -> None:
        """Run the after-save hook, then resolve the handle with ``outcome``.

        Hooks (retention, closing the store) run before the handle resolves, so that
        ``result()`` returning means everything this save set off is done.
        """
        if self.on_done is not None:
            try:
                self.on_done(self.handle)
            except BaseException as e:  # a hook must not hide the save's own outcome
                log.error("%s: after-save hook failed: %r", self.where, e)
        self.handle.resolve(*outcome)
