"""Fragment version 4: a small head, an index, and one binary section per array item, readable by range.

A version-3 fragment (:mod:`.columns`) is one compressed block: a host that wants
one array of a 4096-host checkpoint decoded all 4096 fragments whole (base64,
zlib, JSON) to take one row of each. A version-4 fragment is laid out so that a
reader can read only what it needs, each part checked before use::

    head     magic b"ckptio-fragment\\x04", then <q step (-1: none), <I width, <I items,
             <I the head's own length, 8 bytes of blake2b over the array names in order, <I object count, the object
             keys joined by "\\n", zero padding to a multiple of 8 bytes
    index    ``items`` entries of <Q offset, <I length, <I crc32c: array item ``i``'s section
             (length 0: the host holds no shard of it)
    sections one per item with shards: <I item, <I rows, <I extents, <I checksums, then the
             columns of :mod:`.columns` for those rows (boxes, extent counts, extents as
             little-endian int64, checksums as uint32), zero padding to a multiple of 8

The root's fragment reference records the head's length and crc32c besides the
whole object's (format 10). A reader wanting few items reads the head and the
index entries it needs (one round trip: both lie at offsets the root gives), then
the sections; each section is checked against its entry's crc32c and must name
the item it was read for, so an entry that lies (a flipped byte, another item's
section) is refused, naming the fragment. A reader wanting every item reads the
object whole, checked against the root, and takes every section's columns with
a few array operations (:func:`take_whole`), each section still checked.
Items are numbered as the root lists its arrays; the head's digest of their
names binds the numbers to the names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest.codec.columns import _ranges, column_bytes
from ckptio.manifest.limits import MAX_COUNT, MAX_NDIM
from ckptio.system.checksum import crc32c

__all__ = ["MAGIC", "SECTIONS_FRAGMENT_VERSION", "Head", "encode_sections", "head_size_of", "index_range", "names_digest",
           "parse_head", "parse_index", "take_sections", "take_whole", "with_objects"]

#: The ``version`` of a fragment laid out in sections.
SECTIONS_FRAGMENT_VERSION = 4
MAGIC = b"ckptio-fragment\x04"
_FIXED = struct.Struct("<qIII8sI")
_ENTRY = np.dtype([("off", "<u8"), ("len", "<u4"), ("crc", "<u4")])
_SECTION = struct.Struct("<IIII")
Columns4 = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def names_digest(names: Sequence[str]) -> bytes:
    """8 bytes binding item numbers to the array names, in order."""
    return hashlib.blake2b("\n".join(names).encode(), digest_size=8).digest()


def _pad8(n: int) -> int:
    return -n % 8


def encode_sections(step: int | None, objects: Sequence[str], items: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]
                    ) -> tuple[bytes, int]:
    """A version-4 fragment of every array item of a host record, in order (``(name, shards)``, an
    item without shards included: its number is its place), and its head's length."""
    width = max((len(s["shape"]) for _n, shards in items for s in shards), default=0)
    head = _head_bytes(step, width, len(items), names_digest([n for n, _s in items]), objects)
    at = len(head) + _ENTRY.itemsize * len(items)
    index = np.zeros(len(items), _ENTRY)
    parts: list[bytes] = []
    for i, (name, shards) in enumerate(items):
        if not shards:
            continue
        raw, n_ext, n_crc = column_bytes([(name, shards)], width)
        body = _SECTION.pack(i, len(shards), n_ext, n_crc) + raw
        body += bytes(_pad8(len(body)))
        index[i] = (at, len(body), crc32c(body))
        parts.append(body)
        at += len(body)
    return b"".join([head, index.tobytes(), *parts]), len(head)


def _head_bytes(step: int | None, width: int, items: int, digest: bytes, objects: Sequence[str]) -> bytes:
    keys = "\n".join(objects).encode()
    if any("\n" in k for k in objects):
        raise ValueError("an object key holds a newline")
    size = len(MAGIC) + _FIXED.size + len(keys)
    size += _pad8(size)
    head = MAGIC + _FIXED.pack(-1 if step is None else step, width, items, size, digest, len(objects)) + keys
    return head + bytes(size - len(head))


def with_objects(data: bytes, head: Head, objects: Sequence[str], here: str) -> bytes:
    """A version-4 fragment ``data`` (whose checked ``head`` is given) naming ``objects`` instead of
    its own object keys (as many): a new head, the index's offsets moved by its change of length,
    the sections as they are (their crc32c stays theirs). For a copy whose objects get other keys."""
    if len(objects) != len(head.objects):
        raise ManifestError(f"{here}: {len(objects)} object keys for a fragment naming {len(head.objects)}")
    new = _head_bytes(head.step, head.width, head.items, head.digest, objects)
    lo, hi = index_range(head.size, 0, head.items - 1) if head.items else (head.size, head.size)
    index = np.frombuffer(data, _ENTRY, head.items, lo).copy()
    used = index["len"] > 0  # the head may grow or shrink: offsets moved as signed numbers
    index["off"][used] = (index["off"][used].astype(np.int64) + (len(new) - head.size)).astype(np.uint64)
    return b"".join([new, index.tobytes(), data[hi:]])


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """A version-4 fragment's head, checked."""

    step: int | None
    width: int
    items: int
    digest: bytes
    objects: list[str]
    size: int  # of the head: the index starts here


def parse_head(data: bytes | memoryview, size: int, crc: int, here: str, key: str) -> Head:
    """The head (``data``'s first ``size`` bytes), checked against the root's crc32c and parsed."""
    raw = bytes(data[:size])
    if len(raw) != size or crc32c(raw) != crc:
        raise IntegrityError(f"{here}: its head does not match the checksum the root manifest records", key=key)
    fixed = len(MAGIC) + _FIXED.size
    if size < fixed or size % 8 or raw[: len(MAGIC)] != MAGIC:
        raise ManifestError(f"{here}: not a version-{SECTIONS_FRAGMENT_VERSION} fragment head")
    step, width, items, own, digest, n_objects = _FIXED.unpack_from(raw, len(MAGIC))
    if own != size or width > MAX_NDIM or items > MAX_COUNT or n_objects > MAX_COUNT:
        raise ManifestError(f"{here}: its head's counts are out of range")
    text = raw[fixed:].rstrip(b"\0")
    try:
        objects = text.decode().split("\n") if text else []
    except UnicodeDecodeError as e:
        raise ManifestError(f"{here}: its object keys are not UTF-8: {e}") from e
    if len(objects) != n_objects:
        raise ManifestError(f"{here}: its head lists {len(objects)} objects, it says {n_objects}")
    return Head(None if step == -1 else step, width, items, digest, objects, size)


def head_size_of(data: bytes) -> int | None:
    """The length of a version-4 fragment's head, as it says (None: not a version-4 fragment)."""
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + _FIXED.size:
        return None
    return int(_FIXED.unpack_from(data, len(MAGIC))[3])


def index_range(head_size: int, first: int, last: int) -> tuple[int, int]:
    """The byte range ``[start, end)`` of index entries ``first`` to ``last`` (inclusive)."""
    return head_size + _ENTRY.itemsize * first, head_size + _ENTRY.itemsize * (last + 1)


def parse_index(raw: bytes | memoryview, first: int, head: Head, size: int, here: str) -> np.ndarray:
    """Index entries from number ``first`` (``raw``: their bytes) as int64 rows ``[offset, length,
    crc32c]``, each checked to lie in the object's sections (``size``: the object's length)."""
    n = len(raw) // _ENTRY.itemsize
    if len(raw) % _ENTRY.itemsize or first + n > head.items:
        raise ManifestError(f"{here}: its index is cut short")
    entries = np.frombuffer(raw, _ENTRY, n)
    index = np.empty((n, 3), np.int64)
    index[:, 0], index[:, 1], index[:, 2] = entries["off"], entries["len"], entries["crc"]
    off, length = index[:, 0], index[:, 1]
    start = head.size + _ENTRY.itemsize * head.items
    if (((off < start) | (off + length > size) | (off % 8 != 0)) & (length > 0)).any():
        raise ManifestError(f"{here}: its index names a section outside the fragment")
    return index


def take_sections(parts: Mapping[int, bytes | memoryview], index: np.ndarray, first: int, head: Head,
                  here: str, key: str) -> tuple[list[int], list[int], Columns4]:
    """Sections ``parts`` (item number -> its bytes, as its ``index`` entry says; entries from
    number ``first``), each checked, as one set of columns: ``(items, rows per item, columns)``."""
    got = []
    for i in sorted(parts):
        _off, length, crc = index[i - first].tolist()
        data = parts[i]
        if len(data) != length or crc32c(data) != crc:
            raise IntegrityError(f"{here}: the section of item number {i} does not match its checksum", key=key)
        got.append(_section(data, i, head.width, here))
    rows, cols = _joined(got, head.width)
    return sorted(parts), rows, cols


def take_whole(data: bytes, head: Head, wanted: Sequence[int] | None, here: str
               ) -> tuple[Sequence[int], Sequence[int], Columns4]:
    """Every section (``wanted`` None) or sections ``wanted`` of a whole fragment, whose bytes the
    caller checked against the root's crc32c of the object, as one set of columns: their rows
    gathered with a few array operations whatever their number.

    The object's crc32c covers every byte, so the sections' own are left to ranged readers (a
    crc32c call per section was ~40 % of decoding a 256-item fragment whole). What the index
    says is still checked: the sections tile the object after the index, and each holds the item
    and the length its entry says, so an entry that lies about where a section is is refused."""
    lo, hi = index_range(head.size, 0, head.items - 1) if head.items else (head.size, head.size)
    index = parse_index(memoryview(data)[lo:hi], 0, head, len(data), here)
    used = np.flatnonzero(index[:, 1] > 0)
    spans = index[used[np.argsort(index[used, 0], kind="stable")], :2]
    if len(spans) and (spans[0, 0] != hi or spans[-1].sum() != len(data) or (spans[:-1].sum(1) != spans[1:, 0]).any()):
        raise ManifestError(f"{here}: its sections do not follow its index back to back")
    if wanted is None:
        numbers = used
    else:
        asked = np.asarray(wanted, np.int64)
        numbers = asked[index[asked[asked < len(index)], 1] > 0]
    if not len(numbers):
        return [], [], _joined([], head.width)[1]
    offs = index[numbers, 0]
    u4 = np.frombuffer(data, "<u4")
    hdr = u4[(offs // 4)[:, None] + np.arange(4)]  # item, rows, extents, checksums of each section
    w = head.width
    words = _SECTION.size // 8 + hdr[:, 1].astype(np.int64) * (3 * w + 1) + hdr[:, 2].astype(np.int64) * 6
    lengths = words * 8 + hdr[:, 3].astype(np.int64) * 4
    if (hdr[:, 0] != numbers).any() or (lengths + (-lengths % 8) != index[numbers, 1]).any():
        raise ManifestError(f"{here}: a section does not hold what its index entry says")
    i8 = np.frombuffer(data, "<i8")
    base, rows, n_ext = offs // 8 + _SECTION.size // 8, hdr[:, 1].astype(np.int64), hdr[:, 2].astype(np.int64)
    boxes = i8[_ranges(base, rows * 3 * w)].reshape(-1, 3 * w) if w else np.zeros((int(rows.sum()), 0), np.int64)
    ecount = i8[_ranges(base + rows * 3 * w, rows)]
    ext = i8[_ranges(base + rows * (3 * w + 1), n_ext * 6)].reshape(-1, 6)
    crcs = u4[_ranges((offs + words * 8) // 4, hdr[:, 3].astype(np.int64))]
    _check_counts(ecount, ext, len(crcs), here)
    return numbers, rows, (boxes, ecount, ext, crcs)


def _section(data: bytes | memoryview, i: int, width: int, here: str) -> tuple[int, Columns4]:
    item, rows, n_ext, n_crc = _SECTION.unpack_from(data, 0)
    at = [_SECTION.size, _SECTION.size + rows * 3 * width * 8]
    at += [at[1] + rows * 8, at[1] + rows * 8 + n_ext * 48]
    end = at[3] + n_crc * 4
    if item != i or end + _pad8(end) != len(data):
        raise ManifestError(f"{here}: the section read for item number {i} does not hold it")
    boxes = np.frombuffer(data, "<i8", rows * 3 * width, at[0]).reshape(rows, 3 * width)
    ecount = np.frombuffer(data, "<i8", rows, at[1])
    ext = np.frombuffer(data, "<i8", n_ext * 6, at[2]).reshape(n_ext, 6)
    crcs = np.frombuffer(data, "<u4", n_crc, at[3])
    _check_counts(ecount, ext, n_crc, here)
    return rows, (boxes, ecount, ext, crcs)


def _check_counts(ecount: np.ndarray, ext: np.ndarray, n_crc: int, here: str) -> None:
    if len(ecount) and (ecount.min() < 0 or int(ecount.sum()) != len(ext)) or \
            (len(ext) and (ext[:, 4].min() < 0 or int(ext[:, 4].sum()) != n_crc)):
        raise ManifestError(f"{here}: its extent or checksum counts do not add up")


def _joined(got: list[tuple[int, Columns4]], width: int) -> tuple[list[int], Columns4]:
    """Sections' ``(rows, columns)`` as rows per section and one set of columns."""
    if not got:
        return [], (np.zeros((0, 3 * width), np.int64), np.zeros(0, np.int64), np.zeros((0, 6), np.int64),
                    np.zeros(0, np.uint32))
    cols = tuple(np.concatenate([g[1][k] for g in got]) for k in range(4))
    return [g[0] for g in got], cols  # type: ignore[return-value]
