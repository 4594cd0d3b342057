"""Idle worker-thread pools, parked between stores and reused (one process-wide shelf).

A store owns its backend's IO threads and its engine's checksum threads, and
shuts them down when it closes. Whoever opens a store per save -- the DCP
Writer (three stores a save: its plan check, its lease, its writes), the DCP
Reader, the Orbax handler, a one-shot ``ckptio.save`` -- started 20-30
threads for every save. Each ``Thread.start`` waits until the new thread
runs, on the IO loop; on this loaded 2-core host that was ~65 % of the IO
loop's busy time in a loop of small DCP saves (py-spy), ahead of every first
write. So a closing store gives its pools back here instead, and the next
store that asks for the same kind (thread name, count, nice) takes one with
its threads already running.

Contracts:

- A pool lives on the shelf or with exactly one owner: :func:`give_pool` of a
  pool already parked is a no-op, so a double close cannot hand one pool to
  two owners.
- At most :data:`KEEP` pools per kind are parked; more are shut down
  (``wait=False``: calls in flight finish, as a close always allowed).
- Calls still in flight when a pool is given back run to their end on its
  threads; the next owner's calls queue behind them (the backends' calls are
  plain system calls: none waits for another call on the same pool).
- A forked child starts with an empty shelf: the parent's pools have no
  threads there, and submitting to one would wait forever.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from ckptio.system.threads import background_pool, start_workers

__all__ = ["KEEP", "PoolSlot", "give_pool", "parked", "take_pool"]

#: Idle pools kept per kind: a DCP save holds two stores at once (its lease's and its writes').
KEEP = 2

_Kind = tuple[str, int, int]  # thread name prefix, workers, nice

_lock = threading.Lock()
_shelf: dict[_Kind, list[ThreadPoolExecutor]] = {}
_kinds: weakref.WeakKeyDictionary[ThreadPoolExecutor, _Kind] = weakref.WeakKeyDictionary()  # what take_pool made


def take_pool(name: str, workers: int, *, nice: int = 0, started: bool = False) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``name`` at ``nice`` below their creator: a parked one if any.

    ``started``: a fresh pool has all its threads started before it is returned
    (:func:`~ckptio.system.threads.start_workers`); a parked one has them already.
    """
    kind = (name, workers, nice)
    with _lock:
        parked = _shelf.get(kind)
        if parked:
            return parked.pop()
    pool = background_pool(workers, name, nice)
    if started:
        start_workers(pool, workers)
    with _lock:
        _kinds[pool] = kind
    return pool


def give_pool(pool: ThreadPoolExecutor | None) -> None:
    """Park ``pool`` for the next :func:`take_pool` of its kind, or shut it down (no wait)."""
    if pool is None:
        return
    with _lock:
        kind = _kinds.get(pool)
        parked = _shelf.setdefault(kind, []) if kind is not None else None
        if parked is not None and any(p is pool for p in parked):
            return  # already parked: given back twice
        if parked is not None and len(parked) < KEEP:
            parked.append(pool)
            return
        _kinds.pop(pool, None)
    pool.shutdown(wait=False)


class PoolSlot:
    """One owner's pool of one kind: taken from the shelf at first use, given back by :meth:`release`.

    Thread-safe; usable again after :meth:`release` (it takes a pool anew).
    """

    def __init__(self, name: str, workers: int, *, nice: int = 0, started: bool = False) -> None:
        self._args = (name, workers)
        self._nice, self._started = nice, started
        self._lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None  # the pool held now, if any

    def get(self) -> ThreadPoolExecutor:
        """The pool, taken on the first call after construction or release."""
        pool = self.pool
        if pool is None:
            with self._lock:
                if self.pool is None:
                    self.pool = take_pool(*self._args, nice=self._nice, started=self._started)
                pool = self.pool
        return pool

    def release(self) -> None:
        """Give the pool back (calls in flight finish on it)."""
        with self._lock:
            pool, self.pool = self.pool, None
        give_pool(pool)


def parked(name: str | None = None) -> int:
    """How many pools are parked now (of threads named ``name``, or of every kind): for tests."""
    with _lock:
        return sum(len(v) for k, v in _shelf.items() if name is None or k[0] == name)


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _shelf.clear()
    _kinds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
