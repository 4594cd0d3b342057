"""An arrival gate before each of a torch coordinator's collectives, bounded by a deadline.

A gloo collective that one host never joins blocks the others until the process
group's timeout (30 min by default), then fails without naming anyone. So before
each collective every host checks in through the torch store (the key-value store
the process group was built on), where a wait can be bounded and its absentees
listed; the gloo collective starts only once every host is there.

Protocol of operation ``n`` (keys under ``ckptio/<group>/``):

- a host other than 0 sets ``a/<rank> = n`` (its latest arrival), adds one to
  ``<n>/c`` (the last to arrive sets ``<n>/all``), then waits for ``<n>/v``;
- host 0 sets ``a/0 = n`` and waits for ``<n>/all`` up to the deadline; then sets
  ``<n>/v`` to ``go``, or to ``abort:<ranks>:<message>`` naming the hosts whose ``a/<rank> < n``
  and raises;
- a host whose wait for ``<n>/v`` expires while host 0 has arrived waits one more
  deadline (host 0 is judging the others); otherwise it fails naming host 0, and
  leaves ``gone`` set: host 0, should it come later, aborts instead of starting a
  collective that host will never join.

Every waiting host therefore fails within two deadlines, naming who did not come.
Traffic per operation: O(1) store requests per host other than 0 and for host 0
(only an expiry reads the H arrival keys). After an expiry the hosts are out of
step, so the gate refuses every later collective with the first error.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from ckptio.coord.waits import CollectiveTimeout, Wait, current, missing_message

__all__ = ["StoreGate"]


class StoreGate:
    """Checks every host in before a collective; see the module. One call at a time (the
    coordinator's lock), in the same order on every host."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self._store, self._rank, self._size = store, rank, size
        self._n = 0
        self._broken: CollectiveTimeout | None = None

    def enter(self) -> None:
        """Return once every host has arrived at this collective; CollectiveTimeout otherwise."""
        if self._size == 1:
            return
        if self._broken is not None:
            raise CollectiveTimeout(f"an earlier collective timed out, the hosts are out of step: {self._broken}",
                                    hosts=self._broken.hosts, what=self._broken.what,
                                    deadline_s=self._broken.deadline_s) from self._broken
        self._n += 1
        wait = current()
        try:
            self._judge(self._n, wait) if self._rank == 0 else self._arrive(self._n, wait)
        except CollectiveTimeout as e:
            self._broken = e
            raise

    def _judge(self, n: int, wait: Wait) -> None:
        s = self._store
        s.set("a/0", str(n))
        if not self._wait(f"{n}/all", wait.deadline_s):
            missing = [r for r in range(1, self._size) if self._arrival(r) < n]
            if missing:
                self._abort(n, missing, missing_message(wait, missing), wait)
        if s.check(["gone"]):  # a host gave up waiting for this host: it will not join the collective
            rank, message = s.get("gone").decode().split(":", 1)
            self._abort(n, [int(rank)], f"host {rank} gave up waiting: {message}", wait)
        s.set(f"{n}/v", "go")
        # Every host set a/<rank> = n after reading verdict n-1: nobody reads those keys again.
        for key in (f"{n}/all", f"{n}/c", f"{n - 1}/v"):
            s.delete_key(key)

    def _abort(self, n: int, hosts: list[int], message: str, wait: Wait) -> None:
        self._store.set(f"{n}/v", f"abort:{','.join(map(str, hosts))}:{message}")
        raise CollectiveTimeout(message, hosts=tuple(hosts), what=wait.what, deadline_s=wait.deadline_s)

    def _arrive(self, n: int, wait: Wait) -> None:
        s = self._store
        s.set(f"a/{self._rank}", str(n))
        if s.add(f"{n}/c", 1) == self._size - 1:
            s.set(f"{n}/all", "1")
        if not self._wait(f"{n}/v", wait.deadline_s):
            # Host 0 here: it is waiting for someone else and answers within its own deadline.
            if self._arrival(0) < n or not self._wait(f"{n}/v", wait.deadline_s + 5.0):
                message = missing_message(wait, [0], "answer")
                s.set("gone", f"{self._rank}:{message}")  # host 0, should it come, must not wait for this host
                raise CollectiveTimeout(message, hosts=(0,), what=wait.what, deadline_s=wait.deadline_s)
        verdict = s.get(f"{n}/v").decode()
        if verdict.startswith("abort:"):
            ranks, message = verdict[len("abort:"):].split(":", 1)
            raise CollectiveTimeout(f"host 0 says: {message}", hosts=tuple(int(r) for r in ranks.split(",")),
                                    what=wait.what, deadline_s=wait.deadline_s)

    def _wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` was set within ``seconds``; a store failure before then is raised."""
        began = time.monotonic()
        try:
            self._store.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except RuntimeError:  # DistStoreError: a timeout, or the store is gone
            if time.monotonic() - began < seconds * 0.9:
                raise
            return False

    def _arrival(self, rank: int) -> int:
        """The latest collective host ``rank`` arrived at (0: none)."""
        key = f"a/{rank}"
        return int(self._store.get(key)) if self._store.check([key]) else 0
