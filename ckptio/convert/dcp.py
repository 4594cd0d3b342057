"""PyTorch DCP checkpoint directories (``FileSystemWriter`` layout) <-> ckptio, streaming.

**DCP -> ckptio** (:func:`dcp_to_ckptio`): DCP's ``.metadata`` is read with
the stock ``FileSystemReader`` (it is a pickle: that is DCP's own format, so
convert only checkpoints you trust). Every saved chunk is then read through
``FileSystemReader.read_data`` with a collecting ``LoadPlanner``, in batches
of about ``batch_bytes`` in file order, and handed to a
:class:`ckptio.saving.stream.StreamWriter`; byte items (what DCP's planner
``torch.save``\\ d) are copied raw, never unpickled. The manifest is the one
:class:`ckptio.dcp.Writer` would have written (one array item per FQN, one
shard per chunk, DCP's Metadata as JSON), so the result loads with
``dcp.load(sd, storage_reader=ckptio.dcp.Reader(url))`` and with
``ckptio.restore``. Memory: one batch plus twice the largest chunk (the
stock reader loads a chunk, then copies it into our buffer).

**ckptio -> DCP** (:func:`ckptio_to_dcp`): stock ``dcp.save`` with a stock
``FileSystemWriter(single_file_per_rank=False)`` and :class:`StreamingSavePlanner`,
a ``DefaultSavePlanner`` whose state dict holds only meta tensors: its plan
has one write item per saved shard (cut into row blocks of at most
``chunk_bytes``), and ``resolve_data`` reads each block from ckptio when the
writer asks for it. One file per item means the writer drops each tensor
once written, so at most ``thread_count`` blocks are in memory. ``dcp.load``
(any sharding) reads the result. A checkpoint written through DCP keeps its
FQNs, tensor properties and planner data; a native one gets DCP's own
flattening of its tree (``params/w`` -> FQN ``params.w``), and its Python
values become DCP byte items (``torch.save``, as DCP does).
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckptio.engine import Progress, run_sync
from ckptio.manifest import ArrayItem, Manifest, ValueItem, decode
from ckptio.manifest.hoststate import HostStateItem
from ckptio.restoring.reshard import Region, plan_region
from ckptio.saving.stream import StreamWriter
from ckptio.state.tree import path_str
from ckptio.store import CheckpointStore

__all__ = ["StreamingSavePlanner", "ckptio_to_dcp", "dcp_to_ckptio"]

log = logging.getLogger("ckptio.convert")

METADATA_FILE = ".metadata"


def is_dcp_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


# -- DCP -> ckptio ---------------------------------------------------------


def _read_items(md: Any, writer: StreamWriter) -> tuple[list[tuple[Any, Any, int]], dict[str, Any]]:
    """Every saved chunk as ``(ReadItem, storage info, nbytes)``, in file order, and each tensor's torch
    dtype by FQN; each tensor's array is declared to ``writer``."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from ckptio.dcp._codec import numpy_dtype_of

    items: list[tuple[Any, Any, int]] = []
    dtypes: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            idx = MetadataIndex(fqn)
            zero = torch.Size([0])
            ri = ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx, dest_offsets=zero, storage_index=idx,
                          storage_offsets=zero, lengths=zero)
            items.append((ri, md.storage_data[idx], md.storage_data[idx].length))
            continue
        dtypes[fqn] = m.properties.dtype
        writer.add_array(path_str((fqn,)), numpy_dtype_of(m.properties.dtype, fqn), tuple(m.size), origin="torch")
        itemsize = torch.empty(0, dtype=m.properties.dtype).element_size()
        for chunk in m.chunks:
            idx = MetadataIndex(fqn, chunk.offsets)
            zeros = torch.Size([0] * len(chunk.offsets))
            ri = ReadItem(type=LoadItemType.TENSOR, dest_index=idx, dest_offsets=zeros, storage_index=idx,
                          storage_offsets=zeros, lengths=chunk.sizes)
            items.append((ri, md.storage_data[idx], math.prod(chunk.sizes) * itemsize))
    items.sort(key=lambda t: (t[1].relative_path, t[1].offset))
    return items, dtypes


class _Collect:
    """The planner ``FileSystemReader.read_data`` calls: streams each chunk it reads into ``writer``."""

    def __init__(self, writer: StreamWriter, dtypes: dict[str, Any]) -> None:
        self.writer, self.dtypes = writer, dtypes
        self.placed: list[tuple[Any, str, int, int]] = []  # (index, item name, shard number, nbytes)

    def resolve_tensor(self, read_item: Any) -> Any:
        import torch

        return torch.empty(tuple(read_item.lengths), dtype=self.dtypes[read_item.dest_index.fqn])

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        from ckptio.dcp._codec import numpy_view

        fqn = read_item.dest_index.fqn
        arr = numpy_view(tensor.contiguous(), fqn)  # raw dtypes (complex32, float4) too
        n = self.writer.write_shard(path_str((fqn,)), tuple(read_item.dest_index.offset), arr)
        self.placed.append((read_item.dest_index, path_str((fqn,)), n, arr.nbytes))

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raw = np.frombuffer(value.getbuffer(), np.uint8).copy()
        name = path_str((read_item.dest_index.fqn,))
        self.writer.add_array(name, np.uint8, raw.shape)
        n = self.writer.write_shard(name, (0,), raw)
        self.placed.append((read_item.dest_index, name, n, raw.nbytes))

    def results(self) -> list[Any]:
        """DCP's WriteResults of every chunk placed (after ``writer.finish()``)."""
        from torch.distributed.checkpoint.storage import WriteResult

        from ckptio.dcp._codec import ChunkLocation

        out = []
        for index, name, n, nbytes in self.placed:
            ext = tuple((self.writer.objects[o], off, soff, ln, tuple(crcs), *block)  # block: its own, if any
                        for o, off, soff, ln, crcs, *block in self.writer.extents_of(name, n))
            out.append(WriteResult(index=index, size_in_bytes=nbytes, storage_data=ChunkLocation(0, nbytes, ext)))
        return out


def dcp_to_ckptio(
    src: str | os.PathLike[str],
    dst: CheckpointStore,
    step: int | None = None,
    *,
    batch_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> Manifest:
    """Convert the DCP checkpoint directory ``src`` into a ckptio checkpoint (``dst``, ``step``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadPlan

    from ckptio.dcp._codec import manifest_doc

    src = os.fspath(src)
    if not is_dcp_dir(src):
        raise FileNotFoundError(f"{src} is not a DCP checkpoint directory (no {METADATA_FILE})")
    reader = FileSystemReader(src)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    writer = StreamWriter(dst, step, batch_bytes=batch_bytes, inflight_bytes=2 * batch_bytes, progress=progress)
    try:
        items, dtypes = _read_items(md, writer)
        planner = _Collect(writer, dtypes)
        batch: list[Any] = []
        size = 0
        for ri, _info, nbytes in items:
            batch.append(ri)
            size += nbytes
            if size >= batch_bytes:
                reader.read_data(LoadPlan(batch), planner).wait()
                batch, size = [], 0
        if batch:
            reader.read_data(LoadPlan(batch), planner).wait()
        writer.finish()
        modules = list(getattr(md.storage_meta, "modules", None) or [])
        doc = manifest_doc(md, [planner.results()], step=step, save_id=writer.save_id, created=time.time(),
                           block_size=dst.engine.config.block_size, num_hosts=1, modules=modules)
        return writer.commit_manifest(decode(doc, writer.where))
    except BaseException:
        writer.abort()
        raise


# -- ckptio -> DCP ---------------------------------------------------------


def _tree_leaves(structure: Any, parts: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """``(path parts, item name)`` of every leaf of a :mod:`ckptio.state.tree` structure."""
    ((kind, body),) = structure.items()
    if kind == "leaf":
        yield parts, body
    elif kind == "dict":
        for k, v in body.items():
            yield from _tree_leaves(v, (*parts, k))
    else:
        for i, v in enumerate(body):
            yield from _tree_leaves(v, (*parts, str(i)))


class _Plan:
    """What to write for one DCP FQN: a tensor's blocks, raw bytes, or a Python value."""

    def __init__(self, fqn: str, kind: str, item: str | None, props: Any = None, value: Any = None) -> None:
        self.fqn, self.kind, self.item, self.props, self.value = fqn, kind, item, props, value


def _plans(manifest: Manifest, where: str) -> tuple[list[_Plan], dict[str, Any] | None]:
    """Every FQN to write, and DCP's planner_data (FQN -> path)."""
    from ckptio.dcp._codec import metadata_from_manifest

    meta, refs = metadata_from_manifest(manifest, where)
    names: dict[str, tuple[str, str]] = {}
    for (fqn, _offsets), ref in refs.items():
        if ref.transforms:  # compressed chunks are no array to stream: DCP's reader undoes them
            raise ValueError(f"{where}: {fqn!r} is stored through DCP transforms {list(ref.transforms)}; convert "
                             "does not undo them (load it with dcp.load and ckptio.dcp.Reader)")
        names[fqn] = (ref.name, ref.kind)
    props = {fqn: getattr(m, "properties", None) for fqn, m in meta.state_dict_metadata.items()}
    if "dcp" in manifest.metadata:
        plans = [_Plan(fqn, kind, item, props[fqn]) for fqn, (item, kind) in names.items()]
        return plans, meta.planner_data
    # A native checkpoint: DCP's own flattening of the tree (nested dict keys joined by ".").
    plans, mapping = [], {}
    for parts, item_name in _tree_leaves(manifest.tree):
        if not parts:
            raise ValueError(f"{where}: a checkpoint whose state is a single leaf has no DCP FQN")
        fqn = ".".join(parts)
        mapping[fqn] = tuple(parts)
        it = manifest.items[item_name]
        if isinstance(it, ValueItem):
            plans.append(_Plan(fqn, "value", None, value=it.value))
        elif isinstance(it, HostStateItem):
            log.warning("%s: item %r is a per-host state (one per saving host); not converted to DCP", where, item_name)
        elif item_name in names:
            plans.append(_Plan(fqn, "tensor", item_name, props[item_name]))
        else:
            log.warning(
                "%s: item %r (%s) has no torch dtype; not converted to DCP", where, item_name, it.dtype
            )
    return plans, mapping


def _blocks(item: ArrayItem, chunk_bytes: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes covering ``item`` once: its saved shards, cut into row blocks of at most ``chunk_bytes``."""
    shards = [s for s in item.shards if s.size] or [None]
    for s in shards:
        offs, shape = (s.offsets, s.shape) if s is not None else ((0,) * len(item.shape), item.shape)
        if not shape or math.prod(shape) == 0:
            yield offs, shape
            continue
        row = math.prod(shape[1:]) * item.dtype.itemsize
        rows = max(1, chunk_bytes // max(row, 1))
        for r in range(0, shape[0], rows):
            n = min(rows, shape[0] - r)
            yield (offs[0] + r, *offs[1:]), (n, *shape[1:])


def _streaming_planner_class() -> type:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from ckptio.dcp._codec import numpy_view

    class _StreamingSavePlanner(DefaultSavePlanner):
        """A DefaultSavePlanner over meta tensors whose ``resolve_data`` reads each block from ckptio."""

        def __init__(
            self,
            store: CheckpointStore,
            manifest: Manifest,
            plans: list[_Plan],
            planner_data: dict[str, Any] | None,
            chunk_bytes: int,
            progress: Progress | None,
        ) -> None:
            super().__init__(flatten_state_dict=planner_data is not None, flatten_sharded_tensors=False)
            self.store, self.manifest, self.plans = store, manifest, {p.fqn: p for p in plans}
            self.planner_data, self.chunk_bytes, self.progress = planner_data, chunk_bytes, progress

        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            self.state_dict = state_dict  # already flat: FQN -> meta tensor | value
            self.mappings = self.planner_data or {}
            self.is_coordinator = is_coordinator

        def create_local_plan(self) -> Any:
            items = []
            for p in self.plans.values():
                if p.kind != "tensor":
                    items.append(WriteItem(index=MetadataIndex(p.fqn), type=WriteItemType.BYTE_IO))
                    continue
                it = self.manifest.items[p.item]
                assert isinstance(it, ArrayItem)
                for offs, shape in _blocks(it, self.chunk_bytes):
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(shape))
                    items.append(
                        WriteItem(
                            index=MetadataIndex(p.fqn, torch.Size(offs)),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(
                                chunk=chunk, properties=p.props, size=torch.Size(it.shape)
                            ),
                        )
                    )
            self.plan = SavePlan(items, planner_data=self.mappings if self.flatten_state_dict else None)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            p = self.plans[write_item.index.fqn]
            if p.kind == "value":
                return super().resolve_data(write_item)  # torch.save of the value, as DCP does
            it = self.manifest.items[p.item]
            assert isinstance(it, ArrayItem)
            if p.kind == "bytes":
                dest = np.empty(it.shape, np.uint8)
                self._read(p.item, it, (0,), dest)
                return io.BytesIO(dest.tobytes())
            chunk = write_item.tensor_data.chunk
            t = torch.empty(tuple(chunk.sizes), dtype=p.props.dtype)
            if t.numel():
                self._read(p.item, it, tuple(chunk.offsets), numpy_view(t, p.fqn))
            return t

        def _read(self, name: str, it: ArrayItem, offsets: tuple[int, ...], dest: np.ndarray) -> None:
            reqs = plan_region(
                name, it, Region(offsets, dest), self.manifest.objects, self.manifest.block_size
            )
            run_sync(self.store.engine.read(reqs))
            if self.progress:
                self.progress("read", dest.nbytes)

    return _StreamingSavePlanner


def StreamingSavePlanner(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - a class made on first use
    """The planner :func:`ckptio_to_dcp` gives ``dcp.save`` (torch is imported only when used)."""
    return _streaming_planner_class()(*args, **kwargs)


def ckptio_to_dcp(
    src: CheckpointStore,
    step_dir: str,
    dst: str | os.PathLike[str],
    *,
    chunk_bytes: int = 64 << 20,
    thread_count: int = 1,
    progress: Progress | None = None,
) -> Any:
    """Write the committed ckptio checkpoint ``src``/``step_dir`` as a DCP ``FileSystemWriter`` directory.

    Returns DCP's Metadata. Refuses a ``dst`` that already holds a DCP checkpoint.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    dst = os.fspath(dst)
    if is_dcp_dir(dst):
        raise FileExistsError(f"{dst} already holds a DCP checkpoint")
    manifest = run_sync(src.read_manifest(step_dir))
    where = src.where(step_dir)
    plans, planner_data = _plans(manifest, where)
    state_dict: dict[str, Any] = {}
    for p in plans:
        if p.kind == "tensor":
            it = manifest.items[p.item]
            assert isinstance(it, ArrayItem)
            state_dict[p.fqn] = torch.empty(it.shape, dtype=p.props.dtype, device="meta")
        else:
            state_dict[p.fqn] = p.value
    planner = StreamingSavePlanner(src, manifest, plans, planner_data, chunk_bytes, progress)
    writer = dcp.FileSystemWriter(dst, single_file_per_rank=False, thread_count=thread_count, overwrite=False)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as e:
        # DCP wraps each rank's failure in a BaseException whose text is a traceback; with one rank
        # (no_dist) the failure itself says what went wrong, and its type says which kind it is.
        failures = [exc for exc, _trace in e.failures.values()]
        if len(failures) == 1 and isinstance(failures[0], Exception):
            raise failures[0] from e
        raise
