"""The sidecar writer process (see ckptio.saving.writers.sidecar), and the wire both ends speak.

The child maps the trainer's shared-memory slabs, and for each save runs
ckptio's engine on the objects the trainer describes: it cuts tiles, computes
block checksums, writes and syncs, and reports each object written, then the
whole save's checksums (or its failure). It exits when its socket reaches EOF
and, through ``PR_SET_PDEATHSIG``, when the trainer thread that spawned it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import threading
from typing import Any

import numpy as np

from ckptio.engine import Engine, WrittenObject, gather_or_cancel, submit
from ckptio.engine.layout import ObjectPlan, PlannedExtent
from ckptio.engine.tiling import TileCopy
from ckptio.errors import SaveFailedError
from ckptio.saving.writers.remoteread import RemoteObject, RemoteReads, readable

__all__ = ["Channel", "child_main"]

_PR_SET_PDEATHSIG = 1

log = logging.getLogger("ckptio.sidecar")


class Channel:
    """Messages over a private Unix socket between the trainer and its own sidecar (pickle is
    safe here: both ends are the same code in two processes of one job)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: Any, fd: int | None = None) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        head = struct.pack("!Q", len(data))
        with self._send_lock:
            if fd is None:
                self.sock.sendall(head + data)
                return
            sent = socket.send_fds(self.sock, [head], [fd])
            self.sock.sendall(head[sent:] + data)

    def recv(self) -> tuple[Any, list[int]] | None:
        """The next message and the descriptors that came with it; None at EOF."""
        head, fds, _flags, _addr = socket.recv_fds(self.sock, 8, 1)
        if not head:
            return None
        head += self._exactly(8 - len(head))
        return pickle.loads(self._exactly(struct.unpack("!Q", head)[0])), list(fds)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise EOFError("the other end closed the socket mid-message")
            got += k
        return bytes(buf)


class _Writer:
    """The child: maps the trainer's slabs and runs each request on ckptio's IO loop."""

    def __init__(self, chan: Channel, reads: RemoteReads | None = None) -> None:
        self.chan = chan
        self.reads = reads  # None: every extent is in a slab (the trainer's memory is closed to us)
        self.slabs: dict[int, mmap.mmap] = {}
        self.engines: dict[bytes, Engine] = {}
        self.requests: dict[int, tuple[list[concurrent.futures.Future[Any]], concurrent.futures.Future[Any]]] = {}

    def serve(self) -> None:
        while True:
            got = self.chan.recv()
            if got is None:
                os._exit(0)  # the trainer is gone (or done with us): nothing here is worth finishing
            self.handle(*got)

    def handle(self, msg: Any, fds: list[int]) -> None:
        """One message from the trainer, and the descriptors that came with it (all taken)."""
        kind = msg[0]
        if kind == "slab":
            self.slabs[msg[1]] = mmap.mmap(fds[0], msg[2])
        elif kind == "open":
            _k, rid, spec, n = msg
            if fds:  # the trainer's request budget: this host's one share, drawn from by both
                # Handed over, never closed here: closing any descriptor of the memfd drops this
                # process's lockf on it, which an IO thread may hold at that moment.
                self._join_budget(spec, fds.pop(0))
            objects: list[concurrent.futures.Future[Any]] = [concurrent.futures.Future() for _ in range(n)]
            task = submit(self._run(rid, spec, objects))
            self.requests[rid] = (objects, task)
            task.add_done_callback(lambda _t, rid=rid: self.requests.pop(rid, None))
        elif kind == "object":
            _k, rid, i, key, desc = msg
            req = self.requests.get(rid)
            if req is not None and not req[0][i].done():
                req[0][i].set_result((key, desc))
        elif kind == "abort":
            req = self.requests.get(msg[1])
            if req is not None:
                for f in req[0]:
                    if not f.done():
                        f.set_exception(SaveFailedError(f"aborted by the trainer: {msg[2]}"))
        for fd in fds:  # a slab's mapping keeps a descriptor of its own
            os.close(fd)

    def _engine(self, spec: tuple[str, dict[str, Any], Any, tuple[tuple[str, str], ...]]) -> Engine:
        """The engine of one (URL, options, config, environment): made once, reused by later saves."""
        key = pickle.dumps(spec)
        eng = self.engines.get(key)
        if eng is None:
            from ckptio.backends import open_backend

            url, options, config, env = spec
            os.environ.clear()
            os.environ.update(env)  # what the backend would have seen, opened in the trainer
            eng = self.engines[key] = Engine(open_backend(url, **options), config)
        return eng

    def _join_budget(self, spec: tuple[str, dict[str, Any], Any, tuple[tuple[str, str], ...]], fd: int) -> None:
        """Have the engine of ``spec`` draw from the trainer's budget state behind ``fd`` (taken)."""
        from ckptio.backends.budget import budget_of
        from ckptio.backends.budget import discard_shared_state as discard

        try:
            budget = budget_of(self._engine(spec).backend)
        except Exception as e:  # noqa: BLE001 - the save's own request meets it again, and reports it
            log.warning("could not open %s to join its request budget: %s", spec[0], e)
            discard(fd)  # another engine of this process may hold the state's lockf through its own
            return
        if budget is None:
            discard(fd)
        else:
            budget.join(fd)

    def _plan(self, key: str, desc: list[tuple[Any, ...]],
              block_size: int) -> tuple[ObjectPlan, RemoteObject | None]:
        """The object's plan, and its extents still to read from the trainer's memory (or None)."""
        extents, remote = [], []
        for item, shard, shard_offset, offset, length, src, cuts, block, sums in desc:
            if src[0] == "mem":  # data: once read (RemoteObject.read)
                e = PlannedExtent(item, shard, shard_offset, offset, None, length, cuts=cuts, block=block)
                remote.append((e, src[1]))
                extents.append(e)
                continue
            slab = self.slabs[src[1]]
            if src[0] == "shm":
                view = memoryview(slab)[src[2] : src[2] + length]
                extents.append(PlannedExtent(item, shard, shard_offset, offset, view, length, cuts=cuts, block=block,
                                             sums=sums))
            else:
                _s, _id, off, itemsize, shape, offs, sizes = src
                n = int(np.prod(shape, dtype=np.int64)) * itemsize
                # Whole elements as opaque void items: the child needs no ml_dtypes to cut a tile.
                arr = np.frombuffer(slab, np.dtype(f"V{itemsize}"), count=n // itemsize, offset=off).reshape(shape)
                extents.append(PlannedExtent(item, shard, shard_offset, offset, None, length, TileCopy(arr, offs, sizes),
                                             block=block))
        if not remote:
            return ObjectPlan(key, extents), None
        if self.reads is None:
            raise SaveFailedError(f"{key}: extents in the trainer's memory, which this process cannot read")
        return ObjectPlan(key, extents), RemoteObject(self.reads.pid, remote, block_size)

    async def _write(self, eng: Engine, key: str, desc: list[tuple[Any, ...]]) -> WrittenObject:
        plan, remote = self._plan(key, desc, eng.config.block_size)
        if remote is None:
            return await eng.write_object(plan)
        assert self.reads is not None
        self.reads.limit(eng.backend.layout_defaults.object_size)
        # The write follows the reads, piece by piece (the object is its write's Filling).
        return await self.reads.run(remote, eng.save_pool(), eng.config.checksum_threads,
                                    lambda filling: eng.write_object(plan, filling=filling))

    async def _run(self, rid: int, spec: Any, objects: list[concurrent.futures.Future[Any]]) -> None:
        try:
            eng = self._engine(spec)

            async def one(i: int) -> WrittenObject:
                key, desc = await asyncio.wrap_future(objects[i])
                done = await self._write(eng, key, desc)
                # Each object reported as written: its copies in shared memory can be reused.
                self.chan.send(("wrote", rid, i, sum(d[4] for d in desc)))
                return done

            written = await gather_or_cancel(one(i) for i in range(len(objects)))
            await eng.retrying(f"sync {spec[0]}", eng.backend.sync)
            self.chan.send(("done", rid, [(w.key, w.size, w.crcs) for w in written]))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the trainer
            try:
                blob: bytes | None = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                blob = None
            self.chan.send(("failed", rid, blob, f"{type(e).__name__}: {e}"))


def child_main(fd: str, parent: str, token_at: str = "0", token: str = "") -> None:
    """The writer process's body: ``fd`` its socket, ``parent`` the trainer's pid, ``token_at`` and
    ``token`` (hex) the trainer's probe bytes (:func:`ckptio.saving.writers.remoteread.readable`)."""
    pid = int(parent)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != pid:  # the trainer died before the signal was armed
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when a save stops
    logging.basicConfig(level=logging.WARNING, format="ckptio-sidecar %(levelname)s %(name)s: %(message)s")
    chan = Channel(socket.socket(fileno=int(fd)))
    # The trainer first names this process as the one that may read its memory (Yama), then says so.
    if chan.recv() is None:
        return
    ok = bool(token) and readable(pid, int(token_at), bytes.fromhex(token))
    chan.send(("hello", 0, ok))  # before any reply: the trainer learns it before its first save's objects
    _Writer(chan, RemoteReads(pid) if ok else None).serve()

