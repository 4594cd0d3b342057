"""Packs of small arrays in a manifest as columnar tables (manifest format 5).

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
manifest, by name: :class:`Items` makes its :class:`~ckptio.manifest.ArrayItem`
on first use, and bulk readers (``ckptio.restore``) use the columns directly.

Tables are validated as columns: every field's type and range, each member's
size against its shape and dtype, at most a block each, in order without
overlap, inside the object's addressable range, and names unique across the
whole manifest. Errors name the manifest and the pack, and the member where
one is at fault.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .dtypes import decode_dtype
from .errors import ManifestError

__all__ = ["PackTable", "Items", "split_items", "table_doc", "table_from_doc"]

_KEYS = frozenset({"object", "offset", "dtype", "host", "origin", "names", "shapes", "ends", "crcs", "scalars"})
_ORIGINS = ("numpy", "jax", "torch")
_MAX_NDIM = 64
_MAX_DIM = 1 << 62
_U32 = 1 << 32


@dataclasses.dataclass(slots=True)
class PackTable:
    """One pack's members, as validated columns."""

    object: int
    offset: int  # of the pack's first byte in the object
    dtype: np.dtype
    host: int
    origin: str
    names: list[str]
    shapes: list[list[int]]
    ends: list[int]  # each member's end, relative to ``offset``
    crcs: list[int]
    scalars: frozenset[int]

    def span(self, i: int) -> tuple[int, int]:
        """Member ``i``'s ``(start, end)`` relative to ``offset``."""
        return (self.ends[i - 1] if i else 0), self.ends[i]

    def item(self, i: int) -> Any:
        """Member ``i`` as the ArrayItem any reader takes: a whole array in one extent."""
        from .manifest import ArrayItem, Extent, ShardRecord

        start, end = self.span(i)
        shape = tuple(self.shapes[i])
        extent = Extent(self.object, self.offset + start, 0, end - start, [self.crcs[i]])
        return ArrayItem(self.dtype, shape, [ShardRecord((0,) * len(shape), shape, self.host, [extent])],
                         i in self.scalars, self.origin)


def table_doc(spec: Any, obj: int, offset: int, names: list[str], shapes: list[list[int]], ends: list[int],
              crcs: list[int], host: int, origin: str, scalars: list[int]) -> dict[str, Any]:
    """A pack's JSON table (see the module docstring)."""
    doc = {"object": obj, "offset": offset, "dtype": spec, "host": host, "origin": origin, "names": names,
           "shapes": shapes, "ends": ends, "crcs": crcs}
    if scalars:
        doc["scalars"] = scalars
    return doc


def _ints(v: Any, what: str, here: str, n: int, lo: int, hi: int) -> np.ndarray:
    """A JSON list of ``n`` ints in ``[lo, hi]`` (``n`` < 0: any length) as int64."""
    if type(v) is not list or (n >= 0 and len(v) != n) or not set(map(type, v)) <= {int}:
        raise ManifestError(f"{here}: {what!r} must be a list of {f'{n} ' if n >= 0 else ''}integers")
    try:
        arr = np.array(v, dtype=np.int64)
    except OverflowError:
        raise ManifestError(f"{here}: {what!r} holds an integer out of range") from None
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise ManifestError(f"{here}: {what!r} holds an integer outside [{lo}, {hi}]")
    return arr


def _int(v: Any, what: str, here: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"{here}: {what!r} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def table_from_doc(raw: Any, here: str, n_objects: int, block_size: int) -> PackTable:
    """Validate one pack table; ManifestError naming ``here`` (and the member at fault)."""
    if type(raw) is not dict or not raw.keys() <= _KEYS or len(raw.keys() - {"scalars"}) != len(_KEYS) - 1:
        raise ManifestError(f"{here}: malformed pack table (keys {sorted(raw)[:12] if type(raw) is dict else raw!r})")
    obj = _int(raw["object"], "object", here, 0, n_objects - 1)
    offset = _int(raw["offset"], "offset", here, 0, _MAX_DIM)
    host = _int(raw["host"], "host", here, 0, _MAX_DIM)
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
    ends = _ints(raw["ends"], "ends", here, k, 1, _MAX_DIM - offset)
    _ints(raw["crcs"], "crcs", here, k, 0, _U32 - 1)
    lengths = np.diff(ends, prepend=0)
    bad = np.flatnonzero((lengths <= 0) | (lengths > block_size))
    if bad.size:
        raise ManifestError(f"{here}: member {names[bad[0]]!r} spans {int(lengths[bad[0]])} bytes "
                            f"(members follow each other, 1 to {block_size} bytes each)")
    shapes = raw["shapes"]
    if type(shapes) is not list or len(shapes) != k or not set(map(type, shapes)) <= {list}:
        raise ManifestError(f"{here}: 'shapes' must be a list of {k} lists")
    ndims = np.fromiter(map(len, shapes), np.int64, k)
    if ndims.max() > _MAX_NDIM:
        raise ManifestError(f"{here}: a shape has more than {_MAX_NDIM} dimensions")
    dims = _ints(list(itertools.chain.from_iterable(shapes)), "shapes", here, -1, 0, _MAX_DIM)
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
    sc = _ints(scalars, "scalars", here, -1, 0, k - 1)
    if sc.size and (len(set(scalars)) != sc.size or ndims[sc].any()):
        raise ManifestError(f"{here}: 'scalars' must name distinct members of shape []")
    return PackTable(obj, offset, dtype, host, origin, names, shapes, raw["ends"], raw["crcs"], frozenset(scalars))


class Items(Mapping[str, Any]):
    """A manifest's items: those it lists one by one (``plain``) and the members of its pack
    tables, whose ArrayItems are made on first use (a restore of every leaf reads the tables
    in bulk and makes none). Read-only, like every manifest's items."""

    __slots__ = ("_index", "_made", "_starts", "plain", "tables")

    def __init__(self, plain: dict[str, Any], tables: list[PackTable], where: str) -> None:
        self.plain = plain
        self.tables = tables
        self._starts = list(itertools.accumulate((len(t.names) for t in tables), initial=0))
        self._index = dict(zip(itertools.chain.from_iterable(t.names for t in tables), itertools.count()))
        if len(self._index) != self._starts[-1] or not self._index.keys().isdisjoint(plain):
            seen: set[str] = set(plain)
            for name in itertools.chain.from_iterable(t.names for t in tables):
                if name in seen:
                    raise ManifestError(f"{where}: item {name!r} is listed twice")
                seen.add(name)
        self._made: dict[str, Any] = {}

    def locate(self, name: str) -> tuple[PackTable, int] | None:
        """The table and member number of a packed item; None for any other name."""
        g = self._index.get(name)
        if g is None:
            return None
        t = bisect.bisect_right(self._starts, g) - 1
        return self.tables[t], g - self._starts[t]

    def __getitem__(self, name: str) -> Any:
        item = self.plain.get(name)
        if item is not None:
            return item
        item = self._made.get(name)
        if item is None:
            found = self.locate(name)
            if found is None:
                raise KeyError(name)
            item = self._made[name] = found[0].item(found[1])
        return item

    def __contains__(self, name: object) -> bool:
        return name in self.plain or name in self._index

    def __iter__(self) -> Iterator[str]:
        yield from self.plain
        yield from self._index

    def __len__(self) -> int:
        return len(self.plain) + len(self._index)

    def __repr__(self) -> str:
        return f"Items({len(self.plain)} listed, {len(self._index)} in {len(self.tables)} packs)"


def split_items(items: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[PackTable]]:
    """Any manifest's items as ``(those listed one by one, its pack tables)``: for readers that
    take the columns in bulk (a format-5 manifest) and the rest item by item."""
    return (items.plain, items.tables) if isinstance(items, Items) else (items, [])
