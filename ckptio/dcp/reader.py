"""``ckptio.dcp.Reader``: a torch.distributed.checkpoint StorageReader on the ckptio engine.

``read_metadata`` reads the manifest (only a committed checkpoint has one)
and rebuilds DCP's Metadata from it -- no unpickling. ``read_data`` is asked
for sub-rectangles of saved chunks (``ReadItem.storage_offsets`` /
``lengths``: DCP's planner already intersected the new sharding with the
saved one); each becomes ranged reads of just the saved rows it needs
(:func:`ckptio.reshard.plan_region`), crc32c-verified, straight into the
destination tensor's memory when it is a contiguous CPU tensor of the saved
dtype, else through a host tensor and one ``copy_`` (which also casts, as
DCP's own reader does). All reads of a plan run concurrently in the engine.
"""

from __future__ import annotations

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

from ..engine import EngineConfig, ReadRequest, run_sync
from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..manifest import ArrayItem, Manifest, ShardRecord
from ..reshard import Region, plan_region
from ..staging import torch_to_numpy
from ._codec import metadata_from_manifest
from ._location import Located

__all__ = ["Reader"]

log = logging.getLogger("ckptio.dcp")


class Reader(Located, StorageReader):
    """Load a DCP checkpoint from any ckptio URL; also reads checkpoints saved by ``ckptio.save``.

    ``dcp.load(sd, storage_reader=Reader(url))``, or ``Reader(root, step=100)``
    for a step saved with ``Writer(root, step=100)`` or the native API. Every
    byte read is checked against its crc32c: a corrupt object raises
    :class:`ckptio.IntegrityError` naming the object and the item.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        step: int | None = None,
        engine_config: EngineConfig | None = None,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._init_location(url, step, engine_config, backend_options)
        self._reset_state()

    def _reset_state(self) -> None:
        self._manifest: Manifest | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[str, ArrayItem]] = {}
        self._saved_dtype: dict[str, torch.dtype] = {}
        self.load_id = uuid.uuid4().hex

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_manifest=None, _chunks={}, _saved_dtype={})  # re-read where it lands
        return state

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._relocate(checkpoint_id)
        self._reset_state()

    def read_metadata(self) -> Metadata:
        """The checkpoint's DCP Metadata; CheckpointNotFoundError naming it if it is not committed.

        (No ``rank`` keyword: ckptio checkpoints have one global manifest, so
        DCP never falls back to per-rank metadata.)
        """
        store = self._open()
        where = self.checkpoint_id
        try:
            manifest = run_sync(store.read_manifest(self.step_dir))
        except CheckpointNotFoundError:
            try:  # objects without a manifest: a save that never committed (say so: it is not 'absent')
                leftovers = run_sync(store.backend.list_children(self.step_dir))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                leftovers = []
            if leftovers:
                raise CheckpointNotFoundError(
                    f"checkpoint {where} is not committed (it has no manifest, but holds {leftovers[:3]}): "
                    "its save did not finish, or this URL is a parent of checkpoints, not one"
                ) from None
            raise
        finally:
            self._close()  # read_data reopens it: no connections held between DCP's steps
        metadata, names = metadata_from_manifest(manifest, where)
        metadata.storage_meta.load_id = self.load_id
        self._manifest = manifest
        self._chunks = {}
        for fqn, (name, _kind) in names.items():
            item = manifest.items[name]
            assert isinstance(item, ArrayItem)
            for shard in item.shards:
                # One single-shard view per saved chunk: a ReadItem names exactly one chunk.
                self._chunks[(fqn, shard.offsets)] = (name, ArrayItem(item.dtype, item.shape, [shard], origin=item.origin))
            md = metadata.state_dict_metadata[fqn]
            if hasattr(md, "properties"):
                self._saved_dtype[fqn] = md.properties.dtype
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._manifest is None:  # DCP always reads metadata first; a caller may hand it in instead
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._manifest is None:
            self.read_metadata()
        manifest = self._manifest
        assert manifest is not None
        t0 = time.perf_counter()
        requests: list[ReadRequest] = []
        finish: list[Callable[[], None]] = []
        try:
            for ri in plan.items:
                if ri.type == LoadItemType.BYTE_IO:
                    requests += self._plan_bytes(ri, planner, manifest, finish)
                else:
                    requests += self._plan_tensor(ri, planner, manifest, finish)
            store = self._open()
            run_sync(store.engine.read(requests))
        except IntegrityError as e:  # name the checkpoint too, not only the object key under it
            raise IntegrityError(f"checkpoint {self.checkpoint_id}: {e}", key=e.key, item=e.item) from e
        except FileNotFoundError as e:
            raise FileNotFoundError(f"checkpoint {self.checkpoint_id} is missing an object its manifest names: {e}") from e
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

    def _chunk(self, index: MetadataIndex, ndim: int) -> tuple[str, ArrayItem]:
        offsets = tuple(index.offset) if index.offset is not None else (0,) * ndim
        try:
            return self._chunks[(index.fqn, offsets)]
        except KeyError:
            raise ManifestError(
                f"{self.checkpoint_id}: the load plan asks for chunk {list(offsets)} of {index.fqn!r}, "
                "which the checkpoint does not hold"
            ) from None

    def _plan_bytes(
        self, ri: ReadItem, planner: LoadPlanner, manifest: Manifest, finish: list[Callable[[], None]]
    ) -> list[ReadRequest]:
        name, item = self._chunk(ri.storage_index, 1)
        buf = np.empty(item.shape, np.uint8)

        def load() -> None:
            planner.load_bytes(ri, io.BytesIO(buf.tobytes()))

        finish.append(load)
        return plan_region(name, item, Region((0,), buf), manifest.objects, manifest.block_size)

    def _plan_tensor(
        self, ri: ReadItem, planner: LoadPlanner, manifest: Manifest, finish: list[Callable[[], None]]
    ) -> list[ReadRequest]:
        lengths = tuple(ri.lengths)
        name, item = self._chunk(ri.storage_index, len(lengths))
        shard: ShardRecord = item.shards[0]
        offsets = tuple(s + o for s, o in zip(shard.offsets, ri.storage_offsets))
        if any(o + n > s + m for o, n, s, m in zip(offsets, lengths, shard.offsets, shard.shape)):
            raise ManifestError(f"{self.checkpoint_id}: read of {ri.storage_index} runs outside its saved chunk")
        target = planner.resolve_tensor(ri).detach()
        if tuple(target.shape) != lengths:
            raise ValueError(f"{ri.dest_index.fqn!r}: the planner resolved a {tuple(target.shape)} tensor for {lengths}")
        saved = self._saved_dtype.get(ri.storage_index.fqn, target.dtype)
        direct = target.device.type == "cpu" and target.is_contiguous() and target.dtype == saved
        host = target if direct else torch.empty(lengths, dtype=saved)
        reqs = plan_region(name, item, Region(offsets, torch_to_numpy(host)), manifest.objects, manifest.block_size)

        def commit() -> None:
            if not direct:
                target.copy_(host)  # to the device / into a strided view / with DCP's implicit cast
            planner.commit_tensor(ri, target)

        finish.append(commit)
        return reqs
