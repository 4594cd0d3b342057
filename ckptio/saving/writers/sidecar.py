"""The optional writer process per host ("sidecar"): a save's object writes out of the trainer.

With ``SaveOptions(writer="sidecar")`` (or ``CKPTIO_WRITER=sidecar``) the
bytes of a save are staged into shared memory (:class:`ShmStagingPool`:
memfd slabs, the same single staging copy as in-process), and a child
process runs the engine on them: tile cuts, block checksums, the backend's
writes and its sync. The trainer's background thread only describes each
object (key, extents as slab offsets) once its bytes are staged, then blocks
on the socket -- which releases the GIL -- and does the cheap rest itself:
the host record, the fragment, the gather and the commit. Collectives never
leave the trainer process.

Contracts:

- **No partial commit.** The manifest is written by the trainer only after
  the sidecar confirmed every object (and its sync); a sidecar that dies or
  fails fails the save, which then takes the ordinary failure path (lease
  left to go stale, gc collects the objects).
- **Restarted on the next save.** A dead sidecar is replaced by a fresh one
  the next time a save needs it.
- **Never outlives its trainer.** The child sets ``PR_SET_PDEATHSIG`` (SIGKILL)
  tied to the trainer thread that spawned it and exits on EOF of its socket;
  a trainer that exits normally closes the socket at exit and reaps the child.
- **No leaked shared memory.** Slabs are anonymous ``memfd_create`` files
  handed to the child over the socket (SCM_RIGHTS): they have no name in
  ``/dev/shm`` and vanish with the last process mapping them, whoever dies
  how. So there is nothing to reclaim after a SIGKILL.

Data not already in shared memory (JAX arrays, which are staged without a
copy; ``copy=False`` saves; tensors DCP staged in its own buffers) is read by
the child straight out of the trainer's memory where the kernel allows it
(:mod:`ckptio.saving.writers.remoteread`; the child's first message says whether it can),
else copied into a slab by the trainer's background thread, object by
object, with a copy that releases the GIL. For unaligned sources this is the
copy that the local backend's O_DIRECT bounce buffer made in-process. Either
way at most a few objects are held at a time, and their memory is reused.

Modules: this one is the sidecar :class:`~ckptio.saving.writers.base.Writer`, maps a
store's writer choice to a writer object (:func:`writer_for`), drives the
child from the trainer and keeps this process's one (:func:`ensure`,
:func:`current`); :mod:`ckptio.saving.writers.base` is the protocol, the in-process
writer and the choice's rules; :mod:`ckptio.saving.writers.shm` is the shared-memory pool;
:mod:`ckptio.saving.writers.sidecar_export` puts a save's bytes into it;
:mod:`ckptio.saving.writers.sidecar_child` is the child and the wire both ends speak.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ckptio.backends.budget import budget_of
from ckptio.engine import Progress, WrittenObject
from ckptio.engine.layout import ObjectPlan
from ckptio.errors import SaveFailedError
from ckptio.saving.writers.base import ENV, THREAD_WRITER, WRITERS, Writer, wanted_sidecar, writer_name
from ckptio.saving.writers.remoteread import allow_reads, remote_wanted, token
from ckptio.saving.writers.shm import ShmStagingPool, close_shared_pool, forget_shared_pool, shared_pool
from ckptio.saving.writers.sidecar_child import Channel
from ckptio.saving.writers.sidecar_export import EXPORT_OBJECTS, Export
from ckptio.store import CheckpointStore
from ckptio.system.bufferpool import StagingPool

__all__ = [
    "ENV", "SIDECAR_WRITER", "ShmStagingPool", "Sidecar", "SidecarWriter", "WRITERS", "current", "current_pid",
    "ensure", "prestart", "shared_pool", "shutdown", "staging_pool", "write_and_sync", "writer_for",
]

log = logging.getLogger("ckptio.sidecar")

#: Seconds a save waits for a new writer process's first message (its imports take ~0.5 s; a
#: loaded host or a slow filesystem, much more). Past it the child is killed and the save fails
#: (SaveFailedError): a save never hangs on a writer process that never came up; the next starts another.
START_S = 120.0

# -- choosing the writer ------------------------------------------------------


def prestart(writer: str | None) -> None:
    """Start this process's sidecar now if ``writer`` (``SaveOptions.writer``, else ``CKPTIO_WRITER``)
    asks for one (a manager or writer being made), so that its start-up (~0.5 s of imports) is not
    paid inside the first save."""
    if writer_name(writer) == "sidecar" and hasattr(os, "memfd_create"):
        ensure()


class SidecarWriter:
    """The :class:`~ckptio.saving.writers.base.Writer` that hands a save's objects to this process's sidecar."""

    name = "sidecar"
    copies = True  # into shared memory (ckptio.saving.writers.sidecar_export), page-aligned from 64 KiB on

    def staging_pool(self, pool: StagingPool | None) -> StagingPool | None:
        """This process's shared pool; the sidecar is started now, so that it is up by the time
        the first object is staged."""
        ensure()
        return shared_pool()

    def write(
        self, store: CheckpointStore, plans: Sequence[ObjectPlan], progress: Progress | None,
        ready: Sequence[concurrent.futures.Future[None]] | None, where: str,
    ) -> list[WrittenObject]:
        """The sidecar writes and syncs ``plans`` (``ready[i]`` still gates object ``i``); blocks."""
        return ensure().write(store, plans, progress, ready, where)


#: The sidecar writer (it holds no state: the sidecar itself is this process's, see :func:`ensure`).
SIDECAR_WRITER = SidecarWriter()


def writer_for(store: CheckpointStore, asked: str | None = None) -> Writer:
    """The writer of saves to ``store``: ``asked`` (``SaveOptions.writer``, else ``CKPTIO_WRITER``) mapped
    to a writer object, the sidecar only where :func:`ckptio.saving.writers.base.wanted_sidecar` allows it."""
    return SIDECAR_WRITER if wanted_sidecar(store, asked) else THREAD_WRITER




def staging_pool(store: CheckpointStore, pool: StagingPool | None, asked: str | None = None) -> StagingPool | None:
    """The pool a save of ``store`` stages into (its writer's :meth:`~ckptio.saving.writers.base.Writer.staging_pool`)."""
    return writer_for(store, asked).staging_pool(pool)


def write_and_sync(
    store: CheckpointStore,
    plans: Sequence[ObjectPlan],
    progress: Progress | None = None,
    ready: Sequence[concurrent.futures.Future[None]] | None = None,
    where: str | None = None,
    asked: str | None = None,
) -> list[WrittenObject]:
    """Write every object of ``plans`` and make them durable (the backend's sync); blocks.

    The writer ``asked`` for (:func:`writer_for`) does it; ``ready[i]`` (when given) gates object ``i``.
    """
    return writer_for(store, asked).write(store, plans, progress, ready, where or store.url)


# -- the trainer's side -------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Request:
    future: concurrent.futures.Future[list[WrittenObject]]
    progress: Progress | None
    export: Export


class Sidecar:
    """One writer process and the trainer-side thread that spawned it and reads its replies.

    The thread spawns the child (so the child's parent-death signal is tied to a thread
    that lives exactly as long as the connection), then reads replies until EOF, then
    reaps the child and fails whatever was still pending.
    """

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._chan = Channel(ours)
        self._theirs = theirs
        self._pending: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._send_order = threading.Lock()  # a slab reaches the child before the objects in it
        self._ids = itertools.count(1)
        self._sent: set[int] = set()  # slabs the child has mapped
        self.dead: str | None = None  # why, once the child is gone
        #: The child can read this process's memory (its first message says): JAX arrays and other
        #: unstaged bytes are then read by it, not copied into shared memory here (ckptio.saving.writers.remoteread).
        self.reads_remote = False
        self._hello = threading.Event()  # the child's first message came (or it is gone)
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptio-sidecar", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        self._spawned.wait()
        return self.proc.pid if self.proc is not None else None

    def _run(self) -> None:
        try:
            self.proc = _spawn(self._theirs)
        except BaseException as e:  # noqa: BLE001 - reported through every pending save
            self._die(f"could not start the ckptio writer process: {type(e).__name__}: {e}")
            return
        finally:
            self._theirs.close()
            self._spawned.set()
        log.info("ckptio writer process started (pid %d)", self.proc.pid)
        reason = ""
        try:
            # Named as the process that may read ours before it probes (the probe waits for this).
            if remote_wanted():
                allow_reads(self.proc.pid)
            self._chan.send(("probe", 0))
            while True:
                got = self._chan.recv()
                if got is None:
                    break
                self._dispatch(got[0])
        except (OSError, EOFError) as e:
            log.debug("ckptio writer process: connection lost: %r", e)
        except BaseException as e:  # a reply this side cannot handle: no later reply could be trusted
            log.exception("ckptio writer process: reading its replies failed")
            reason = f" after its replies could not be read ({type(e).__name__}: {e})"
            self.proc.kill()
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._die(f"the ckptio writer process (pid {self.proc.pid}) exited with status {code}{reason}")

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "hello":
            self.reads_remote = bool(msg[2])
            self._hello.set()
            return
        with self._lock:
            req = self._pending.get(rid) if kind == "wrote" else self._pending.pop(rid, None)
        if req is None:
            return
        if kind == "wrote":
            req.export.written(msg[2])
            if req.progress is not None:
                try:
                    req.progress("written", msg[3])
                except Exception as e:  # noqa: BLE001 - a progress bar must not stop the replies
                    log.error("progress callback failed: %r", e)
            return
        req.export.abandon()
        if kind == "done":
            req.future.set_result([WrittenObject(k, n, c) for k, n, c in msg[2]])
        else:
            req.future.set_exception(_error_from(msg[2], msg[3]))

    def _give_up(self, why: str) -> None:
        """Kill a child that went silent: its thread then reaps it and fails whatever was pending
        (with ``why``), and :func:`ensure` starts another for the next save."""
        with self._lock:
            self.dead = self.dead or why
        if self.proc is not None:
            self.proc.kill()

    def _die(self, why: str) -> None:
        with self._lock:
            self.dead = self.dead or why
            pending, self._pending = self._pending, {}
        self._hello.set()
        for req in pending.values():
            req.export.abandon()
            req.future.set_exception(SaveFailedError(f"{why}; the save's objects were not all confirmed"))

    def _send_slabs(self, pool: ShmStagingPool) -> None:
        for sid, fd, size in pool.slabs():
            if sid not in self._sent:
                self._chan.send(("slab", sid, size), fd)
                self._sent.add(sid)

    def write(
        self,
        store: CheckpointStore,
        plans: Sequence[ObjectPlan],
        progress: Progress | None,
        ready: Sequence[concurrent.futures.Future[None]] | None,
        where: str,
    ) -> list[WrittenObject]:
        """Have the child write and sync ``plans``; blocks (socket waits release the GIL)."""
        rid = next(self._ids)
        fut: concurrent.futures.Future[list[WrittenObject]] = concurrent.futures.Future()
        caps, layout = store.backend.capabilities, store.backend.layout_defaults
        # Its first reply says whether it can read this process's memory; it comes as soon as the
        # child has started, which the first save's objects would have waited for anyway.
        if not self._hello.wait(START_S):
            self._give_up(f"the ckptio writer process (pid {self.pid}) did not start within {START_S:g} s")
        budget_bytes = max(EXPORT_OBJECTS * layout.object_size, caps.concurrency * caps.preferred_io_size)
        export = Export(shared_pool(), budget_bytes, remote=self.reads_remote and remote_wanted())
        with self._lock:
            if self.dead is not None:
                raise SaveFailedError(f"{where}: {self.dead}")
            self._pending[rid] = _Request(fut, progress, export)
        # The environment travels too: backends read theirs when opened (credentials, an emulator's
        # address), and the trainer's may have changed since the child started.
        spec = (store.url, store.backend_options, store.engine.config,
                tuple(sorted(os.environ.items())))
        # The host's request budget travels as its shared state: the child joins it, and trainer and
        # sidecar together keep the host's one share (ckptio.backends.budget).
        budget = budget_of(store.engine.backend)
        try:
            self._chan.send(("open", rid, spec, len(plans)), None if budget is None else budget.share_fd())
            for i, plan in enumerate(plans):
                if ready is not None:
                    ready[i].result()
                desc = export.describe(i, plan)
                with self._send_order:
                    self._send_slabs(export.pool)
                    self._chan.send(("object", rid, i, plan.key, desc))
            written = fut.result()
        except BaseException as e:
            if not fut.done():
                # The staged buffers go back to the pool after this: the child must be done with them.
                try:
                    self._chan.send(("abort", rid, f"{type(e).__name__}: {e}"))
                except OSError:
                    pass
                concurrent.futures.wait([fut])
            if isinstance(e, OSError) and self.dead is not None:
                raise SaveFailedError(f"{where}: {self.dead}") from e
            raise
        finally:
            export.release()
        export.settle()  # off every path a step waits on: this save's thread, before its result()
        return written

    def close(self, timeout: float = 5.0) -> None:
        """End the child (EOF on its socket) and wait for the reader thread to reap it."""
        self._spawned.wait(timeout)
        try:
            self._chan.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout)
        self._chan.sock.close()


def _error_from(blob: bytes | None, text: str) -> BaseException:
    """The child's exception, re-raised here when it unpickles; else a SaveFailedError with its text."""
    if blob is not None:
        try:
            e = pickle.loads(blob)
            if isinstance(e, BaseException):
                return e
        except Exception:  # noqa: BLE001 - an exception type that does not round-trip
            pass
    return SaveFailedError(f"ckptio writer process: {text}")


def _spawn(sock: socket.socket) -> subprocess.Popen[bytes]:
    # The child imports this very ckptio, wherever it came from (a worktree on sys.path included), and
    # never a folder named ckptio in its working directory (PYTHONSAFEPATH: no current directory first).
    here = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["ckptio"].__file__ or "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONSAFEPATH"] = "1"
    env[ENV] = "thread"
    at, expected = token()  # the child reads it back to learn whether it can read our memory
    return subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from ckptio.saving.writers.sidecar_child import child_main; child_main(*sys.argv[1:])",
         str(sock.fileno()), str(os.getpid()), str(at), expected.hex()],
        pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, env=env,
    )


_current: Sidecar | None = None
_current_lock = threading.Lock()


def ensure() -> Sidecar:
    """This process's sidecar, started (again) if there is none or the last one died. One that
    could not start is returned all the same: its ``pid`` is None and ``dead`` says why."""
    global _current
    with _current_lock:
        sc = _current
        if sc is None or sc.dead is not None or sc.owner_pid != os.getpid():
            if sc is not None and sc.owner_pid == os.getpid():
                log.warning("%s; starting a new one", sc.dead)
                sc.close()
            _current = sc = Sidecar()
        return sc


def current() -> Sidecar | None:
    """This process's sidecar as it stands, live or dead, without starting one: None if none was
    started in this process (a forked child included), or since :func:`shutdown`."""
    sc = _current
    return sc if sc is not None and sc.owner_pid == os.getpid() else None


def current_pid() -> int | None:
    """The pid of this process's live sidecar, if one is running (for tests and tools)."""
    sc = current()
    return sc.pid if sc is not None and sc.dead is None else None


def shutdown() -> None:
    """Stop this process's sidecar and free its shared memory (also run at exit)."""
    global _current
    with _current_lock:
        sc, _current = _current, None
    if sc is not None and sc.owner_pid == os.getpid():
        sc.close()
    close_shared_pool()
    dcp_staging = sys.modules.get("ckptio.dcp.stager")
    if dcp_staging is not None:  # DCP's staging keeps its own free buffers, views into the slabs
        dcp_staging.SHARED_BUFFERS.clear()


def _forget_after_fork() -> None:
    # A forked child (a data-loader worker) shares neither the sidecar nor its slabs' bookkeeping.
    global _current
    _current = None
    forget_shared_pool()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_after_fork)
