"""Boxes of C-order buffers as runs of bytes, and runs copied between flat buffers, vectorised.

A restore exchange moves many pieces (boxes of arrays) per round: out of a
sender's read buffers into its messages, out of a receiver's staging into its
target buffers. A Python step per piece (or per row of a piece) would cost
more than the bytes at a million pieces, so here a piece is its *runs*: the
contiguous spans of bytes it covers in the buffer holding it (its inner
dimensions that span the whole buffer merged into one run, the outer indices
decoded with numpy), and runs are copied as strided 2-D views (a strided piece's rows: one step
apart at each end) or with one fancy-indexed gather per distinct run length
(over sliding windows of the flat buffers), in chunks so that no temporary
exceeds :data:`_CHUNK` bytes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["box_view", "copy_runs", "counted_runs", "flat", "groups", "runs"]

_I64 = np.int64
#: A gather's temporary (runs of one length, copied at once) is at most this many bytes.
_CHUNK = 64 << 10
#: Runs in a row of one length and one step at each end, this many or more, move as one 2-D copy.
_LONG = 8


def runs(lo: np.ndarray, hi: np.ndarray, off: np.ndarray, shape: np.ndarray, itemsize: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of pieces ``[lo, hi)`` (``(m, ndim)``, array coordinates), each in a C-order
    buffer of box ``(off, shape)`` (its row: the buffer holding that piece), elements of
    ``itemsize`` bytes: ``(piece, start, length)`` per run, by piece then in C order, ``start``
    in bytes from the start of the piece's buffer. A piece of no bytes has no run."""
    return counted_runs(lo, hi, off, shape, itemsize)[:3]


def counted_runs(lo: np.ndarray, hi: np.ndarray, off: np.ndarray, shape: np.ndarray, itemsize: int,
                 most: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`runs`, and each piece's count of runs; with ``most``, the runs of pieces of at most
    that many runs only (a piece of many rows is copied faster as one strided numpy copy)."""
    m, ndim = lo.shape
    size = np.prod(hi - lo, axis=1, dtype=_I64) * itemsize
    if not ndim:
        keep = np.flatnonzero(size > 0)
        return keep, np.zeros(len(keep), _I64), size[keep], (size > 0).astype(_I64)
    sh = hi - lo
    stride = np.ones((m, ndim), _I64) * itemsize
    if ndim > 1:  # stride[:, d]: bytes of one step along d, the product of the buffer's inner dims
        stride[:, :-1] = np.cumprod(shape[:, :0:-1], axis=1)[:, ::-1] * itemsize
    # Inner dims the piece spans whole, from the last: merged with the one before them into a run.
    whole = np.cumprod((sh == shape)[:, :0:-1], axis=1).sum(axis=1) if ndim > 1 else np.zeros(m, _I64)
    k = ndim - 1 - whole  # the dim a run goes along (earlier dims: outer indices)
    rows = np.arange(m)
    length = sh[rows, k] * stride[rows, k]
    outer = np.where(np.arange(ndim) < k[:, None], sh, 1)
    counts = all_counts = np.where(size > 0, np.prod(outer, axis=1, dtype=_I64), 0)
    if most is not None:
        counts = np.where(counts <= most, counts, 0)
    piece = np.repeat(rows, counts)
    j = np.arange(len(piece), dtype=_I64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = ((lo - off) * stride).sum(axis=1)[piece]
    for d in range(ndim - 1, -1, -1):  # mixed-radix decode of each run's outer index
        radix = outer[piece, d]
        start += (j % radix) * stride[piece, d]
        j //= radix
    return piece, start, length[piece], all_counts


def box_view(buf: np.ndarray, shape: tuple[int, ...], itemsize: int, lo: tuple[int, ...], hi: tuple[int, ...]
             ) -> np.ndarray:
    """Box ``[lo, hi)`` (coordinates in the buffer) of flat uint8 ``buf`` holding a C-order array of
    ``shape``, as a uint8 view with a last axis of the element's bytes (any dtype alike)."""
    return buf[: int(np.prod(shape, dtype=_I64)) * itemsize].reshape(*shape, itemsize)[
        tuple(slice(a, b) for a, b in zip(lo, hi))]


def flat(a: np.ndarray | memoryview | bytearray) -> np.ndarray:
    """A C-contiguous buffer as a flat uint8 array over the same memory."""
    arr = np.asarray(a) if not isinstance(a, np.ndarray) else a
    return arr.reshape(-1).view(np.uint8) if arr.dtype != np.uint8 or arr.ndim != 1 else arr


def copy_runs(src: np.ndarray, at: np.ndarray, dst: np.ndarray, to: np.ndarray, length: np.ndarray) -> None:
    """``dst[to[i] : to[i] + length[i]] = src[at[i] : at[i] + length[i]]`` for every run ``i``
    (``src`` and ``dst``: flat uint8 arrays, distinct memory; runs never overlap in ``dst``).

    No temporary holds the bytes moved: :data:`_LONG` or more runs in a row of one length and
    one step at each end (a strided piece's rows) move as one strided 2-D copy; the rest with one
    gather per distinct length, in chunks of at most :data:`_CHUNK` bytes; runs of ``_CHUNK``
    bytes or more as slice copies."""
    left = np.ones(len(length), bool)
    for a, b in _strided(length, at, to):
        k, n = b - a, int(length[a])
        step_at, step_to = (int(at[a + 1] - at[a]), int(to[a + 1] - to[a])) if k > 1 else (n, n)
        view = np.lib.stride_tricks.as_strided
        view(dst[int(to[a]):], (k, n), (step_to, 1), writeable=True)[...] = \
            view(src[int(at[a]):], (k, n), (step_at, 1), writeable=False)
        left[a:b] = False
    rest = np.flatnonzero(left)
    order = rest[np.argsort(length[rest], kind="stable")]
    lengths, firsts = np.unique(length[order], return_index=True)
    bounds = np.append(firsts, len(order))
    for n, a, b in zip(lengths.tolist(), bounds[:-1].tolist(), bounds[1:].tolist()):
        sel = order[a:b]
        if n >= _CHUNK:
            for s, t in zip(at[sel].tolist(), to[sel].tolist()):
                dst[t : t + n] = src[s : s + n]
        elif n:
            per = max(1, _CHUNK // n)
            for c in range(0, len(sel), per):
                part = sel[c : c + per]
                _windows(dst, n, True)[to[part]] = _windows(src, n, False)[at[part]]


def _windows(buf: np.ndarray, n: int, writeable: bool) -> np.ndarray:
    """Every ``n`` bytes of flat ``buf`` from each offset on, as rows of a 2-D view (no copy)."""
    return np.lib.stride_tricks.as_strided(buf, (len(buf) - n + 1, n), (1, 1), writeable=writeable)


def _strided(length: np.ndarray, at: np.ndarray, to: np.ndarray) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` in a row, at least :data:`_LONG` of them and :data:`_CHUNK` bytes, of one non-zero length, each
    ``at`` and each ``to`` one step (not negative; in ``to`` at least the length) after the one
    before. Two such rows may share their edge run (copied twice: the same bytes)."""
    if len(length) < _LONG:
        return []
    d_at, d_to = np.diff(at), np.diff(to)
    same = length[1:] == length[:-1]
    cut = np.ones(len(d_at), bool)  # gap g: between runs g and g + 1; a row of gaps of one kind
    cut[1:] = (d_at[1:] != d_at[:-1]) | (d_to[1:] != d_to[:-1]) | ~same[1:] | ~same[:-1]
    starts = np.flatnonzero(cut)
    ends = np.append(starts[1:], len(d_at))  # gaps [s, e) join runs [s, e + 1)
    n = length[starts]
    count = ends - starts + 1
    keep = same[starts] & (n > 0) & (d_at[starts] >= 0) & (d_to[starts] >= n) & (count >= _LONG) \
        & (count * n >= _CHUNK)  # smaller rows: through the gathers (a Python step per row costs more)
    return list(zip(starts[keep].tolist(), (ends[keep] + 1).tolist()))


def groups(lengths: np.ndarray, small: int, group: int, first: np.ndarray | None = None) -> np.ndarray:
    """Where the buffers of messages of pieces ``lengths`` start (piece indices, ascending, the
    first 0): each piece of ``small`` bytes or more alone; consecutive smaller ones together, cut
    where the bytes before them in their message cross a multiple of ``group`` (a million tiny
    pieces must not be a million sends). ``first``: the pieces that start a message (default:
    the first only); a buffer never spans two messages. A rule both ends of a message compute
    alike from the lengths."""
    n = len(lengths)
    if not n:
        return np.zeros(0, _I64)
    lengths = np.asarray(lengths, _I64)
    if first is None:
        first = np.zeros(n, bool)
    first = first.copy()
    first[0] = True
    is_small = lengths < small
    before = np.cumsum(lengths) - lengths
    before -= before[first][np.cumsum(first) - 1]  # bytes before each piece in its own message
    cut = first | ~is_small
    cut[1:] |= ~is_small[:-1] | (before[1:] // group != before[:-1] // group)
    return np.flatnonzero(cut)
