"""Several hosts of one job as forked processes of this one, each with its own event loop.

:mod:`ckptio.bench.threadhosts` runs a job's hosts as threads of one process:
their requests share one interpreter (one GIL) and bunch together whenever it is
busy. :class:`HostProcesses` forks one process per host instead, so each paces
its requests on its own loop, as the hosts of a real job do.

Fork them *before* this process starts a thread or an event loop (a server, a
proxy): the children then share the parent's imported modules copy-on-write
(ckptio is imported once) and inherit no half-held lock. The bodies they can
run are fixed at fork time (``bodies``, by name); each run sends only the name
and JSON arguments.

The collectives between the hosts go through the parent: one pipe per host,
rounds numbered alike on every host (every host calls the same collectives in
the same order), JSON on the wire as on a real coordinator. The parent answers
an all-gather once every host has sent its part, a gather to rank 0 alone
(the others go on at once), and a broadcast once rank 0 has sent it.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection as mpc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HostProcesses", "PipeCoordinator"]

#: A host body: ``body(rank, coordinator, **kwargs) -> JSON-able`` (None: the host succeeded).
Body = Callable[..., Any]

_ALL, _GATHER, _BCAST = "a", "g", "b"


class PipeCoordinator:
    """One host's end of the parent's relay: ``rank``, ``size``, ``all_gather``, ``gather``, ``broadcast``."""

    def __init__(self, conn: Any, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._conn = conn
        self._round = 0
        self._lock = threading.Lock()  # a save's thread and the caller's never interleave a round

    def _call(self, kind: str, obj: Any, *, send: bool = True, answered: bool = True) -> Any:
        with self._lock:
            self._round += 1
            n = self._round
            if send:
                self._conn.send_bytes(json.dumps([n, kind, obj]).encode())
            if not answered:
                return None
            if not self._conn.poll(self.timeout):
                raise TimeoutError(f"host {self.rank}: collective {n} ({kind}) unanswered after {self.timeout:g} s")
            got, payload = json.loads(self._conn.recv_bytes())
            if got != n:
                raise RuntimeError(f"host {self.rank}: collective {n} answered as round {got}: hosts out of step")
            return payload

    def all_gather(self, obj: Any) -> list[Any]:
        return self._call(_ALL, obj)  # type: ignore[no-any-return]

    def gather(self, obj: Any) -> list[Any] | None:
        return self._call(_GATHER, obj, answered=self.rank == 0)  # type: ignore[no-any-return]

    def broadcast(self, obj: Any) -> Any:
        if self.rank == 0:
            self._call(_BCAST, obj, answered=False)
            return json.loads(json.dumps(obj))  # as the others receive it
        return self._call(_BCAST, None, send=False)


def _host_main(rank: int, size: int, ctrl: Any, coll: Any, bodies: dict[str, Body], timeout: float,
               inherited: list[Any]) -> None:
    """A host process: run each body the parent names until it says stop."""
    for c in inherited:  # the parent's ends of earlier hosts' pipes: theirs to see closed
        c.close()
    coord = PipeCoordinator(coll, rank, size, timeout)
    while True:
        try:
            msg = json.loads(ctrl.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        name, kwargs, env = msg
        os.environ.update(env)
        try:
            out = bodies[name](rank, coord, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported as this host's outcome
            out = f"host {rank}: {name}: {type(e).__name__}: {e}"
        ctrl.send_bytes(json.dumps(out).encode())


class _Round:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parts: dict[int, Any] = {}


class HostProcesses:
    """``n`` host processes forked now; :meth:`run` runs one of ``bodies`` on all of them at once.

    Construct it before this process starts any thread or event loop. Use as a context manager
    (or call :meth:`close`): the hosts exit, and any that does not within a few seconds is killed.
    """

    def __init__(self, n: int, bodies: dict[str, Body], *, timeout: float = 900.0) -> None:
        if n < 1:
            raise ValueError(f"host processes: need at least one host, got {n}")
        ctx = multiprocessing.get_context("fork")
        self.n, self.timeout = n, timeout
        self._ctrl: list[Any] = []
        self._coll: list[Any] = []
        self._procs: list[Any] = []
        for rank in range(n):
            (ctrl, ctrl_child), (coll, coll_child) = ctx.Pipe(), ctx.Pipe()
            proc = ctx.Process(target=_host_main, name=f"host-{rank}",
                               args=(rank, n, ctrl_child, coll_child, bodies, timeout, self._ctrl + self._coll))
            proc.start()
            ctrl_child.close()  # the host's alone: EOF on ours then means the host is gone
            coll_child.close()
            self._ctrl.append(ctrl)
            self._coll.append(coll)
            self._procs.append(proc)
        self._ctrl_set = set(self._ctrl)
        self._closed = False

    def __enter__(self) -> HostProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, name: str, kwargs: dict[str, Any], env: dict[str, str] | None = None) -> list[Any]:
        """Run body ``name`` on every host at once; each host's result.

        A host whose process dies fails the run: it is reported so, and every other host as stopped
        (they are killed: they may wait on the dead one in a collective), and the hosts are closed.
        Raises TimeoutError (and closes them) if the hosts are not done within ``timeout``."""
        if self._closed:
            raise RuntimeError("host processes: closed (a host died, or close() was called)")
        msg = json.dumps([name, kwargs, env or {}]).encode()
        for c in self._ctrl:
            c.send_bytes(msg)
        results: dict[int, Any] = {}
        rounds: dict[int, _Round] = {}
        conns = {c: r for r, c in enumerate(self._coll)} | {c: r for r, c in enumerate(self._ctrl)}
        deadline = time.monotonic() + self.timeout
        while len(results) < self.n:
            ready = mpc.wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise TimeoutError(f"host processes: {self.n - len(results)} hosts not done with {name!r} "
                                   f"after {self.timeout:g} s")
            for conn in ready:
                rank = conns[conn]
                try:
                    data = conn.recv_bytes()
                except EOFError:
                    return self._died(rank, name, results)
                if conn in self._ctrl_set:
                    results[rank] = json.loads(data)
                else:
                    self._relay(rounds, rank, *json.loads(data))
        return [results[r] for r in range(self.n)]

    def _died(self, dead: int, name: str, results: dict[int, Any]) -> list[Any]:
        code = self._exitcode(dead)
        self.close()
        out = [results.get(r, f"host {r}: {name}: stopped: host {dead} died") for r in range(self.n)]
        out[dead] = f"host {dead}: {name}: its process died (exit code {code})"
        return out

    def _relay(self, rounds: dict[int, _Round], rank: int, n: int, kind: str, obj: Any) -> None:
        """One host's part of collective ``n``: answer the round once it is complete."""
        rnd = rounds.setdefault(n, _Round(kind))
        if rnd.kind != kind:
            self.close()
            raise RuntimeError(f"host processes: host {rank} called {kind!r} as collective {n}, "
                               f"another host {rnd.kind!r}: hosts out of step")
        rnd.parts[rank] = obj
        if kind == _BCAST:
            if rank != 0:
                return
            to, payload = range(1, self.n), obj
        elif len(rnd.parts) < self.n:
            return
        else:
            to = range(self.n) if kind == _ALL else range(1)
            payload = [rnd.parts[r] for r in range(self.n)]
        data = json.dumps([n, payload]).encode()
        for r in to:
            self._coll[r].send_bytes(data)
        del rounds[n]

    def private_bytes(self) -> int:
        """The hosts' private memory (USS: pages no other process maps) summed, now; 0 for a host gone."""
        import psutil

        total = 0
        for p in self._procs:
            try:
                total += psutil.Process(p.pid).memory_full_info().uss
            except (psutil.Error, ValueError):
                pass
        return total

    def _exitcode(self, rank: int) -> int | None:
        self._procs[rank].join(1.0)
        return self._procs[rank].exitcode

    def close(self) -> None:
        """Tell every host to exit; kill those still there a few seconds later."""
        if self._closed:
            return
        self._closed = True
        for c in self._ctrl:
            try:
                c.send_bytes(b"null")
            except OSError:
                pass
        end = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self._ctrl + self._coll:
            c.close()
