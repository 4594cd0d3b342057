"""Preemption: every host agrees on one step to save at, once any host got a notice.

:meth:`ckptio.CheckpointManager.reached_preemption` (Orbax's name and
meaning) is true on every host at the same step, once any host was told it
is about to be preempted: a signal (SIGTERM by default, handled from the
first call on) or :meth:`Preemption.notify`, which a user's own handler may
call. The manager then saves that step even off its interval.

How hosts agree, without a collective per step. A per-step call only reads
a flag under a lock (no message, no system call). A background thread per
host watches one key of the job's key-value store (torch.distributed's
store, or jax.distributed's coordination service) every ``poll`` seconds.
The host that gets the notice sets that key. Each host's thread, once it
sees it, stops its training thread from passing another step (the next
call waits), publishes the last step its training thread passed, and
reads every host's: the sync step is the largest plus one. No host had
passed it, so each returns True when it gets there. The wait involves
only these threads, never the training collectives, so it cannot
deadlock with them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ckptio.coord.distributed import AllGatherCoordinator, JaxCoordinator, TorchCoordinator

__all__ = ["Preemption"]

log = logging.getLogger("ckptio.preemption")

#: How long a host waits for every host's step once a notice is out (a host that never
#: answers is dead: the job is going down anyway).
_AGREE_TIMEOUT_S = 600.0


class _KV(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def has(self, key: str) -> bool: ...

    def get(self, key: str, timeout_s: float) -> str: ...


class _LocalKV:
    """One process: a dict."""

    def __init__(self) -> None:
        self._d: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self._d[key] = value

    def has(self, key: str) -> bool:
        return key in self._d

    def get(self, key: str, timeout_s: float) -> str:
        return self._d[key]


class _TorchKV:
    """torch.distributed's store (the one its default process group was made with)."""

    def __init__(self) -> None:
        from torch.distributed import distributed_c10d

        self._store = distributed_c10d._get_default_store()

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def get(self, key: str, timeout_s: float) -> str:
        import datetime

        self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        return bytes(self._store.get(key)).decode()


class _JaxKV:
    """jax.distributed's coordination service."""

    def __init__(self) -> None:
        from jax._src import distributed

        self._client = distributed.global_state.client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def has(self, key: str) -> bool:
        try:
            self._client.blocking_key_value_get(key, 1)
            return True
        except Exception:  # the service reports a timeout as an error of its own type
            return False

    def get(self, key: str, timeout_s: float) -> str:
        return str(self._client.blocking_key_value_get(key, int(timeout_s * 1000)))


def _kv_for(coord: AllGatherCoordinator) -> _KV:
    if coord.size == 1:
        return _LocalKV()
    if isinstance(coord, TorchCoordinator):
        return _TorchKV()
    if isinstance(coord, JaxCoordinator):
        return _JaxKV()
    raise TypeError(f"reached_preemption needs torch.distributed or jax.distributed across hosts, "
                    f"not a {type(coord).__name__}")


_instances = 0


class Preemption:
    """One manager's preemption agreement (see the module docstring).

    ``signals``: the signals that count as a notice (handled from the first :meth:`reached`
    call on, in the main thread; a handler that was there is called too). ``poll``: how often
    the background thread looks for a notice, in seconds. ``kv``: the key-value store (default:
    the coordinator's); ``namespace``: its keys' prefix (default: one per manager, in creation order).
    """

    def __init__(self, coord: AllGatherCoordinator, *, signals: Sequence[int] = (signal.SIGTERM,), poll: float = 0.2,
                 kv: Any = None, namespace: str | None = None) -> None:
        global _instances
        _instances += 1
        self.coord, self.signals, self.poll = coord, tuple(signals), poll
        self.kv: _KV | None = kv
        self.ns = namespace or f"ckptio/preemption/{_instances}"
        self._lock = threading.Lock()
        self._flagged = False  # set by a signal handler: a plain store, nothing that could block
        self._noticed = False
        self._passed = -1  # the newest step reached() answered False for
        self._decided = threading.Event()
        self.sync_step: int | None = None
        self._answered = False
        self._thread: threading.Thread | None = None
        self._closed = False
        self._previous: dict[int, Any] = {}

    def notify(self) -> None:
        """This host was told it will be preempted (call it from your own handler: signal-safe)."""
        self._flagged = True

    def reached(self, step: int) -> bool:
        """True once, on every host at the same step, after any host got a notice; False otherwise."""
        if self._thread is None:
            self._start()
        with self._lock:
            if not self._noticed:
                self._passed = step
                return False
        self._decided.wait()  # only the hosts' watcher threads take part: no training collective
        if self.sync_step is not None and step >= self.sync_step and not self._answered:
            self._answered = True
            return True
        return False

    def close(self) -> None:
        """Stop the watcher and give back the signal handlers this installed."""
        self._closed = True
        for sig, prev in self._previous.items():
            try:
                signal.signal(sig, prev)
            except (ValueError, TypeError):  # off the main thread: left in place
                pass
        self._previous.clear()

    def _start(self) -> None:
        if self.kv is None:
            self.kv = _kv_for(self.coord)
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: notify() is the way in
                log.warning("reached_preemption: signal %s is not handled (not called from the main thread)", sig)
        self._thread = threading.Thread(target=self._watch, name="ckptio-preemption", daemon=True)
        self._thread.start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._flagged = True
        prev = self._previous.get(signum)
        if callable(prev) and prev not in (signal.SIG_IGN, signal.SIG_DFL):
            prev(signum, frame)

    def _watch(self) -> None:
        kv, notice = self.kv, f"{self.ns}/notice"
        assert kv is not None
        try:
            while not self._closed:
                if self._flagged:
                    kv.set(notice, str(self.coord.rank))
                if kv.has(notice):
                    self._agree(kv)
                    return
                time.sleep(self.poll)
        except BaseException as e:  # the training thread must not wait forever on a dead watcher
            log.error("preemption watcher failed: %r", e)
            self._decided.set()

    def _agree(self, kv: _KV) -> None:
        with self._lock:
            self._noticed = True
            passed = self._passed
        kv.set(f"{self.ns}/step/{self.coord.rank}", str(passed))
        steps = [int(kv.get(f"{self.ns}/step/{r}", _AGREE_TIMEOUT_S)) for r in range(self.coord.size)]
        self.sync_step = max(steps) + 1
        log.warning("preemption notice: every host saves at step %d", self.sync_step)
        self._decided.set()
