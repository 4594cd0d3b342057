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
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ckptio.backends.base import join_key

from ..copy import copy_objects, object_writers, rekey
from ..distributed import join_errors
from ..engine import run_sync
from ..errors import CkptioError
from ..intents import Lease, new_id
from ..manifest import Manifest
from ..names import INTENT_PREFIX, parse_object
from ..store import CheckpointStore, sweeps_temporaries_by_prefix
from .group import PeerGroup
from .peer import checkpoint_disagreement, holdings
from .policy import TierPolicy

__all__ = ["Lag", "Pins", "ReplicationError", "ReplicationWorker", "durable_recovery", "durable_round"]

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


@dataclasses.dataclass
class Lag:
    """How far a replication destination is behind the fast tier, as this host sees it.

    ``steps`` committed in the fast tier and meant for this destination are not
    there yet (queued, in a round, or owed after a failure); the oldest of them
    was committed ``seconds`` ago. ``owed`` are those that failed and wait for a retry.
    """

    steps: int
    seconds: float
    uncopied: list[int]
    owed: list[int]
    last_done: int | None


@dataclasses.dataclass
class _Owed:
    failures: int
    due: float


class ReplicationWorker:
    """One background thread working off a bounded queue of committed steps, in lockstep across hosts.

    Every decision of the thread is collective (host 0 gathers each host's
    proposal and broadcasts what to do): which step the next round copies,
    a *park* while a restore needs the tiers to hold still (:meth:`pause`),
    and the stop at :meth:`close`. A host never enters a round, a park or a
    stop the others do not, whatever its own timing.

    A failed round is *owed* (with ``retry_backoff``): retried after a backoff
    that doubles per failure, before any newer step is skipped; the step stays
    pinned in the fast tier meanwhile, up to ``max_backlog`` owed steps.

    Args:
        name: for the thread and logs ("peer", "durable").
        group: a group that only this worker uses.
        round_fn: does the replication of one step (collective; may raise).
        queue_size: steps waiting at most; :meth:`submit` waits beyond that.
        coalesce: take the newest waiting step and drop the older ones (owed ones too).
        pins: shared with the fast tier's retention.
        prologue: run first on the thread (collective); returns steps to replicate before the queue.
        after_round: run (locally) after each round, once its step is unpinned -- the fast
            tier's retention, which could not delete the step while it was pinned.
        retry_backoff: seconds before the retry after ``n`` failures of one step; None: never retried.
        max_backlog: owed steps kept at most (the oldest is given up beyond).
        lag_warn_steps: warn (log) whenever this many steps or more are not yet replicated.
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
        retry_backoff: Callable[[int], float] | None = None,
        max_backlog: int = 4,
        lag_warn_steps: int = 2,
    ) -> None:
        self.name = name
        self.group = group
        self.round_fn = round_fn
        self.queue_size = queue_size
        self.coalesce = coalesce
        self.pins = pins
        self.prologue = prologue
        self.after_round = after_round
        self.retry_backoff = retry_backoff
        self.max_backlog = max_backlog
        self.lag_warn_steps = lag_warn_steps
        self.done: list[int] = []
        self.skipped: list[int] = []
        self.given_up: list[int] = []
        self._errors: list[BaseException] = []
        self._pending: collections.deque[int] = collections.deque()
        self._owed: dict[int, _Owed] = {}
        self._since: dict[int, float] = {}  # step -> when it was committed in the fast tier (for the lag)
        self._current: int | None = None
        self._busy = prologue is not None
        self._closing = False
        self._pause_requests = 0
        self._parked = False
        self._resumes = 0  # resume() calls so far
        self._parked_at = -1  # _resumes when the thread last parked
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
            self._since.setdefault(step, time.monotonic())
            self._cond.notify_all()
        self._warn_if_behind()

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._pending)

    def lag(self) -> Lag:
        """What is not replicated yet, and since when (this host's view; no collective)."""
        with self._cond:
            uncopied = sorted({*self._pending, *self._owed, *([self._current] if self._current is not None else [])})
            now = time.monotonic()
            oldest = min((self._since.get(s, now) for s in uncopied), default=now)
            return Lag(len(uncopied), now - oldest, uncopied, sorted(self._owed),
                       self.done[-1] if self.done else None)

    def _warn_if_behind(self) -> None:
        lag = self.lag()
        if lag.steps >= self.lag_warn_steps:
            log.warning("%s tier is %d steps and %.1f s behind the fast tier (not yet copied: %s; failed, "
                        "to retry: %s)", self.name, lag.steps, lag.seconds, lag.uncopied, lag.owed)

    def wait(self) -> None:
        """Until every queued step has had its round (on this host); owed retries are not waited for."""
        with self._cond:
            while (self._pending or self._busy) and self._thread.is_alive():
                self._cond.wait()

    def take_errors(self) -> list[BaseException]:
        with self._cond:
            out, self._errors = self._errors, []
        return out

    def pause(self) -> None:
        """Park the thread after its current round (collective: every host pauses its worker alike).

        While parked no round runs, so the caller (a restore, a save retiring
        steps) sees the tiers hold still.
        """
        with self._cond:
            self._pause_requests += 1
            self._cond.notify_all()
            # A park from before the last resume does not count, though the thread may not have woken from
            # it yet: the other hosts' threads may have, and wait in their next decision for this one's.
            while not (self._parked and self._parked_at == self._resumes) and self._thread.is_alive():
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._pause_requests = max(0, self._pause_requests - 1)
            self._resumes += 1
            self._cond.notify_all()

    def drop_newer(self, step: int) -> list[int]:
        """Forget queued and owed steps newer than ``step`` (training resumed from an older step); only
        while paused."""
        with self._cond:
            assert self._parked or not self._thread.is_alive(), "drop_newer needs a paused worker"
            dropped = [s for s in self._pending if s > step] + [s for s in self._owed if s > step]
            self._pending = collections.deque(s for s in self._pending if s <= step)
            for s in dropped:
                self._owed.pop(s, None)
                self._since.pop(s, None)
                self.pins.remove(s)
            self._cond.notify_all()
        if dropped:
            log.info("%s replication: steps %s dropped (training resumed from an older step)", self.name, dropped)
        return dropped

    def close(self) -> None:
        """Finish what is queued (owed retries are given up: a new run's recovery completes them), stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            if self._owed:
                log.error("%s replication: steps %s never got there (failed rounds, closed before a retry "
                          "succeeded)", self.name, sorted(self._owed))
            for s in self._owed:
                self.pins.remove(s)
            self._owed.clear()

    # -- the thread ------------------------------------------------------

    def _round(self, step: int) -> bool:
        with self._cond:
            self._current = step
        try:
            self.round_fn(step)
            with self._cond:
                self.done.append(step)
                self._since.pop(step, None)
            return True
        except BaseException as e:  # the next round must still run, on every host alike
            log.error("%s replication of step %d failed: %s", self.name, step, e)
            with self._cond:
                self._errors.append(e)
            return False
        finally:
            with self._cond:
                self._current = None

    def _owe(self, step: int, failures: int) -> bool:
        """After a failed round: keep ``step`` for a retry (True: it stays pinned), unless retries are off."""
        if self.retry_backoff is None:
            self._since.pop(step, None)
            return False
        with self._cond:
            self._owed[step] = _Owed(failures, time.monotonic() + self.retry_backoff(failures))
            # Bounded: the fast tier keeps every owed step, so the oldest go first beyond the backlog.
            while len(self._owed) > self.max_backlog:
                old = min(self._owed)
                del self._owed[old]
                self._since.pop(old, None)
                self.pins.remove(old)
                self.given_up.append(old)
                log.error("%s replication: step %d given up after failed rounds (more than %d steps owed)",
                          self.name, old, self.max_backlog)
        self._warn_if_behind()
        return True

    def _run_one(self, step: int, pinned: bool, failures: int) -> None:
        """One round; a failure makes the step owed (kept pinned), else its pin (if any) goes."""
        keep_pin = False
        try:
            if not self._round(step):
                keep_pin = pinned and self._owe(step, failures + 1)
        finally:
            if pinned and not keep_pin:
                self.pins.remove(step)
            self._after()

    def _proposal(self) -> int | None:
        """The step this host would copy next (under the lock): the oldest due retry or queued step."""
        now = time.monotonic()
        due = [s for s, o in self._owed.items() if o.due <= now]
        if self._closing:
            due = []  # closing does not wait out a backoff
        if self.coalesce:
            return self._pending[-1] if self._pending else (max(due) if due else None)
        return min([*due, *([self._pending[0]] if self._pending else [])], default=None)

    def _next_due(self) -> float | None:
        if not self._owed or self._closing:
            return None
        return max(0.0, min(o.due for o in self._owed.values()) - time.monotonic())

    def _run(self) -> None:
        if self.prologue is not None:
            try:
                todo = self.prologue()
            except BaseException as e:
                log.error("%s replicator: recovery failed: %s", self.name, e)
                with self._cond:
                    self._errors.append(e)
                todo = []
            for step in todo:  # all pinned before the first round: its retention must not take the next ones
                self.pins.add(step)
                with self._cond:
                    self._since.setdefault(step, time.monotonic())
            for step in todo:
                self._run_one(step, True, 0)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        while True:
            with self._cond:
                while True:
                    proposal = self._proposal()
                    if proposal is not None or self._pause_requests or self._closing:
                        break
                    self._cond.wait(timeout=self._next_due())
                msg = {"step": proposal, "pause": bool(self._pause_requests), "close": self._closing}
                self._busy = proposal is not None
            # Host 0 alone decides, from every host's proposal, and broadcasts: no host receives
            # every proposal, and every host does the same thing next (a round, a park, or the stop).
            try:
                msgs = self.group.gather(msg)
                decision = self.group.broadcast(_decide(msgs) if msgs is not None else None)
            except BaseException as e:  # the group is gone (job tearing down): stop quietly
                log.error("%s replicator stopped: %s", self.name, e)
                with self._cond:
                    self._errors.append(e)
                    for s in [*self._pending, *self._owed]:
                        self.pins.remove(s)
                    self._pending.clear()
                    self._owed.clear()
                    self._busy = False
                    self._cond.notify_all()
                return
            if decision["do"] == "stop":
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                return
            if decision["do"] == "park":
                with self._cond:
                    self._parked, self._busy = True, False
                    self._parked_at = self._resumes
                    self._cond.notify_all()
                    # Every resume ends the park, even if a new pause came before this thread woke: the
                    # other hosts' threads left theirs, and only a new collective decision parks them all.
                    while self._pause_requests and self._parked_at == self._resumes:
                        self._cond.wait()
                    self._parked = False
                continue
            if decision["do"] != "copy":
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                continue
            step = int(decision["step"])
            with self._cond:
                # Hosts may be a save apart; the smallest proposal is one every host has queued (or,
                # for a host whose save hook failed, one it runs and fails alike). Older queued steps
                # are skipped only when coalescing (then owed ones too): else they were proposed first.
                while self._pending and self._pending[0] < step:
                    old = self._pending.popleft()
                    self.skipped.append(old)
                    self._since.pop(old, None)
                    self.pins.remove(old)
                    log.info("%s replication: step %d skipped for the newer step %d", self.name, old, step)
                if self.coalesce:
                    for old in [s for s in self._owed if s < step]:
                        del self._owed[old]
                        self.skipped.append(old)
                        self._since.pop(old, None)
                        self.pins.remove(old)
                failures = 0
                pinned = False
                if step in self._owed:
                    failures, pinned = self._owed.pop(step).failures, True
                if self._pending and self._pending[0] == step:
                    self._pending.popleft()
                    if pinned:
                        self.pins.remove(step)  # pinned twice (owed and queued again): one pin is enough
                    pinned = True
                self._busy = True
                self._cond.notify_all()
            try:
                self._run_one(step, pinned, failures)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _after(self) -> None:
        if self.after_round is not None:
            try:
                self.after_round()
            except Exception as e:  # retention failing must not stop replication
                log.error("%s replicator: after-round hook failed: %r", self.name, e)


def _decide(msgs: list[dict[str, object]]) -> dict[str, object]:
    """Host 0: what every host does next, from each host's ``{"step", "pause", "close"}``."""
    if any(m["pause"] for m in msgs):
        return {"do": "park"}
    steps = [int(m["step"]) for m in msgs if m["step"] is not None]  # type: ignore[call-overload]
    if steps:
        return {"do": "copy", "step": min(steps)}
    if any(m["close"] for m in msgs):
        return {"do": "stop"}
    return {"do": "idle"}


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
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, step: int, policy: TierPolicy,
    unclean: set[int] | None = None,
) -> None:
    """Copy ``step`` from every host's fast tier to the durable tier; host 0 commits it there, last.

    Collective. Raises ReplicationError on every host alike if the step is
    not complete in the fast tier, the durable tier holds another checkpoint
    under that step, or any host's copy failed (then nothing is committed).
    ``unclean``: the durable steps whose killed copies' leftovers a live-looking
    intent still protected at an earlier round (kept across rounds by the caller;
    see :func:`_after_durable_commit`).
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
    # This host's copy is a save into the durable tier: it announces an intent before its first object
    # (covering the source's save ids, which the copied objects keep), so that no deleter takes them
    # for a crash's leftovers; kept until the commit's verdict, retired only on success.
    writers = {n.save_id for k in out.objects if (n := parse_object(k)) is not None}
    lease: Lease | None = None
    try:
        lease = Lease(durable, step_dir, new_id(), host=rank, covers=writers).start()
        indices = _own_indices(own, m.objects, object_writers(m), rank)
        stats = run_sync(copy_objects(own, durable, m, out, indices))
        log.info("durable copy of step %d: host %d written (%d objects, %d kept from an earlier try)",
                 step, rank, stats.written, stats.kept)
    except BaseException as e:
        error = f"host {rank}: {type(e).__name__}: {e}"
    errors = group.gather(error)
    verdict: dict[str, object] = {"ok": False, "error": ""}
    committed = False
    if errors is not None:
        failed = [e for e in errors if e]
        verdict = {"ok": not failed, "error": join_errors(failed)}
        if not failed:
            try:
                run_sync(durable.commit(step_dir, out))
                committed = True
                log.info("durable copy of step %d: committed", step)
            except FileExistsError:
                pass  # the same checkpoint, committed by an earlier try that lost its reply
            except BaseException as e:
                verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
    verdict = group.broadcast(verdict)
    if lease is not None:
        lease.close(retire=bool(verdict["ok"]))
    if committed:
        # After the intents are retired: the cleanup must see only dead attempts' intents.
        _after_durable_commit(durable, step_dir, policy, set() if unclean is None else unclean)
    if not verdict["ok"]:
        raise ReplicationError(f"durable copy of step {step} failed: {verdict['error']}")


def _after_durable_commit(
    durable: CheckpointStore, step_dir: str, policy: TierPolicy, unclean: set[int]
) -> None:
    """Host 0, once a step is committed in the durable tier: retention, and killed copies' leftovers.

    A copy killed midway (an earlier run's, or a re-saved step's earlier checkpoint) leaves objects
    that no manifest names and an intent that stops beating. They go through the store's step sweep
    (:meth:`CheckpointStore.sweep_step`, the rules of the orphan sweep for one step: only ckptio's
    names, never a live save's objects) -- of this step whenever its directory holds an intent, and
    of each older step directory that has no manifest; never a listing of every key of the durable
    root. A healthy round costs one listing of the step's intents and one of the root's step directories.
    A dead copy's intent protects its objects until its lease runs out (``CheckpointStore.lease_s``):
    after a restart quicker than that, a swept step still holds an intent; it joins ``unclean`` and
    is swept again at each later round until none is left.
    """
    committed: list[int] = []
    try:
        committed = _durable_retention(durable, policy)
    except Exception as e:  # noqa: BLE001 -- retention failing leaves extra steps, never loses one
        log.error("%s: durable retention failed: %r", durable.url, e)
    try:
        leftovers = run_sync(durable.backend.list(join_key(step_dir, INTENT_PREFIX)))
        stray = [d for d in run_sync(durable.step_dirs()) if d < int(step_dir) and d not in committed]
        swept = sorted({*stray, *unclean, *([int(step_dir)] if leftovers else [])})
        for step in swept:
            report = run_sync(durable.sweep_step(step, grace_seconds=0.0))
            if report.deleted or report.spared_in_flight:
                log.info("%s: cleaned what interrupted copies left (%d objects, %d intents, %d temporaries; "
                         "%d spared in flight)", durable.where(str(step)), len(report.objects),
                         len(report.intents), len(report.temporaries), report.spared_in_flight)
            # An intent that survived the sweep looked live: its objects wait for a later round.
            if run_sync(durable.backend.list(join_key(str(step), INTENT_PREFIX))):
                unclean.add(step)
            else:
                unclean.discard(step)
        if swept and not sweeps_temporaries_by_prefix(durable.backend):
            # A killed write leaves a temporary file that the step sweep cannot reach on this backend.
            # One untouched for a whole lease is a dead writer's (a live write keeps touching its file,
            # as a live save keeps beating); a younger one is left to gc. Root-wide, but only POSIX
            # backends have temporaries: on object stores this is a no-op that lists nothing.
            lease = durable.lease_s
            gone = run_sync(durable.engine.retrying(
                f"sweep temporaries of {durable.url}", lambda: durable.backend.sweep_temporaries(lease)))
            if gone:
                log.info("%s: removed %d temporaries of killed writes", durable.url, len(gone))
    except Exception as e:  # noqa: BLE001 -- leftovers stay for gc; the checkpoint is committed
        log.warning("%s: cleaning an interrupted copy's leftovers failed: %r", durable.where(step_dir), e)


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


def _durable_retention(durable: CheckpointStore, policy: TierPolicy) -> list[int]:
    """Delete the durable steps beyond the policy's retention; the committed steps that remain."""
    steps = run_sync(durable.committed_steps())
    doomed = policy.durable.doomed(steps)
    for s in doomed:
        run_sync(durable.delete(str(s)))
    return [s for s in steps if s not in doomed]


def durable_recovery(
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, policy: TierPolicy
) -> list[int]:
    """Collective: the fast-tier steps to copy again after a restart (an earlier run died mid-copy).

    Those that every host holds whole, that the policy replicates, that the
    durable tier lacks (an earlier run's failed or killed round, older than the
    durable tier's newest or not), and that its retention would keep.
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
            there = set(recs[0]["durable"])  # type: ignore[call-overload]
            # Every step the fast tiers hold whole and the durable tier lacks -- older than its newest
            # too (a failed round's step), unless its retention would delete it at once.
            held = sorted({s for s, _cid in common})
            doomed = set(policy.durable.doomed(sorted(there | set(held))))
            todo = [s for s in held if s not in there and s not in doomed]
            verdict["todo"] = todo[-1:] if policy.coalesce else todo
    verdict = group.broadcast(verdict)
    if verdict["error"]:
        raise ReplicationError(f"durable replicator: cannot tell what an earlier run left: {verdict['error']}")
    todo = [int(s) for s in verdict["todo"]]  # type: ignore[attr-defined]
    if todo:
        log.info("durable replicator: completing the copy of steps %s left by an earlier run", todo)
    return todo
