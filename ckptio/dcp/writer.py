"""``ckptio.dcp.Writer``: a torch.distributed.checkpoint StorageWriter on the ckptio engine.

Save, in DCP's order of calls:

1. ``prepare_local_plan`` -- the coordinator refuses a checkpoint that is
   already committed (before anyone writes a byte).
2. ``prepare_global_plan`` (coordinator) -- one save id for every rank, and
   each rank's number, so object names follow the store's naming.
3. ``write_data`` (every rank) -- each WriteItem's bytes (a tensor chunk's
   raw C-order bytes, or a planner byte item) become one piece; the layout
   packs them into objects, and the engine writes them all concurrently
   (DCP waits on the returned future at once, so all parallelism is in
   here). Each WriteResult's ``storage_data`` is a :class:`ChunkLocation`.
4. ``finish`` (coordinator) -- builds a normal ckptio manifest (one array
   item per FQN, one shard per chunk, DCP's Metadata as JSON beside it) and
   commits it with create-if-absent: last, once. Until then the checkpoint
   does not exist for any reader.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..engine import EngineConfig, run_sync
from ..intents import Lease, new_id
from ..layout import Naming, Piece, pack
from ..manifest import Manifest
from ..staging import torch_to_numpy
from ..store import CheckpointStore
from ._codec import DCP_VERSION, ChunkLocation, manifest_doc
from ._location import Located
from .staging import HostBuffers, stage_state_dict

__all__ = ["Writer"]

log = logging.getLogger("ckptio.dcp")


@dataclasses.dataclass(frozen=True)
class _PlanInfo:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    save_id: str
    rank: int
    world: int


class Writer(Located, StorageWriter, AsyncStager):
    """Save a DCP checkpoint to any ckptio URL (local path, ``mem://``, ``gs://``, ...).

    ``dcp.save(sd, storage_writer=Writer(url))`` makes ``url`` the checkpoint;
    ``Writer(root, step=100)`` writes ``<root>/100`` as the native API would.
    As an ``AsyncStager`` it stages ``dcp.async_save`` state dicts into host
    buffers reused across saves (``buffers``, by default one process-wide
    pool); it pickles small for the process executor.

    Args:
        url: checkpoint URL or path (a ``checkpoint_id`` given to ``dcp.save`` replaces it).
        step: save as step ``step`` under ``url``.
        engine_config: concurrency, byte budget, checksum block size, retries.
        naming: object naming (default: the backend's -- hashed on object stores).
        backend_options: options of the backend (e.g. ``{"fsync": False}`` for local).
        buffers: the staging pool for ``async_save``.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        step: int | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
        buffers: HostBuffers | None = None,
    ) -> None:
        super().__init__()
        self._init_location(url, step, engine_config, backend_options, naming)
        self.buffers = buffers
        self.is_coordinator = False
        self.rank = 0
        self._save_id: str | None = None
        self._lease: Lease | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["buffers"] = None  # the pool stays in the process that stages
        state["_lease"] = None  # a live intent's heartbeat stays with the process that plans
        return state

    # -- AsyncStager -------------------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reused host buffers (see :mod:`ckptio.dcp.staging`)."""
        return stage_state_dict(state_dict, self.buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    # -- StorageWriter -----------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._relocate(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            # Without collectives every rank would commit its own partial manifest.
            raise NotImplementedError("ckptio.dcp.Writer needs use_collectives=True: one coordinator commits")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator:
            try:
                run_sync(self._open().prepare_save(self.step_dir))  # finishes an interrupted deletion
                committed = False
            except FileExistsError:
                committed = True
            finally:
                self._close()  # write_data may run in another process (async_save's process executor)
            if committed:
                raise FileExistsError(
                    f"checkpoint {self.checkpoint_id} is already committed; ckptio never overwrites one "
                    "(delete it first, e.g. with CheckpointManager or `ckptio gc`)"
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One id for the whole save: in every object's name and in the manifest.
        save_id = self._save_id = uuid.uuid4().hex[:12]
        # Announced before any rank writes an object; kept fresh until finish() commits.
        self._lease = Lease(CheckpointStore(self.url, engine_config=self.engine_config,
                                            backend_options=self.backend_options),
                            self.step_dir, new_id(), covers=[save_id]).start()
        return [dataclasses.replace(p, storage_data=_PlanInfo(save_id, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):  # a caller that skipped the global plan
            info = _PlanInfo(uuid.uuid4().hex[:12], self.rank, 1)
        store = self._open()
        try:
            results = self._write(store, info, plan.items, planner)
        finally:
            if not self.is_coordinator:  # the coordinator still commits in finish()
                self._close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, store: Any, info: _PlanInfo, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        t0 = time.perf_counter()
        pieces, sizes = [], []
        for i, item in enumerate(items):
            data = _raw_bytes(item, planner.resolve_data(item))
            sizes.append(data.nbytes)
            pieces.append(Piece(str(i), 0, data))
        plans = pack(
            pieces,
            object_size=store.backend.capabilities.object_size,
            key_for=lambda n: store.naming.object_key(self.step_dir, info.save_id, info.rank, info.world, n),
        )
        written = run_sync(store.engine.write_objects(plans))
        run_sync(store.backend.sync())
        extents: dict[int, list[tuple[str, int, int, int, tuple[int, ...]]]] = {}
        for obj, w in zip(plans, written):
            for e, crcs in zip(obj.extents, w.crcs):
                extents.setdefault(int(e.item), []).append((obj.key, e.offset, e.shard_offset, e.data.nbytes, tuple(crcs)))
        log.info("%s: rank %d wrote %d objects, %d bytes (%.3fs)", self.checkpoint_id, info.rank, len(plans),
                 sum(sizes), time.perf_counter() - t0)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=sizes[i],
                storage_data=ChunkLocation(info.rank, sizes[i], tuple(sorted(extents.get(i, []), key=lambda x: x[2]))),
            )
            for i, item in enumerate(items)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._open()
        where = self.checkpoint_id
        try:
            doc = manifest_doc(
                metadata, results, step=self.step, save_id=self._save_id or uuid.uuid4().hex[:12], created=time.time(),
                block_size=store.engine.config.block_size, num_hosts=len(results),
                modules=list(metadata.storage_meta.modules) if metadata.storage_meta else [],
            )
            manifest = Manifest.from_doc(doc, where)  # validates: every tensor's chunks tile it once
            run_sync(store.commit(self.step_dir, manifest))
        except BaseException:
            self._end_lease(retire=False)
            raise
        finally:
            self._close()
        self._end_lease(retire=True)
        # The Metadata dcp.save returns says where each item went, like FileSystemWriter's.
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rr in results for r in rr}
        log.info("%s: committed", where)


    def _end_lease(self, *, retire: bool) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close(retire=retire)
            run_sync(lease.store.close())


def _raw_bytes(item: WriteItem, data: Any) -> memoryview:
    """The bytes one WriteItem stores: a byte item's buffer, or a tensor chunk's C-order bytes."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"{item.index.fqn!r}: the planner resolved a byte item to {type(data).__name__}")
        return data.getbuffer()
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn!r}: the planner resolved a tensor item to {type(data).__name__}")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    expected = tuple(item.tensor_data.chunk.sizes) if item.tensor_data is not None else tuple(t.shape)
    if tuple(t.shape) != expected:
        raise ValueError(f"{item.index.fqn!r}: the planner resolved a {tuple(t.shape)} tensor for a {expected} chunk")
    arr: np.ndarray = torch_to_numpy(t).reshape(-1).view(np.uint8)
    return memoryview(arr)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
