"""The optional writer process per host ("sidecar"): a save's object writes out of the trainer.

With ``EngineConfig(writer="sidecar")`` (or ``CKPTIO_WRITER=sidecar``) the
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
copy; ``copy=False`` saves; tensors DCP staged in its own buffers) is copied
into a slab by the trainer's background thread, object by object, with a
copy that releases the GIL. For unaligned sources this is the copy that the
local backend's O_DIRECT bounce buffer made in-process. Such copies are
bounded to a few objects in flight and reused as objects are written.

Modules: this one is the sidecar :class:`~ckptio.writers.Writer`, maps a
store's writer choice to a writer object (:func:`writer_for`) and drives the
child from the trainer; :mod:`ckptio.writers` is the protocol, the in-process
writer and the choice's rules; :mod:`ckptio.shm` is the shared-memory pool;
:mod:`ckptio.sidecar_child` is the child and the wire both ends speak.
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

import numpy as np

from ckptio._system import copy_bytes
from ckptio.backends.budget import budget_of

from .engine import EngineConfig, Progress, WrittenObject
from .errors import SaveFailedError
from .layout import ObjectPlan
from .shm import ShmStagingPool, close_shared_pool, forget_shared_pool, shared_pool
from .sidecar_child import Channel
from .staging import StagingPool
from .store import CheckpointStore
from .tiling import TileCopy
from .writers import ENV, THREAD_WRITER, WRITERS, Writer, wanted_sidecar, writer_name

__all__ = [
    "ENV", "SIDECAR_WRITER", "ShmStagingPool", "SidecarWriter", "WRITERS", "current_pid", "prestart", "shared_pool",
    "shutdown", "staging_pool", "wanted", "write_and_sync", "writer_for", "writer_of",
]

log = logging.getLogger("ckptio.sidecar")

#: Copies in flight per save, in objects (_Export); also what the pool keeps after a JAX save: 2 x 64 MiB
#: held 129 MiB after 256 MiB and 1 GiB saves against 257 MiB with 4, at no measured loss (issue 35).
_EXPORT_OBJECTS = 2


# -- choosing the writer ------------------------------------------------------


def writer_of(config: EngineConfig | None) -> str:
    """The writer an engine config asks for (compatibility name of :func:`ckptio.writers.writer_name`)."""
    return writer_name(config)


def prestart(config: EngineConfig | None) -> None:
    """Start this process's sidecar now if ``config`` asks for one (a manager or writer being made),
    so that its start-up (~0.5 s of imports) is not paid inside the first save."""
    if writer_name(config) == "sidecar" and hasattr(os, "memfd_create"):
        _sidecar()


class SidecarWriter:
    """The :class:`~ckptio.writers.Writer` that hands a save's objects to this process's sidecar."""

    name = "sidecar"

    def staging_pool(self, pool: StagingPool | None) -> StagingPool | None:
        """This process's shared pool; the sidecar is started now, so that it is up by the time
        the first object is staged."""
        _sidecar()
        return shared_pool()

    def write(
        self, store: CheckpointStore, plans: Sequence[ObjectPlan], progress: Progress | None,
        ready: Sequence[concurrent.futures.Future[None]] | None, where: str,
    ) -> list[WrittenObject]:
        """The sidecar writes and syncs ``plans`` (``ready[i]`` still gates object ``i``); blocks."""
        return _sidecar().write(store, plans, progress, ready, where)


#: The sidecar writer (it holds no state: the sidecar itself is this process's, see _sidecar).
SIDECAR_WRITER = SidecarWriter()


def writer_for(store: CheckpointStore) -> Writer:
    """The writer of ``store``'s saves: its config's choice (string) mapped to a writer object,
    the sidecar only where :func:`ckptio.writers.wanted_sidecar` allows it."""
    return SIDECAR_WRITER if wanted_sidecar(store) else THREAD_WRITER


#: True if a store's saves go through the sidecar (compatibility name).
wanted = wanted_sidecar


def staging_pool(store: CheckpointStore, pool: StagingPool | None) -> StagingPool | None:
    """The pool a save of ``store`` stages into (its writer's :meth:`~ckptio.writers.Writer.staging_pool`)."""
    return writer_for(store).staging_pool(pool)


def write_and_sync(
    store: CheckpointStore,
    plans: Sequence[ObjectPlan],
    progress: Progress | None = None,
    ready: Sequence[concurrent.futures.Future[None]] | None = None,
    where: str | None = None,
) -> list[WrittenObject]:
    """Write every object of ``plans`` and make them durable (the backend's sync); blocks.

    ``store``'s writer (:func:`writer_for`) does it; ``ready[i]`` (when given) gates object ``i``.
    """
    return writer_for(store).write(store, plans, progress, ready, where or store.url)


# -- the trainer's side -------------------------------------------------------


class _Export:
    """Puts every extent of a save into shared memory: copies what is not there already.

    Copies (JAX arrays, ``copy=False`` saves) are bounded to ``budget`` bytes in flight:
    an object's copies go back to the pool once the sidecar reports it written, so a
    JAX state needs a few objects' worth of shared memory, not a copy of itself.
    """

    def __init__(self, pool: ShmStagingPool, budget: int) -> None:
        self.pool = pool
        self.budget = max(1, budget)
        self.held = 0
        self.over = False  # the save ended (failed): nobody waits for the budget any more
        self._cond = threading.Condition()
        self._users: dict[int, tuple[np.ndarray, set[int]]] = {}  # id(buffer) -> buffer, objects using it
        self._by_object: dict[int, set[int]] = {}
        self._shards: dict[int, tuple[np.ndarray, int, tuple[int, int]]] = {}  # id(shard) -> shard, buffer, place

    def _need(self, plan: ObjectPlan) -> int:
        """Bytes ``plan``'s extents will be copied into (0 for bytes already in shared memory)."""
        need = 0
        for e in plan.extents:
            if isinstance(e.fill, TileCopy):
                shard = e.fill.shard
                if id(shard) not in self._shards and self.pool.locate(_bytes_of(shard)) is None:
                    need += shard.nbytes
            elif e.fill is not None or (e.data is not None and self.pool.locate(e.data) is None):
                need += e.length
        return need

    def _copy_into_slab(self, n: int, fill: Any, user: int) -> tuple[int, tuple[int, int]]:
        buf = self.pool.take(n)
        fill(memoryview(buf))
        with self._cond:
            self._users[id(buf)] = (buf, {user})
            self._by_object.setdefault(user, set()).add(id(buf))
        loc = self.pool.locate(memoryview(buf))
        assert loc is not None
        return id(buf), loc

    def _place(self, view: memoryview, user: int) -> tuple[int, int]:
        loc = self.pool.locate(view)
        if loc is not None:
            return loc
        # copy_bytes releases the GIL for anything but small copies.
        return self._copy_into_slab(view.nbytes, lambda dst: copy_bytes(dst, view), user)[1]

    def describe(self, i: int, plan: ObjectPlan) -> list[tuple[Any, ...]]:
        """``(item, shard, shard_offset, offset, length, source, cuts, block)`` per extent of object ``i``."""
        need = self._need(plan)
        with self._cond:  # a copy larger than the budget waits until nothing else is held
            self._cond.wait_for(lambda: self.over or not need or not self.held or self.held + need <= self.budget)
            self.held += need
        out = []
        for e in plan.extents:
            src: tuple[Any, ...]
            if isinstance(e.fill, TileCopy):
                shard = e.fill.shard
                known = self._shards.get(id(shard))
                if known is None:  # the shard's reference keeps its id from being reused meanwhile
                    view = _bytes_of(shard)
                    loc = self.pool.locate(view)
                    bid = -1
                    if loc is None:
                        bid, loc = self._copy_into_slab(view.nbytes, lambda dst, v=view: copy_bytes(dst, v), i)
                    known = self._shards[id(shard)] = (shard, bid, loc)
                elif known[1] in self._users:
                    with self._cond:
                        self._users[known[1]][1].add(i)
                        self._by_object.setdefault(i, set()).add(known[1])
                slab, off = known[2]
                src = ("tile", slab, off, shard.dtype.itemsize, shard.shape, e.fill.offs, e.fill.sizes)
            elif e.fill is not None:  # some other lazy extent: fill it here, straight into a slab
                src = ("shm", *self._copy_into_slab(e.length, e.fill, i)[1])
            else:
                assert e.data is not None
                src = ("shm", *self._place(e.data, i))
            out.append((e.item, e.shard, e.shard_offset, e.offset, e.length, src, e.cuts, e.block))
        return out

    def written(self, i: int) -> None:
        """Object ``i`` is written: the copies no other object still needs go back to the pool."""
        freed = []
        with self._cond:
            for bid in self._by_object.pop(i, ()):
                buf, users = self._users[bid]
                users.discard(i)
                if not users:
                    del self._users[bid]
                    freed.append(buf)
            self._shards = {k: v for k, v in self._shards.items() if v[1] < 0 or v[1] in self._users}
            self.held -= sum(b.nbytes for b in freed)
            self._cond.notify_all()
        self.pool.give_back(freed)

    def abandon(self) -> None:
        """The save has ended (its reply came, or the sidecar died): stop waiting for the budget."""
        with self._cond:
            self.over = True
            self._cond.notify_all()

    def release(self) -> None:
        """Give back every copy still held (the save is over, written or not)."""
        with self._cond:
            bufs = [b for b, _u in self._users.values()]
            self._users, self._by_object, self._shards, self.held = {}, {}, {}, 0
            self._cond.notify_all()
        self.pool.give_back(bufs)


def _bytes_of(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


@dataclasses.dataclass(eq=False)
class _Request:
    future: concurrent.futures.Future[list[WrittenObject]]
    progress: Progress | None
    export: _Export


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

    def _die(self, why: str) -> None:
        with self._lock:
            self.dead = self.dead or why
            pending, self._pending = self._pending, {}
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
        export = _Export(shared_pool(), max(_EXPORT_OBJECTS * layout.object_size, caps.concurrency * caps.preferred_io_size))
        with self._lock:
            if self.dead is not None:
                raise SaveFailedError(f"{where}: {self.dead}")
            self._pending[rid] = _Request(fut, progress, export)
        # The environment travels too: backends read theirs when opened (credentials, an emulator's
        # address), and the trainer's may have changed since the child started.
        spec = (store.url, store.backend_options, dataclasses.replace(store.engine.config, writer="thread"),
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
            return fut.result()
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
    # The child imports this very ckptio, wherever it came from (a worktree on sys.path included).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    env[ENV] = "thread"
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from ckptio.sidecar_child import child_main; child_main(*map(int, sys.argv[1:]))",
         str(sock.fileno()), str(os.getpid())],
        pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, env=env,
    )


_current: Sidecar | None = None
_current_lock = threading.Lock()


def _sidecar() -> Sidecar:
    """This process's sidecar, started (again) if there is none or the last one died."""
    global _current
    with _current_lock:
        sc = _current
        if sc is None or sc.dead is not None or sc.owner_pid != os.getpid():
            if sc is not None and sc.owner_pid == os.getpid():
                log.warning("%s; starting a new one", sc.dead)
                sc.close()
            _current = sc = Sidecar()
        return sc


def current_pid() -> int | None:
    """The pid of this process's live sidecar, if one is running (for tests and tools)."""
    sc = _current
    return sc.pid if sc is not None and sc.dead is None and sc.owner_pid == os.getpid() else None


def shutdown() -> None:
    """Stop this process's sidecar and free its shared memory (also run at exit)."""
    global _current
    with _current_lock:
        sc, _current = _current, None
    if sc is not None and sc.owner_pid == os.getpid():
        sc.close()
    close_shared_pool()
    dcp_staging = sys.modules.get("ckptio.dcp.staging")
    if dcp_staging is not None:  # DCP's staging keeps its own free buffers, views into the slabs
        dcp_staging.SHARED_BUFFERS.clear()


def _forget_after_fork() -> None:
    # A forked child (a data-loader worker) shares neither the sidecar nor its slabs' bookkeeping.
    global _current
    _current = None
    forget_shared_pool()


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_after_fork)
