"""The JSON of items, written in exactly one place.

Every writer of a manifest -- a save's host records, the DCP writer, the
converters, :meth:`~ckptio.manifest.Manifest.to_doc` -- builds an item's JSON
here, so its shape (and, byte for byte, its key order: stored manifests are
compared and checksummed as bytes) is defined once:

* an array item: ``{"kind": "array", "dtype", "shape", "scalar", "origin",
  "shards": [{"offsets", "shape", "host", "extents": [[object, offset,
  shard_offset, length, [crc, ...], block?], ...], "tile"?}, ...]}`` (``block``: the
  extent's own checksum block size, only where it differs from the manifest's, format 6);
* a compact row (format 4): ``[dtype, shape, object, offset, crcs]`` plus
  ``{host, origin, scalar}`` where not the defaults;
* a pack table (format 5): see :mod:`ckptio.manifest.codec.packs`;
* a value item: :func:`ckptio.manifest.values.encode_value`;
* a per-host item (format 8): :func:`ckptio.manifest.hoststate.host_state_json`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptio.manifest.formats import FORMAT
from ckptio.manifest.hoststate import HostStateItem, host_state_json
from ckptio.manifest.model import ArrayItem, Extent, ValueItem
from ckptio.manifest.values import encode_value
from ckptio.state.dtypes import decode_dtype, encode_dtype

__all__ = [
    "array_json",
    "document",
    "dtype_code",
    "extent_json",
    "item_row",
    "item_to_json",
    "row_object",
    "shard_json",
    "table_doc",
]

_DTYPE_CODES: dict[np.dtype, Any] = {}


def dtype_code(dtype: np.dtype) -> Any:
    """``encode_dtype(dtype)``, remembered: a state of 100k leaves has a handful of dtypes."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = encode_dtype(dtype)
    return code


def extent_json(e: Extent, block_size: int) -> list[Any]:
    """An extent as its JSON row ``[object, offset, shard_offset, length, crcs]``, plus its own
    block size where it differs from the manifest's ``block_size`` (format 6)."""
    row = [e.object, e.offset, e.shard_offset, e.length, e.crcs]
    if e.block != block_size:
        row.append(e.block)
    return row


def shard_json(offsets: list[int], shape: list[int], host: int, extents: list[Any],
               tile: Sequence[int] | None = None) -> dict[str, Any]:
    """One shard's JSON object (``extents`` already as rows, see :func:`extent_json`).

    Lists are taken as they are (no copy): a reader's error path passes malformed fields through.
    """
    doc = {"offsets": offsets, "shape": shape, "host": host, "extents": extents}
    if tile is not None:
        doc["tile"] = list(tile)
    return doc


def array_json(dtype: Any, shape: list[int], scalar: bool, origin: str, shards: list[dict[str, Any]]
               ) -> dict[str, Any]:
    """An array item's JSON object (``dtype`` encoded, ``shards`` from :func:`shard_json`)."""
    return {"kind": "array", "dtype": dtype, "shape": shape, "scalar": scalar, "origin": origin, "shards": shards}


def item_to_json(item: ArrayItem | ValueItem | HostStateItem, name: str, block_size: int = 0) -> dict[str, Any]:
    """The manifest's JSON form of one item (an array's extents against the manifest's ``block_size``:
    see :func:`extent_json`)."""
    if isinstance(item, ValueItem):
        return encode_value(item.value, name)
    if isinstance(item, HostStateItem):
        return host_state_json(item)
    return array_json(encode_dtype(item.dtype), list(item.shape), item.scalar, item.origin, [
        shard_json(list(s.offsets), list(s.shape), s.host, [extent_json(e, block_size) for e in s.extents], s.tile)
        for s in item.shards
    ])


def item_row(dtype: Any, shape: list[int], obj: int, offset: int, crcs: list[int], host: int = 0,
             origin: str = "numpy", scalar: bool = False) -> list[Any]:
    """A whole array held in one extent (``crcs`` of its checksum blocks) of object ``obj`` as the compact
    row ``[dtype, shape, object, offset, crcs]`` (plus ``{host, origin, scalar}`` where not the
    defaults 0, numpy, false) that a format-4 manifest may hold in place of the item's JSON object."""
    row = [dtype, shape, obj, offset, crcs]
    if host == 0 and origin == "numpy" and not scalar:  # the commonest row, built per member of a pack
        return row
    extra = {k: v for k, v, d in (("host", host, 0), ("origin", origin, "numpy"), ("scalar", scalar, False)) if v != d}
    return [*row, extra]


def row_object(row: list[Any]) -> dict[str, Any]:
    """A compact row (:func:`item_row`) as the item's full JSON object."""
    spec, shape, obj, at, crcs = row[:5]
    extra = row[5] if len(row) == 6 and type(row[5]) is dict else {}
    try:
        length = math.prod(shape) * decode_dtype(spec, "").itemsize
    except (ValueError, TypeError):
        length = -1  # refused with the dtype
    offsets = [0] * len(shape) if type(shape) is list else shape
    shard = shard_json(offsets, shape, extra.get("host", 0), [[obj, at, 0, length, crcs]])
    return array_json(spec, shape, extra.get("scalar", False), extra.get("origin", "numpy"), [shard])


def table_doc(spec: Any, obj: int, offset: int, names: list[str], shapes: list[list[int]], ends: list[int],
              crcs: list[int], host: int, origin: str, scalars: list[int]) -> dict[str, Any]:
    """A pack's JSON table (format 5, see :mod:`ckptio.manifest.codec.packs`)."""
    doc = {"object": obj, "offset": offset, "dtype": spec, "host": host, "origin": origin, "names": names,
           "shapes": shapes, "ends": ends, "crcs": crcs}
    if scalars:
        doc["scalars"] = scalars
    return doc


def document(*, version: int, step: int | None, checkpoint_id: str, created: float, block_size: int,
             num_hosts: int, tree: Any, objects: list[str], items: dict[str, Any], metadata: dict[str, Any],
             fence: str | None = None) -> dict[str, Any]:
    """A one-document manifest (formats 1, 3, 4) from its parts, in its canonical key order."""
    doc = {"format": FORMAT, "version": version, "step": step, "checkpoint_id": checkpoint_id, "created": created,
           "block_size": block_size, "num_hosts": num_hosts, "tree": tree, "objects": objects, "items": items,
           "metadata": metadata}
    if fence:
        doc["fence"] = fence
    return doc
