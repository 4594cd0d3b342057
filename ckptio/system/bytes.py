"""Flat byte views of caller buffers, copies between them that do not hold the GIL, and addresses.

Every backend and the engine see caller buffers of any format and shape
(float arrays, bfloat16 views, ...) and work on their bytes: :func:`flat_bytes`
and :func:`byte_views` are the one place that casts them.

A memoryview slice assignment (``dst[:] = src``) is a memcpy with the GIL
held: copying one 64 MiB object stops every other Python thread of the
process -- the training loop's among them -- for 10-20 ms. numpy's copyto
releases the GIL for a plain byte copy, so anything but small copies goes
through it. Measured with ``bench/train.py``'s host step while a thread
copied 8 MiB chunks in a loop: 2.0x slower steps with slice assignment,
1.3x with copyto (the rest is the two cores' shared memory bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "GIL_FREE_MIN", "address", "byte_views", "copy_bytes", "flat_bytes", "gather_bytes", "scatter_bytes",
]

#: Copies of at least this many bytes release the GIL; below it the numpy call costs more than it frees.
GIL_FREE_MIN = 64 << 10


def flat_bytes(view: memoryview) -> memoryview:
    """``view`` as a 1-D unsigned-byte view (no copy; C-contiguous input)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def byte_views(buffers: Sequence[memoryview | bytes | bytearray]) -> list[memoryview]:
    """Flat byte views of ``buffers``, empty ones dropped (a zero in a shape cannot be cast)."""
    views = (b if isinstance(b, memoryview) else memoryview(b) for b in buffers)
    return [flat_bytes(v) for v in views if v.nbytes]


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for two C-contiguous buffers of equal byte size, GIL released when large."""
    n = dst.nbytes
    if n != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into a buffer of {n}")
    if not n:
        return  # cast() refuses views with a zero in their shape
    if n < GIL_FREE_MIN:
        flat_bytes(dst)[:] = flat_bytes(src)
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def gather_bytes(buffers: Sequence[memoryview]) -> bytearray:
    """The concatenation of ``buffers`` in one new buffer (one copy, GIL released when large)."""
    out = bytearray(sum(b.nbytes for b in buffers))
    view, pos = memoryview(out), 0
    for b in buffers:
        copy_bytes(view[pos : pos + b.nbytes], b)
        pos += b.nbytes
    return out


def scatter_bytes(src: memoryview, buffers: Sequence[memoryview]) -> None:
    """Fill ``buffers`` in order from ``src`` (whose size is the buffers' total)."""
    src = flat_bytes(src)
    if src.nbytes != sum(b.nbytes for b in buffers):
        raise ValueError(f"{src.nbytes} bytes cannot fill buffers of {sum(b.nbytes for b in buffers)}")
    pos = 0
    for b in buffers:
        copy_bytes(b, src[pos : pos + b.nbytes])
        pos += b.nbytes


def address(view: memoryview) -> int:
    """The memory address of a buffer's first byte (alignment checks, shared-memory offsets)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
