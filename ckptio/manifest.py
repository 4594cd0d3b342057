"""The manifest: the JSON document whose presence makes a checkpoint exist.

Schema (version 1)::

    {"format": "ckptio", "version": 1, "step": 100 | null,
     "checkpoint_id": "<hex>", "created": <unix seconds>, "block_size": 4194304,
     "num_hosts": 4, "tree": <structure, see ckptio.tree>,
     "objects": ["h3f/100/<id>/h00000-00000", ...],        # keys relative to the checkpoint root
     "items": {"params/w": {"kind": "array", "dtype": "bfloat16", "shape": [8, 4],
                            "scalar": false, "origin": "jax",
                            "shards": [{"offsets": [0, 0], "shape": [4, 4], "host": 0,
                                        "extents": [[object, offset, shard_offset, length, [crc, ...]]]}]},
               "step": {"kind": "value", "type": "int", "value": 100}},
     "metadata": {...user JSON...}}

An array's shards tile its global shape; each shard's C-order bytes are cut
into extents, each stored at ``offset`` in ``objects[object]`` with the
crc32c of every ``block_size`` bytes from the extent's start. Everything read
is validated (bounded sizes, keys that cannot escape the root, dtypes from an
allow-list); nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import heapq
import itertools
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptio.backends.base import check_key

from . import _json
from .checksum import crc32c
from .dtypes import decode_dtype, encode_dtype
from .errors import IntegrityError, ManifestError
from .packtable import Items, split_items, table_from_doc

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "TOMBSTONE_NAME",
    "ROWS_VERSION",
    "PACKS_VERSION",
    "VERSION",
    "ArrayItem",
    "array_item",
    "Extent",
    "Manifest",
    "ShardRecord",
    "ValueItem",
    "decode_value",
    "encode_value",
    "item_row",
    "item_to_json",
    "row_item",
    "row_object",
    "seal",
    "unseal",
]

FORMAT = "ckptio"
#: The newest format this ckptio reads: 1 (one manifest) or 2 (a root and per-host fragments, see
#: ckptio.fragments). Writers write 1 unless they split. 3 is 1 or 2 (a root has 'fragments') with
#: tiled shards (ckptio.tiling): written only when some shard is tiled, so that a reader that
#: predates tiles refuses the checkpoint instead of reading tile streams as C order.
#: 4 is 1 (one manifest) whose items may be compact rows (:func:`item_row`): small whole arrays,
#: a few dozen bytes each instead of ~200, for states of 100k leaves. 5 is 4 with ``packs``: the
#: small whole arrays of each pack as one columnar table (ckptio.packtable), not as items.
VERSION = 5
TILED_VERSION = 3
ROWS_VERSION = 4
PACKS_VERSION = 5
MANIFEST_NAME = "ckptio.manifest.json"
#: Written before a checkpoint's objects are deleted; readers skip such checkpoints.
TOMBSTONE_NAME = "ckptio.deleting"
MAX_MANIFEST_BYTES = 1 << 30

_MAX_NDIM = 64
_MAX_DIM = 1 << 62
_MAX_COUNT = 50_000_000
_U32 = 1 << 32
_MAX_INT_DIGITS = 4000
_FENCE_ID = re.compile(r"[0-9a-f]{12}")


@dataclasses.dataclass(slots=True)
class Extent:
    """``length`` bytes of a shard, from ``shard_offset``, stored at ``offset`` in object ``object``."""

    object: int
    offset: int
    shard_offset: int
    length: int
    crcs: list[int]


@dataclasses.dataclass(slots=True)
class ShardRecord:
    """One saved slice of an array: where it sits in the global array and where its bytes are."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    host: int
    extents: list[Extent]
    #: The tile shape when the shard's bytes are its tiles in stream order (ckptio.tiling).
    tile: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(slots=True)
class ArrayItem:
    dtype: np.dtype
    shape: tuple[int, ...]
    shards: list[ShardRecord]
    scalar: bool = False  # saved from a numpy scalar: restored as one
    origin: str = "numpy"  # numpy | jax | torch | sharded: a hint for adapters
    #: Built on first use by :func:`ckptio.reshard.shards_meeting` (not part of the record).
    index: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    #: Format 2: the int64 table ``[fragment, offsets..., shape...]`` of every shard (ckptio.fragments).
    locator: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(slots=True)
class ValueItem:
    """A small non-array leaf kept inline: int, float, bool, str, bytes or None."""

    value: Any


def encode_value(value: Any, where: str) -> dict[str, Any]:
    """The JSON form of a value leaf; TypeError naming ``where`` for anything else."""
    if value is None:
        return {"kind": "value", "type": "none"}
    if isinstance(value, bool):
        return {"kind": "value", "type": "bool", "value": value}
    if isinstance(value, int):
        try:
            digits = str(value)
        except ValueError:  # past Python's int-to-str limit
            digits = "x" * _MAX_INT_DIGITS
        if len(digits) >= _MAX_INT_DIGITS:  # a reader refuses it: refuse it before anything is written
            raise ValueError(f"{where}: int of {value.bit_length()} bits is too large to store "
                             f"(at most {_MAX_INT_DIGITS - 1} characters)")
        return {"kind": "value", "type": "int", "value": digits}
    if isinstance(value, float):
        return {"kind": "value", "type": "float", "value": value.hex()}
    if isinstance(value, str):
        return {"kind": "value", "type": "str", "value": value}
    if isinstance(value, (bytes, bytearray)):
        return {"kind": "value", "type": "bytes", "value": base64.b64encode(bytes(value)).decode()}
    raise TypeError(f"{where}: leaf of type {type(value).__name__} is not a value ckptio can store")


def decode_value(d: dict[str, Any], where: str) -> Any:
    kind, v = d.get("type"), d.get("value")
    try:
        if kind == "none":
            return None
        if kind == "bool" and isinstance(v, bool):
            return v
        if kind == "int" and isinstance(v, str) and len(v) < _MAX_INT_DIGITS:
            return int(v)
        if kind == "float" and isinstance(v, str):
            return float.fromhex(v)
        if kind == "str" and isinstance(v, str):
            return v
        if kind == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
    except ValueError as e:
        raise ManifestError(f"{where}: bad {kind} value: {e}") from e
    raise ManifestError(f"{where}: malformed value item {str(d)[:100]!r}")


@dataclasses.dataclass(slots=True)
class Manifest:
    step: int | None
    checkpoint_id: str
    created: float
    block_size: int
    num_hosts: int
    tree: Any
    #: By name; a format-5 manifest's are a ``packtable.Items`` (its packed arrays made on first use).
    items: Mapping[str, ArrayItem | ValueItem]
    objects: list[str]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Format 2: the per-host fragments the root names (None for format 1).
    fragments: list[Any] | None = None
    #: False for a format-2 root loaded with only some (or none) of its fragments' shards.
    complete: bool = True
    #: The commit's fence id (ckptio.fence): the manifest counts only once that fence says
    #: "commit". None in manifests written before fencing (trusted on their own).
    fence: str | None = None

    def keys(self) -> list[str]:
        """Every key this checkpoint owns besides its manifest: objects (loaded) and fragments."""
        return [*self.objects, *(f.key for f in self.fragments or [])]

    # -- writing ---------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        """The manifest as a JSON-able dict (format 1: every shard in one document)."""
        if not self.complete:
            raise ManifestError("a manifest loaded with only some of its fragments cannot be written whole")
        tiled = any(isinstance(it, ArrayItem) and any(s.tile for s in it.shards) for it in self.items.values())
        return {
            "format": FORMAT,
            "version": TILED_VERSION if tiled else 1,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "block_size": self.block_size,
            "num_hosts": self.num_hosts,
            "tree": self.tree,
            "objects": self.objects,
            "items": {name: item_to_json(item, name) for name, item in self.items.items()},
            "metadata": self.metadata,
            **({"fence": self.fence} if self.fence else {}),
        }

    def to_json(self) -> bytes:
        return seal(self.to_doc())

    # -- reading ---------------------------------------------------------

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate a manifest; ManifestError naming ``where`` (its URL) on any fault."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        body = unseal(data, where)
        try:
            doc = _json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: manifest is not valid JSON: {e}") from e
        except RecursionError:
            raise ManifestError(f"{where}: manifest is nested too deeply to be a ckptio manifest") from None
        try:
            return cls.from_doc(doc, where)
        except ManifestError:
            raise
        except RecursionError:
            raise ManifestError(f"{where}: manifest tree is nested too deeply") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{where}: malformed manifest: {type(e).__name__}: {e}") from e

    @classmethod
    def from_doc(cls, doc: Any, where: str) -> Manifest:
        """Validate a parsed manifest document (see :meth:`from_json`)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a ckptio manifest")
        version = doc.get("version")
        if not isinstance(version, int) or version < 1 or version > VERSION:
            raise ManifestError(
                f"{where}: manifest version {version!r} is not supported by this ckptio (reads <= {VERSION})"
            )
        if version == 2 or (version >= TILED_VERSION and "fragments" in doc):
            from .fragments import root_from_doc

            return root_from_doc(doc, where)
        block_size = _int(doc["block_size"], "block_size", where, lo=1)
        objects = doc["objects"]
        if not isinstance(objects, list) or len(objects) > _MAX_COUNT:
            raise ManifestError(f"{where}: 'objects' must be a list of keys")
        for key in objects:
            try:
                check_key(key)
            except ValueError as e:
                raise ManifestError(f"{where}: object key escapes the checkpoint root: {e}") from e
        raw_items = doc["items"]
        if not isinstance(raw_items, dict) or len(raw_items) > _MAX_COUNT:
            raise ManifestError(f"{where}: 'items' must be a JSON object")
        items: dict[str, ArrayItem | ValueItem] = {}
        for name, raw in raw_items.items():
            if type(raw) is list:  # a compact row: a small whole array
                items[name] = row_item(raw, f"{where}: item {name!r}", len(objects), block_size)
                continue
            here = f"{where}: item {name!r}"
            if not isinstance(raw, dict):
                raise ManifestError(f"{here}: not a JSON object")
            if raw.get("kind") == "value":
                items[name] = ValueItem(decode_value(raw, here))
            elif raw.get("kind") == "array":
                items[name] = array_item(raw, here, len(objects), block_size)
            else:
                raise ManifestError(f"{here}: unknown kind {raw.get('kind')!r}")
        if "packs" in doc:
            items = _with_packs(items, doc["packs"], version, where, len(objects), block_size)
        return cls(block_size=block_size, items=items, objects=objects, **head_fields(doc, items, where))


def _with_packs(items: dict[str, ArrayItem | ValueItem], raw: Any, version: int, where: str, n_objects: int,
                block_size: int) -> Items:
    """``items`` and the members of a format-5 manifest's pack tables, validated."""
    if version < PACKS_VERSION or type(raw) is not list or len(raw) > _MAX_COUNT:
        raise ManifestError(f"{where}: 'packs' must be a list of pack tables (format {PACKS_VERSION})")
    tables = [table_from_doc(t, f"{where}: pack {i}", n_objects, block_size) for i, t in enumerate(raw)]
    return Items(items, tables, where)


def head_fields(doc: dict[str, Any], items: dict[str, Any], where: str) -> dict[str, Any]:
    """The validated fields every manifest format shares (step, id, time, hosts, tree, metadata)."""
    step = doc.get("step")
    if step is not None:
        _int(step, "step", where)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: 'metadata' must be a JSON object")
    _check_tree(doc["tree"], items, where)
    fence = doc.get("fence")
    if fence is not None and not (isinstance(fence, str) and _FENCE_ID.fullmatch(fence)):
        raise ManifestError(f"{where}: 'fence' must be 12 hex digits, got {str(fence)[:40]!r}")
    return {"fence": fence, "step": step, "checkpoint_id": str(doc.get("checkpoint_id", "")), "created": float(doc.get("created", 0.0)),
            "num_hosts": _int(doc.get("num_hosts", 1), "num_hosts", where, lo=1), "tree": doc["tree"],
            "metadata": metadata}


def _check_tree(tree: Any, items: Mapping[str, Any], where: str) -> None:
    from .tree import tree_leaf_names

    try:
        plain, tables = split_items(items)
        missing = set(tree_leaf_names(tree)).difference(plain, *(t.names for t in tables))
    except (AttributeError, ValueError, TypeError) as e:
        raise ManifestError(f"{where}: malformed tree: {e}") from e
    if missing:
        raise ManifestError(f"{where}: tree names items the manifest lacks: {sorted(missing)[:5]}")


_SEAL_HEAD, _SEAL_TAIL = b'{"crc32c":"', b'","manifest":'
_SEAL_LEN = len(_SEAL_HEAD) + 8 + len(_SEAL_TAIL)


def seal(doc: dict[str, Any]) -> bytes:
    """A manifest document as stored: JSON whose ``manifest`` member is checksummed byte for byte.

    The checksum covers the exact bytes of the body, so a flipped byte that
    still parses as JSON (a digit of a shape, say) is caught too.
    """
    body = _json.dumps(doc)
    return b"%s%08x%s%s}" % (_SEAL_HEAD, crc32c(body), _SEAL_TAIL, body)


def unseal(data: bytes, where: str) -> bytes:
    """The body of a sealed manifest; IntegrityError naming ``where`` if its checksum fails."""
    head = data[:_SEAL_LEN]
    n = len(_SEAL_HEAD)
    if len(data) <= _SEAL_LEN or head[:n] != _SEAL_HEAD or head[n + 8 :] != _SEAL_TAIL or data[-1:] != b"}":
        raise ManifestError(f"{where}: manifest is not valid JSON of the ckptio format (no sealed body)")
    body = data[_SEAL_LEN:-1]
    try:
        expected = int(head[n : n + 8], 16)
    except ValueError:
        raise ManifestError(f"{where}: manifest checksum field is malformed") from None
    if crc32c(body) != expected:
        raise IntegrityError(f"checksum mismatch in manifest {where}: the object is corrupt", key=where)
    return body


def item_to_json(item: ArrayItem | ValueItem, name: str) -> dict[str, Any]:
    """The manifest's JSON form of one item."""
    if isinstance(item, ValueItem):
        return encode_value(item.value, name)
    return {
        "kind": "array",
        "dtype": encode_dtype(item.dtype),
        "shape": list(item.shape),
        "scalar": item.scalar,
        "origin": item.origin,
        "shards": [
            {
                "offsets": list(s.offsets),
                "shape": list(s.shape),
                "host": s.host,
                "extents": [[e.object, e.offset, e.shard_offset, e.length, e.crcs] for e in s.extents],
                **({"tile": list(s.tile)} if s.tile is not None else {}),
            }
            for s in item.shards
        ],
    }


def _int(v: Any, what: str, where: str, lo: int = 0, hi: int = _MAX_DIM) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"{where}: {what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _dims(v: Any, what: str, where: str) -> tuple[int, ...]:
    # The common case in one pass (a manifest of 100k leaves holds ~300k of these lists).
    if type(v) is list and len(v) <= _MAX_NDIM and all(type(d) is int and 0 <= d <= _MAX_DIM for d in v):
        return tuple(v)
    if not isinstance(v, list) or len(v) > _MAX_NDIM:
        raise ManifestError(f"{where}: {what} must be a list of at most {_MAX_NDIM} integers")
    return tuple(_int(d, what, where) for d in v)


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
    shape = _dims(raw["shape"], "shape", where)
    # numpy refuses a shape whose non-zero dimensions span more than an intp of bytes, even with a
    # zero dimension beside them: such an array is empty on disk but can never be made in memory.
    if math.prod(d for d in shape if d) * dtype.itemsize > _MAX_DIM:
        raise ManifestError(f"{where}: shape {str(list(shape))[:120]} of {dtype} spans more than "
                            f"{_MAX_DIM} bytes")
    shards_raw = raw["shards"]
    if not isinstance(shards_raw, list) or len(shards_raw) > _MAX_COUNT:
        raise ManifestError(f"{where}: 'shards' must be a list")
    shards = []
    for i, s in enumerate(shards_raw):
        here = f"{where} shard {i}"
        offsets = _dims(s["offsets"], "offsets", here)
        sshape = _dims(s["shape"], "shape", here)
        if len(offsets) != len(shape) or len(sshape) != len(shape):
            raise ManifestError(f"{here}: rank differs from the array's {len(shape)}")
        if any(o + n > d for o, n, d in zip(offsets, sshape, shape)):
            raise ManifestError(f"{here}: slice {offsets}+{sshape} lies outside the array shape {shape}")
        nbytes = math.prod(sshape) * dtype.itemsize
        extents, covered = [], 0
        for e in s["extents"]:
            if (type(e) is list and len(e) == 5 and type(e[0]) is int and type(e[1]) is int and type(e[2]) is int
                    and type(e[3]) is int and type(e[4]) is list and 0 <= e[0] < n_objects
                    and 0 <= e[1] <= _MAX_DIM and e[2] == covered and 1 <= e[3] <= _MAX_DIM):
                ext = Extent(e[0], e[1], e[2], e[3], e[4])  # the common case, checked in one expression
            else:
                ext = _extent(e, here, n_objects, covered)
            if len(ext.crcs) != -(-ext.length // block_size) or not all(
                type(c) is int and 0 <= c < _U32 for c in ext.crcs
            ):
                raise ManifestError(f"{here}: extent checksums do not match its length")
            covered += ext.length
            extents.append(ext)
        if covered != nbytes:
            raise ManifestError(f"{here}: extents hold {covered} bytes, the shard needs {nbytes}")
        tile = None
        if s.get("tile") is not None:
            tile = _dims(s["tile"], "tile", here)
            if len(tile) != len(sshape) or not all(1 <= t <= max(n, 1) for t, n in zip(tile, sshape)):
                raise ManifestError(f"{here}: tile {list(tile)} does not fit the shard's shape {list(sshape)}")
        shards.append(ShardRecord(offsets, sshape, _int(s.get("host", 0), "host", here), extents, tile))
    if tiling:
        _check_tiling(shards, shape, where)
    scalar = raw.get("scalar", False)
    origin = raw.get("origin", "numpy")
    if not isinstance(scalar, bool) or origin not in ("numpy", "jax", "torch", "sharded"):
        raise ManifestError(f"{where}: bad 'scalar' or 'origin'")
    return ArrayItem(dtype, shape, shards, scalar, origin)


_PLAIN_DTYPES: dict[str, np.dtype] = {}  # decoded dtype strings (a few kinds, 100k items)
_ZEROS = [(0,) * n for n in range(_MAX_NDIM + 1)]  # whole arrays' offsets
_ROW_EXTRAS = frozenset({"host", "origin", "scalar"})


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


def row_item(raw: list[Any], where: str, n_objects: int, block_size: int) -> ArrayItem:
    """Validate a compact row (:func:`item_row`); ManifestError naming ``where`` on any fault."""
    if len(raw) == 5:  # the commonest row, checked inline (100k of them in a large state)
        spec, shape, obj, at, crcs = raw
        dtype = _PLAIN_DTYPES.get(spec) if type(spec) is str else None
        if (dtype is not None and type(shape) is list and len(shape) <= _MAX_NDIM and type(obj) is int
                and 0 <= obj < n_objects and type(at) is int and 0 <= at <= _MAX_DIM and type(crcs) is list):
            for d in shape:
                if type(d) is not int or not 0 <= d <= _MAX_DIM:
                    break
            else:
                length = math.prod(shape) * dtype.itemsize
                if 0 < length <= _MAX_DIM and len(crcs) == -(-length // block_size):
                    for c in crcs:
                        if type(c) is not int or not 0 <= c < _U32:
                            break
                    else:
                        tup = tuple(shape)
                        return ArrayItem(dtype, tup, [ShardRecord(_ZEROS[len(tup)], tup, 0,
                                                                  [Extent(obj, at, 0, length, crcs)])])
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


def row_object(row: list[Any]) -> dict[str, Any]:
    """A compact row (:func:`item_row`) as the item's full JSON object."""
    spec, shape, obj, at, crcs = row[:5]
    extra = row[5] if len(row) == 6 and type(row[5]) is dict else {}
    try:
        length = math.prod(shape) * decode_dtype(spec, "").itemsize
    except (ValueError, TypeError):
        length = -1  # refused with the dtype
    return {"kind": "array", "dtype": spec, "shape": shape, "scalar": extra.get("scalar", False),
            "origin": extra.get("origin", "numpy"),
            "shards": [{"offsets": [0] * len(shape) if type(shape) is list else shape, "shape": shape,
                        "host": extra.get("host", 0), "extents": [[obj, at, 0, length, crcs]]}]}


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
    if not (type(shape) is list and len(shape) <= _MAX_NDIM and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)):
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
    if not (type(obj) is int and 0 <= obj < n_objects and type(at) is int and 0 <= at <= _MAX_DIM
            and type(length) is int and length == nbytes and length >= 1
            and type(crcs) is list and len(crcs) == -(-length // block_size)
            and all(type(c) is int and 0 <= c < _U32 for c in crcs)
            and type(host) is int and 0 <= host <= _MAX_DIM and type(scalar) is bool
            and origin in ("numpy", "jax", "torch", "sharded")):
        return None
    tup = tuple(shape)
    return ArrayItem(dtype, tup, [ShardRecord((0,) * len(tup), tup, host, [Extent(obj, at, 0, length, crcs)])],
                     scalar, origin)


def _extent(e: Any, here: str, n_objects: int, covered: int) -> Extent:
    """One extent, validated field by field with an error naming the fault."""
    if not (isinstance(e, list) and len(e) == 5 and isinstance(e[4], list)):
        raise ManifestError(f"{here}: malformed extent {str(e)[:80]!r}")
    obj = _int(e[0], "extent object", here, hi=max(n_objects - 1, 0))
    ext = Extent(obj, _int(e[1], "extent offset", here), _int(e[2], "shard offset", here),
                 _int(e[3], "extent length", here, lo=1), e[4])
    if n_objects == 0 or ext.shard_offset != covered:
        raise ManifestError(f"{here}: extents do not tile the shard's bytes (gap or overlap at {covered})")
    return ext


def overlap(
    a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes as ``(offsets, shape)``, or None if they do not meet."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _check_tiling(shards: list[ShardRecord], shape: tuple[int, ...], where: str) -> None:
    """Shards must cover the array exactly once, or a restore would return holes or ambiguity.

    Every shard lies inside the array (checked by the caller), so equal volumes and
    no two overlapping shards mean an exact tiling.
    """
    total = sum(s.size for s in shards)
    if total != math.prod(shape):
        raise ManifestError(
            f"{where}: the shards hold {total} of the array's {math.prod(shape)} elements (missing or overlapping slices)"
        )
    pair = first_overlap([(s.offsets, s.shape) for s in shards if s.size])
    if pair is not None:
        raise ManifestError(f"{where}: shards {pair[0]} and {pair[1]} overlap")


Box = tuple[tuple[int, ...], tuple[int, ...]]


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (``(offsets, shape)``, none empty) that overlap, or None.

    Thousands of shards per array are normal at scale (8192 for a parameter
    sharded over 1024 hosts x 8 devices), so this is not pairwise. In a
    dimension whose distinct intervals are disjoint, boxes with different
    intervals cannot meet, and boxes with the same interval meet exactly when
    they do in the other dimensions: so the boxes are split into those groups
    and each group is checked on the remaining dimensions. A grid (any mesh
    sharding) resolves completely that way, one dictionary pass per dimension;
    only a group whose remaining dimensions all have overlapping intervals is
    swept, along the dimension with the most distinct intervals, comparing the
    boxes whose intervals there overlap.
    """
    if len(boxes) < 2:
        return None
    return _overlap_in(boxes, list(range(len(boxes[0][0]))))


def _overlap_in(boxes: list[Box], dims: list[int]) -> tuple[Box, Box] | None:
    """first_overlap for boxes known to coincide in every dimension not in ``dims``."""
    if not dims:
        return boxes[0], boxes[1]  # identical boxes
    for k in dims:
        groups: dict[tuple[int, int], list[Box]] = {}
        for box in boxes:
            groups.setdefault((box[0][k], box[0][k] + box[1][k]), []).append(box)
        spans = sorted(groups)
        if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)):
            rest = [d for d in dims if d != k]
            for group in groups.values():
                if len(group) > 1 and (found := _overlap_in(group, rest)) is not None:
                    return found
            return None
    if len(dims) == 2:  # any 2-D tiling (pinwheels included) in O(n log n)
        return _sweep_2d(boxes, dims[0], dims[1])
    return _sweep(boxes, max(dims, key=lambda d: len({(b[0][d], b[1][d]) for b in boxes})))


def _sweep_2d(boxes: list[Box], k: int, j: int) -> tuple[Box, Box] | None:
    """Boxes that coincide outside dimensions ``k`` and ``j``: sweep along ``k`` keeping the active
    intervals along ``j`` sorted and disjoint, so each insertion is checked against its two neighbours."""
    events: list[tuple[int, int, int]] = []  # (position along k, 0 = leaves / 1 = enters, box number)
    for i, b in enumerate(boxes):
        events.append((b[0][k], 1, i))
        events.append((b[0][k] + b[1][k], 0, i))
    events.sort()
    starts: list[int] = []  # sorted starts along j of the active boxes
    owner: dict[int, int] = {}  # start -> box number
    for _pos, enters, i in events:
        lo = boxes[i][0][j]
        if not enters:
            if owner.get(lo) == i:
                del starts[bisect.bisect_left(starts, lo)]
                del owner[lo]
            continue
        hi = lo + boxes[i][1][j]
        at = bisect.bisect_left(starts, lo)
        if at < len(starts) and starts[at] < hi:
            return boxes[owner[starts[at]]], boxes[i]
        if at > 0:
            prev = owner[starts[at - 1]]
            if boxes[prev][0][j] + boxes[prev][1][j] > lo:
                return boxes[prev], boxes[i]
        starts.insert(at, lo)
        owner[lo] = i
    return None


def _sweep(boxes: list[Box], k: int) -> tuple[Box, Box] | None:
    active: list[tuple[int, int, Box]] = []  # heap of (end along k, tie-breaker, box)
    for i, box in enumerate(sorted(boxes, key=lambda b: b[0][k])):
        start = box[0][k]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if overlap(*other, *box) is not None:
                return other, box
        heapq.heappush(active, (start + box[1][k], i, box))
    return None
