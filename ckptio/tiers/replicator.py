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

The rounds themselves are the caller's (``round_fn``): a partner's replica
(:func:`ckptio.tiers.peer.replicate_to_partner`) or a durable copy
(:func:`ckptio.tiers.durable.durable_round`, with
:func:`~ckptio.tiers.durable.durable_recovery` as the worker's prologue).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ckptio.errors import CkptioError
from ckptio.tiers.group import PeerGroup

__all__ = ["Lag", "Pins", "ReplicationError", "ReplicationWorker"]

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
            self._recover(self.prologue)
        while True:
            decision = self._decision()
            if decision is None or decision["do"] == "stop":
                return
            if decision["do"] == "park":
                self._park()
            elif decision["do"] == "copy":
                step = int(decision["step"])  # type: ignore[call-overload]
                pinned, failures = self._take(step)
                try:
                    self._run_one(step, pinned, failures)
                finally:
                    self._idle()
            else:
                self._idle()

    def _recover(self, prologue: Callable[[], list[int]]) -> None:
        """Run the prologue's rounds (the steps a killed run left to copy) before any queued one."""
        try:
            todo = prologue()
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
        self._idle()

    def _idle(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _decision(self) -> dict[str, object] | None:
        """What every host does next (a round, a park, idle or the stop); None once the group is gone."""
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
            decision: dict[str, object] = self.group.broadcast(_decide(msgs) if msgs is not None else None)
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
            return None
        if decision["do"] == "stop":
            self._idle()
        return decision

    def _park(self) -> None:
        """Hold still until resumed (every host parks alike, by a collective decision)."""
        with self._cond:
            self._parked, self._busy = True, False
            self._parked_at = self._resumes
            self._cond.notify_all()
            # Every resume ends the park, even if a new pause came before this thread woke: the
            # other hosts' threads left theirs, and only a new collective decision parks them all.
            while self._pause_requests and self._parked_at == self._resumes:
                self._cond.wait()
            self._parked = False

    def _take(self, step: int) -> tuple[bool, int]:
        """Take ``step`` off the queue (and the owed) for its round: whether it is pinned, and its failures."""
        with self._cond:
            # Hosts may be a save apart; the smallest proposal is one every host has queued (or,
            # for a host whose save hook failed, one it runs and fails alike). Older queued steps
            # are skipped only when coalescing (then owed ones too): else they were proposed first.
            while self._pending and self._pending[0] < step:
                self._skip(self._pending.popleft(), step)
            if self.coalesce:
                for old in [s for s in self._owed if s < step]:
                    del self._owed[old]
                    self._skip(old, None)
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
        return pinned, failures

    def _skip(self, old: int, newer: int | None) -> None:
        """(Under the lock) ``old`` is not copied: a newer step goes instead."""
        self.skipped.append(old)
        self._since.pop(old, None)
        self.pins.remove(old)
        if newer is not None:
            log.info("%s replication: step %d skipped for the newer step %d", self.name, old, newer)

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
