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
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from ..dtypes import encode_dtype
from ..errors import ManifestError
from ..manifest import ArrayItem, Manifest, ShardRecord
from ..staging import torch_to_numpy
from ..tree import path_str

__all__ = [
    "DCP_VERSION",
    "ChunkLocation",
    "manifest_doc",
    "metadata_from_manifest",
    "numpy_dtype_of",
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
    length, crc32c of each block)``; a chunk larger than the backend's object
    size is split over several objects. ``rank`` wrote it. Small and picklable:
    DCP gathers every rank's results to the coordinator.
    """

    rank: int
    nbytes: int
    extents: tuple[tuple[str, int, int, int, tuple[int, ...]], ...]


def _torch() -> Any:
    import torch

    return torch


def numpy_dtype_of(torch_dtype: Any, fqn: str) -> np.dtype:
    """The numpy (ml_dtypes) dtype whose bytes are ``torch_dtype``'s; TypeError naming ``fqn``."""
    torch = _torch()
    try:
        return torch_to_numpy(torch.empty(0, dtype=torch_dtype)).dtype
    except (TypeError, RuntimeError, AttributeError) as e:
        raise TypeError(f"{fqn!r}: tensors of dtype {torch_dtype} have no raw-bytes form ckptio can store: {e}") from e


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
) -> dict[str, Any]:
    """The manifest document of a DCP save, from the global Metadata and every rank's WriteResults."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    where: dict[Any, ChunkLocation] = {}
    for rank_results in results:
        for r in rank_results:
            if not isinstance(r.storage_data, ChunkLocation):
                raise TypeError(f"WriteResult for {r.index} was not written by ckptio.dcp.Writer")
            where[r.index] = r.storage_data
    objects: list[str] = []
    object_no: dict[str, int] = {}

    def extents(loc: ChunkLocation) -> list[list[Any]]:
        out = []
        for key, offset, chunk_offset, length, crcs in loc.extents:
            if key not in object_no:
                object_no[key] = len(objects)
                objects.append(key)
            out.append([object_no[key], offset, chunk_offset, length, list(crcs)])
        return out

    def missing(index: Any) -> ChunkLocation:
        raise ManifestError(f"no rank reported writing {index}: the save's results are incomplete")

    items: dict[str, Any] = {}
    dcp_items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        name = path_str((fqn,))
        if isinstance(md, BytesStorageMetadata):
            loc = where.get(MetadataIndex(fqn)) or missing(fqn)
            items[name] = {
                "kind": "array", "dtype": "|u1", "shape": [loc.nbytes], "scalar": False, "origin": "numpy",
                "shards": [{"offsets": [0], "shape": [loc.nbytes], "host": loc.rank, "extents": extents(loc)}],
            }
            dcp_items[fqn] = {"item": name, "kind": "bytes"}
            continue
        props = md.properties
        shards = []
        for chunk in md.chunks:
            loc = where.get(MetadataIndex(fqn, chunk.offsets)) or missing(MetadataIndex(fqn, chunk.offsets))
            shards.append({"offsets": list(chunk.offsets), "shape": list(chunk.sizes), "host": loc.rank,
                           "extents": extents(loc)})
        items[name] = {
            "kind": "array", "dtype": encode_dtype(numpy_dtype_of(props.dtype, fqn)), "shape": list(md.size),
            "scalar": False, "origin": "torch", "shards": shards,
        }
        dcp_items[fqn] = {
            "item": name, "kind": "tensor", "dtype": _torch_name(props.dtype), "layout": _torch_name(props.layout),
            "requires_grad": bool(props.requires_grad), "memory_format": _torch_name(props.memory_format),
            "pin_memory": bool(props.pin_memory),
        }
    return {
        "format": "ckptio", "version": 1, "step": step, "checkpoint_id": save_id, "created": created,
        "block_size": block_size, "num_hosts": num_hosts,
        # A flat dict keyed by FQN: a native restore returns {fqn: array}.
        "tree": {"dict": {fqn: {"leaf": d["item"]} for fqn, d in dcp_items.items()}},
        "objects": objects,
        "items": items,
        "metadata": {"dcp": {
            "version": DCP_VERSION, "items": dcp_items,
            "planner_data": _planner_data_json(metadata.planner_data), "modules": list(modules),
        }},
    }


# -- reading ----------------------------------------------------------------


def _properties(d: dict[str, Any], item: ArrayItem, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    dtype = _torch_attr(d.get("dtype"), "dtype", None, where)
    if numpy_dtype_of(dtype, where) != item.dtype:
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


def _location(item: ArrayItem, shard: ShardRecord, objects: list[str]) -> ChunkLocation:
    nbytes = math.prod(shard.shape) * item.dtype.itemsize
    return ChunkLocation(shard.host, nbytes, tuple(
        (objects[e.object], e.offset, e.shard_offset, e.length, tuple(e.crcs)) for e in shard.extents
    ))


def metadata_from_manifest(manifest: Manifest, where: str) -> tuple[Any, dict[str, tuple[str, str]]]:
    """DCP ``Metadata`` of a committed checkpoint, and FQN -> (manifest item name, kind).

    A checkpoint written by the native API (no ``metadata["dcp"]``) is offered
    as tensors; its non-array values cannot be, and are left out.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    dcp = manifest.metadata.get("dcp")
    if dcp is None:  # a native checkpoint: its array items with a torch dtype, FQN = item name
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
        dcp = {"items": fqns, "planner_data": None, "modules": []}
    if not isinstance(dcp, dict) or not isinstance(dcp.get("items"), dict):
        raise ManifestError(f"{where}: malformed 'dcp' metadata")
    sd_md: dict[str, Any] = {}
    storage: dict[Any, ChunkLocation] = {}
    names: dict[str, tuple[str, str]] = {}
    for fqn, d in dcp["items"].items():
        here = f"{where}: DCP item {fqn!r}"
        item = manifest.items.get(d["item"]) if isinstance(d, dict) and isinstance(d.get("item"), str) else None
        if not isinstance(item, ArrayItem):
            raise ManifestError(f"{here}: names no array item of the manifest")
        kind = d.get("kind")
        if kind == "bytes":
            if item.dtype != np.uint8 or len(item.shape) != 1 or len(item.shards) != 1:
                raise ManifestError(f"{here}: a byte item must be one 1-D uint8 shard")
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = _location(item, item.shards[0], manifest.objects)
        elif kind in ("tensor", "native"):
            props = (_properties(d, item, here) if kind == "tensor"
                     else TensorProperties(dtype=_torch_dtype_for(item.dtype, here)))
            chunks = []
            for s in item.shards:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.shape)))
                storage[MetadataIndex(fqn, s.offsets)] = _location(item, s, manifest.objects)
            sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(item.shape), chunks=chunks)
        else:
            raise ManifestError(f"{here}: unknown kind {kind!r}")
        names[fqn] = (d["item"], "bytes" if kind == "bytes" else "tensor")
    planner_data = dcp.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
            isinstance(v, list) and all(type(p) in (str, int) for p in v) for v in planner_data.values()
        ):
            raise ManifestError(f"{where}: malformed DCP planner_data")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    modules = dcp.get("modules") or []
    meta = Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=where, save_id=manifest.checkpoint_id,
                                 modules=[m for m in modules if isinstance(m, str)]),
        version=dcp.get("version") if isinstance(dcp.get("version"), str) else DCP_VERSION,
    )
    return meta, names

