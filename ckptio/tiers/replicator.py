"""Background replication: a bounded queue per destination, worked off in the same order on every host.

A :class:`ReplicationWorker` owns one thread and one dedicated group. Saves
hand it committed steps (:meth:`ReplicationWorker.submit` waits only while
its queue is full); the thread agrees with the other hosts on the next step
(host 0 gathers each host's proposal and broadcasts the step), runs one *round* for it, and moves
on. Because every host runs the same rounds in the same order, a round may
itself use collectives.

Steps queued or in a round are *pinned*: the fast tier's retention keeps
them until the worker is done with them, so a replica is never copied from
a checkpoint that retention is deleting. Nothing uncommitted is ever queued:
only a save whose fast-tier commit succeeded submits its step.

The durable round (:func:`durable_round`) copies every host's own objects to
the durable tier with :func:`ckptio.copy.copy_objects` and then host 0
commits the manifest there, last. A run killed mid-copy leaves objects
without a manifest (invisible to readers); :func:`durable_recovery`, the
first thing a new run's worker does, finds fast-tier steps newer than the
durable tier's newest and copies them again, keeping the objects that
already arrived whole.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from ..copy import copy_objects, object_writers, rekey
from ..distributed import join_errors
from ..engine import run_sync
from ..errors import CkptioError
from ..manifest import Manifest
from ..store import CheckpointStore
from .group import PeerGroup
from .peer import checkpoint_disagreement, holdings
from .policy import TierPolicy

__all__ = ["Pins", "ReplicationError", "ReplicationWorker", "durable_recovery", "durable_round"]

log = logging.getLogger("ckptio.tiers.replicator")


class ReplicationError(CkptioError):
    """A replication round failed; the checkpoint is still in the fast tier, and the durable
    tier shows nothing of it (or a complete earlier copy)."""


class Pins:
    """Steps the fast tier must keep (a count per step: several queues may hold one step)."""

    def __init__(self) -> None:
        self._n: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, step: int) -> None:
        with self._lock:
            self._n[step] += 1

    def remove(self, step: int) -> None:
        with self._lock:
            self._n[step] -= 1
            if self._n[step] <= 0:
                del self._n[step]

    def snapshot(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._n)


class ReplicationWorker:
    """One background thread working off a bounded queue of committed steps, in lockstep across hosts.

    Args:
        name: for the thread and logs ("peer", "durable").
        group: a group that only this worker uses.
        round_fn: does the replication of one step (collective; may raise).
        queue_size: steps waiting at most; :meth:`submit` waits beyond that.
        coalesce: take the newest waiting step and drop the older ones.
        pins: shared with the fast tier's retention.
        prologue: run first on the thread (collective); returns steps to replicate before the queue.
        after_round: run (locally) after each round, once its step is unpinned -- the fast
            tier's retention, which could not delete the step while it was pinned.
    """

    def __init__(
        self,
        name: str,
        group: PeerGroup,
        round_fn: Callable[[int], None],
        *,
        queue_size: int,
        coalesce: bool,
        pins: Pins,
        prologue: Callable[[], list[int]] | None = None,
        after_round: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.group = group
        self.round_fn = round_fn
        self.queue_size = queue_size
        self.coalesce = coalesce
        self.pins = pins
        self.prologue = prologue
        self.after_round = after_round
        self.done: list[int] = []
        self.skipped: list[int] = []
        self._errors: list[BaseException] = []
        self._pending: collections.deque[int] = collections.deque()
        self._busy = prologue is not None
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"ckptio-{name}-replicator", daemon=True)
        self._thread.start()

    # -- the saving side -------------------------------------------------

    def submit(self, step: int) -> None:
        """Queue a committed step; waits only while the queue is full."""
        with self._cond:
            while len(self._pending) >= self.queue_size and not self._closing:
                self._cond.wait()
            if self._closing:
                raise RuntimeError(f"{self.name} replicator is closed")
            self.pins.add(step)
            self._pending.append(step)
            self._cond.notify_all()

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._pending)

    def wait(self) -> None:
        """Until every queued step has had its round (on this host)."""
        with self._cond:
            while (self._pending or self._busy) and self._thread.is_alive():
                self._cond.wait()

    def take_errors(self) -> list[BaseException]:
        with self._cond:
            out, self._errors = self._errors, []
        return out

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the thread ------------------------------------------------------

    def _round(self, step: int) -> None:
        try:
            self.round_fn(step)
            self.done.append(step)
        except BaseException as e:  # the next round must still run, on every host alike
            log.error("%s replication of step %d failed: %s", self.name, step, e)
            with self._cond:
                self._errors.append(e)

    def _run(self) -> None:
        if self.prologue is not None:
            try:
                todo = self.prologue()
            except BaseException as e:
                log.error("%s replicator: recovery failed: %s", self.name, e)
                with self._cond:
                    self._errors.append(e)
                todo = []
            for step in todo:
                self.pins.add(step)
                try:
                    self._round(step)
                finally:
                    self.pins.remove(step)
                self._after()
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                proposal = self._pending[-1] if self.coalesce else self._pending[0]
                self._busy = True
            # Hosts may be a save apart; the smallest proposal is one every host has queued
            # (or, for a host whose save hook failed, one it runs and fails alike). Host 0
            # alone picks it: a gather and a broadcast, so no host receives every proposal.
            try:
                proposals = self.group.gather(proposal)
                step = int(self.group.broadcast(min(proposals) if proposals is not None else None))
            except BaseException as e:  # the group is gone (job tearing down): stop quietly
                log.error("%s replicator stopped: %s", self.name, e)
                with self._cond:
                    self._errors.append(e)
                    for s in self._pending:
                        self.pins.remove(s)
                    self._pending.clear()
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                while self._pending and self._pending[0] < step:
                    old = self._pending.popleft()
                    self.skipped.append(old)
                    self.pins.remove(old)
                    log.info("%s replication: step %d skipped for the newer step %d", self.name, old, step)
                mine = bool(self._pending) and self._pending[0] == step
                if mine:
                    self._pending.popleft()
                self._cond.notify_all()
            try:
                self._round(step)
            finally:
                if mine:
                    self.pins.remove(step)
                self._after()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _after(self) -> None:
        if self.after_round is not None:
            try:
                self.after_round()
            except Exception as e:  # retention failing must not stop replication
                log.error("%s replicator: after-round hook failed: %r", self.name, e)


def _own_indices(own: CheckpointStore, manifest_objects: list[str], writers: list[int | None], rank: int) -> list[int]:
    """The objects this host copies: those it wrote, plus any unreferenced ones it has."""
    mine = [i for i, w in enumerate(writers) if w == rank]
    loose = [i for i, w in enumerate(writers) if w is None]
    for i in loose:
        try:
            run_sync(own.backend.stat(manifest_objects[i]))
            mine.append(i)
        except FileNotFoundError:
            pass
    return sorted(mine)


def durable_round(
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, step: int, policy: TierPolicy
) -> None:
    """Copy ``step`` from every host's fast tier to the durable tier; host 0 commits it there, last.

    Collective. Raises ReplicationError on every host alike if the step is
    not complete in the fast tier, the durable tier holds another checkpoint
    under that step, or any host's copy failed (then nothing is committed).
    """
    step_dir = str(step)
    rank = group.rank
    # Nothing before a collective may raise on one host only: the others would wait forever.
    m = _manifest_or_none(own, step_dir)
    recs = group.gather(m.checkpoint_id if m is not None else None)
    # Host 0 alone decides whether to copy ("copy"), there is nothing to do ("done"), or the round fails.
    plan: dict[str, object] = {"do": "copy", "error": None}
    if recs is not None:
        plan = _durable_plan(durable, step_dir, recs)
    plan = group.broadcast(plan)
    if plan["do"] == "done":
        log.info("durable copy of step %d: already committed there", step)
        return
    if plan["do"] != "copy":
        raise ReplicationError(f"durable copy of step {step}: {plan['error']}")
    assert m is not None  # host 0 saw the same committed checkpoint on every host
    out = rekey(m, step_dir, durable)  # deterministic: the same keys (or the same error) on every host
    error: str | None = None
    try:
        indices = _own_indices(own, m.objects, object_writers(m), rank)
        stats = run_sync(copy_objects(own, durable, m, out, indices))
        log.info("durable copy of step %d: host %d written (%d objects, %d kept from an earlier try)",
                 step, rank, stats.written, stats.kept)
    except BaseException as e:
        error = f"host {rank}: {type(e).__name__}: {e}"
    errors = group.gather(error)
    verdict: dict[str, object] = {"ok": False, "error": ""}
    if errors is not None:
        failed = [e for e in errors if e]
        verdict = {"ok": not failed, "error": join_errors(failed)}
        if not failed:
            try:
                run_sync(durable.commit(step_dir, out))
                log.info("durable copy of step %d: committed", step)
                _durable_retention(durable, policy)
            except FileExistsError:
                pass  # the same checkpoint, committed by an earlier try that lost its reply
            except BaseException as e:
                verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
    verdict = group.broadcast(verdict)
    if not verdict["ok"]:
        raise ReplicationError(f"durable copy of step {step} failed: {verdict['error']}")


def _durable_plan(durable: CheckpointStore, step_dir: str, ids: list[str | None]) -> dict[str, object]:
    """Host 0, with every host's checkpoint id of the step: copy it, nothing to do, or fail (and why)."""
    disagreement = checkpoint_disagreement(ids)
    if disagreement is not None:
        return {"do": "fail", "error": disagreement}
    try:
        there: str | None = run_sync(durable.read_manifest(step_dir)).checkpoint_id
    except FileNotFoundError:
        there = None
    except Exception as e:
        return {"do": "fail", "error": f"reading {durable.where(step_dir)}: {type(e).__name__}: {e}"}
    if there == ids[0]:
        return {"do": "done", "error": None}
    if there is not None:
        return {"do": "fail", "error": f"{durable.where(step_dir)} holds another checkpoint"}
    return {"do": "copy", "error": None}


def _manifest_or_none(store: CheckpointStore, step_dir: str) -> Manifest | None:
    """The committed manifest of ``step_dir``, or None if it is absent or unreadable (logged)."""
    try:
        return run_sync(store.read_manifest(step_dir))
    except FileNotFoundError:
        return None
    except Exception as e:
        log.error("%s: unreadable manifest: %r", store.where(step_dir), e)
        return None


def _durable_retention(durable: CheckpointStore, policy: TierPolicy) -> None:
    steps = run_sync(durable.committed_steps())
    for s in policy.durable.doomed(steps):
        run_sync(durable.delete(str(s)))


def durable_recovery(
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, policy: TierPolicy
) -> list[int]:
    """Collective: the fast-tier steps to copy again after a restart (an earlier run died mid-copy).

    Those that every host holds whole, that the policy replicates, and that
    are newer than the durable tier's newest committed step (older ones
    would only be deleted by its retention).
    """
    rec: dict[str, object] = {"steps": [], "durable": [], "error": None}
    try:
        mine = {(h.step, h.checkpoint_id) for h in holdings(own, None, group.rank) if policy.replicates(h.step)}
        rec["steps"] = [list(x) for x in sorted(mine)]
        if group.rank == 0:
            rec["durable"] = run_sync(durable.committed_steps())
    except Exception as e:
        rec["error"] = f"host {group.rank}: {type(e).__name__}: {e}"
    recs = group.gather(rec)
    # Host 0 alone works out the steps; the others receive only that list (bounded by retention).
    verdict: dict[str, object] = {"todo": [], "error": None}
    if recs is not None:
        errors = [str(r["error"]) for r in recs if r["error"]]
        if errors:
            verdict["error"] = join_errors(errors)
        else:
            common = set.intersection(*({tuple(x) for x in r["steps"]} for r in recs))  # type: ignore[union-attr]
            newest = max(recs[0]["durable"], default=-1)  # type: ignore[type-var]
            todo = sorted(s for s, _cid in common if s > newest)
            verdict["todo"] = todo[-1:] if policy.coalesce else todo
    verdict = group.broadcast(verdict)
    if verdict["error"]:
        raise ReplicationError(f"durable replicator: cannot tell what an earlier run left: {verdict['error']}")
    todo = [int(s) for s in verdict["todo"]]  # type: ignore[attr-defined]
    if todo:
        log.info("durable replicator: completing the copy of steps %s left by an earlier run", todo)
    return todo
