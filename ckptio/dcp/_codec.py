"""DCP's ``Metadata`` <-> a normal ckptio manifest, as JSON (never pickle).

Every saved tensor chunk is a shard of an :class:`~ckptio.manifest.ArrayItem`
named by the DCP FQN, so ``ckptio restore`` / ``inspect`` / ``verify`` read a
DCP-written checkpoint like a native one. What a manifest cannot say by
itself -- which FQNs are DCP byte items, the torch dtype and the other
``TensorProperties``, ``planner_data``, ``storage_meta`` -- lives in the
manifest's free ``metadata["dcp"]`` object::

    {"version": "1.0.0",
     "items": {"<fqn>": {"item": "<manifest item name>", "kind": "tensor",
                         "dtype": "bfloat16", "layout": "strided", "requires_grad": false,
                         "memory_format": "contiguous_format", "pin_memory": false}
               | {"item": ..., "kind": "bytes"}},
     "planner_data": {"<fqn>": ["model", "layers", 0, "weight"]} | null,
     "modules": [...]}

Byte items (what the planner produced as ``io.BytesIO``) are stored raw, as a
1-D uint8 array item. Their content is the planner's business: the default
planners ``torch.save`` non-tensor values into them (pickle), and
``DefaultLoadPlanner.load_bytes`` unpickles them. ckptio never does either.

dtypes: a tensor is stored as its raw bytes. Where numpy (ml_dtypes) has the
same dtype the manifest records it (a native restore returns it as such);
torch dtypes numpy lacks (``complex32``, ``float4_e2m1fn_x2``, the ``bits*``
kinds) are stored as ``|V<itemsize>`` with the torch dtype's name in
``metadata["dcp"]``, so DCP gets them back bit for bit. Quantized and
sub-byte "shell" dtypes (``uint1`` .. ``int7``), which ``torch.save`` cannot
serialize either, are refused with the tensor's FQN.

Stream transforms (``Writer(_extensions=[ZStandard()])``, DCP's
``StreamTransformExtension``): each chunk's bytes are transformed whole and
stored as a 1-D uint8 item ``dcp-stored/<fqn>`` outside the tree (a native
restore does not offer them: it would hand out compressed bytes); the DCP
entry then holds the tensor's ``size`` and per chunk its box, where its
bytes start in that item (``at``) and the transforms' descriptors, exactly
as DCP writes them (``"stream.zstd/1"``; reversed application order)::

    {"item": "dcp-stored/w", "kind": "tensor", "dtype": ..., "size": [8, 4],
     "chunks": [{"offsets": [0, 0], "sizes": [4, 4], "at": 0, "transforms": ["stream.zstd/1"]}, ...]}
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from ckptio.dcp._tensorbytes import plain_bytes
from ckptio.errors import ManifestError
from ckptio.manifest import (
    ArrayItem, Manifest, ObjectNumbers, ShardRecord, array_json, document, shard_json, version_for,
)
from ckptio.manifest.limits import check_dims
from ckptio.state.dtypes import encode_dtype
from ckptio.state.leaves import torch_to_numpy
from ckptio.state.tree import path_str

__all__ = [
    "DCP_VERSION",
    "ChunkLocation",
    "ChunkRef",
    "manifest_doc",
    "metadata_from_manifest",
    "RAW_DTYPES",
    "numpy_dtype_of",
    "numpy_view",
    "stored_item_name",
]

log = logging.getLogger("ckptio.dcp")

#: The DCP metadata version we write (what FileSystemWriter writes in torch 2.4+).
DCP_VERSION = "1.0.0"

_LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")


@dataclasses.dataclass(frozen=True)
class ChunkLocation:
    """Where one WriteItem's bytes went: the ``storage_data`` of its WriteResult.

    ``extents`` are ``(object key, offset in the object, offset in the chunk,
    length, crc32c of each block[, block size])`` (the block size only where the extent
    has one of its own, manifest format 6); a chunk larger than the backend's object
    size is split over several objects. ``rank`` wrote it. Small and picklable:
    DCP gathers every rank's results to the coordinator.
    """

    rank: int
    nbytes: int
    extents: tuple[tuple[Any, ...], ...]
    #: DCP extension descriptors applied to the stored bytes, as DCP lists them (``()``: raw bytes).
    transforms: tuple[str, ...] = ()
    #: ``(object key, offset, length)`` of the whole record stock torch reads (a tensor chunk's
    #: ``torch.save`` frame around the extents); None where the save is not torch-readable.
    record: tuple[str, int, int] | None = None


def _torch() -> Any:
    import torch

    return torch


#: torch dtypes numpy has no equivalent of, stored as raw bytes (``|V<itemsize>``) under their torch name.
RAW_DTYPES = frozenset({"complex32", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"})


_NUMPY_DTYPES: dict[Any, np.dtype] = {}


def numpy_dtype_of(torch_dtype: Any, fqn: str) -> np.dtype:
    """The numpy dtype the manifest records for ``torch_dtype``; TypeError naming ``fqn`` if ckptio cannot store it.

    ml_dtypes' dtype where it is the same (bfloat16, float8_*), ``|V<n>`` for
    :data:`RAW_DTYPES`, refused for quantized and sub-byte shell dtypes
    (``torch.save`` refuses those too, so no DCP checkpoint holds them).
    """
    known = _NUMPY_DTYPES.get(torch_dtype)
    if known is not None:
        return known
    torch = _torch()
    name = _torch_name(torch_dtype)
    if name in RAW_DTYPES:
        out = np.dtype(f"V{torch.empty(0, dtype=torch_dtype).element_size()}")
    else:
        try:
            out = torch_to_numpy(torch.empty(0, dtype=torch_dtype)).dtype
        except (TypeError, RuntimeError, AttributeError) as e:
            raise TypeError(f"{fqn!r}: ckptio cannot store tensors of dtype {torch_dtype} (neither can torch.save): "
                            f"{e}") from e
    _NUMPY_DTYPES[torch_dtype] = out  # torch.empty gives the GIL away: once per dtype (ckptio.dcp._tensorbytes)
    return out


def numpy_view(t: Any, fqn: str) -> np.ndarray:
    """A numpy view of the contiguous CPU tensor ``t`` with its manifest dtype (shares memory)."""
    dtype = numpy_dtype_of(t.dtype, fqn)
    flat = plain_bytes(t)
    if flat is None:
        flat = t.reshape(-1).view(_torch().uint8).numpy()
    return flat.view(dtype).reshape(tuple(t.shape))


def _torch_attr(name: Any, kind: str, allowed: tuple[str, ...] | None, where: str) -> Any:
    """``getattr(torch, name)`` checked to be a ``kind`` (dtype, layout, memory_format): an allow-list."""
    torch = _torch()
    ok = isinstance(name, str) and name.isidentifier() and (allowed is None or name in allowed)
    value = getattr(torch, name, None) if ok else None
    if value is None or not isinstance(value, getattr(torch, kind)):
        raise ManifestError(f"{where}: {kind} {name!r} is not one torch knows")
    return value


def _torch_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


# -- writing ----------------------------------------------------------------


def stored_item_name(fqn: str) -> str:
    """The manifest item of a transformed FQN's stored bytes (two path components: never a plain FQN's name)."""
    return path_str(("dcp-stored", fqn))


def _transformed(d: dict[str, Any]) -> bool:
    return "chunks" in d or bool(d.get("transforms"))


def _planner_data_json(data: Any) -> Any:
    """The default planners' ``planner_data``: FQN -> object path (str and int keys)."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(type(p) in (str, int) for p in v)
        for k, v in data.items()
    ):
        return {k: list(v) for k, v in data.items()}
    # A custom planner's data has no JSON form we can promise to round-trip; say so, do not pickle.
    log.warning("DCP planner_data of type %s is not FQN->path; it is not saved", type(data).__name__)
    return None


def _locations(results: list[list[Any]]) -> dict[Any, ChunkLocation]:
    """Every rank's WriteResults by their MetadataIndex."""
    where: dict[Any, ChunkLocation] = {}
    for rank_results in results:
        for r in rank_results:
            if not isinstance(r.storage_data, ChunkLocation):
                raise TypeError(f"WriteResult for {r.index} was not written by ckptio.dcp.Writer")
            where[r.index] = r.storage_data
    return where


def _located(where: dict[Any, ChunkLocation], index: Any) -> ChunkLocation:
    loc = where.get(index)
    if loc is None:
        raise ManifestError(f"no rank reported writing {index}: the save's results are incomplete")
    return loc


def _tensor_entry(name: str, props: Any) -> dict[str, Any]:
    """The ``metadata["dcp"]`` entry of a tensor: its TensorProperties by name."""
    return {"item": name, "kind": "tensor", "dtype": _torch_name(props.dtype), "layout": _torch_name(props.layout),
            "requires_grad": bool(props.requires_grad), "memory_format": _torch_name(props.memory_format),
            "pin_memory": bool(props.pin_memory)}


def _stored_bytes(entry: dict[str, Any], fqn: str, md: Any, locs: list[ChunkLocation], numbers: ObjectNumbers
                  ) -> dict[str, Any]:
    """A transformed tensor: one uint8 item of every chunk's stored bytes (out of the tree), its boxes
    in ``entry``."""
    entry["item"] = stored_item_name(fqn)
    entry["size"] = list(md.size)
    entry["chunks"] = []
    shards, at = [], 0
    for chunk, loc in zip(md.chunks, locs):
        entry["chunks"].append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "at": at,
                                "transforms": list(loc.transforms)})
        shards.append(shard_json([at], [loc.nbytes], loc.rank, numbers.extents(loc.extents)))
        at += loc.nbytes
    return array_json("|u1", [at], False, "numpy", shards)


def manifest_doc(
    metadata: Any,
    results: list[list[Any]],
    *,
    step: int | None,
    save_id: str,
    created: float,
    block_size: int,
    num_hosts: int,
    modules: list[str],
    companions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The manifest document of a DCP save, from the global Metadata and every rank's WriteResults."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    where = _locations(results)
    numbers = ObjectNumbers()
    items: dict[str, Any] = {}
    dcp_items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        name = path_str((fqn,))
        if isinstance(md, BytesStorageMetadata):
            loc = _located(where, MetadataIndex(fqn))
            if loc.transforms:
                name = stored_item_name(fqn)
            items[name] = array_json("|u1", [loc.nbytes], False, "numpy",
                                     [shard_json([0], [loc.nbytes], loc.rank, numbers.extents(loc.extents))])
            dcp_items[fqn] = {"item": name, "kind": "bytes"}
            if loc.transforms:
                dcp_items[fqn]["transforms"] = list(loc.transforms)
            continue
        locs = [_located(where, MetadataIndex(fqn, c.offsets)) for c in md.chunks]
        entry = dcp_items[fqn] = _tensor_entry(name, md.properties)
        if any(loc.transforms for loc in locs):
            stored = _stored_bytes(entry, fqn, md, locs, numbers)  # renames the entry's item
            items[entry["item"]] = stored
            continue
        shards = [shard_json(list(c.offsets), list(c.sizes), loc.rank, numbers.extents(loc.extents))
                  for c, loc in zip(md.chunks, locs)]
        items[name] = array_json(encode_dtype(numpy_dtype_of(md.properties.dtype, fqn)), list(md.size), False,
                                 "torch", shards)
    blocks = any(len(e) > 5 for loc in where.values() for e in loc.extents)  # an extent's own block: format 6
    return document(
        version=version_for(blocks=blocks), step=step, checkpoint_id=save_id, created=created, block_size=block_size,
        num_hosts=num_hosts,
        # A flat dict keyed by FQN: a native restore returns {fqn: array}.
        # Transformed items are left out: their stored bytes are not the values.
        tree={"dict": {fqn: {"leaf": d["item"]} for fqn, d in dcp_items.items() if not _transformed(d)}},
        objects=numbers.objects, items=items,
        metadata={"dcp": {"version": DCP_VERSION, "items": dcp_items,
                          "planner_data": _planner_data_json(metadata.planner_data), "modules": list(modules),
                          **({"companions": companions} if companions else {})}},
    )


# -- reading ----------------------------------------------------------------


def _properties(d: dict[str, Any], item: ArrayItem | None, where: str) -> Any:
    """DCP's TensorProperties of an entry; ``item`` (the raw array, if not transformed) must hold its dtype."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    dtype = _torch_attr(d.get("dtype"), "dtype", None, where)
    if item is not None and numpy_dtype_of(dtype, where) != item.dtype:
        raise ManifestError(f"{where}: torch dtype {d.get('dtype')} does not match the stored {item.dtype}")
    if not isinstance(d.get("requires_grad", False), bool) or not isinstance(d.get("pin_memory", False), bool):
        raise ManifestError(f"{where}: requires_grad / pin_memory must be booleans")
    return TensorProperties(
        dtype=dtype,
        layout=_torch_attr(d.get("layout", "strided"), "layout", _LAYOUTS, where),
        requires_grad=d.get("requires_grad", False),
        memory_format=_torch_attr(d.get("memory_format", "contiguous_format"), "memory_format", _MEMORY_FORMATS, where),
        pin_memory=d.get("pin_memory", False),
    )


def _torch_dtype_for(dtype: np.dtype, where: str) -> Any:
    """The torch dtype of a native ckptio array item (checkpoints not written through DCP)."""
    torch = _torch()
    name = encode_dtype(dtype)
    if isinstance(name, str) and hasattr(torch, name) and isinstance(getattr(torch, name), torch.dtype):
        return getattr(torch, name)  # ml_dtypes names match torch's (bfloat16, float8_*)
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except TypeError as e:
        raise ManifestError(f"{where}: dtype {dtype} has no torch equivalent") from e


def _location(item: ArrayItem, shard: ShardRecord, objects: list[str], block_size: int) -> ChunkLocation:
    nbytes = math.prod(shard.shape) * item.dtype.itemsize
    return ChunkLocation(shard.host, nbytes, tuple(
        (objects[e.object], e.offset, e.shard_offset, e.length, tuple(e.crcs), *([e.block] if e.block != block_size else []))
        for e in shard.extents
    ))


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One saved chunk (or byte item) as the reader finds it: a single-shard view of its manifest item.

    With ``transforms`` the item holds the chunk's transformed bytes (uint8),
    to be read whole and undone with DCP's extension registry.
    """

    name: str
    item: ArrayItem
    transforms: tuple[str, ...] = ()
    kind: str = "tensor"  # or "bytes" (a planner byte item)


def _descriptors(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(d, str) for d in v):
        raise ManifestError(f"{where}: transforms must be a list of descriptor strings")
    return tuple(v)


def _one_shard(item: ArrayItem, shard: ShardRecord) -> ArrayItem:
    return ArrayItem(item.dtype, item.shape, [shard], origin=item.origin)


@dataclasses.dataclass
class _Found:
    """What reading a manifest's DCP entries gathers besides the Metadata: DCP's storage_data, the refs."""

    objects: list[str]
    block_size: int  # the manifest's: an extent with another block carries its own
    storage: dict[Any, ChunkLocation] = dataclasses.field(default_factory=dict)
    refs: dict[tuple[str, tuple[int, ...]], ChunkRef] = dataclasses.field(default_factory=dict)


def _native_entries(manifest: Manifest, where: str) -> dict[str, Any]:
    """The DCP entries of a checkpoint written by the native API: its array items with a torch dtype."""
    fqns = {}
    for name, it in manifest.items.items():
        if not isinstance(it, ArrayItem):
            continue
        try:
            _torch_dtype_for(it.dtype, where)
        except ManifestError:
            log.debug("%s: item %r (%s) has no torch dtype; not offered to DCP", where, name, it.dtype)
            continue
        fqns[name] = {"item": name, "kind": "native"}
    return {"items": fqns, "planner_data": None, "modules": []}


def _bytes_md(fqn: str, d: dict[str, Any], item: ArrayItem, here: str, found: _Found) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    if item.dtype != np.uint8 or len(item.shape) != 1 or len(item.shards) != 1:
        raise ManifestError(f"{here}: a byte item must be one 1-D uint8 shard")
    found.storage[MetadataIndex(fqn)] = _location(item, item.shards[0], found.objects, found.block_size)
    found.refs[(fqn, (0,))] = ChunkRef(d["item"], item, _descriptors(d.get("transforms", []), here), "bytes")
    return BytesStorageMetadata()


def _transformed_md(fqn: str, d: dict[str, Any], item: ArrayItem, here: str, found: _Found) -> Any:
    """Transformed chunks: the stored bytes in ``item``, their boxes in the entry ``d``."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata,
    )

    if item.dtype != np.uint8 or len(item.shape) != 1 or not isinstance(d["chunks"], list) or len(
            d["chunks"]) != len(item.shards):
        raise ManifestError(f"{here}: transformed chunks must be one uint8 shard each")
    props = _properties(d, None, here)
    size = check_dims(d.get("size"), "size", here)
    by_at = {s.offsets[0]: s for s in item.shards}
    chunks = []
    for c in d["chunks"]:
        if not isinstance(c, dict) or c.get("at") not in by_at:
            raise ManifestError(f"{here}: chunk {c!r} names no stored shard")
        offsets, sizes = check_dims(c.get("offsets"), "offsets", here), check_dims(c.get("sizes"), "sizes", here)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + n > m for o, n, m in zip(offsets, sizes, size)):
            raise ManifestError(f"{here}: chunk {c!r} lies outside the tensor's size {list(size)}")
        shard = by_at[c["at"]]
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        transforms = _descriptors(c.get("transforms"), here)
        found.storage[MetadataIndex(fqn, offsets)] = dataclasses.replace(
            _location(item, shard, found.objects, found.block_size), transforms=transforms)
        found.refs[(fqn, offsets)] = ChunkRef(d["item"], _one_shard(item, shard), transforms)
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _tensor_md(fqn: str, d: dict[str, Any], item: ArrayItem, here: str, found: _Found) -> Any:
    """A tensor (or a native array) whose shards are its chunks."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    props = (_properties(d, item, here) if d.get("kind") == "tensor"
             else TensorProperties(dtype=_torch_dtype_for(item.dtype, here)))
    chunks = []
    for s in item.shards:
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.shape)))
        found.storage[MetadataIndex(fqn, s.offsets)] = _location(item, s, found.objects, found.block_size)
        # One single-shard view per saved chunk: a ReadItem names exactly one chunk.
        found.refs[(fqn, s.offsets)] = ChunkRef(d["item"], _one_shard(item, s))
    return TensorStorageMetadata(properties=props, size=torch.Size(item.shape), chunks=chunks)


def _planner_data(dcp: dict[str, Any], where: str) -> dict[str, tuple[Any, ...]] | None:
    planner_data = dcp.get("planner_data")
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict) or not all(
        isinstance(v, list) and all(type(p) in (str, int) for p in v) for v in planner_data.values()
    ):
        raise ManifestError(f"{where}: malformed DCP planner_data")
    return {k: tuple(v) for k, v in planner_data.items()}


def metadata_from_manifest(manifest: Manifest, where: str) -> tuple[Any, dict[tuple[str, tuple[int, ...]], ChunkRef]]:
    """DCP ``Metadata`` of a committed checkpoint, and (FQN, chunk offsets) -> :class:`ChunkRef`.

    A checkpoint written by the native API (no ``metadata["dcp"]``) is offered
    as tensors; its non-array values cannot be, and are left out.
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    dcp = manifest.metadata.get("dcp")
    if dcp is None:  # a native checkpoint: FQN = item name
        dcp = _native_entries(manifest, where)
    if not isinstance(dcp, dict) or not isinstance(dcp.get("items"), dict):
        raise ManifestError(f"{where}: malformed 'dcp' metadata")
    sd_md: dict[str, Any] = {}
    found = _Found(manifest.objects, manifest.block_size)
    for fqn, d in dcp["items"].items():
        here = f"{where}: DCP item {fqn!r}"
        item = manifest.items.get(d["item"]) if isinstance(d, dict) and isinstance(d.get("item"), str) else None
        if not isinstance(item, ArrayItem):
            raise ManifestError(f"{here}: names no array item of the manifest")
        kind = d.get("kind")
        if kind == "bytes":
            sd_md[fqn] = _bytes_md(fqn, d, item, here, found)
        elif kind == "tensor" and "chunks" in d:
            sd_md[fqn] = _transformed_md(fqn, d, item, here, found)
        elif kind in ("tensor", "native"):
            sd_md[fqn] = _tensor_md(fqn, d, item, here, found)
        else:
            raise ManifestError(f"{here}: unknown kind {kind!r}")
    modules = dcp.get("modules") or []
    meta = Metadata(
        state_dict_metadata=sd_md,
        planner_data=_planner_data(dcp, where),
        storage_data=found.storage,
        storage_meta=StorageMeta(checkpoint_id=where, save_id=manifest.checkpoint_id,
                                 modules=[m for m in modules if isinstance(m, str)]),
        version=dcp.get("version") if isinstance(dcp.get("version"), str) else DCP_VERSION,
    )
    return meta, found.refs
