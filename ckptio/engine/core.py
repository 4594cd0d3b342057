"""The async IO engine: concurrency, byte budget, retries, checksums, progress.

One engine drives one backend from a shared event-loop thread (``ckptio-io``),
so the caller's thread -- the training step -- never runs IO. Every request
holds a concurrency slot and a share of the in-flight byte budget; only
:class:`~ckptio.backends.base.RetryableError` is retried, with exponential
backoff and full jitter. Checksums are crc32c per block (computed in worker
threads: the crc32c library releases the GIL).

What to write is decided above it: the layout plans objects (:mod:`ckptio.engine.layout`)
and a writer drives their writes (:mod:`ckptio.saving.writers.base`). A read request and
its cutting into verified pieces live in :mod:`ckptio.engine.readpieces`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from ckptio.backends.base import Backend, ByteRange, Filling
from ckptio.backends.budget import RequestRate, budgeted
from ckptio.backends.deadline import Deadlines, with_deadlines
from ckptio.backends.retrying import RetryPolicy, retry_call
from ckptio.engine.layout import ObjectPlan
from ckptio.engine.readpieces import ConcatView, ReadRequest, split_request
from ckptio.engine.scratch import ScratchPool
from ckptio.errors import IntegrityError
from ckptio.system import POPULATE_MIN, flat_bytes, populate
from ckptio.system.checksum import DEFAULT_BLOCK_SIZE, block_crcs, crc32c, member_crcs, verify_blocks
from ckptio.system.poolshelf import PoolSlot
from ckptio.system.threadwait import thread_done, threads_done

__all__ = ["UNLABELLED_S", "ByteBudget", "Engine", "EngineConfig", "Progress", "ReadRequest", "WrittenObject",
           "gather_or_cancel", "run_sync", "split_request", "thread_done", "threads_done"]

#: The deadline of a collective wait nobody labelled (a tiers round, a user's own collective):
#: torch's own process-group default, so no unlabelled wait fails sooner than it did before.
UNLABELLED_S = 1800.0

log = logging.getLogger("ckptio.engine")
T = TypeVar("T")

#: ``progress(event, nbytes)``; event is "written" or "read".
Progress = Callable[[str, int], None]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine (picklable). ``None`` means: take it from the backend's capabilities."""

    concurrency: int | None = None
    byte_budget: int = 1 << 30
    block_size: int = DEFAULT_BLOCK_SIZE
    retries: int = 8
    backoff_initial: float = 0.05
    backoff_max: float = 8.0
    #: A call the storage throttles (429/503) is retried until this many seconds have passed,
    #: however many attempts that takes (``ckptio.backends.retrying``).
    throttle_patience_s: float = 600.0
    #: The job's request budget on this storage (``ckptio.backends.budget.RequestRate``): every
    #: request of this engine and of its store (saves, restores, listings, gc, retention) waits
    #: for a slot of this host's share. None: no budget, requests go out as fast as concurrency
    #: allows. A manager, ``ckptio.save`` and ``ckptio.restore`` fill in the host's rank and the
    #: job's size from their coordinator (:meth:`for_host`).
    request_rate: RequestRate | None = None
    #: How long one storage call may take before it is cancelled and fails naming the host, the
    #: object and what it waited for (``ckptio.backends.deadline``): a floor plus the call's bytes
    #: over the throughput measured so far, or one fixed deadline (``Deadlines(fixed_s=...)``).
    #: None: no deadline (a call that never answers hangs its save or restore).
    deadlines: Deadlines | None = Deadlines()
    #: Adjacent ranges of one object are merged into reads of at most this many bytes.
    max_read_size: int = 64 << 20
    #: A merged read is issued in pieces of about this many bytes (cut at checksum block
    #: boundaries), each verified while the next one is read, so that verification is
    #: off the critical path but never skipped. None: the larger of the backend's
    #: preferred IO size, four checksum blocks and 16 MiB.
    read_piece_size: int | None = None
    checksum_threads: int = 2
    #: A save's checksums run this many nice steps below the caller's priority: they are
    #: CPU the training step would otherwise wait for (backends/_threads.py has the numbers).
    #: A restore's verification keeps full priority. 0 (default): no change -- on a saturated
    #: host a lowered save loses throughput to every other process, not just the trainer.
    save_nice: int = 0

    @property
    def retry_policy(self) -> RetryPolicy:
        """The retry knobs above, as the retry loop takes them."""
        return RetryPolicy(self.retries, self.backoff_initial, self.backoff_max, self.throttle_patience_s)

    def collective_deadline_s(self, nbytes: int = 0) -> float:
        """How long a host waits for the others at a collective of a save or restore that covers
        ``nbytes`` of IO on each of them (``Deadlines.collective_s``); a stretch of throttling
        they may sit through (``throttle_patience_s``) is part of it. Without deadlines, the
        wait nobody labelled (``UNLABELLED_S``)."""
        if self.deadlines is None:
            return UNLABELLED_S
        return self.deadlines.collective_s(nbytes, extra_s=self.throttle_patience_s)

    def drive(self, backend: Backend) -> Backend:
        """``backend`` as these knobs drive it: each call under its deadline, within the request budget
        (the budget's wait is not part of a call's deadline)."""
        return budgeted(with_deadlines(backend, self.deadlines), self.request_rate)

    def for_host(self, rank: int, hosts: int) -> EngineConfig:
        """These knobs for host ``rank`` of a job of ``hosts``: its share of ``request_rate``."""
        if self.request_rate is None or self.request_rate.hosts is not None:
            return self
        return dataclasses.replace(self, request_rate=self.request_rate.for_host(rank, hosts))


# -- the shared event-loop thread -------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _io_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ckptio-io", daemon=True).start()
            _loop = loop
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run ``coro`` on the ckptio IO loop; returns a thread-safe future."""
    return asyncio.run_coroutine_threadsafe(coro, _io_loop())


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the IO loop and wait for it (never call from the loop itself)."""
    loop = _io_loop()
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("run_sync called from the ckptio IO loop: await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def gather_or_cancel(coros: Iterable[Awaitable[T]], *, limit: int | None = None) -> list[T]:
    """Run all concurrently (at most ``limit`` at a time); on the first failure cancel the rest,
    wait for them, and raise it -- so none is still running when the caller closes what they use."""
    if limit is not None:
        slots = asyncio.Semaphore(max(1, limit))

        async def bounded(c: Awaitable[T]) -> T:
            async with slots:
                return await c

        coros = [bounded(c) for c in coros]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class ByteBudget:
    """An async semaphore counted in bytes; a request larger than the budget takes all of it."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


@dataclasses.dataclass(slots=True)
class WrittenObject:
    """What the engine reports for one written object: its key and each extent's block checksums."""

    key: str
    size: int
    crcs: list[list[int]]  # per extent of the plan, in order


class Engine:
    """Reads and writes objects of one backend, concurrently and within a byte budget."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.backend = self.config.drive(backend)
        self.concurrency = self.config.concurrency or backend.capabilities.concurrency
        # A read's checks (and populating, copying out), its threads started at the first read, all at once,
        # before any read is issued (start_workers); a save's checksums and tile cuts, at save_nice. Both
        # taken from, and parked back on, the process's shelf (ckptio.system.poolshelf).
        self._cpu = PoolSlot("ckptio-crc", self.config.checksum_threads, started=True)
        self._cpu_save = PoolSlot("ckptio-crc-w", self.config.checksum_threads, nice=self.config.save_nice)
        self._state: dict[asyncio.AbstractEventLoop, tuple[asyncio.Semaphore, ByteBudget]] = {}

    def _limits(self) -> tuple[asyncio.Semaphore, ByteBudget]:
        # asyncio primitives belong to one loop; an Orbax commit thread brings its own.
        loop = asyncio.get_running_loop()
        if loop not in self._state:
            self._state[loop] = (asyncio.Semaphore(self.concurrency), ByteBudget(self.config.byte_budget))
        return self._state[loop]

    def save_pool(self) -> concurrent.futures.Executor:
        """The threads a save's CPU work runs on here (its checksums, its tile cuts)."""
        return self._cpu_save.get()

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu.get(), fn, *args)

    async def _in_save_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu_save.get(), fn, *args)

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call()``, retrying RetryableError as :func:`ckptio.backends.retrying.retry_call` does,
        with this engine's policy. Only the engine's own data reads and writes go through here:
        everything else reaches storage through the store's retrying backend (``store.io``)."""
        return await retry_call(what, call, self.config.retry_policy)

    # -- writing ---------------------------------------------------------

    async def write_object(
        self,
        plan: ObjectPlan,
        progress: Progress | None = None,
        ready: concurrent.futures.Future[None] | None = None,
        filling: Filling | None = None,
    ) -> WrittenObject:
        """Write one object once ``ready`` resolves (its bytes are staged), with block checksums.

        With ``filling``, its bytes are still arriving, front to back: the write starts at once and
        follows them (:meth:`~ckptio.backends.base.Backend.write_filling`), the checksums once all
        are in; a fill that fails fails the write, which leaves no object.
        """
        if ready is not None:
            await asyncio.wrap_future(ready)
        sem, budget = self._limits()
        size = plan.size
        async with sem:
            held = await budget.acquire(size)
            try:
                if plan.lazy:  # tiles are cut out of their staged shards before anything reads them
                    await self._in_save_thread(plan.materialize)
                crcs = await self._write_summed(plan, filling)
            finally:
                plan.release()
                await budget.release(held)
        if progress:  # payload bytes, not alignment padding
            progress("written", sum(e.length for e in plan.extents))
        return WrittenObject(plan.key, size, crcs)

    async def _write_summed(self, plan: ObjectPlan, filling: Filling | None) -> list[list[int]]:
        """Write ``plan`` and checksum it, both at once: the write does not wait for a pass over its
        object (64 MiB: 5-15 ms here). Returns once neither thread reads its buffers any more."""
        backend, key = self.backend, plan.key

        def call() -> Awaitable[None]:
            if filling is None:
                return backend.write(key, plan.buffers)
            return backend.write_filling(key, plan.buffers, filling)

        writing = asyncio.ensure_future(self.retrying(f"write {key!r}", call))
        summing = None
        try:
            if filling is not None:
                await filling.complete()
            summing = self._cpu_save.get().submit(_checksums, plan, self.config.block_size)
            await writing
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                writing.cancel()
            await asyncio.wait([writing])  # a failed fill fails the write at its next byte
            if not writing.cancelled() and writing.exception() is not e:
                log.debug("write of %r ended too: %r", key, writing.exception())
            if summing is not None:
                await thread_done(summing)  # its thread reads the buffers that release() gives back
                _drop_failed(summing, key)  # the write's (or the fill's) error is the one to raise
            raise
        await thread_done(summing)
        return summing.result()

    async def write_objects(
        self,
        plans: Sequence[ObjectPlan],
        progress: Progress | None = None,
        ready: Sequence[concurrent.futures.Future[None]] | None = None,
    ) -> list[WrittenObject]:
        """Write every plan concurrently; on the first failure cancel the rest and raise it.

        ``ready[i]``, when given, resolves once plan ``i``'s bytes are staged.
        """
        gates = ready if ready is not None else [None] * len(plans)
        return await gather_or_cancel(self.write_object(p, progress, g) for p, g in zip(plans, gates))

    # -- reading ---------------------------------------------------------

    def coalesce(self, requests: Sequence[ReadRequest]) -> list[ReadRequest]:
        """Merge requests for adjacent ranges of one object into fewer, larger reads.

        Merging extends the previous request's lists in place: thousands of
        small shards in one object must not cost quadratic list copies.
        """
        out: list[ReadRequest] = []
        for r in sorted(requests, key=lambda r: (r.key, r.rng.start)):
            prev = out[-1] if out else None
            if (
                prev is not None
                and prev.key == r.key
                and prev.rng.end == r.rng.start
                and prev.block_size == r.block_size
                and prev.rng.length + r.rng.length <= self._merge_limit(prev, r)
            ):
                shift = prev.rng.length
                prev.rng = ByteRange(prev.rng.start, r.rng.end)
                prev.buffers.extend(r.buffers)
                prev.checks.extend((o + shift, n, c, i) for o, n, c, i in r.checks)
                prev.after.extend(r.after)
            else:
                out.append(ReadRequest(r.key, r.rng, list(r.buffers), list(r.checks), list(r.after), r.block_size))
        return out

    def _merge_limit(self, a: ReadRequest, b: ReadRequest) -> int:
        """How large a merged read of ``a`` and ``b`` may grow. Reads with copy-out (through
        scratch) stop at one piece: their copy-outs run once the whole merged read is verified,
        so a 64 MiB merge left them all to the end, serially, in one thread (a tiled shard's row
        block restored 2x slower than a C-order one's)."""
        if a.after or b.after:
            return min(self.config.max_read_size, self._piece_size(a))
        return self.config.max_read_size

    def _piece_size(self, req: ReadRequest) -> int:
        return self.config.read_piece_size or max(self.backend.capabilities.preferred_io_size, 4 * req.block_size, _PIECE)

    async def _read_verified(self, req: ReadRequest) -> None:
        """Read ``req`` piece by piece; each piece's checksums run in a thread while the next
        piece is read. Returns once every piece is read and verified (raises IntegrityError)."""
        loop = asyncio.get_running_loop()
        checking: list[asyncio.Future[None]] = []
        pieces = split_request(req, self._piece_size(req))
        # First-touch page faults were a cold restore's largest CPU cost (backends/_pages.py):
        # a worker faults each piece's destination in with one call while the piece before it
        # is read, so the read copies into memory that is already there (and a backend that
        # fills buffers on the event loop, such as GCS, takes no faults holding the GIL).
        # Not for a request with copy-out: it reads into scratch that lives only until then,
        # and populating that cost peak RSS (+25-50 % in ``ckptio bench --reshard``) and time
        # (numpy's scratch takes huge pages on first touch, cheaper than 4 KiB populated ones).
        final = not req.after
        faulting = self._populate(pieces[0], final)
        try:
            for i, piece in enumerate(pieces):
                await faulting
                if i + 1 < len(pieces):
                    faulting = self._populate(pieces[i + 1], final)
                await self.retrying(
                    f"read {req.key!r}", lambda p=piece: self.backend.read_into(p.key, p.rng, p.buffers)
                )
                checking.append(loop.run_in_executor(self._cpu.get(), self._verify_checks, piece))
            await asyncio.gather(*checking)
        finally:  # a failed read must not leave checks running over buffers a retry refills
            await asyncio.gather(faulting, *checking, return_exceptions=True)

    def _populate(self, piece: ReadRequest, wanted: bool) -> asyncio.Future[None]:
        """Fault ``piece``'s buffers in on a worker thread when ``wanted`` and large enough to gain."""
        loop = asyncio.get_running_loop()
        if wanted and piece.rng.length >= POPULATE_MIN:
            return loop.run_in_executor(self._cpu.get(), populate, piece.buffers)
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done

    def _verify_checks(self, req: ReadRequest) -> None:
        bs = req.block_size
        if len(req.buffers) == 1:  # one buffer (a bulk read of many small arrays): plain slices
            flat = flat_bytes(req.buffers[0])
            for offset, length, crcs, item in req.checks:
                view = flat[offset : offset + length]
                if length > bs or crc32c(view) != crcs[0]:  # one block checked inline, the rest in full
                    verify_blocks(view, crcs, bs, key=req.key, item=item, start=req.rng.start + offset)
            return
        joined = ConcatView(req.buffers)
        for offset, length, crcs, item in req.checks:
            verify_blocks(joined.slice(offset, length), crcs, bs, key=req.key, item=item, start=req.rng.start + offset)

    async def read_one(
        self, req: ReadRequest, progress: Progress | None = None, scratch: ScratchPool | None = None
    ) -> None:
        """Read, verify and copy out one request; its scratch comes from ``scratch`` once a
        read slot and the byte budget are granted."""
        sem, budget = self._limits()
        async with sem:
            held = await budget.acquire(req.rng.length)
            try:
                req.buffers = (scratch or ScratchPool()).resolve(req.buffers)
                for attempt in (0, 1):
                    try:
                        await self._read_verified(req)
                        break
                    except IntegrityError:
                        if attempt:  # corrupt twice: it is the object, not the wire
                            raise
                        log.warning("checksum mismatch reading %r; reading it once more", req.key)
                if req.after:  # copy-out (resharding, casts) once the whole range is verified
                    await self._in_thread(lambda: [fn() for fn in req.after])
            finally:
                await budget.release(held)
        if progress:
            progress("read", req.rng.length)

    async def read(self, requests: Sequence[ReadRequest], progress: Progress | None = None) -> None:
        """Coalesce, then run every read concurrently; the first failure cancels the rest.

        Consumes ``requests``: each read drops its buffers and callbacks once done, so the
        scratch memory of a resharded read is freed as soon as it is copied out, not when
        the whole restore returns.
        """
        merged = self.coalesce(requests)
        self._cpu.get()  # its threads up before the first read, not started one by one amid them
        for r in requests:
            r.buffers, r.after = [], []
        scratch = ScratchPool()  # reused across this call's copy-outs, dropped with it
        await gather_or_cancel(self._read_and_drop(r, progress, scratch) for r in merged)

    async def _read_and_drop(self, req: ReadRequest, progress: Progress | None, scratch: ScratchPool) -> None:
        try:
            await self.read_one(req, progress, scratch)
        finally:
            req.buffers, req.after = [], []

    def close(self) -> None:
        self._cpu.release()  # parked for the next store's engine
        self._cpu_save.release()


_PIECE = 16 << 20


def _drop_failed(fut: concurrent.futures.Future[Any], key: str) -> None:
    """Retrieve the error of ``fut``, a finished checksum pass whose object's write failed, so
    that it is not lost unseen (it is seldom news: the write's failure is what is raised)."""
    err = fut.exception()
    if err is not None:
        log.debug("checksums of %r failed too, after its write did: %r", key, err)


def _checksums(plan: ObjectPlan, block_size: int) -> list[list[int]]:
    """Checksum every extent of a materialized plan: in its own blocks where the layout gave it
    some (a small shard's), else in ``block_size``; an extent staging already checksummed keeps
    its sums."""
    return [e.sums if e.sums is not None
            else block_crcs(e.data, e.block or block_size) if e.cuts is None  # type: ignore[arg-type]
            else member_crcs(e.data, e.cuts)  # type: ignore[arg-type]
            for e in plan.extents]
