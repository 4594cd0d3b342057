"""``ckptio.dcp.Reader``: a torch.distributed.checkpoint StorageReader on the ckptio engine.

``read_metadata`` reads the manifest (only a committed checkpoint has one)
and rebuilds DCP's Metadata from it -- no unpickling. ``read_data`` is asked
for sub-rectangles of saved chunks (``ReadItem.storage_offsets`` /
``lengths``: DCP's planner already intersected the new sharding with the
saved one); each becomes ranged reads of just the saved rows it needs
(:func:`ckptio.restoring.reshard.plan_region`), crc32c-verified, straight into the
destination tensor's memory when it is a contiguous CPU tensor of the saved
dtype, else through a host tensor and one ``copy_`` (which also casts, as
DCP's own reader does). All reads of a plan run concurrently in the engine.
Chunks saved through stream transforms (``_extensions``) are read whole,
verified, and undone with DCP's extension registry.

Where there is no ckptio manifest but a stock DCP checkpoint (``.metadata``
+ ``__*.distcp``, as torch's FileSystemWriter writes them, on any backend),
the Reader loads that: see :mod:`ckptio.dcp._stock` (its ``.metadata`` is a
pickle -- stock DCP's format -- unpickled by torch's own FileSystemReader
code; ``allow_stock=False`` refuses it).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptio.backends.base import ByteRange, join_key
from ckptio.coord.distributed import default_coordinator
from ckptio.dcp import _stock, _transforms
from ckptio.dcp._codec import ChunkRef, metadata_from_manifest, numpy_dtype_of, numpy_view
from ckptio.dcp._location import Located
from ckptio.dcp._readonce import Want, exchange_regions
from ckptio.dcp._rootview import boxed, located, wanted
from ckptio.engine import EngineConfig, ReadRequest, gather_or_cancel, run_sync
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, Manifest
from ckptio.manifest.names import parse_object
from ckptio.restoring.agreement import can_read_once
from ckptio.restoring.reshard import Region, plan_region, plan_regions
from ckptio.store import CheckpointStore
from ckptio.store.companions import is_companion

__all__ = ["Reader"]

log = logging.getLogger("ckptio.dcp")
_READS = "ckptio.reads"  # a LoadPlan's storage_data key: the checkpoint a rank chose (Reader without a step)


class Reader(Located, StorageReader):
    """Load a DCP checkpoint from any ckptio URL: ckptio's, the native API's, or stock DCP's.

    ``dcp.load(sd, storage_reader=Reader(url))``, or ``Reader(root, step=100)``
    for a step saved with ``Writer(root, step=100)`` or the native API. Every
    byte of a ckptio checkpoint is checked against its crc32c: a corrupt
    object raises :class:`ckptio.IntegrityError` naming the object and the
    item. A stock checkpoint (FileSystemWriter's ``.metadata`` + ``.distcp``)
    is read where it lies, with ranged reads (it has no checksums to check).

    Args:
        url: checkpoint URL or path (a ``checkpoint_id`` given to ``dcp.load`` replaces it).
        step: read step ``step`` under ``url``. Without it, ``url`` is the checkpoint, or, if ``url`` is
            a root of steps (``Writer(root, step=N)``, ``CheckpointManager``, ``ckptio.save``), its
            newest committed step, chosen afresh at each load (every rank must choose the same: a save
            committing between their looks fails the load with a clear error; pass ``step`` then).
        engine_config: concurrency, byte budget, retries.
        backend_options: options of the backend.
        allow_stock: read stock DCP checkpoints (their ``.metadata`` is a pickle).
        read_once: every rank passes it: each stored byte of a ckptio checkpoint is read from
            storage by one rank and sent to the ranks that need it over torch.distributed, by
            logical-box exchange (:mod:`ckptio.dcp._readonce`: tensors no two ranks share each
            rank reads itself); a stock checkpoint is read as without it.
        _extension_registry: DCP's ``ExtensionRegistry`` for transformed items (default: torch's).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        step: int | None = None,
        engine_config: EngineConfig | None = None,
        backend_options: dict[str, Any] | None = None,
        allow_stock: bool = True,
        read_once: bool = False,
        _extension_registry: Any | None = None,
    ) -> None:
        super().__init__()
        self._init_location(url, step, engine_config, backend_options)
        self.allow_stock = allow_stock
        self.read_once = read_once
        self.extension_registry = _extension_registry
        self._reset_state()

    def _reset_state(self) -> None:
        self._manifest: Manifest | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], ChunkRef] = {}
        self._saved_dtype: dict[str, torch.dtype] = {}
        self._sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}  # (FQN, chunk offsets) -> chunk shape
        self._stock: dict[Any, Any] | None = None  # a stock checkpoint's storage_data
        self.load_id = uuid.uuid4().hex

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_manifest=None, _chunks={}, _saved_dtype={}, _sizes={}, _stock=None)  # re-read where it lands
        return state

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._relocate(checkpoint_id)
        self._reset_state()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's DCP Metadata; CheckpointNotFoundError naming it if it is not committed.

        ``rank=`` (DCP asks for it only when the global metadata is missing)
        reads a stock checkpoint's per-rank ``__<rank>.metadata``; ckptio
        checkpoints always have one global manifest.
        """
        rank = kwargs.get("rank")
        store = self._open()
        where = self.checkpoint_id
        try:
            if rank is not None:
                return self._stock_metadata(store, rank)
            if self.step is None:
                self.step_dir = ""  # "the newest step" is decided afresh at every load
            manifest, stock = run_sync(_find(store, self.step_dir))
            if manifest is None and not stock and self.step is None:
                manifest = self._newest_step(store)
                where = self.checkpoint_id
            if manifest is not None and stock and not run_sync(
                    is_companion(store, self.step_dir, manifest, _stock.metadata_key("", None))):
                raise ManifestError(
                    f"{where} holds both a ckptio checkpoint ({MANIFEST_NAME}) and a stock DCP one (.metadata): "
                    "one was saved over the other; remove the stale one"
                )
            if manifest is None and stock:
                if run_sync(_holds_ckptio_objects(store, self.step_dir)):
                    # A .metadata ckptio wrote for torch, whose manifest is gone: not committed, never unpickled.
                    raise CheckpointNotFoundError(f"no checkpoint at {where}")
                return self._stock_metadata(store, None)
            if manifest is None:
                run_sync(store.read_manifest(self.step_dir))  # raises CheckpointNotFoundError with its reason
                raise CheckpointNotFoundError(f"no checkpoint at {where}")  # deleted meanwhile
        except CheckpointNotFoundError:
            try:  # objects without a manifest: a save that never committed (say so: it is not 'absent')
                leftovers = run_sync(store.backend.list_children(self.step_dir))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                leftovers = []
            if leftovers and rank is None:
                raise CheckpointNotFoundError(
                    f"checkpoint {where} is not committed (it has no manifest, but holds {leftovers[:3]}): "
                    "its save did not finish, or this URL is a parent of checkpoints, not one"
                ) from None
            raise
        finally:
            self._close()  # read_data reopens it: no connections held between DCP's steps
        # A format-2 root's chunks are its boxes: no fragment is read until read_data knows which it needs.
        metadata, chunks = metadata_from_manifest(boxed(manifest), where)
        metadata.storage_meta.load_id = self.load_id
        self._manifest, self._chunks, self._stock = manifest, chunks, None
        self._index(metadata)
        return metadata

    def _newest_step(self, store: CheckpointStore) -> Manifest | None:
        """With no step, a root of steps reads its newest committed one (as ``ckptio.restore`` does);
        None if the root holds none."""
        try:
            step_dir, manifest = run_sync(store.resolve_manifest(None, shards=False))
        except CheckpointNotFoundError:
            return None
        self.step_dir = step_dir
        log.info("%s: reading its newest committed step, %s", self.url, step_dir)
        return manifest

    def _index(self, metadata: Metadata) -> None:
        """Each tensor's saved dtype and each saved chunk's shape, by FQN and chunk offsets."""
        self._saved_dtype = {fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items()
                             if hasattr(md, "properties")}
        self._sizes = {(fqn, tuple(c.offsets)): tuple(c.sizes)
                       for fqn, md in metadata.state_dict_metadata.items() for c in getattr(md, "chunks", [])}

    def _stock_metadata(self, store: CheckpointStore, rank: int | None) -> Metadata:
        """A stock DCP checkpoint's Metadata (torch unpickles it; see :mod:`ckptio.dcp._stock`)."""
        where = self.checkpoint_id
        key = _stock.metadata_key(self.step_dir, rank)
        if not self.allow_stock:
            raise ManifestError(f"{where} is a stock DCP checkpoint (its .metadata is a pickle); this Reader was "
                                "built with allow_stock=False")
        try:
            data = run_sync(store.io.read(key))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {where} (no ckptio manifest, no {key})") from None
        metadata = _stock.load_metadata(bytes(data), rank)
        if metadata.storage_data is None:
            raise ManifestError(f"{where}/{key}: stock DCP metadata without storage_data")
        metadata.storage_meta.load_id = self.load_id
        self._manifest, self._chunks, self._stock = None, {}, dict(metadata.storage_data)
        self._index(metadata)
        log.info("%s: a stock DCP checkpoint (%d stored items)", where, len(self._stock))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._manifest is None and self._stock is None:  # DCP reads metadata first; a caller may hand it in
            per_rank = kwargs.get("use_collectives") is False and kwargs.get("rank") is not None
            self.read_metadata(rank=kwargs["rank"]) if per_rank else self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self.step is None and plan.storage_data is None:  # the coordinator checks every rank chose the same
            return dataclasses.replace(plan, storage_data={_READS: self.checkpoint_id})
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        chosen = {p.storage_data[_READS] for p in plans if isinstance(p.storage_data, dict) and _READS in p.storage_data}
        if len(chosen) > 1:  # a save committed between two ranks' looks at the root
            raise CheckpointNotFoundError(
                f"ranks chose different newest steps: {sorted(chosen)}; a save committed while they looked. "
                "Pass the step (Reader(root, step=N)) to load one"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._manifest is None and self._stock is None:
            self.read_metadata()
        t0 = time.perf_counter()
        finish: list[Callable[[], None]] = []
        try:
            store = self._open()
            coord = default_coordinator() if self.read_once and self._stock is None else None
            if coord is not None and can_read_once(coord) and not store.host_local:
                requests = []
                assert self._manifest is not None
                exchange_regions(store, self._manifest, self.step_dir, lambda: self._wants(plan, planner, finish),
                                 coord)
            else:
                requests = (self._plan_stock(store, plan, planner, finish) if self._stock is not None
                            else self._plan_manifest(store, plan, planner, finish))
                run_sync(store.engine.read(requests))
        except IntegrityError as e:  # name the checkpoint too, not only the object key under it
            raise IntegrityError(f"checkpoint {self.checkpoint_id}: {e}", key=e.key, item=e.item) from e
        except FileNotFoundError as e:
            raise FileNotFoundError(f"checkpoint {self.checkpoint_id} is missing an object its metadata names: {e}"
                                    ) from e
        finally:
            self._close()
        # Hand data to the planner on this thread, only once every read is in and verified.
        for fn in finish:
            fn()
        log.info("%s: read %d items in %d requests (%.3fs)", self.checkpoint_id, len(plan.items), len(requests),
                 time.perf_counter() - t0)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- ckptio checkpoints --------------------------------------------------

    def _plan_manifest(self, store: CheckpointStore, plan: LoadPlan, planner: LoadPlanner,
                       finish: list[Callable[[], None]]) -> list[ReadRequest]:
        manifest = self._manifest
        assert manifest is not None
        if not manifest.complete:  # only the fragments holding this rank's chunks, only their items' rows
            keys = {k for k in map(self._key_of, plan.items) if k in self._chunks}  # _chunk names the others
            boxes = wanted(self._chunks[k] for k in keys)
            manifest = run_sync(store.load_fragments(self.step_dir, manifest, boxes))
            self._chunks = located(self._chunks, keys, manifest, self.checkpoint_id)
        return plan_regions(self._wants(plan, planner, finish), manifest.objects, manifest.block_size)

    def _wants(self, plan: LoadPlan, planner: LoadPlanner, finish: list[Callable[[], None]]) -> list[Want]:
        """Per read item, the region of a manifest item it is filled from (read plainly or by
        exchange); ``finish`` gets what hands each to the planner once every byte is in."""
        wants: list[Want] = []
        for ri in plan.items:
            ref = self._chunk(ri.storage_index, 1 if ri.type == LoadItemType.BYTE_IO else len(ri.lengths))
            if ref.transforms or ri.type == LoadItemType.BYTE_IO:
                wants.append(self._want_whole(ri, planner, ref, finish))
            else:
                wants.append(self._want_tensor(ri, planner, ref, finish))
        return wants

    @staticmethod
    def _key_of(ri: ReadItem) -> tuple[str, tuple[int, ...]]:
        """The (FQN, chunk offsets) a read item names (a byte item's: ``(0,)``)."""
        index, ndim = ri.storage_index, 1 if ri.type == LoadItemType.BYTE_IO else len(ri.lengths)
        return index.fqn, tuple(index.offset) if index.offset is not None else (0,) * ndim

    def _chunk(self, index: MetadataIndex, ndim: int) -> ChunkRef:
        offsets = tuple(index.offset) if index.offset is not None else (0,) * ndim
        try:
            return self._chunks[(index.fqn, offsets)]
        except KeyError:
            raise ManifestError(
                f"{self.checkpoint_id}: the load plan asks for chunk {list(offsets)} of {index.fqn!r}, "
                "which the checkpoint does not hold"
            ) from None

    def _want_whole(
        self, ri: ReadItem, planner: LoadPlanner, ref: ChunkRef, finish: list[Callable[[], None]]
    ) -> Want:
        """A byte item, or a transformed chunk: its stored bytes whole (verified), then undone and handed over."""
        shard = ref.item.shards[0]
        buf = np.empty(shard.shape, np.uint8)
        where = f"{self.checkpoint_id}: {ri.storage_index.fqn!r}"

        def load() -> None:
            data = _transforms.undo(ref.transforms, buf, self.extension_registry, where)
            if ri.type == LoadItemType.BYTE_IO:
                planner.load_bytes(ri, io.BytesIO(data))
            else:
                md_sizes = self._chunk_sizes(ri, len(ri.lengths))
                chunk = _raw_tensor(data, self._saved_dtype[ri.storage_index.fqn], md_sizes, where)
                _commit(planner, ri, _narrow(chunk, ri))

        finish.append(load)
        return ref.name, ref.item, Region(shard.offsets, buf)

    def _chunk_sizes(self, ri: ReadItem, ndim: int) -> tuple[int, ...]:
        """The saved chunk's shape, from the Metadata :meth:`read_metadata` returned."""
        sizes = self._sizes.get((ri.storage_index.fqn, tuple(ri.storage_index.offset or (0,) * ndim)))
        if sizes is None:
            raise ManifestError(f"{self.checkpoint_id}: no saved chunk {ri.storage_index}")
        return sizes

    def _want_tensor(
        self, ri: ReadItem, planner: LoadPlanner, ref: ChunkRef, finish: list[Callable[[], None]]
    ) -> Want:
        lengths = tuple(ri.lengths)
        shard = ref.item.shards[0]
        offsets = tuple(s + o for s, o in zip(shard.offsets, ri.storage_offsets))
        if any(o + n > s + m for o, n, s, m in zip(offsets, lengths, shard.offsets, shard.shape)):
            raise ManifestError(f"{self.checkpoint_id}: read of {ri.storage_index} runs outside its saved chunk")
        target, host, direct = self._destination(ri, planner)
        finish.append(lambda: _commit(planner, ri, host if not direct else None, target))
        return ref.name, ref.item, Region(offsets, numpy_view(host, ri.dest_index.fqn))

    def _destination(self, ri: ReadItem, planner: LoadPlanner) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The planner's target, and the host tensor the bytes land in (the target itself when it can be)."""
        lengths = tuple(ri.lengths)
        target = planner.resolve_tensor(ri).detach()
        if tuple(target.shape) != lengths:
            raise ValueError(f"{ri.dest_index.fqn!r}: the planner resolved a {tuple(target.shape)} tensor for {lengths}")
        saved = self._saved_dtype.get(ri.storage_index.fqn, target.dtype)
        direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == saved
        return target, (target if direct else torch.empty(lengths, dtype=saved)), direct

    # -- stock DCP checkpoints -------------------------------------------------

    def _plan_stock(
        self, store: CheckpointStore, plan: LoadPlan, planner: LoadPlanner, finish: list[Callable[[], None]]
    ) -> list[ReadRequest]:
        """Read requests for a stock checkpoint's items: ranged where a probe shows C-order bytes, else whole."""
        assert self._stock is not None
        infos = {}
        for ri in plan.items:
            info = self._stock.get(ri.storage_index)
            if info is None:
                raise ManifestError(f"{self.checkpoint_id}: the load plan asks for {ri.storage_index}, which the "
                                    "checkpoint's metadata does not hold")
            infos[ri.storage_index] = info
        # Round 1: probe the large untransformed tensor records, all at once.
        probes: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, int, int, Any, tuple[int, ...]]] = {}
        requests: list[ReadRequest] = []
        for ri in plan.items:
            info = infos[ri.storage_index]
            rec = (info.relative_path, info.offset)
            if ri.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None) or rec in probes:
                continue
            if info.length >= _stock.RANGED_MIN_BYTES and ri.storage_index.fqn in self._saved_dtype:
                reqs, head, tail = _stock.probe_requests(self._key(info), info.offset, info.length)
                requests += reqs
                probes[rec] = (head, tail, info.offset, info.length, self._saved_dtype[ri.storage_index.fqn],
                               self._chunk_sizes(ri, len(ri.lengths)))
        if requests:
            run_sync(store.engine.read(requests))
        layouts = {rec: _stock.parse_probe(*p) for rec, p in probes.items()}
        # Round 2: ranged reads of probed C-order records; whole reads of the rest (each record once).
        requests = []
        whole: dict[tuple[str, int], np.ndarray] = {}
        for ri in plan.items:
            info = infos[ri.storage_index]
            rec = (info.relative_path, info.offset)
            layout = layouts.get(rec)
            if layout is not None:
                requests += self._plan_ranged(ri, planner, info, layout, finish)
                continue
            if rec not in whole:
                whole[rec] = buf = np.empty(info.length, np.uint8)
                requests.append(ReadRequest(self._key(info), ByteRange(info.offset, info.offset + info.length),
                                            [memoryview(buf)], []))
            finish.append(self._stock_loader(ri, planner, info, whole[rec]))
        return requests

    def _key(self, info: Any) -> str:
        return join_key(self.step_dir, info.relative_path)

    def _plan_ranged(self, ri: ReadItem, planner: LoadPlanner, info: Any, layout: _stock.RecordLayout,
                     finish: list[Callable[[], None]]) -> list[ReadRequest]:
        fqn = ri.storage_index.fqn
        item = _stock.record_item(layout, numpy_dtype_of(self._saved_dtype[fqn], fqn))
        target, host, direct = self._destination(ri, planner)
        reqs = plan_region(fqn, item, Region(tuple(ri.storage_offsets), numpy_view(host, ri.dest_index.fqn)),
                           [self._key(info)], 1)
        for r in reqs:
            r.checks = []  # stock files carry no checksums
        finish.append(lambda: _commit(planner, ri, host if not direct else None, target))
        return reqs

    def _stock_loader(self, ri: ReadItem, planner: LoadPlanner, info: Any, buf: np.ndarray) -> Callable[[], None]:
        """Hand one stock item over as torch's FileSystemReader does: transforms undone, torch.load, narrow."""
        where = f"{self.checkpoint_id}: {ri.storage_index.fqn!r} in {info.relative_path}"

        def load() -> None:
            data = _transforms.undo(getattr(info, "transform_descriptors", None) or (), buf, self.extension_registry,
                                    where)
            if ri.type == LoadItemType.BYTE_IO:
                planner.load_bytes(ri, io.BytesIO(data))
                return
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if not isinstance(tensor, torch.Tensor):
                raise ManifestError(f"{where}: the record holds a {type(tensor).__name__}, not a tensor")
            _commit(planner, ri, _narrow(tensor, ri))

        return load


async def _find(store: CheckpointStore, step_dir: str) -> tuple[Manifest | None, bool]:
    """The committed ckptio manifest of ``step_dir`` (None if there is none), and whether a stock ``.metadata`` is there."""

    async def manifest() -> Manifest | None:
        try:
            return await store.read_manifest(step_dir, shards=False)
        except CheckpointNotFoundError:
            return None

    async def stock() -> bool:
        key = _stock.metadata_key(step_dir, None)
        try:
            await store.io.stat(key)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    m, s = await gather_or_cancel([manifest(), stock()])
    return m, s


async def _holds_ckptio_objects(store: CheckpointStore, step_dir: str) -> bool:
    """Whether ``step_dir`` holds objects ckptio's naming proves are its own (a stock checkpoint holds none)."""
    try:
        names = await store.backend.list_children(step_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return False
    return any(parse_object(f"{step_dir}/{n}" if step_dir else n, store.naming) is not None for n in names)


def _raw_tensor(data: bytes, dtype: torch.dtype, sizes: tuple[int, ...], where: str) -> torch.Tensor:
    """A chunk's C-order raw bytes as a tensor of ``dtype`` and ``sizes`` (any dtype, complex32 included)."""
    out = torch.empty(sizes, dtype=dtype)
    flat = out.reshape(-1).view(torch.uint8)
    if flat.numel() != len(data):
        raise IntegrityError(f"{where}: {len(data)} bytes after its transforms, the chunk needs {flat.numel()}")
    if len(data):
        flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return out


def _narrow(chunk: torch.Tensor, ri: ReadItem) -> torch.Tensor:
    """The part of a saved chunk a ReadItem asks for (DCP's ``narrow_tensor_by_index``)."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    return narrow_tensor_by_index(chunk, ri.storage_offsets, ri.lengths)


def _commit(planner: LoadPlanner, ri: ReadItem, src: torch.Tensor | None, target: torch.Tensor | None = None) -> None:
    """Copy ``src`` into the planner's target (unless the bytes already landed there) and commit it."""
    if target is None:
        target = planner.resolve_tensor(ri).detach()
        if target.size() != src.size():  # type: ignore[union-attr]
            raise ValueError(f"{ri.dest_index.fqn!r}: read {tuple(src.size())} for a {tuple(target.size())} target")  # type: ignore[union-attr]
    if src is not None:
        target.copy_(src)  # to the device / into a strided view / with DCP's implicit cast
    planner.commit_tensor(ri, target)
