"""Pieces as runs of bytes (ckptio.restoring.runs) against numpy slicing: every box of every buffer,
packed and unpacked through runs, gives exactly the bytes of the slice, in C order."""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.restoring import runs as R
from ckptio.restoring.runs import copy_runs, flat, groups, runs

PROFILE = settings(max_examples=80, derandomize=True, deadline=None)


@st.composite
def boxes(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    """A few C-order buffers (each a box of an array: offsets, shape) of one dtype, and pieces of
    them: ``(buffer index, lo, hi)`` in array coordinates (some empty)."""
    ndim = draw(st.integers(0, 4))
    dtype = np.dtype(draw(st.sampled_from(["u1", "i2", "f4", "c16"])))
    bufs = []
    for _ in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        off = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
        bufs.append((off, shape))
    pieces = []
    for _ in range(draw(st.integers(0, 6))):
        b = draw(st.integers(0, len(bufs) - 1))
        off, shape = bufs[b]
        lo = [draw(st.integers(0, n)) for n in shape]
        hi = [draw(st.integers(a, n)) for a, n in zip(lo, shape)]
        pieces.append((b, tuple(o + a for o, a in zip(off, lo)), tuple(o + a for o, a in zip(off, hi))))
    return np.dtype(dtype), bufs, pieces  # type: ignore[return-value]


def _columns(bufs: list, pieces: list, ndim: int) -> tuple[np.ndarray, ...]:
    lo = np.array([p[1] for p in pieces], np.int64).reshape(len(pieces), ndim)
    hi = np.array([p[2] for p in pieces], np.int64).reshape(len(pieces), ndim)
    off = np.array([bufs[p[0]][0] for p in pieces], np.int64).reshape(len(pieces), ndim)
    shape = np.array([bufs[p[0]][1] for p in pieces], np.int64).reshape(len(pieces), ndim)
    return lo, hi, off, shape


@PROFILE
@given(boxes(), st.integers(0, 2**32 - 1))
def test_runs_pack_and_unpack_exactly_the_slices(case: tuple, seed: int) -> None:
    dtype, bufs, pieces = case
    ndim = len(bufs[0][1])
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, int(np.prod(s, dtype=np.int64)) * dtype.itemsize, np.uint8).view(dtype).reshape(s)
              for _o, s in bufs]
    lo, hi, off, shape = _columns(bufs, pieces, ndim)
    piece, start, length = runs(lo, hi, off, shape, dtype.itemsize)
    assert (length > 0).all() and (np.diff(piece) >= 0).all()
    # Pack: each piece's runs back to back, pieces in order: the C-order bytes of each slice.
    want = b"".join(np.ascontiguousarray(arrays[b][tuple(slice(a - o, z - o) for a, z, o in zip(lo_, hi_, bufs[b][0]))])
                    .tobytes() for b, lo_, hi_ in pieces)
    out = np.zeros(len(want), np.uint8)
    to = np.cumsum(length) - length
    for b in range(len(bufs)):
        mine = np.array([pieces[i][0] == b for i in piece.tolist()], bool)
        copy_runs(flat(arrays[b]), start[mine], out, to[mine], length[mine])
    assert out.tobytes() == want
    # Unpack into zeroed buffers: every slice back where it was, nothing else written.
    back = [np.zeros_like(a) for a in arrays]
    for b in range(len(bufs)):
        mine = np.array([pieces[i][0] == b for i in piece.tolist()], bool)
        copy_runs(out, to[mine], flat(back[b]), start[mine], length[mine])
    for b, lo_, hi_ in pieces:
        box = tuple(slice(a - o, z - o) for a, z, o in zip(lo_, hi_, bufs[b][0]))
        assert back[b][box].tobytes() == arrays[b][box].tobytes()
    touched = sum(int(np.count_nonzero(flat(x))) for x in back)
    assert touched <= len(want)  # no byte outside the pieces written


def test_a_piece_spanning_the_inner_dims_is_one_run_and_a_column_block_one_per_row() -> None:
    off, shape = np.zeros((2, 3), np.int64), np.array([[8, 4, 5]] * 2, np.int64)
    lo = np.array([[2, 0, 0], [0, 1, 2]], np.int64)
    hi = np.array([[5, 4, 5], [8, 3, 4]], np.int64)
    piece, start, length = runs(lo, hi, off, shape, 4)
    assert piece.tolist() == [0] + [1] * 16
    assert (start[0], length[0]) == (2 * 20 * 4, 3 * 20 * 4)
    assert (length[1:] == 8).all() and start[1] == (5 + 2) * 4


def test_large_runs_and_chunks_copy_alike(monkeypatch) -> None:
    monkeypatch.setattr(R, "_CHUNK", 16)  # runs of 16 bytes or more: slice copies; more runs than a chunk
    src = np.arange(4096, dtype=np.uint8)
    at = np.array([0, 100, 200, 300, 1000, 2000], np.int64)
    length = np.array([3, 3, 3, 40, 3, 17], np.int64)
    to = np.cumsum(length) - length
    dst = np.zeros(int(length.sum()), np.uint8)
    copy_runs(src, at, dst, to, length)
    assert dst.tobytes() == b"".join(src[a : a + n].tobytes() for a, n in zip(at.tolist(), length.tolist()))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=40), st.integers(1, 50), st.integers(1, 200))
def test_groups_keep_large_pieces_alone_and_bound_small_runs(lengths: list[int], small: int, group: int) -> None:
    starts = groups(np.array(lengths, np.int64), small, group).tolist()
    assert starts == ([0] if lengths else []) + starts[1:] and starts == sorted(set(starts))
    for i, j in zip(starts, [*starts[1:], len(lengths)]):
        part = lengths[i:j]
        if len(part) > 1:
            assert all(n < small for n in part)
            assert sum(part[:-1]) < group  # a buffer of small pieces ends once past a multiple of group
        for k in range(i, j):
            if lengths[k] >= small:
                assert j - i == 1


def test_copying_runs_holds_no_copy_of_the_bytes_moved() -> None:
    """A column block's rows (one step apart) and scattered runs move through at most a chunk of
    temporary memory, whatever the buffers' sizes (numpy reports its allocations to tracemalloc)."""
    src = np.arange(16 << 20, dtype=np.int64).astype(np.uint8)  # 16 MiB
    rng = np.random.default_rng(0)
    for at in (np.arange(512, dtype=np.int64) * 32768,  # rows of a column block
               np.sort(rng.choice(8192, 512, replace=False)).astype(np.int64) * 2048):  # scattered
        length = np.full(512, 2048, np.int64)
        to = np.cumsum(length) - length
        dst = np.zeros(int(length.sum()), np.uint8)
        tracemalloc.start()
        try:
            copy_runs(src, at, dst, to, length)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= R._CHUNK + (64 << 10), peak
        assert dst.tobytes() == b"".join(src[a : a + 2048].tobytes() for a in at.tolist())
