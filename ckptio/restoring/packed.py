"""Bulk reads of many small whole arrays: packed neighbours and format-5 pack tables.

A state holds 10k-100k small arrays (norms, biases, counters). Planning one
read per leaf would cost more than reading them, so these readers turn whole
runs of them into a few large requests into one buffer each, every member
verified against its own checksum, and every restored array a view of that
buffer. Each returns its requests and a batch finisher that builds the
leaves (name -> value) once the bytes are in.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.backends.base import ByteRange
from ckptio.engine import ReadRequest
from ckptio.manifest import ArrayItem, Extent, PackTable
from ckptio.system import fresh_pages

__all__ = ["BULK_ITEM_BYTES", "Batch", "bulk_reads", "table_reads"]

#: Builds many restored leaves (name -> value) once their shared buffers are filled.
Batch = Callable[[], dict[str, Any]]

#: Whole arrays up to this size (one extent, one checksum block) are read in bulk.
BULK_ITEM_BYTES = 1 << 20
_BULK_GAP = 64 << 10  # skipped bytes (padding, another host's data) read rather than split


def bulk_reads(
    small: list[tuple[str, ArrayItem, Extent]], objects: list[str], block_size: int, max_read: int,
) -> tuple[list[ReadRequest], Batch]:
    """Whole small arrays (a state's norms, biases, counters: 10k-100k of them) read as few
    large requests, with no per-leaf plan: the arrays packed together in an object become one
    read into one buffer, each verified against its own checksum, and each restored array is a
    view of that buffer (a copy where its offset does not suit its dtype's alignment).

    Returns the requests and the function that builds the leaves once they are read.
    """
    small.sort(key=lambda t: (t[2].object, t[2].offset))
    requests: list[ReadRequest] = []
    spans: list[tuple[np.ndarray, int, list[tuple[str, ArrayItem, Extent]]]] = []
    i = 0
    while i < len(small):
        first = small[i][2]
        j, end = i + 1, first.offset + first.length
        while j < len(small):
            e = small[j][2]
            # Next to each other in one object (alignment padding aside) and within one read.
            if e.object != first.object or e.offset - end > _BULK_GAP or e.offset + e.length - first.offset > max_read:
                break
            end = e.offset + e.length
            j += 1
        members = small[i:j]
        buf = fresh_pages(end - first.offset)
        checks = [(e.offset - first.offset, e.length, e.crcs, name) for name, _item, e in members]
        requests.append(ReadRequest(objects[first.object], ByteRange(first.offset, end), [memoryview(buf)], checks,
                                    [], block_size))
        spans.append((buf, first.offset, members))
        i = j

    def finish() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for buf, base, members in spans:
            for name, item, e in members:
                at = e.offset - base
                if at % item.dtype.alignment == 0:
                    arr = np.ndarray(item.shape, item.dtype, buf, at)
                else:  # a view would be unaligned
                    arr = buf[at : at + e.length].copy().view(item.dtype).reshape(item.shape)
                out[name] = arr[()] if item.scalar else arr
        return out

    return requests, finish


def table_reads(
    tables: list[PackTable], objects: list[str], block_size: int, max_read: int,
) -> tuple[list[ReadRequest], Batch]:
    """Every member of format-5 pack tables: one read per pack (or per ``max_read`` bytes of it)
    into one buffer, each member verified against its own checksum, each restored array a view
    of that buffer. A pack holds one dtype back to back, so every member is aligned for it.

    Returns the requests and the function that builds the leaves once they are read.
    """
    requests: list[ReadRequest] = []
    spans: list[tuple[PackTable, int, int, np.ndarray, int]] = []
    for t in tables:
        ends, i = t.ends, 0
        while i < len(ends):
            base = t.span(i)[0]
            j = max(bisect.bisect_right(ends, base + max_read, i), i + 1)  # members [i, j) in one read
            buf = fresh_pages(ends[j - 1] - base)
            checks = [(start - base, end - start, [crc], name) for start, end, crc, name
                      in zip([base, *ends[i : j - 1]], ends[i:j], t.crcs[i:j], t.names[i:j])]
            requests.append(ReadRequest(objects[t.object], ByteRange(t.offset + base, t.offset + ends[j - 1]),
                                        [memoryview(buf)], checks, [], block_size))
            spans.append((t, i, j, buf, base))
            i = j

    def finish() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for t, i, j, buf, base in spans:
            out.update(zip(t.names[i:j], _members(t, i, j, buf, base)))
        return out

    return requests, finish


def _members(t: PackTable, i: int, j: int, buf: np.ndarray, base: int) -> list[Any]:
    """Members ``[i, j)`` of ``t`` as arrays over ``buf`` (which holds its bytes from ``base`` on)."""
    dtype, shapes = t.dtype, t.shapes[i:j]
    # fresh_pages: page-aligned, or numpy's allocator (16 bytes, every dtype's alignment at most).
    assert buf.ctypes.data % dtype.alignment == 0
    if shapes[0] and shapes.count(shapes[0]) == len(shapes) and not t.scalars:
        # One shape throughout (a layer's worth of equal vectors): the rows of one 2-D view.
        return list(np.ndarray((j - i, *shapes[0]), dtype, buf, 0))
    out: list[Any] = []
    for m, shape in enumerate(shapes, i):
        arr = np.ndarray(shape, dtype, buf, t.span(m)[0] - base)
        out.append(arr[()] if m in t.scalars else arr)
    return out

