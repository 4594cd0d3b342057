"""A save, from staging to commit, and the handle the caller holds.

``start_save`` stages on the calling thread (the only part the training
step waits for), then a background thread drives the engine: write every
object (``written``), gather every host's records, and the coordinator
commits the manifest (``committed``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from . import _gc, sidecar
from .distributed import Coordinator, SingleProcess, broadcast_from_root, gather_to_root
from .engine import Progress, WrittenObject, run_sync
from .errors import ManifestError, SaveFailedError
from .intents import Lease, new_id
from .layout import ObjectPlan, Piece, pack
from .dtypes import encode_dtype
from .checksum import crc32c
from .fragments import FragmentRef, build_root, fragment_doc, fragment_key, summary_of
from .manifest import PACKS_VERSION, ROWS_VERSION, TILED_VERSION, Manifest, item_row, item_to_json, row_object, seal
from .packtable import table_doc
from .staging import PACK_MAX_BYTES, LeafPack, LeafPacker, StagedArray, StagingArea, StagingPool, stage_leaf
from .states import SaveState
from .store import CheckpointStore, step_dir_of
from .tiling import TileCopy, tile_boxes
from .tree import flatten_named

__all__ = ["SaveHandle", "merge_records", "start_save"]

log = logging.getLogger("ckptio.save")


class SaveHandle:
    """A save in flight. Returned once staged; :meth:`result` waits until committed."""

    def __init__(self, url: str, step: int | None) -> None:
        self.url = url
        self.step = step
        self.state = SaveState.STAGED
        self.stage_seconds = 0.0
        self._future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> Manifest | None:
        """Wait until the checkpoint is committed; raise if the save failed (on any host).

        Returns the manifest on the coordinator (rank 0), None on other hosts.
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        return f"SaveHandle({self.url!r}, step={self.step}, state={self.state})"


def _plan_staging(
    state: Any, rank: int, area: StagingArea | None, tile_bytes: int = 0, packer: LeafPacker | None = None,
    deferred: list[Callable[[], None]] | None = None, placeholders: bool = True,
) -> tuple[Any, dict[str, Any], list[LeafPack]]:
    """Flatten and validate ``state``; snapshot buffers are allocated, not yet filled.

    With a ``packer``, the small whole arrays this host writes go into its packs instead, each
    holding its place in the staged items as PACKED with ``placeholders`` (a host of many lists
    its items in tree order, rows included). With ``deferred``, parts of the structure are left
    to its calls (``tree.flatten_named``).
    """
    names, values, structure = flatten_named(state, deferred=deferred)
    staged: dict[str, Any] = {}
    if packer is None:
        rest: Iterable[int] = range(len(names))
    else:
        rest = packer.take_many(names, values)
        if placeholders:
            staged = dict.fromkeys(names, PACKED)
    for i in rest:
        name = names[i]
        staged[name] = stage_leaf(name or "<root>", values[i], host=rank, area=area, tile_bytes=tile_bytes)
    return structure, staged, packer.finish() if packer is not None else []


def _pieces(staged: dict[str, Any], packs: Sequence[LeafPack] = ()) -> tuple[list[Piece], dict[tuple[str, int], np.ndarray]]:
    """Every shard as byte pieces (one per tile of a tiled shard; one per pack, numbered -1, -2, ...),
    and each shard's or pack's buffer (to fill before its objects are written)."""
    out, arrays = [], {}
    for k, pack in enumerate(packs):
        out.append(Piece("", -1 - k, memoryview(pack.buffer), cuts=pack.ends, align=pack.arrays[0].dtype.alignment))
        arrays[("", -1 - k)] = pack.buffer
    for name, item in staged.items():
        if isinstance(item, StagedArray):
            for i, (_offs, shape, data) in enumerate(item.shards):
                tile = item.tile_of(i)
                if tile is None:
                    out.append(Piece(name, i, memoryview(data.reshape(-1).view(np.uint8))))
                else:
                    size = item.dtype.itemsize
                    for offs, sizes, pos in tile_boxes(shape, tile):
                        out.append(Piece(name, i, None, pos * size, _tile_fill(data, offs, sizes), math.prod(sizes) * size))
                arrays[(name, i)] = data
    return out, arrays


def _tile_fill(shard: np.ndarray, offs: tuple[int, ...], sizes: tuple[int, ...]) -> Callable[[memoryview], None]:
    """Copies one tile of a staged C-order shard into the buffer the writer hands it."""
    return TileCopy(shard, offs, sizes)


def _pack_items(items: dict[str, Any], pack: LeafPack, n: int, at: int, crcs: list[int], rank: int) -> None:
    """The items of a pack written at offset ``at`` of object ``n`` (``crcs``: one per member), as
    compact rows (``manifest.item_row``)."""
    start = 0
    dtype = _dtype_code(pack.arrays[0].dtype)
    origin = pack.origin
    for name, arr, end, crc in zip(pack.names, pack.arrays, pack.ends, crcs):
        items[name] = item_row(dtype, list(arr.shape), n, at + start, [crc], rank, origin)
        start = end


def _pack_table(pack: LeafPack, n: int, at: int, crcs: list[int], rank: int) -> dict[str, Any]:
    """The format-5 table (``packtable``) of a pack written at offset ``at`` of object ``n``."""
    return table_doc(_dtype_code(pack.arrays[0].dtype), n, at, pack.names, [list(a.shape) for a in pack.arrays],
                     pack.ends, crcs, rank, pack.origin, [])


def _dtype_code(dtype: np.dtype) -> Any:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = encode_dtype(dtype)
    return code


def _expanded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its compact rows as full item objects (what fragments are built from)."""
    items = {name: row_object(it) if type(it) is list else it for name, it in record["items"].items()}
    return {**record, "items": items}


_DTYPE_CODES: dict[np.dtype, Any] = {}

#: A staged item's place when the item itself is in a LeafPack.
PACKED: Any = object()


def _host_record(
    staged: dict[str, Any], plans: list[ObjectPlan], written: list[WrittenObject], rank: int, include_values: bool,
    packs: Sequence[LeafPack] = (), tables: bool = False,
) -> dict[str, Any]:
    """This host's part of the manifest, with object numbers local to the host.

    Its packs' members are compact rows among the items or, with ``tables`` (format 5; a
    single-host save, whose record is the whole manifest), one table per pack.
    """
    extents: dict[tuple[str, int], list[list[Any]]] = {}
    packed: dict[str, Any] = {}
    pack_tables: list[dict[str, Any]] = []
    for n, (plan, w) in enumerate(zip(plans, written)):
        for e, crcs in zip(plan.extents, w.crcs):
            if e.cuts is None:
                extents.setdefault((e.item, e.shard), []).append([n, e.offset, e.shard_offset, e.length, crcs])
            elif tables:
                pack_tables.append(_pack_table(packs[-1 - e.shard], n, e.offset, crcs, rank))
            else:
                _pack_items(packed, packs[-1 - e.shard], n, e.offset, crcs, rank)
    items: dict[str, Any] = {}
    for name, item in staged.items():
        if item is PACKED:
            if not tables:
                items[name] = packed[name]
        elif isinstance(item, StagedArray):
            items[name] = {
                "kind": "array",
                "dtype": encode_dtype(item.dtype),
                "shape": list(item.shape),
                "scalar": item.scalar,
                "origin": item.origin,
                "shards": [
                    {"offsets": list(o), "shape": list(s), "host": rank,
                     "extents": sorted(extents.get((name, i), []), key=lambda x: x[2]),
                     **({"tile": list(t)} if (t := item.tile_of(i)) is not None else {})}
                    for i, (o, s, _d) in enumerate(item.shards)
                ],
            }
        elif include_values:
            items[name] = item_to_json(item, name)
    record = {"ok": True, "objects": [p.key for p in plans], "items": items}
    if pack_tables:
        record["packs"] = pack_tables
    return record


async def _write_fragment(
    store: CheckpointStore, step_dir: str, save_id: str, host: int, step: int | None,
    record: dict[str, Any], plans: list[ObjectPlan],
) -> dict[str, Any]:
    """Write this host's fragment, check that its objects are all there, and return its summary."""
    ref = None
    if any(it["kind"] == "array" and it["shards"] for it in record["items"].values()):
        data = fragment_doc(record, step, save_id, host)
        key = fragment_key(step_dir, save_id)
        view = memoryview(data)
        await store.engine.retrying(f"write {key!r}", lambda: store.backend.write(key, [view]))
        await store.engine.retrying(f"sync {key!r}", store.backend.sync)
        ref = FragmentRef(key, len(data), crc32c(data), host)
    # The coordinator sees only fragments: each host vouches for its own objects before the commit.
    have = await store.object_sizes(p.key for p in plans)
    for p in plans:
        if have.get(p.key, -1) < p.size:
            raise FileNotFoundError(f"{store.where(step_dir)}: object {p.key!r} is missing or short after its write")
    return summary_of(record, ref, coordinator=host == 0)


def merge_records(records: list[dict[str, Any]], head: dict[str, Any], where: str) -> Manifest:
    """The coordinator's manifest from every host's record (validated like any manifest read)."""
    return _validated(_merged_doc(records, head, where), where)


def _validated(doc: dict[str, Any], where: str) -> Manifest:
    try:
        return Manifest.from_doc(doc, where)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: the merged manifest is invalid: {e}") from e
    # (from_doc also checks that every array's shards tile it exactly once.)


def _merged_doc(records: list[dict[str, Any]], head: dict[str, Any], where: str) -> dict[str, Any]:
    """Every host's record in one manifest document (format 1; 3 with tiled shards; 4 with compact rows;
    5 with pack tables, from a single host)."""
    objects: list[str] = []
    items: dict[str, Any] = {}
    tables: list[dict[str, Any]] = []
    # Boxes already in each array item, kept across hosts: rebuilding them per host made
    # merging quadratic in the host count (1024 hosts x 8 shards per array).
    boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for host, rec in enumerate(records):
        base = len(objects)
        objects.extend(rec["objects"])
        for table in rec.get("packs", ()):  # only a single host's record has tables
            table["object"] += base
            tables.append(table)
        for name, it in rec["items"].items():
            if type(it) is list:  # a compact row: a whole array in one extent
                it[2] += base
                if items.setdefault(name, it) is it:
                    continue
                it = row_object(it)  # the same item from two hosts: compared in full below
            elif it["kind"] == "array":
                for s in it["shards"]:
                    for e in s["extents"]:
                        e[0] += base
            mine = items.get(name)
            if mine is None:
                items[name] = it
                if it["kind"] == "array":
                    boxes[name] = {(tuple(s["offsets"]), tuple(s["shape"])) for s in it["shards"]}
                continue
            if type(mine) is list and it["kind"] == "array" and not it["shards"]:
                if (it["dtype"], it["shape"]) != (mine[0], mine[1]):  # another host's view of a host-0 array
                    raise SaveFailedError(f"{where}: item {name!r} differs between hosts (dtype, shape or kind)")
                continue
            if type(mine) is list:
                mine = items[name] = row_object(mine)
                boxes[name] = {(tuple(s["offsets"]), tuple(s["shape"])) for s in mine["shards"]}
            if it["kind"] != mine["kind"] or (it["kind"] == "array" and (it["dtype"], it["shape"]) != (mine["dtype"], mine["shape"])):
                raise SaveFailedError(f"{where}: item {name!r} differs between hosts (dtype, shape or kind)")
            if it["kind"] == "array":
                seen = boxes[name]
                for s in it["shards"]:  # a replica another host already wrote is left out
                    box = (tuple(s["offsets"]), tuple(s["shape"]))
                    if box not in seen:
                        seen.add(box)
                        mine["shards"].append(s)
    tiled = rows = False
    for name, it in items.items():
        if type(it) is list:
            rows = True
            continue
        if it["kind"] == "array" and not it["shards"] and math.prod(it["shape"]):
            raise SaveFailedError(
                f"{where}: item {name!r} has no shard on any host. Plain arrays count as replicated and are "
                "written by host 0 only; an array that only some hosts hold must be a ckptio.Sharded"
            )
        tiled = tiled or (it["kind"] == "array" and any("tile" in sh for sh in it["shards"]))
    if tables:
        return {**head, "version": PACKS_VERSION, "objects": objects, "items": items, "packs": tables}
    version = ROWS_VERSION if rows else TILED_VERSION if tiled else head.get("version", 1)
    return {**head, "version": version, "objects": objects, "items": items}


def _join_as_failed(coord: Coordinator, error: str, where: str) -> None:
    """Take part in this save's collectives with a failure record, as the background thread would.

    A host that refuses a save before its background thread starts (bad input, a committed
    step, an unwritable intent) must still join the gather and the verdict: otherwise the other
    hosts' gather for this step pairs with this host's next save, and every later save fails or
    hangs one step out of phase. So every host fails this step (naming this host's error) and
    the next one pairs up. Runs on the calling thread, before the error reaches the caller.
    """
    if coord.size == 1:
        return
    try:
        records = gather_to_root(coord, {"ok": False, "error": error})
        verdict = {"ok": False, "error": error}
        if coord.rank == 0:
            assert records is not None
            verdict = {"ok": False, "error": "; ".join(r["error"] for r in records if not r["ok"])}
        broadcast_from_root(coord, verdict)
    except BaseException as e:  # the caller's own error is the one to raise
        log.error("%s: host %d could not report its refusal to the other hosts: %r", where, coord.rank, e)


def start_save(
    store: CheckpointStore,
    step: int | None,
    state: Any,
    **kwargs: Any,
) -> SaveHandle:
    """Stage ``state`` now and write + commit it in the background (see :func:`_start_save`)."""
    with _gc.paused():  # the caller waits for staging anyway: no collections mid-burst
        return _start_save(store, step, state, **kwargs)


def _start_save(
    store: CheckpointStore,
    step: int | None,
    state: Any,
    *,
    metadata: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    copy: bool = True,
    pool: StagingPool | None = None,
    progress: Progress | None = None,
    on_done: Callable[[SaveHandle], None] | None = None,
) -> SaveHandle:
    """Stage ``state`` now and write + commit it in the background."""
    coord = coordinator or SingleProcess()
    step_dir = step_dir_of(step)
    where = store.where(step_dir)
    t0 = time.perf_counter()
    # The save's buffers: snapshots of mutable leaves (with ``copy``) and packs of small ones (always:
    # a pack is one copy of bytes that are tiny next to the per-leaf work it saves). A writer process
    # reads staged bytes from shared memory: they are staged there, no later copy.
    area = StagingArea(sidecar.staging_pool(store, pool))
    try:
        # Every leaf is checked before the first byte is written (nothing to clean up on bad input).
        tile_bytes = store.engine.config.tile_bytes
        if tile_bytes is None:
            tile_bytes = store.backend.layout_defaults.tile_bytes
        caps = store.backend.layout_defaults
        packer = None
        single_host = coord.size == 1  # its record is the whole manifest: pack tables, no placeholders
        deferred: list[Callable[[], None]] = []  # the structure's bulk, built by the writer thread
        if coord.rank == 0:  # only host 0 writes plain (replicated) arrays
            packer = LeafPacker(area, min(PACK_MAX_BYTES, store.engine.config.block_size, caps.object_size),
                                caps.object_size)
        structure, staged, packs = _plan_staging(state, coord.rank, area if copy else None,
                                                 min(tile_bytes, caps.object_size), packer, deferred,
                                                 placeholders=not single_host)
        if coord.rank == 0:
            run_sync(store.prepare_save(step_dir))  # finishes an interrupted deletion of this step
        elif run_sync(store.is_committed(step_dir)):
            raise FileExistsError(f"checkpoint {where} is already committed")
    except BaseException as e:
        area.release()
        _join_as_failed(coord, f"host {coord.rank}: {type(e).__name__}: {e}", where)
        raise
    pieces, arrays = _pieces(staged, packs)
    save_id = new_id()
    plans = pack(
        pieces,
        object_size=store.backend.layout_defaults.object_size,
        align=store.backend.capabilities.alignment,
        key_for=lambda n: store.naming.object_key(step_dir, save_id, coord.rank, coord.size, n),
    )
    # Each object's write starts as soon as its own bytes are staged.
    ready: list[concurrent.futures.Future[None]] = [concurrent.futures.Future() for _ in plans]
    handle = SaveHandle(where, step)
    head = {
        "format": "ckptio", "version": 1, "step": step, "checkpoint_id": save_id, "fence": new_id(), "created": time.time(),
        "block_size": store.engine.config.block_size, "num_hosts": coord.size, "tree": structure,
        "metadata": metadata or {},
    }

    # Many hosts: each writes its own manifest fragment and sends the coordinator only boxes
    # (ckptio.fragments). A host-local store could not read other hosts' fragments back.
    split = coord.size > 1 and not store.host_local

    def background() -> None:
        try:
            with _gc.paused():
                for build in deferred:
                    build()
            written = sidecar.write_and_sync(store, plans, progress, ready, where)
            with _gc.paused():
                record = _host_record(staged, plans, written, coord.rank, include_values=coord.rank == 0, packs=packs,
                                      tables=single_host)
            if split:
                record = _expanded(record)  # fragments hold full items
                record = run_sync(_write_fragment(store, step_dir, save_id, coord.rank, step, record, plans))
            handle.state = SaveState.WRITTEN
            log.info("%s: host %d written (%d objects)", where, coord.rank, len(plans))
        except BaseException as e:  # every host must still join the gather, or the others hang
            log.error("%s: host %d failed to write: %r", where, coord.rank, e)
            record = {"ok": False, "error": f"host {coord.rank}: {type(e).__name__}: {e}"}
            failure: BaseException | None = e
        else:
            failure = None
        finally:
            area.release()
        try:
            # O(H) traffic: records go to rank 0 only; every host receives just the small verdict.
            records = gather_to_root(coord, record)
            verdict: dict[str, Any] = {"ok": False}
            manifest: Manifest | None = None
            if coord.rank == 0:
                assert records is not None
                errors = [r["error"] for r in records if not r["ok"]]
                if errors:
                    verdict = {"ok": False, "error": "; ".join(errors)}
                else:
                    try:
                        with _gc.paused():
                            if split:
                                data = seal(build_root(records, head, where))
                                manifest = Manifest.from_json(data, where)
                            else:
                                # The document validated is the one written: no second encoding pass.
                                doc = _merged_doc(records, head, where)
                                manifest = _validated(doc, where)
                                data = seal(doc)
                        run_sync(store.commit(step_dir, manifest, data))
                        verdict = {"ok": True}
                    except BaseException as e:
                        verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
                        failure = failure or e
            verdict = broadcast_from_root(coord, verdict)
            if not verdict["ok"]:
                raise failure or SaveFailedError(f"{where}: save failed: {verdict['error']}")
            lease.close(retire=True)
            handle.state = SaveState.COMMITTED
            log.info("%s: committed", where)
            outcome: tuple[Manifest | None, BaseException | None] = (manifest if coord.rank == 0 else None, None)
        except BaseException as e:
            lease.close(retire=False)  # goes stale: marks this attempt's objects as a dead save's
            handle.state = SaveState.FAILED
            outcome = (None, e)
        # Hooks (retention, closing the store) run before the handle resolves, so that
        # result() returning means everything this save set off is done.
        if on_done is not None:
            try:
                on_done(handle)
            except BaseException as e:  # a hook must not hide the save's own outcome
                log.error("%s: after-save hook failed: %r", where, e)
        if outcome[1] is not None:
            handle._future.set_exception(outcome[1])
        else:
            handle._future.set_result(outcome[0])

    # Announced before the first object: deleters spare a live save's objects, whatever their age.
    lease = Lease(store, step_dir, save_id, coord.rank)
    try:
        lease.start()
    except BaseException as e:
        area.release()
        _join_as_failed(coord, f"host {coord.rank}: {type(e).__name__}: {e}", where)
        raise
    writer = threading.Thread(target=background, name=f"ckptio-save-{step}", daemon=True)
    try:
        area.prefault()
        # Packs first, before the writer starts: copying thousands of small arrays holds the GIL,
        # and the writer's per-member checksums would contend for it inside the step's stall.
        for p in packs:
            area.fill(p.buffer)
        writer.start()
        for plan, fut in zip(plans, ready):
            for e in plan.extents:
                area.fill(arrays[(e.item, e.shard)])
            if not fut.done():  # a failed write cancels the objects still waiting for their bytes
                fut.set_result(None)
        area.fill_all()  # zero-byte pieces belong to no object
    except BaseException as e:
        for fut in ready:
            if not fut.done():
                fut.set_exception(SaveFailedError(f"{where}: staging failed: {e!r}"))
        if writer.ident is None:
            writer.start()  # it fails the save, tells the other hosts and releases the buffers
        raise
    handle.stage_seconds = time.perf_counter() - t0
    log.info("%s: staged %d objects (%.3fs)", where, len(plans), handle.stage_seconds)
    return handle

