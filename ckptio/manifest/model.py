"""The manifest in memory: plain dataclasses, below every codec.

A :class:`Manifest` names a checkpoint's items; an :class:`ArrayItem`'s
:class:`ShardRecord` s say which slice of the array each saved piece is and
its :class:`Extent` s where its bytes are (object, offset, block checksums).
A format-5 manifest keeps its packed small arrays as :class:`PackTable`
columns inside an :class:`Items` mapping, which makes each member's
ArrayItem on first use. Nothing here parses or writes JSON: the codecs
(:mod:`ckptio.manifest.codec`) build these objects and turn them back into
documents.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from ckptio.errors import ManifestError

__all__ = [
    "ArrayItem",
    "Box",
    "Codec",
    "Extent",
    "FragmentRef",
    "Items",
    "Manifest",
    "PackTable",
    "ShardRecord",
    "ValueItem",
    "split_items",
    "use_codec",
]

#: A box of an array: ``(offsets, shape)``.
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(slots=True)
class Extent:
    """``length`` bytes of a shard, from ``shard_offset``, stored at ``offset`` in object ``object``.

    ``crcs`` holds the crc32c of every ``block`` bytes from the extent's start (the last block
    may be shorter). ``block`` is the extent's own checksum block size where its record names
    one (format 6: small shards get small blocks, so that a partial read rounds out little),
    else the manifest's ``block_size``: every decoder fills it, and every reader verifies with it.
    """

    object: int
    offset: int
    shard_offset: int
    length: int
    crcs: list[int]
    block: int


@dataclasses.dataclass(slots=True)
class ShardRecord:
    """One saved slice of an array: where it sits in the global array and where its bytes are."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    host: int
    extents: list[Extent]
    #: The tile shape when the shard's bytes are its tiles in stream order (ckptio.engine.tiling).
    tile: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(slots=True)
class ArrayItem:
    """An array leaf: its dtype, global shape and saved shards."""

    dtype: np.dtype
    shape: tuple[int, ...]
    shards: list[ShardRecord]
    scalar: bool = False  # saved from a numpy scalar: restored as one
    origin: str = "numpy"  # numpy | jax | torch | sharded: a hint for adapters
    #: Its shards as columns (:class:`ckptio.manifest.table.ShardTable`, row ``i`` = ``shards[i]``): made on
    #: first use by :func:`~ckptio.manifest.table.table_of`, or straight from a fragment (not part of the record).
    table: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    #: Format 2: the int64 table ``[fragment, offsets..., shape...]`` of every shard (see .fragments).
    locator: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(slots=True)
class ValueItem:
    """A small non-array leaf kept inline: int, float, bool, str, bytes or None."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class FragmentRef:
    """Where one host's fragment of a format-2 manifest is and what its bytes must be."""

    key: str
    size: int
    crc32c: int
    host: int
    #: A version-4 fragment's head (:mod:`.codec.sections`): its length and crc32c, so that a
    #: reader can read and check it alone (format 10); None for older fragments.
    head_size: int | None = None
    head_crc32c: int | None = None


@dataclasses.dataclass(slots=True)
class PackTable:
    """One pack's members (format 5), as validated columns: small whole arrays back to back."""

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
    #: The manifest's block size: no member is longer, so each member's one crc is its one block.
    block: int

    def span(self, i: int) -> tuple[int, int]:
        """Member ``i``'s ``(start, end)`` relative to ``offset``."""
        return (self.ends[i - 1] if i else 0), self.ends[i]

    def item(self, i: int) -> ArrayItem:
        """Member ``i`` as the ArrayItem any reader takes: a whole array in one extent."""
        start, end = self.span(i)
        shape = tuple(self.shapes[i])
        extent = Extent(self.object, self.offset + start, 0, end - start, [self.crcs[i]], self.block)
        return ArrayItem(self.dtype, shape, [ShardRecord((0,) * len(shape), shape, self.host, [extent])],
                         i in self.scalars, self.origin)


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


class Codec(Protocol):
    """What :class:`Manifest`'s readers and writers delegate to (:mod:`ckptio.manifest.codec`)."""

    def decode(self, doc: Any, where: str) -> Manifest: ...

    def decode_json(self, data: bytes, where: str) -> Manifest: ...

    def encode(self, manifest: Manifest) -> dict[str, Any]: ...

    def encode_json(self, manifest: Manifest) -> bytes: ...


# The codec sits above the model (it builds it), so it registers itself here on import rather than
# being imported: ``ckptio.manifest`` imports it, so whoever holds a Manifest has it registered.
_codec: list[Codec] = []


def use_codec(codec: Codec) -> None:
    """Make ``codec`` the one :meth:`Manifest.from_json` & co. delegate to (done by the codec package)."""
    _codec[:] = [codec]


@dataclasses.dataclass(slots=True)
class Manifest:
    """A checkpoint's manifest: its items by name, the objects holding their bytes, and its head."""

    step: int | None
    checkpoint_id: str
    created: float
    block_size: int
    num_hosts: int
    tree: Any
    #: By name; a format-5 manifest's are an :class:`Items` (its packed arrays made on first use).
    items: Mapping[str, ArrayItem | ValueItem]
    objects: list[str]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Format 2: the per-host fragments the root names (None for format 1).
    fragments: list[FragmentRef] | None = None
    #: False for a format-2 root loaded with only some (or none) of its fragments' shards: ask
    #: :meth:`object_count` / :meth:`tiles_known`, or load them (:func:`ckptio.manifest.lazy`).
    complete: bool = True
    #: The commit's fence id (ckptio.store.fence): the manifest counts only once that fence says
    #: "commit". None in manifests written before fencing (trusted on their own).
    fence: str | None = None
    #: Format 9 (:mod:`ckptio.manifest.refs`): the older steps whose objects this manifest references,
    #: each with the checkpoint id committed there when it did (None: references nothing).
    bases: dict[str, str] | None = None
    #: Format 9: the sha256 (hex) of shards' bytes, by item and box: what an incremental save compares.
    digests: dict[str, dict[Box, str]] | None = None

    def keys(self) -> list[str]:
        """Every key this checkpoint owns besides its manifest: objects (loaded) and fragments."""
        return [*self.objects, *(f.key for f in self.fragments or [])]

    def object_count(self) -> int | None:
        """How many objects hold the data; None while they are named only in unread fragments."""
        return len(self.objects) if self.complete else None

    def tiles_known(self, name: str) -> bool:
        """Whether the shards at hand of item ``name`` are all of its shards, checked on read to
        tile it exactly once (False while some of a format-2 manifest's fragments are unread)."""
        return self.complete

    def to_doc(self) -> dict[str, Any]:
        """The manifest as a JSON-able dict (every shard in one document; see ``codec.encode``)."""
        return _codec[0].encode(self)

    def to_json(self) -> bytes:
        """The manifest as stored: its document, sealed."""
        return _codec[0].encode_json(self)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate a stored manifest; ManifestError naming ``where`` (its URL) on any fault."""
        return _codec[0].decode_json(data, where)

    @classmethod
    def from_doc(cls, doc: Any, where: str) -> Manifest:
        """Validate a parsed manifest document (see :meth:`from_json`)."""
        return _codec[0].decode(doc, where)
