"""Many whole version-4 fragments taken at once: their sections' rows as one set of columns.

:func:`.sections.take_whole` takes one fragment's sections with ~40 array operations,
whatever their number; a host planning a column block of every array of a 4096-host
job makes those calls 4096 times, and their fixed cost was most of its load.
:func:`take_wholes` does the same checks on a batch of fragments laid end to end, with
the same ~40 operations for the whole batch.

It answers None where anything is not as a sound writer leaves it (a check fails, or the
fragments differ in rank): the caller then takes each fragment alone, as before, so that
the error raised, and what is accepted, are exactly those of :func:`.sections.take_whole`
and :meth:`.gather.Gather.add`. Its checks may be stricter than theirs, never weaker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ckptio.manifest.codec.columns import _ranges
from ckptio.manifest.codec.sections import _SECTION, Head

__all__ = ["Wholes", "take_wholes"]

_I64 = np.int64


@dataclasses.dataclass
class Wholes:
    """Rows of a batch of fragments: per row its item number and its fragment's position in the
    batch; ``boxes``, ``ecount``, ``extents`` (object numbers still per fragment); ``ext_pos``:
    each extent's fragment position in the batch. The checksums are not copied out yet: they
    are ``crc_src[crc_at]``, taken by :meth:`crcs_into` straight into the gathered column (a
    batch has ~1.4 M of them at 4096 x 256: one copy and one index less per batch)."""

    item: np.ndarray
    pos: np.ndarray
    boxes: np.ndarray
    ecount: np.ndarray
    extents: np.ndarray
    ext_pos: np.ndarray
    crc_src: np.ndarray
    crc_at: np.ndarray

    @property
    def n_crcs(self) -> int:
        return len(self.crc_at)

    def crcs_into(self, out: np.ndarray) -> None:
        """The checksums, in order, into ``out`` (of length :attr:`n_crcs`)."""
        # mode="clip": take buffers ``out`` under the default "raise"; every index is in bounds.
        np.take(self.crc_src, self.crc_at, out=out, mode="clip")


def take_wholes(datas: Sequence[bytes], heads: Sequence[Head], wanted: Sequence[int] | None,
                n_objects: Sequence[int]) -> Wholes | None:
    """The sections (``wanted`` None: all; else items ``wanted``) of whole fragments ``datas``,
    each already checked against the root's crc32c and its ``heads`` against the root, taken
    as one set of columns; None where any check fails (see the module docstring).
    ``n_objects``: each fragment's object count, which its extents must stay below."""
    if not datas or len({h.width for h in heads}) != 1 or len({h.items for h in heads}) != 1:
        return None
    sizes = np.fromiter(map(len, datas), _I64, len(datas))
    items, w = heads[0].items, heads[0].width
    hsize = np.fromiter((h.size for h in heads), _I64, len(heads))
    hi = hsize + 16 * items  # the index's end: the first section starts here
    if (sizes % 8).any() or (hi > sizes).any():
        return None
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    buf = b"".join(datas)
    u8 = np.frombuffer(buf, "<u8")
    words = ((base + hsize) // 8)[:, None] + 2 * np.arange(items)[None, :]  # (fragments, items)
    off_u, lc = u8[words], u8[words + 1]
    length = (lc & np.uint64(0xFFFFFFFF)).astype(_I64)
    used = length > 0
    if (used & ((off_u >= np.uint64(1 << 62)) | (off_u % np.uint64(8) != 0))).any():
        return None
    off = off_u.astype(_I64)
    if (used & ((off < hi[:, None]) | (off + length > sizes[:, None]))).any():
        return None
    if not _tiled(off, length, used, hi, sizes, base):
        return None
    if wanted is not None:
        mask = np.zeros(items, bool)
        asked = np.asarray(wanted, _I64)
        mask[asked[asked < items]] = True
        used = used & mask[None, :]
    pos, numbers = np.nonzero(used)
    return _columns(buf, base[pos] + off[pos, numbers], length[pos, numbers], pos, numbers, w,
                    np.asarray(n_objects, _I64))


def _tiled(off: np.ndarray, length: np.ndarray, used: np.ndarray, hi: np.ndarray, sizes: np.ndarray,
           base: np.ndarray) -> bool:
    """Whether each fragment's sections follow its index back to back up to its end."""
    pos, _n = np.nonzero(used)
    if not len(pos):
        return True
    start = base[pos] + off[used]
    order = np.argsort(start, kind="stable")
    pos, start, end = pos[order], start[order], start[order] + length[used][order]
    same = pos[1:] == pos[:-1]
    first = np.concatenate([[True], ~same])
    last = np.concatenate([~same, [True]])
    return bool((end[:-1][same] == start[1:][same]).all()
                and (start[first] == base[pos[first]] + hi[pos[first]]).all()
                and (end[last] == base[pos[last]] + sizes[pos[last]]).all())


def _columns(buf: bytes, goff: np.ndarray, length: np.ndarray, pos: np.ndarray, numbers: np.ndarray, w: int,
             n_objects: np.ndarray) -> Wholes | None:
    """The sections at ``goff`` (offsets into ``buf``, of index lengths ``length``), checked, as rows."""
    u4 = np.frombuffer(buf, "<u4")
    hdr = u4[(goff // 4)[:, None] + np.arange(4)].astype(_I64)  # item, rows, extents, checksums
    rows, n_ext, n_crc = hdr[:, 1], hdr[:, 2], hdr[:, 3]
    words = _SECTION.size // 8 + rows * (3 * w + 1) + n_ext * 6
    nbytes = words * 8 + n_crc * 4
    if (hdr[:, 0] != numbers).any() or (nbytes + (-nbytes % 8) != length).any():
        return None
    i8 = np.frombuffer(buf, "<i8")
    at = goff // 8 + _SECTION.size // 8
    # Rows are taken whole from windows over the words (one index per row, not one per word).
    boxes = (sliding_window_view(i8, 3 * w)[_rows_at(at, rows, 3 * w)] if w
             else np.zeros((int(rows.sum()), 0), _I64))
    ecount = i8[_ranges(at + rows * 3 * w, rows)]
    ext = sliding_window_view(i8, 6)[_rows_at(at + rows * (3 * w + 1), n_ext, 6)]
    # int32 indices where the buffer allows: half the memory traffic of int64 at a million.
    crc_at = _ranges((goff + words * 8) // 4, n_crc, np.int32 if len(u4) < 1 << 31 else _I64)
    # Each section's counts add up (stricter than per fragment, as take_whole checks them).
    if (len(ecount) and ecount.min() < 0) or (len(ext) and ext[:, 4].min() < 0):
        return None
    if (_sums(ecount, rows) != n_ext).any() or (_sums(ext[:, 4], n_ext) != n_crc).any():
        return None
    ext_pos = np.repeat(pos, n_ext)
    if len(ext) and ((ext[:, 0] < 0) | (ext[:, 0] >= n_objects[ext_pos])).any():
        return None
    return Wholes(np.repeat(numbers, rows), np.repeat(pos, rows), boxes, ecount, ext, ext_pos, u4, crc_at)


def _rows_at(starts: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
    """The first words of ``counts[i]`` rows of ``step`` words from word ``starts[i]``, for every ``i``."""
    return np.repeat(starts - step * (np.cumsum(counts) - counts), counts) + step * np.arange(int(counts.sum()))


def _sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The sums of ``values`` in consecutive runs of ``counts`` (empty runs sum to 0)."""
    cs = np.concatenate([[0], np.cumsum(values)])
    ends = np.cumsum(counts)
    return cs[ends] - cs[ends - counts]
