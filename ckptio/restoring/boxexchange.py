"""Logical-box exchange, executed: each host reads the shards it is responsible for and sends boxes.

The plan is :mod:`ckptio.restoring.boxroute`. Here, collectively (every host of
the coordinator calls :func:`restore_exchange`):

1. every host makes its target regions (the buffers it restores into) and
   learns every host's target boxes: from :class:`TargetTable` s the caller
   gives (a description every host holds: a grid, a jax sharding), else by
   one all-gather of each host's boxes (:func:`boxroute.gathered`);
2. arrays no two hosts share (:func:`boxroute.apart`, decided alike on every
   host from the root and the tables) it reads itself, as a plain restore
   does, before the first agreement; for the others it reads the root's
   fragments it is responsible for (not the ones its target meets) and lists
   the pieces it sends and the pieces it receives;
3. per round (a run of arrays, the same on every host, from the root), it
   reads from storage, through the engine, the part of each of its shards that
   some host needs (every byte verified against its checksum blocks on the
   host that reads it), and sends every host its pieces, raw bytes in the
   canonical order both ends know, each message led by a status byte and
   sealed with the crc32c of its pieces; a receiver checks the seal (damage
   between the host that verified the bytes and the host that uses them is
   an IntegrityError). Where the coordinator has ``exchange_into``, a piece
   that is one run of its target buffer is received right there, others
   through a staging buffer (:mod:`ckptio.restoring.landing`); a box the sender
   wants itself as one run of its target (a replicated array) is read there.
   An array whose shards lie in fewer fragments than there are hosts (a
   replicated one) has each band of its shards read and sent by another host
   (:mod:`ckptio.restoring.spread`), not all of it by one;
4. each round ends in a status round: an error on any host (a missing object,
   a checksum, a bad target) is raised on every host, naming the host that
   failed and what it failed on (:func:`ckptio.restoring.agreement.agree`).

So each stored byte some target needs is read from storage once in the job,
no host reads another host's fragment (but for the bands of a spread array),
and a host holds its restored arrays plus one round's reads and messages.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptio.coord.distributed import Coordinator
from ckptio.coord.waits import waiting_for
from ckptio.engine import Progress, run_sync
from ckptio.engine.layout import MIN_BLOCK, MIN_BLOCKS_PER_SHARD
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.manifest import ArrayItem, Manifest, table_of
from ckptio.restoring.agreement import agree as _agree
from ckptio.restoring.agreement import named as _named
from ckptio.restoring.boxroute import Pieces, TargetTable, apart, gathered, incoming, outgoing, responsible
from ckptio.restoring.landing import Landing, dest_run
from ckptio.restoring.packed import table_reads
from ckptio.restoring.packing import buffer_lengths, pack, read_buffers
from ckptio.restoring.planner import ReadPlan, Selection, _Builder, select
from ckptio.restoring.reshard import Region, coverage_gaps, plan_regions
from ckptio.restoring.runs import flat
from ckptio.restoring.spread import may_send, original_senders, received, sent, spread_bands, spread_fragments
from ckptio.restoring.targets import target_regions
from ckptio.store import CheckpointStore
from ckptio.system.checksum import crc32c

__all__ = ["restore_exchange"]

#: A round moves about 1/_ROUNDS of the bytes the job restores (bands of large arrays' shards).
_ROUNDS = 8
#: At most this many bands of one array's shards (see :func:`_bands`); shards up to _ONE_BAND bytes
#: are never cut (a whole array up to 1 MiB has one checksum block).
_MAX_BANDS, _ONE_BAND = 4, 1 << 20


@dataclasses.dataclass
class _Side:
    """One host's view of the restore: its regions, the pieces it sends and receives."""

    regions: dict[str, dict[tuple[int, ...], list[Region]]]
    sends: dict[str, Pieces]
    gets: dict[str, Pieces]
    local: Manifest  # the root with the shards of this host's responsible fragments
    targets: dict[str, TargetTable]
    #: Arrays whose bands several hosts send (:mod:`ckptio.restoring.spread`), and their bands.
    spread: dict[str, int] = dataclasses.field(default_factory=dict)


def restore_exchange(store: CheckpointStore, root: Manifest, step_dir: str, target: Any, coord: Coordinator, *,
                     targets: Mapping[str, TargetTable] | None = None, progress: Progress | None = None) -> Any:
    """Restore ``root`` (a committed manifest of ``store``'s ``step_dir``) as ``target`` asks, by
    logical-box exchange over ``coord`` (an :class:`~ckptio.coord.distributed.ExchangeCoordinator`).
    Collective. ``targets``: every host's target boxes per array, if every host can say them
    (else they are all-gathered). ``target`` may be a :class:`~ckptio.restoring.planner.Selection`
    (the DCP Reader's read items, by item name). Raises on every host if any host fails.
    ``progress`` is fed ``("read", n)`` as this host's bytes land: from storage (what it reads
    itself, as a plain restore reports) and from the exchange (each round's pieces it received,
    once copied in)."""
    where = store.where(step_dir)
    failure: BaseException | None = None
    side: _Side | None = None
    finish: ReadPlan | None = None
    try:
        sel = target if isinstance(target, Selection) else select(root, target, where)
        builder = _Builder(root, where, (coord.rank, coord.size))
        regions: dict[str, dict[tuple[int, ...], list[Region]]] = {}
        for name, tgt in sel.wanted.items():
            if isinstance(root.items[name], ArrayItem):
                rs, builder.finishers[name] = target_regions(name, root.items[name], tgt)  # type: ignore[arg-type]
                for r in rs:  # a box held twice (two pieces of one replica) is filled twice
                    regions.setdefault(name, {}).setdefault((*r.offsets, *r.dest.shape), []).append(r)
            else:
                builder.add(name, tgt)
        tables_read, tables_finish = table_reads(sel.tables, root.objects, root.block_size,
                                                 store.engine.config.max_read_size)
        finish = ReadPlan([], sel.structure, builder.finishers, [tables_finish], {}, {})
        described = _described(root, sel.wanted) if targets is None else {}
    except Exception as e:
        failure = e
        regions, described, tables_read = {}, {}, []
    # Every host joins the all-gather and the agreement, whatever it failed with.
    if targets is not None:
        tables = dict(targets)
    else:
        tables = dict(described)
        tables.update(gathered(
            coord, {n: [(rs[0].offsets, tuple(rs[0].dest.shape)) for rs in by_box.values()]
                    for n, by_box in regions.items() if n not in tables},
            {n: len(it.shape) for n, it in root.items.items() if isinstance(it, ArrayItem)}))
    if failure is None:
        try:
            _check_tables(root, regions, tables, coord.rank)
            # Arrays no two hosts share: each host reads its own (the same choice on every host).
            own = apart(root.items, tables)
            _read_own(store, root, step_dir, {n: r for n, r in regions.items() if n in own}, tables_read, progress)
            shared = {n: t for n, t in tables.items() if n not in own}
            bands = {n: b for rnd in (_rounds(root, shared) if shared else []) for n, _k, b in rnd}
            side = _plan(store, root, step_dir, regions, shared, coord, spread_bands(root, shared, bands, coord.size))
        except Exception as e:
            failure = _named(e, coord.rank)
    config, what = store.engine.config, f"exchange restore of {where}"
    with waiting_for(f"{what}: agreeing on the plan", config.collective_deadline_s()):
        _agree(coord, failure, 0)
    assert side is not None and finish is not None
    rounds = _rounds(root, side.targets) if side.targets else []
    # A round waits for the other hosts' reads and sends: about a host's share of one round's bytes.
    share = sum(root.items[n].nbytes for n in side.targets) // (_ROUNDS * coord.size)
    for i, rnd in enumerate(rounds):
        with waiting_for(f"{what}: round {i + 1} of {len(rounds)}", config.collective_deadline_s(share)):
            _round(store, coord, side, rnd, progress)
    return finish.finish()


def _read_own(store: CheckpointStore, root: Manifest, step_dir: str,
              regions: dict[str, dict[tuple[int, ...], list[Region]]], extra: list[Any],
              progress: Progress | None = None) -> None:
    """Read this host's own ``regions`` from storage, as a plain restore does (the fragments their
    boxes meet, checksums verified), and the requests ``extra`` (pack tables: every host reads them)."""
    if not regions and not extra:
        return
    where = store.where(step_dir)
    boxes = {n: [(rs[0].offsets, tuple(rs[0].dest.shape)) for rs in by_box.values()] for n, by_box in regions.items()}
    manifest = run_sync(store.load_fragments(step_dir, root, boxes)) if boxes else root
    if not store.host_local:
        run_sync(store.check_objects(manifest, where))
    wants = [(n, manifest.items[n], r) for n, by_box in regions.items() for rs in by_box.values() for r in rs]
    for n, item, r in wants:
        if coverage_gaps(item, r.offsets, tuple(r.dest.shape)):  # type: ignore[arg-type]
            raise CheckpointNotFoundError(f"{where}: item {n!r}: part of the target slice at {r.offsets} is not saved")
    run_sync(store.engine.read(plan_regions(wants, manifest.objects, manifest.block_size) + extra, progress))


def _described(root: Manifest, wanted: Mapping[str, Any]) -> dict[str, TargetTable]:
    """The target tables every host can make alone: of jax targets, from their shardings."""
    jax = sys.modules.get("jax")
    out: dict[str, TargetTable] = {}
    for name, tgt in wanted.items():
        sharding = getattr(tgt, "sharding", None) if jax is not None and isinstance(
            tgt, (jax.Array, jax.ShapeDtypeStruct)) else None
        if isinstance(root.items[name], ArrayItem) and hasattr(sharding, "devices_indices_map"):
            out[name] = TargetTable.from_sharding(sharding, root.items[name].shape)  # type: ignore[union-attr]
    return out


def _check_tables(root: Manifest, regions: dict[str, dict[tuple[int, ...], list[Region]]],
                  tables: dict[str, TargetTable], rank: int) -> None:
    """ValueError naming the item unless the tables say of host ``rank`` what its own target says."""
    for name, mine in regions.items():
        said = set(tables[name].of_host(rank)) if isinstance(root.items.get(name), ArrayItem) and name in tables \
            else set()
        boxes = {(rs[0].offsets, tuple(rs[0].dest.shape)) for rs in mine.values() if rs[0].dest.size}
        if said != boxes:
            raise ValueError(f"item {name!r}: the target tables say host {rank} restores {sorted(said)[:4]}, "
                             f"its target says {sorted(boxes)[:4]}")


def _plan(store: CheckpointStore, root: Manifest, step_dir: str,
          regions: dict[str, dict[tuple[int, ...], list[Region]]],
          tables: dict[str, TargetTable], coord: Coordinator, spread: dict[str, int]) -> _Side:
    """This host's pieces of the arrays of ``tables``: its responsible fragments' shards (and those
    whose bands it sends of the ``spread`` arrays) against every target, its own targets against
    the root's locators. A send's ``src`` is the host that would send it unspread (see
    :func:`_round`)."""
    arrays = {n: t for n, t in tables.items() if isinstance(root.items.get(n), ArrayItem)}
    rank, hosts = coord.rank, coord.size
    if not arrays:  # nothing exchanged: no fragment read to send from
        return _Side(regions, {}, {}, root, {})
    if root.complete:  # format 1: every shard in the root; shard i is sent by host i % H
        local, gets = root, _incoming_complete(root, arrays, rank, hosts)
        sends = {n: dataclasses.replace(p, src=p.ref % hosts) for n, p in outgoing(root.items, arrays, rank).items()}
    else:
        mine = set(responsible(len(root.fragments or []), hosts, rank))
        extra = spread_fragments(root, spread, rank, hosts) - mine
        local = run_sync(store.load_fragment_numbers(step_dir, root, sorted(mine | extra), names=set(arrays)))
        sends = outgoing(local.items, arrays, rank)  # src: this host, the sender of its responsible fragments
        if extra:  # shards of other hosts' fragments too: each one's sender unspread, by the root's locator
            sends = {n: dataclasses.replace(p, src=original_senders(local.items[n], root.items[n], rank, hosts)[p.ref])
                     for n, p in sends.items()}  # type: ignore[arg-type]
        gets = incoming(root.items, arrays, rank, hosts)
    sends = {n: p.take(may_send(p.src, spread.get(n, 1), rank, hosts)) for n, p in sends.items()}
    if not store.host_local:
        run_sync(store.check_objects(local, store.where(step_dir)))
    return _Side(regions, sends, gets, local, arrays, spread)


def _incoming_complete(root: Manifest, targets: dict[str, TargetTable], rank: int, hosts: int) -> dict[str, Pieces]:
    """:func:`incoming` for a format-1 manifest, through a locator made from its shards (shard
    ``i`` as if in fragment ``i``)."""
    out = {}
    for name, tt in targets.items():
        item = root.items[name]
        t = table_of(item)  # type: ignore[arg-type]
        shim = copy.copy(item)
        shim.locator = np.column_stack([np.arange(t.n), t.offsets, t.shape])  # type: ignore[union-attr]
        out.update(incoming({name: shim}, {name: tt}, rank, hosts))
    return out


#: One round: per array, (name, band, bands): band ``k`` of ``bands`` of the rows of every stored shard.
Round = list[tuple[str, int, int]]


def _rounds(root: Manifest, targets: dict[str, TargetTable]) -> list[Round]:
    """The rounds, the same on every host (from the root and the targets): each moves about
    1/``_ROUNDS`` of the bytes the job restores; an array larger than that is cut into bands of
    the rows of each of its stored shards, one band a round."""
    sizes = {n: int(np.prod(t.shape, axis=1, dtype=np.int64).sum())
             * root.items[n].dtype.itemsize for n, t in targets.items()}  # type: ignore[union-attr]
    budget = max(1, sum(sizes.values()) // _ROUNDS)
    out: list[Round] = [[]]
    held = 0
    for n in sorted(sizes):
        bands = _bands(root.items[n], sizes[n], budget)  # type: ignore[arg-type]
        for k in range(bands):
            if held >= budget:
                out.append([])
                held = 0
            out[-1].append((n, k, bands))
            held += sizes[n] // bands
    return out


def _bands(item: ArrayItem, size: int, budget: int) -> int:
    """Into how many bands of rows each stored shard of ``item`` is cut (``size``: the bytes the
    job restores of it). A band's edge inside a checksum block has that block read in both
    rounds: blocks are at most 1/32 of a shard (:func:`ckptio.engine.layout.extent_block`, unless
    :data:`~ckptio.engine.layout.MIN_BLOCK` or a small whole array's one block stops it), so at most
    ``_MAX_BANDS`` bands and a band at least 32 smallest blocks: at most 3/32 of a shard read twice."""
    if not item.shape or not size:
        return 1
    ndim = len(item.shape)
    if item.locator is not None:
        shapes = item.locator[:, 1 + ndim :]
    else:
        shapes = table_of(item).shape
    smallest = int(np.prod(shapes, axis=1, dtype=np.int64).min()) * item.dtype.itemsize if len(shapes) else 0
    if smallest <= _ONE_BAND:
        return 1
    return max(1, min(-(-size // budget), _MAX_BANDS, item.shape[0], smallest // (MIN_BLOCKS_PER_SHARD * MIN_BLOCK)))


def _round(store: CheckpointStore, coord: Coordinator, side: _Side, rnd: Round, progress: Progress | None = None
           ) -> None:
    """Read this round's shards, exchange its pieces, copy them in; then agree (raises on every
    host if any failed)."""
    x: Any = coord
    # Keyed by (array, band): a round may hold several bands of one array.
    # A spread array's band k is sent k hosts on from the host that holds its shard's fragment.
    hosts, spread = coord.size, side.spread
    sends = {(n, k): sent(side.sends[n].band(k, b), k if n in spread else 0, coord.rank, hosts) for n, k, b in rnd
             if n in side.sends}
    gets = {(n, k): received(side.gets[n].band(k, b), k if n in spread else 0, hosts) for n, k, b in rnd
            if n in side.gets}
    failure: BaseException | None = None
    try:
        messages = _read_and_pack(store, side, sends, gets, coord.rank)
    except Exception as e:
        failure = _named(e, coord.rank)
        messages = {}
    status = memoryview(bytearray([failure is not None]))
    out: dict[int, list[memoryview]] = {}
    for dst, lengths in _buffers(side, sends, "dst").items():
        # After a failure, zeros of the promised lengths: nobody waits for bytes that never come.
        bufs = messages.get(dst) or [memoryview(bytearray(n)) for n in lengths]
        out[dst] = [status, *bufs, _sealed(bufs)]
    expect = _buffers(side, gets, "src")
    sizes = {src: [1, *lengths, _SEAL] for src, lengths in expect.items()}
    if callable(getattr(x, "exchange_into", None)):
        # Each piece lands in its target where it is one run of it (no message held beside it).
        landing = _landing(side, gets)
        x.exchange_into(out, sizes, landing.into)
        del out, messages
        try:
            if failure is None and not any(landing.statuses().values()):  # else the sender reports its failure
                for src, views in landing.into.items():
                    _check_views(views, src, coord.rank)
                landing.finish()
                if progress and landing.nbytes:
                    progress("read", landing.nbytes)
        except Exception as e:
            failure = _named(e, coord.rank)
        del landing
    else:
        got = x.exchange(out, sizes)
        del out, messages
        try:
            if failure is None and not any(got[s][0] for s in expect):  # else the sender reports its failure
                for src in expect:
                    _check_seal(got[src], src, coord.rank)
                _unpack(side, gets, got)
                if progress and expect:
                    progress("read", sum(sum(lengths) for lengths in expect.values()))
        except Exception as e:
            failure = _named(e, coord.rank)
        del got
    _agree(coord, failure, 0)


#: Bytes of a message's seal: the crc32c of its pieces, so bytes corrupted between the host that
#: read (and verified) them and the host that uses them are an IntegrityError, not a silent bad restore.
_SEAL = 4


def _sealed(bufs: list[memoryview]) -> memoryview:
    value = 0
    for b in bufs:
        value = crc32c(b, value)
    return memoryview(value.to_bytes(_SEAL, "little"))


def _check_seal(message: bytearray, src: int, rank: int) -> None:
    """Raise IntegrityError unless ``message`` (status byte, pieces, seal) arrived as sent."""
    view = memoryview(message)
    _check_views([view[:1], view[1:-_SEAL], view[-_SEAL:]], src, rank)


def _check_views(views: list[memoryview], src: int, rank: int) -> None:
    """:func:`_check_seal` of a message received into ``views`` (status byte, buffers, seal)."""
    if _sealed(views[1:-1]).tobytes() != views[-1].tobytes():
        raise IntegrityError(f"host {rank}: the pieces host {src} sent in a restore exchange arrived damaged "
                             f"(crc32c mismatch over {sum(v.nbytes for v in views[1:-1])} bytes)")


def _landing(side: _Side, gets: dict[tuple[str, int], Pieces]) -> Landing:
    """Where this round's received pieces go (see :mod:`ckptio.restoring.landing`), per source in
    message order, cut as the senders cut their messages."""
    landing, targets = Landing(_SEAL), []
    for (n, _k), p in gets.items():
        tt, regions = side.targets[n], side.regions[n]
        refs, inv = np.unique(p.ref, return_inverse=True)
        base = len(targets)
        targets += [regions[(*tt.offsets[r].tolist(), *tt.shape[r].tolist())] for r in refs.tolist()]
        landing.add(p.src, p.lo, p.hi, tt.offsets[p.ref], tt.shape[p.ref], base + inv.reshape(-1),
                    side.local.items[n].dtype.itemsize)  # type: ignore[union-attr]
    landing.build(targets)
    return landing


def _buffers(side: _Side, pieces: dict[tuple[str, int], Pieces], peer: str) -> dict[int, list[int]]:
    """Per peer (``"dst"`` or ``"src"`` of ``pieces``), the lengths of the buffers its message is
    cut into (:func:`~ckptio.restoring.packing.buffer_lengths`)."""
    if not pieces:
        return {}
    return buffer_lengths(np.concatenate([getattr(p, peer) for p in pieces.values()]),
                          np.concatenate([p.nbytes(side.local.items[n].dtype.itemsize)  # type: ignore[union-attr]
                                          for (n, _k), p in pieces.items()]))


def _read_and_pack(store: CheckpointStore, side: _Side, sends: dict[tuple[str, int], Pieces],
                   gets: dict[tuple[str, int], Pieces] | None = None, rank: int = -1) -> dict[int, list[memoryview]]:
    """Read (verified) the part of each shard this round's pieces need, then each destination's
    message: its pieces' bytes in canonical order, as the buffers
    :func:`~ckptio.restoring.packing.buffer_lengths` cuts (a piece alone in its buffer and contiguous where it was read: a view; the rest packed into one flat
    send buffer for the round, as runs). Where this host (``rank``, receiving ``gets``) wants that
    very box itself as one run of its target buffer (a replicated array), it is read there, not
    beside it; the rest is read into one flat read buffer for the round."""
    reads, cols = [], []
    for (n, k), p in sends.items():
        item = side.local.items[n]
        order = np.argsort(p.ref, kind="stable")
        rows, begin = np.unique(p.ref[order], return_index=True)
        lo, hi = np.minimum.reduceat(p.lo[order], begin, axis=0), np.maximum.reduceat(p.hi[order], begin, axis=0)
        base = len(reads)
        for lo_, hi_ in zip(lo, hi):  # one per stored shard (its band) sent from
            reads.append((n, item, lo_, hi_, _in_place(side, (gets or {}).get((n, k)), rank, n, lo_, hi_)))
        src = base + np.searchsorted(rows, p.ref)
        cols.append((p.dst, p.lo, p.hi, lo[src - base], hi[src - base], src, item.dtype.itemsize))  # type: ignore[union-attr]
    buffers = read_buffers([(item, lo_, hi_, own) for _n, item, lo_, hi_, own in reads])
    wants = [(n, item, Region(tuple(lo_.tolist()), buf)) for (n, item, lo_, _h, _o), buf in zip(reads, buffers)]
    run_sync(store.engine.read(plan_regions(wants, side.local.objects, side.local.block_size)))
    return pack(cols, [flat(b) for b in buffers])


def _in_place(side: _Side, gets: Pieces | None, rank: int, name: str, lo: np.ndarray, hi: np.ndarray
              ) -> np.ndarray | None:
    """This host's target buffer for box ``[lo, hi)`` of array ``name``, as an array of that box's
    shape, if it receives exactly that box from itself and it is one run of its first region."""
    if gets is None or not len(gets):
        return None
    mine = np.flatnonzero((gets.src == rank) & (gets.lo == lo).all(axis=1) & (gets.hi == hi).all(axis=1))
    if not len(mine):
        return None
    tt, ref = side.targets[name], int(gets.ref[mine[0]])
    region = side.regions[name][(*tt.offsets[ref].tolist(), *tt.shape[ref].tolist())][0]
    run = dest_run(region, tuple(lo.tolist()), tuple(hi.tolist()))
    return None if run is None else run.view(region.dest.dtype).reshape(tuple((hi - lo).tolist()))


def _unpack(side: _Side, gets: dict[tuple[str, int], Pieces], got: dict[int, bytearray]) -> None:
    """Copy every received piece of this round into its target region."""
    pos = {src: 1 for src in got}
    for (n, _k), p in gets.items():
        dtype = side.local.items[n].dtype  # type: ignore[union-attr]
        tt, regions = side.targets[n], side.regions[n]
        for src, ref, lo, hi in zip(p.src.tolist(), p.ref.tolist(), p.lo.tolist(), p.hi.tolist()):
            shape = [b - a for a, b in zip(lo, hi)]
            count = int(np.prod(shape, dtype=np.int64))
            data = np.frombuffer(got[src], dtype, count, pos[src]).reshape(shape)
            for region in regions[(*tt.offsets[ref].tolist(), *tt.shape[ref].tolist())]:
                region.dest[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, region.offsets))] = data
            pos[src] += count * dtype.itemsize
