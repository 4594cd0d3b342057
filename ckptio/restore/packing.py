"""A restore exchange's messages, packed: pieces as runs of one flat read buffer per round.

The sending side of :mod:`ckptio.restore.boxexchange`. Per round a host reads
the bands of the stored shards its pieces come from into one flat buffer (or,
for a box it restores itself as one run of its target, into that target),
then cuts each destination's message into buffers by :func:`grouped` -- the
rule both ends compute from the pieces' lengths -- and fills them: a piece
alone in its buffer and contiguous where it was read is sent as a view, the
rest are packed into one flat send buffer as runs
(:func:`ckptio.restore.runs.copy_runs`: a gather per run length, not a Python
step per piece). The flat buffers are fresh pages (:func:`ckptio._system.fresh_pages`),
given back to the system when a round drops them, not kept by the allocator for the next
round. The receiving side is :mod:`ckptio.restore.landing`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._system import fresh_pages
from .runs import copy_runs, groups, runs

__all__ = ["GROUP", "SMALL", "grouped", "pack", "read_buffers"]

#: Pieces under SMALL bytes go in one buffer per run of about GROUP bytes (sends, not copies, cost).
SMALL, GROUP = 64 << 10, 4 << 20


def grouped(lengths: list[int]) -> list[int]:
    """The buffers' lengths of a message of pieces ``lengths`` (see :func:`ckptio.restore.runs.groups`)."""
    cuts = groups(np.asarray(lengths, np.int64), SMALL, GROUP)
    return np.add.reduceat(np.asarray(lengths, np.int64), cuts).tolist() if len(cuts) else []


def read_buffers(reads: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray | None]]) -> list[np.ndarray]:
    """A buffer per shard band to read: the target where it is read in place, else a slice of one
    flat buffer for the round (each slice aligned for any dtype)."""
    sizes = [0 if own is not None else int(np.prod(hi - lo, dtype=np.int64)) * item.dtype.itemsize
             for item, lo, hi, own in reads]
    at = np.cumsum([(n + 63) // 64 * 64 for n in sizes]) - [(n + 63) // 64 * 64 for n in sizes] if sizes else []
    whole = fresh_pages(int(at[-1]) + sizes[-1] if sizes else 0)
    return [own if own is not None else whole[a : a + n].view(item.dtype).reshape(tuple((hi - lo).tolist()))
            for (item, lo, hi, own), a, n in zip(reads, np.asarray(at).tolist(), sizes)]


def pack(cols: list[tuple[Any, ...]], sources: list[np.ndarray]) -> dict[int, list[memoryview]]:
    """The messages of pieces ``cols`` (per array: dst, lo, hi, its source's box lo and hi, source
    index into ``sources`` (flat uint8), itemsize), pieces in order, cut by :func:`grouped`."""
    if not cols:
        return {}
    dst = np.concatenate([c[0] for c in cols])
    nbytes = np.concatenate([np.prod(c[2] - c[1], axis=1, dtype=np.int64) * c[6] for c in cols])
    src = np.concatenate([c[5] for c in cols])
    piece_l, start_l, length_l, count = [], [], [], 0
    for d, lo, hi, slo, shi, _s, isz in cols:
        pc, st, ln = runs(lo, hi, slo, shi - slo, isz)
        piece_l.append(pc + count)
        start_l.append(st)
        length_l.append(ln)
        count += len(d)
    piece, start, length = np.concatenate(piece_l), np.concatenate(start_l), np.concatenate(length_l)
    first = np.searchsorted(piece, np.arange(len(dst)))
    one = np.bincount(piece, minlength=len(dst)) == 1
    order = np.argsort(dst, kind="stable")  # per destination, its pieces in message order
    dests, begin = np.unique(dst[order], return_index=True)
    packed = np.zeros(len(dst), bool)
    plan: dict[int, list[tuple[int, int]]] = {}  # per dst, its buffers: (piece, -1) a view, (-1, size) packed
    for d, a, b in zip(dests.tolist(), begin.tolist(), [*begin[1:].tolist(), len(order)]):
        idx = order[a:b]
        cuts = groups(nbytes[idx], SMALL, GROUP).tolist()
        plan[d] = []
        for i, j in zip(cuts, [*cuts[1:], len(idx)]):
            if j == i + 1 and one[idx[i]]:
                plan[d].append((int(idx[i]), -1))
            else:
                packed[idx[i:j]] = True
                plan[d].append((-1, int(nbytes[idx[i:j]].sum())))
    # Packed pieces back to back in the send buffer, in the order the buffers go out.
    seq = order[packed[order]]
    pos = np.zeros(len(dst), np.int64)
    pos[seq] = np.cumsum(nbytes[seq]) - nbytes[seq]
    send = fresh_pages(int(nbytes[packed].sum()))
    within = np.cumsum(length) - length
    within -= within[first[piece]] if len(piece) else 0
    mine = packed[piece]
    for s in np.unique(src[piece[mine]]).tolist():
        sel = mine & (src[piece] == s)
        copy_runs(sources[s], start[sel], send, pos[piece[sel]] + within[sel], length[sel])
    out: dict[int, list[memoryview]] = {}
    at = 0
    for d, bufs in plan.items():
        out[d] = []
        for p, size in bufs:
            if p >= 0:
                r = int(first[p])
                out[d].append(memoryview(sources[src[p]][start[r] : start[r] + length[r]]))
            else:
                out[d].append(memoryview(send[at : at + size]))
                at += size
    return out
