"""Array items as a manifest stores them, validated: the object form and the compact row.

Readers of every format build their :class:`~ckptio.manifest.model.ArrayItem` s
here. Everything is bounded (:mod:`..limits`) and cross-checked: each
shard lies inside the array, its extents hold exactly its bytes with one
checksum per block (the extent's own block size where it records one, format 6), and (``tiling``) the shards cover the array exactly once.
The commonest item -- a small whole array in one extent, 100k of them in a
large state -- is checked in one expression first; anything else takes the
field-by-field path, whose errors name the fault.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.geometry import check_tiling
from ckptio.manifest.itemjson import row_object
from ckptio.manifest.limits import MAX_COUNT, MAX_DIM, MAX_NDIM, ORIGINS, U32, check_dims, check_int
from ckptio.manifest.model import ArrayItem, Extent, ShardRecord
from ckptio.state.dtypes import decode_dtype

__all__ = ["array_item", "row_item"]


def array_item(
    raw: dict[str, Any], where: str, n_objects: int, block_size: int, *, tiling: bool = True,
    dtype: np.dtype | None = None,
) -> ArrayItem:
    """Validate one array item's JSON (``tiling``: its shards must tile it exactly once).

    ``dtype``: already decoded (a format-2 root's item, completed from its fragments).
    """
    simple = _whole_item(raw, n_objects, block_size, dtype)
    if simple is not None:
        return simple
    if dtype is None:
        try:
            dtype = decode_dtype(raw["dtype"], where)
        except ValueError as e:
            raise ManifestError(str(e)) from e
    shape = check_dims(raw["shape"], "shape", where)
    # numpy refuses a shape whose non-zero dimensions span more than an intp of bytes, even with a
    # zero dimension beside them: such an array is empty on disk but can never be made in memory.
    if math.prod(d for d in shape if d) * dtype.itemsize > MAX_DIM:
        raise ManifestError(f"{where}: shape {str(list(shape))[:120]} of {dtype} spans more than "
                            f"{MAX_DIM} bytes")
    shards_raw = raw["shards"]
    if not isinstance(shards_raw, list) or len(shards_raw) > MAX_COUNT:
        raise ManifestError(f"{where}: 'shards' must be a list")
    shards = []
    for i, s in enumerate(shards_raw):
        here = f"{where} shard {i}"
        offsets = check_dims(s["offsets"], "offsets", here)
        sshape = check_dims(s["shape"], "shape", here)
        if len(offsets) != len(shape) or len(sshape) != len(shape):
            raise ManifestError(f"{here}: rank differs from the array's {len(shape)}")
        if any(o + n > d for o, n, d in zip(offsets, sshape, shape)):
            raise ManifestError(f"{here}: slice {offsets}+{sshape} lies outside the array shape {shape}")
        nbytes = math.prod(sshape) * dtype.itemsize
        extents, covered = [], 0
        for e in s["extents"]:
            if (type(e) is list and 5 <= len(e) <= 6 and type(e[0]) is int and type(e[1]) is int
                    and type(e[2]) is int and type(e[3]) is int and type(e[4]) is list and 0 <= e[0] < n_objects
                    and 0 <= e[1] <= MAX_DIM and e[2] == covered and 1 <= e[3] <= MAX_DIM
                    and (len(e) == 5 or (type(e[5]) is int and 1 <= e[5] < U32))):
                # The common case, checked in one expression (a 6th element: the extent's own block).
                ext = Extent(e[0], e[1], e[2], e[3], e[4], e[5] if len(e) == 6 else block_size)
            else:
                ext = _extent(e, here, n_objects, covered, block_size)
            if len(ext.crcs) != -(-ext.length // ext.block) or not all(
                type(c) is int and 0 <= c < U32 for c in ext.crcs
            ):
                raise ManifestError(f"{here}: extent checksums do not match its length")
            covered += ext.length
            extents.append(ext)
        if covered != nbytes:
            raise ManifestError(f"{here}: extents hold {covered} bytes, the shard needs {nbytes}")
        tile = None
        if s.get("tile") is not None:
            tile = check_dims(s["tile"], "tile", here)
            if len(tile) != len(sshape) or not all(1 <= t <= max(n, 1) for t, n in zip(tile, sshape)):
                raise ManifestError(f"{here}: tile {list(tile)} does not fit the shard's shape {list(sshape)}")
        shards.append(ShardRecord(offsets, sshape, check_int(s.get("host", 0), "host", here), extents, tile))
    if tiling:
        check_tiling(shards, shape, where)
    scalar = raw.get("scalar", False)
    origin = raw.get("origin", "numpy")
    if not isinstance(scalar, bool) or origin not in ORIGINS:
        raise ManifestError(f"{where}: bad 'scalar' or 'origin'")
    return ArrayItem(dtype, shape, shards, scalar, origin)


_PLAIN_DTYPES: dict[str, np.dtype] = {}  # decoded dtype strings (a few kinds, 100k items)
_ZEROS = [(0,) * n for n in range(MAX_NDIM + 1)]  # whole arrays' offsets
_ROW_EXTRAS = frozenset({"host", "origin", "scalar"})


def row_item(raw: list[Any], where: str, n_objects: int, block_size: int) -> ArrayItem:
    """Validate a compact row (:func:`item_row`); ManifestError naming ``where`` on any fault."""
    if len(raw) == 5:  # the commonest row, checked inline (100k of them in a large state)
        spec, shape, obj, at, crcs = raw
        dtype = _PLAIN_DTYPES.get(spec) if type(spec) is str else None
        if (dtype is not None and type(shape) is list and len(shape) <= MAX_NDIM and type(obj) is int
                and 0 <= obj < n_objects and type(at) is int and 0 <= at <= MAX_DIM and type(crcs) is list):
            for d in shape:
                if type(d) is not int or not 0 <= d <= MAX_DIM:
                    break
            else:
                length = math.prod(shape) * dtype.itemsize
                if 0 < length <= MAX_DIM and len(crcs) == -(-length // block_size):
                    for c in crcs:
                        if type(c) is not int or not 0 <= c < U32:
                            break
                    else:
                        tup = tuple(shape)
                        return ArrayItem(dtype, tup, [ShardRecord(_ZEROS[len(tup)], tup, 0,
                                                                  [Extent(obj, at, 0, length, crcs, block_size)])])
    extra = raw[5] if len(raw) == 6 else {}
    if len(raw) not in (5, 6) or type(extra) is not dict or not extra.keys() <= _ROW_EXTRAS:
        raise ManifestError(f"{where}: malformed item row {str(raw)[:80]!r}")
    spec, shape, obj, at, crcs = raw[:5]
    item = _whole(spec, shape, None, obj, at, None, crcs, extra.get("host", 0), extra.get("scalar", False),
                  extra.get("origin", "numpy"), n_objects, block_size, None)
    if item is None:  # the field-by-field checks of its object form name the fault
        array_item(row_object(raw), where, n_objects, block_size)
        raise ManifestError(f"{where}: invalid item row {str(raw)[:120]!r}")
    return item


def _whole_item(raw: dict[str, Any], n_objects: int, block_size: int, dtype: np.dtype | None) -> ArrayItem | None:
    """The commonest item checked in one pass: a whole array in one untiled shard of one extent
    (every small leaf of a large state). Anything else, or anything wrong, returns None and takes
    the field-by-field path, whose errors name the fault."""
    try:
        (s,) = raw["shards"]
        ((obj, at, zero, length, crcs),) = s["extents"]
        shape, offsets, spec = raw["shape"], s["offsets"], raw["dtype"]
    except (KeyError, TypeError, ValueError):
        return None
    if not (type(s) is dict and s["shape"] == shape and s.get("tile") is None and zero == 0 and type(zero) is int):
        return None
    return _whole(spec, shape, offsets, obj, at, length, crcs, s.get("host", 0), raw.get("scalar", False),
                  raw.get("origin", "numpy"), n_objects, block_size, dtype)


def _whole(spec: Any, shape: Any, offsets: Any, obj: Any, at: Any, length: Any, crcs: Any, host: Any, scalar: Any,
           origin: Any, n_objects: int, block_size: int, dtype: np.dtype | None) -> ArrayItem | None:
    """A whole array in one extent from its fields (``offsets``/``length`` None: zeros/the array's
    size), or None if any field is off."""
    if not (type(shape) is list and len(shape) <= MAX_NDIM and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        return None
    if offsets is not None and not (type(offsets) is list and len(offsets) == len(shape) and not any(offsets)
                                    and all(type(o) is int for o in offsets)):
        return None
    if dtype is None:
        dtype = _PLAIN_DTYPES.get(spec) if type(spec) is str else None
        if dtype is None:
            try:
                dtype = decode_dtype(spec, "")
            except (ValueError, TypeError):
                return None
            if type(spec) is str:
                _PLAIN_DTYPES[spec] = dtype
    nbytes = math.prod(shape) * dtype.itemsize
    if length is None:
        length = nbytes
    if not (type(obj) is int and 0 <= obj < n_objects and type(at) is int and 0 <= at <= MAX_DIM
            and type(length) is int and length == nbytes and length >= 1
            and type(crcs) is list and len(crcs) == -(-length // block_size)
            and all(type(c) is int and 0 <= c < U32 for c in crcs)
            and type(host) is int and 0 <= host <= MAX_DIM and type(scalar) is bool
            and origin in ORIGINS):
        return None
    tup = tuple(shape)
    return ArrayItem(dtype, tup, [ShardRecord((0,) * len(tup), tup, host, [Extent(obj, at, 0, length, crcs, block_size)])],
                     scalar, origin)


def _extent(e: Any, here: str, n_objects: int, covered: int, block_size: int) -> Extent:
    """One extent, validated field by field with an error naming the fault: ``[object, offset,
    shard_offset, length, crcs]`` and, where the extent has a checksum block of its own
    (format 6), its size as a 6th element (else the manifest's ``block_size``)."""
    if not (isinstance(e, list) and len(e) in (5, 6) and isinstance(e[4], list)):
        raise ManifestError(f"{here}: malformed extent {str(e)[:80]!r}")
    obj = check_int(e[0], "extent object", here, hi=max(n_objects - 1, 0))
    block = check_int(e[5], "extent block size", here, lo=1, hi=U32 - 1) if len(e) == 6 else block_size
    ext = Extent(obj, check_int(e[1], "extent offset", here), check_int(e[2], "shard offset", here),
                 check_int(e[3], "extent length", here, lo=1), e[4], block)
    if n_objects == 0 or ext.shard_offset != covered:
        raise ManifestError(f"{here}: extents do not tile the shard's bytes (gap or overlap at {covered})")
    return ext
