"""Read-once reads of a request list: each stored byte read from storage by one host of the job, then redistributed.

What the DCP Reader's ``read_once`` uses (it plans DCP's requests, not target regions);
``ckptio.restore(read_once=True)`` and ``CheckpointManager.restore()`` restore by logical-box
exchange instead (:mod:`ckptio.restore.boxexchange`), which also spares each host every
fragment but its own.

When several hosts need the same stored bytes (a replicated array,
data-parallel replicas, rows restored as columns), a plain restore has every
one of them read those bytes: H× the checkpoint from storage at 8 hosts,
while storage bandwidth is what a restart is short of and the network between
hosts has 10-100× more. Here (after ByteCheckpoint, NSDI '25, and Orbax's
single-replica restore):

1. every host plans its reads as usual; the byte ranges of its requests are
   what it needs;
2. object byte space is cut at fixed :data:`CHUNK` boundaries and chunk ``c``
   of object ``k`` is owned by host ``(crc32(k) + c) % H``: no global plan,
   nothing O(H²), one large object spread over every host;
3. per round, each host sends each owner the ``(key, start, end)`` it needs of
   it (exchange 1, small); owners read the union of what they were asked from
   storage once (``store.io``, retried); each owner sends each needer its bytes
   (exchange 2, large);
4. each host executes its **unchanged** read plan through the normal engine
   against a :class:`~ckptio.restore.ranges.RangesBackend` holding what it
   received, so every byte is verified against its checksums on the host that
   uses it (a byte flipped in storage or on the wire is an IntegrityError
   naming the object), scratch and copy-outs work as ever.

Rounds bound memory: a host's requests go out in rounds of about
``round_bytes`` (what it needs), so a host holds at a time its restored
arrays, one round of received bytes and the chunks it read for others in that
round. Every round ends in a status round (gather to host 0, broadcast), so a
failure on any host (a missing object, a checksum, a bad target) is raised on
every host, naming the host and what failed, never a hang; the step fallback
of :mod:`ckptio.restore.step` sees the same kind of error on every host and
makes one decision.

Transports (:class:`ckptio.distributed.ExchangeCoordinator`): torch.distributed
(gloo ``all_to_all_single`` for lengths, isend/irecv for bytes) carries it
fully; jax.distributed goes through the coordination service's key-value
store, which relays every byte through process 0: right, O(own bytes) per
client, but not a bulk path for a large job (that wants the bytes placed on
the saved sharding and resharded on device, or a jax all-to-all).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import logging
import zlib
from collections import defaultdict
from typing import Any

from ..backends.base import ByteRange
from ..distributed import Coordinator, broadcast_from_root, gather_to_root, join_errors
from ..waits import waiting_for
from ..engine import Engine, Progress, ReadRequest, run_sync
from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..readpieces import split_request
from ..store import CheckpointStore
from .ranges import RangesBackend

__all__ = ["CHUNK", "can_read_once", "owner", "read_once"]

#: Object byte space is owned in chunks of this many bytes (cut anywhere: the needer verifies
#: whole checksum blocks after reassembly, so a chunk need not align with them).
CHUNK = 8 << 20
#: Rounds are about this share of what a host reads (at least 1 MiB, at most 64 MiB), so that
#: what is in flight stays small beside what the host restores.
_ROUND_SHARE = 16
_ROUND_MIN, _ROUND_MAX = 1 << 20, 64 << 20
#: Error kinds carried across hosts as themselves (so every host makes the same step decision).
_KINDS: dict[str, type[BaseException]] = {
    "CheckpointNotFoundError": CheckpointNotFoundError,
    "IntegrityError": IntegrityError,
    "ManifestError": ManifestError,
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
}

log = logging.getLogger("ckptio.restore")

#: (key, start, end): a byte range of one object, within one chunk.
Span = tuple[str, int, int]


def can_read_once(coord: Coordinator) -> bool:
    """Whether ``coord`` spans several hosts and exchanges bytes (see
    :class:`ckptio.distributed.ExchangeCoordinator`)."""
    return coord.size > 1 and callable(getattr(coord, "exchange", None))


def owner(key: str, chunk: int, hosts: int) -> int:
    """The host that reads chunk ``chunk`` of object ``key`` (crc32: the same in every process,
    unlike ``hash``)."""
    return (zlib.crc32(key.encode()) + chunk) % hosts


def read_once(store: CheckpointStore, requests: list[ReadRequest], coord: Coordinator, *,
              progress: Progress | None = None, failure: BaseException | None = None, chunk: int = CHUNK,
              round_bytes: int | None = None) -> None:
    """Read and verify ``requests`` as ``store.engine.read`` does, each stored byte read once
    across the job (collective: every host of ``coord`` calls it, with its own requests).

    ``failure``: what this host failed with before it had requests (planning them); it joins
    the collectives anyway, and every host raises. Consumes ``requests`` as the engine does.
    """
    rounds: list[list[ReadRequest]] = []
    budget = round_bytes or chunk
    if failure is None:
        try:
            budget = round_bytes or _round_size(sum(r.rng.length for r in requests))
            # A request that lands in its final buffers splits at checksum blocks (each piece
            # verifies alone), so a round holds a share of a large array, not all of it; one with
            # copy-out stays whole (its callbacks need all of it).
            rounds = _rounds([p for r in requests for p in ([r] if r.after else split_request(r, budget))], budget)
        except Exception as e:
            failure = e
    config, what = store.engine.config, f"read-once restore of {store.url}"
    with waiting_for(f"{what}: agreeing on the rounds", config.collective_deadline_s()):
        n = _agree(coord, failure, len(rounds))
    received = RangesBackend(f"read-once:{store.url}")
    # Bytes already in this process: nothing to wait for, no storage to budget.
    engine = Engine(received, dataclasses.replace(store.engine.config, deadlines=None, request_rate=None))
    try:
        for r in range(n):
            # Each round covers what every host reads for the others: about one round's bytes.
            with waiting_for(f"{what}: round {r + 1} of {n}", config.collective_deadline_s(budget)):
                _round(store, coord, engine, rounds[r] if r < len(rounds) else [], chunk, progress)
    finally:
        engine.close()
        received.clear()


def _round(store: CheckpointStore, coord: Coordinator, engine: Engine, requests: list[ReadRequest], chunk: int,
           progress: Progress | None) -> None:
    """One round: ask (exchange 1), read for others, send and receive (exchange 2), execute,
    agree (raises on every host if any failed).

    Each reply starts with one status byte: an owner whose read failed sends 1 and zeros (the
    needers must not wait), the needers then execute nothing and the owner's error is raised
    on every host at the agreement."""
    x: Any = coord  # an ExchangeCoordinator (can_read_once)
    asks = _asks(requests, chunk, coord.size)
    asked = {src: json.loads(m) for src, m in x.exchange(
        {dst: [memoryview(json.dumps(spans).encode())] for dst, spans in asks.items()}).items()}
    failure: BaseException | None = None
    try:
        replies = run_sync(_serve(store, asked))
    except Exception as e:
        failure = _named(e, coord.rank)
        zeros = memoryview(bytearray(max((e - s for needs in asked.values() for _, s, e in needs), default=0)))
        replies = {src: [zeros[: e - s] for _, s, e in needs] for src, needs in asked.items()}
    status = memoryview(bytearray([failure is not None]))
    got = x.exchange({src: [status, *views] for src, views in replies.items()},
                     {o: [1] + [e - s for _, s, e in spans] for o, spans in asks.items()})
    backend: RangesBackend = engine.backend  # type: ignore[assignment]
    try:
        if failure is None and not any(got[o][0] for o in asks):  # else the owner reports its failure
            for o, spans in asks.items():
                view, pos = memoryview(got[o]), 1
                for key, s, e in spans:
                    backend.add(key, s, view[pos : pos + e - s])
                    pos += e - s
            del got
            run_sync(engine.read(requests, progress))
    except Exception as e:
        failure = e
    finally:
        backend.clear()
    _agree(coord, failure, 0)


def _round_size(nbytes: int) -> int:
    return max(_ROUND_MIN, min(_ROUND_MAX, nbytes // _ROUND_SHARE))


def _rounds(requests: list[ReadRequest], budget: int) -> list[list[ReadRequest]]:
    """``requests`` in rounds of about ``budget`` bytes, in object order; requests whose ranges
    overlap (two shards sharing a checksum block) stay in one round, so no byte is asked twice."""
    out: list[list[ReadRequest]] = []
    size, key, end = budget, "", 0
    for r in sorted(requests, key=lambda r: (r.key, r.rng.start)):
        if size >= budget and (r.key != key or r.rng.start >= end):
            out.append([])
            size = 0
        if r.key != key:
            key, end = r.key, 0
        out[-1].append(r)
        size += r.rng.length
        end = max(end, r.rng.end)
    return out


def _asks(requests: list[ReadRequest], chunk: int, hosts: int) -> dict[int, list[Span]]:
    """Per owner, the byte ranges these requests need of it: their union, cut at chunk boundaries."""
    merged: list[Span] = []
    for r in sorted(requests, key=lambda r: (r.key, r.rng.start)):
        if merged and merged[-1][0] == r.key and r.rng.start <= merged[-1][2]:
            k, s, e = merged[-1]
            merged[-1] = (k, s, max(e, r.rng.end))
        elif r.rng.length:
            merged.append((r.key, r.rng.start, r.rng.end))
    out: dict[int, list[Span]] = defaultdict(list)
    for key, s, e in merged:
        while s < e:
            c = s // chunk
            cut = min(e, (c + 1) * chunk)
            out[owner(key, c, hosts)].append((key, s, cut))
            s = cut
    return dict(out)


async def _serve(store: CheckpointStore, asked: dict[int, list[list[Any]]]) -> dict[int, list[memoryview]]:
    """Read the union of what each needer asked of this host, once; per needer, its bytes as views
    (in the order it asked)."""
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for needs in asked.values():
        for key, s, e in needs:
            spans[key].append((s, e))
    reads: list[tuple[str, int, bytearray]] = []
    for key, ranges in spans.items():
        for s, e in sorted(ranges):
            if reads and reads[-1][0] == key and s <= reads[-1][1] + len(reads[-1][2]):
                k, s0, buf = reads[-1]
                if s0 + len(buf) < e:
                    buf.extend(bytes(e - s0 - len(buf)))  # grows before any byte is read into it
            else:
                reads.append((key, s, bytearray(e - s)))
    limit = asyncio.Semaphore(store.engine.concurrency)

    async def read(key: str, start: int, buf: bytearray) -> None:
        async with limit:
            await store.io.read_into(key, ByteRange(start, start + len(buf)), [memoryview(buf)])

    await asyncio.gather(*(read(*r) for r in reads))
    index = {key: [] for key in spans}  # type: dict[str, list[tuple[int, memoryview]]]
    for key, s, buf in reads:
        index[key].append((s, memoryview(buf)))
    return {src: [_slice(index[k], s, e) for k, s, e in needs] for src, needs in asked.items()}


def _slice(held: list[tuple[int, memoryview]], start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of one object out of its disjoint, sorted reads (one holds them all)."""
    i = bisect.bisect_right(held, start, key=lambda h: h[0]) - 1
    s, view = held[i]
    return view[start - s : end - s]


def _named(e: BaseException, rank: int) -> BaseException:
    """``e`` with this host's rank in its message (its type kept when it can be rebuilt)."""
    try:
        out = type(e)(f"host {rank}: {e}")
    except Exception:
        return e
    out.__dict__.update(e.__dict__)
    out.__cause__ = e
    return out


def _kind(e: BaseException) -> str:
    """The most specific kind of ``e`` that other hosts re-raise as itself."""
    return next((c.__name__ for c in type(e).__mro__ if c.__name__ in _KINDS), "RuntimeError")


class _Failed:
    """What a status round says of a failure (attached to the exception every host raises): one
    decision for every host, whatever it raised itself."""

    def __init__(self, only_integrity: bool) -> None:
        self.only_integrity = only_integrity


def _agree(coord: Coordinator, failure: BaseException | None, n: int) -> int:
    """Status round: every host learns whether any host failed (then raises) and the largest ``n``.

    The broadcast verdict is bounded (the first failures' messages, not every host's)."""
    mine = [n, None if failure is None else [_kind(failure), f"host {coord.rank}: {type(failure).__name__}: {failure}"]]
    reports = gather_to_root(coord, mine)
    verdict = None
    if reports is not None:
        errors = [r[1] for r in reports if r[1]]
        verdict = [max(r[0] for r in reports), errors[0][0] if errors else "",
                   join_errors([m for _, m in errors]), all(k == "IntegrityError" for k, _ in errors)]
    most, kind, message, only_integrity = broadcast_from_root(coord, verdict)
    if not kind:
        return int(most)
    raised = failure or _KINDS.get(kind, RuntimeError)(f"read-once restore failed on another host: {message}")
    try:
        raised.ckptio_read_once = _Failed(only_integrity)  # type: ignore[union-attr]
    except AttributeError:  # an exception type without a __dict__: no retry for it
        pass
    raise raised
