"""Format 5: packs of small arrays as columnar tables, validated.

A state of 100k leaves is mostly small whole arrays that a host stages back to
back in packs (``staging.LeafPack``: one dtype, one origin, one extent of one
object). Format 4 described each member as a row of its own; decoding,
validating and building 100k rows and their items dominated saves and
restores (issue 15). Format 5 describes a pack once, as columns::

    {"object": 3, "offset": 4096, "dtype": "<f4", "host": 0, "origin": "numpy",
     "names": ["a", "b", ...], "shapes": [[671], [2, 3], ...],
     "ends": [2684, 2708, ...], "crcs": [...], "scalars": [5, ...]}

Member ``i`` holds bytes ``[ends[i-1], ends[i])`` (from 0 for the first) after
``offset`` in object ``object``, checksummed whole by ``crcs[i]`` (a member is
at most one checksum block), and is a whole array of ``shapes[i]``; members
listed in ``scalars`` were numpy scalars. Each member is still an item of the
manifest, by name: :class:`~ckptio.manifest.model.Items` makes its :class:`~ckptio.manifest.model.ArrayItem`
on first use, and bulk readers (``ckptio.restore``) use the columns directly.

Tables are validated as columns: every field's type and range, each member's
size against its shape and dtype, at most a block each, in order without
overlap, inside the object's addressable range, and names unique across the
whole manifest. Errors name the manifest and the pack, and the member where
one is at fault.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.limits import MAX_DIM, MAX_NDIM, U32, check_int, check_ints
from ckptio.manifest.model import PackTable
from ckptio.state.dtypes import decode_dtype

__all__ = ["table_from_doc"]

_KEYS = frozenset({"object", "offset", "dtype", "host", "origin", "names", "shapes", "ends", "crcs", "scalars"})
#: Members of a pack are plain leaves: never a ckptio.Sharded.
_ORIGINS = ("numpy", "jax", "torch")


def table_from_doc(raw: Any, here: str, n_objects: int, block_size: int) -> PackTable:
    """Validate one pack table; ManifestError naming ``here`` (and the member at fault)."""
    if type(raw) is not dict or not raw.keys() <= _KEYS or len(raw.keys() - {"scalars"}) != len(_KEYS) - 1:
        raise ManifestError(f"{here}: malformed pack table (keys {sorted(raw)[:12] if type(raw) is dict else raw!r})")
    obj = check_int(raw["object"], "'object'", here, 0, n_objects - 1)
    offset = check_int(raw["offset"], "'offset'", here, 0, MAX_DIM)
    host = check_int(raw["host"], "'host'", here, 0, MAX_DIM)
    origin = raw["origin"]
    if origin not in _ORIGINS:
        raise ManifestError(f"{here}: unknown origin {str(origin)[:40]!r}")
    try:
        dtype = decode_dtype(raw["dtype"], here)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{here}: {e}") from e
    names = raw["names"]
    if type(names) is not list or not names or not set(map(type, names)) <= {str}:
        raise ManifestError(f"{here}: 'names' must be a non-empty list of strings")
    k = len(names)
    ends = check_ints(raw["ends"], "'ends'", here, k, 1, MAX_DIM - offset)
    check_ints(raw["crcs"], "'crcs'", here, k, 0, U32 - 1)
    lengths = np.diff(ends, prepend=0)
    bad = np.flatnonzero((lengths <= 0) | (lengths > block_size))
    if bad.size:
        raise ManifestError(f"{here}: member {names[bad[0]]!r} spans {int(lengths[bad[0]])} bytes "
                            f"(members follow each other, 1 to {block_size} bytes each)")
    shapes = raw["shapes"]
    if type(shapes) is not list or len(shapes) != k or not set(map(type, shapes)) <= {list}:
        raise ManifestError(f"{here}: 'shapes' must be a list of {k} lists")
    ndims = np.fromiter(map(len, shapes), np.int64, k)
    if ndims.max() > MAX_NDIM:
        raise ManifestError(f"{here}: a shape has more than {MAX_NDIM} dimensions")
    dims = check_ints(list(itertools.chain.from_iterable(shapes)), "'shapes'", here, -1, 0, MAX_DIM)
    # Elements per member, in float64: a product past 2**53 cannot match a length of one block anyway.
    counts = np.ones(k, np.float64)
    has = ndims > 0
    if dims.size:
        counts[has] = np.multiply.reduceat(dims.astype(np.float64), (np.cumsum(ndims) - ndims)[has])
    bad = np.flatnonzero(counts * dtype.itemsize != lengths)
    if bad.size:
        i = int(bad[0])
        raise ManifestError(f"{here}: member {names[i]!r} of shape {shapes[i]} and dtype {dtype} spans "
                            f"{int(lengths[i])} bytes")
    scalars = raw.get("scalars", [])
    sc = check_ints(scalars, "'scalars'", here, -1, 0, k - 1)
    if sc.size and (len(set(scalars)) != sc.size or ndims[sc].any()):
        raise ManifestError(f"{here}: 'scalars' must name distinct members of shape []")
    return PackTable(obj, offset, dtype, host, origin, names, shapes, raw["ends"], raw["crcs"], frozenset(scalars), block_size)
