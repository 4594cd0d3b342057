"""A restore exchange's messages, packed: pieces as runs of one flat read buffer per round.

The sending side of :mod:`ckptio.restoring.boxexchange`. Per round a host reads
the bands of the stored shards its pieces come from into one flat buffer (or,
for a box it restores itself as one run of its target, into that target),
then cuts each destination's message into buffers by :func:`buffer_lengths` -- the
rule both ends compute from the pieces' lengths -- and fills them: a piece
alone in its buffer and contiguous where it was read is sent as a view, the
rest are packed into one flat send buffer as runs
(:func:`ckptio.restoring.runs.copy_runs`: a gather per run length, not a Python
step per piece). The flat buffers are fresh pages (:func:`ckptio.system.fresh_pages`),
given back to the system when a round drops them, not kept by the allocator for the next
round. The receiving side is :mod:`ckptio.restoring.landing`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptio.restoring.runs import box_view, copy_runs, counted_runs, groups
from ckptio.system import fresh_pages, populate, unique

__all__ = ["GROUP", "SMALL", "buffer_lengths", "pack", "read_buffers"]

#: Pieces under SMALL bytes go in one buffer per run of about GROUP bytes (sends, not copies, cost).
SMALL, GROUP = 64 << 10, 4 << 20
#: A piece of more runs than this (rows of a column block) is copied as one strided numpy copy;
#: fewer (a million tiny pieces) as runs, vectorised over all of them.
MANY = 16


def buffer_lengths(peer: np.ndarray, nbytes: np.ndarray) -> dict[int, list[int]]:
    """Per peer, the lengths of the buffers its message is cut into (see
    :func:`ckptio.restoring.runs.groups`): pieces of ``nbytes`` listed in message order, each to
    or from host ``peer``. All messages at once: a numpy call per peer costs more than the
    copies at thousands of hosts."""
    order = np.argsort(peer, kind="stable")
    hosts, sizes = peer[order], np.asarray(nbytes, np.int64)[order]
    if not len(hosts):
        return {}
    new = np.ones(len(hosts), bool)
    new[1:] = hosts[1:] != hosts[:-1]
    cuts = groups(sizes, SMALL, GROUP, new)
    lengths = np.add.reduceat(sizes, cuts).tolist()
    owner = hosts[cuts]
    firsts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    bounds = [*firsts.tolist(), len(cuts)]
    return {h: lengths[a:b] for h, a, b in zip(owner[firsts].tolist(), bounds[:-1], bounds[1:])}


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
    index into ``sources`` (flat uint8), itemsize), pieces in order, cut by :func:`buffer_lengths`."""
    if not cols:
        return {}
    dst = np.concatenate([c[0] for c in cols])
    nbytes = np.concatenate([np.prod(c[2] - c[1], axis=1, dtype=np.int64) * c[6] for c in cols])
    src = np.concatenate([c[5] for c in cols])
    piece_l, start_l, length_l, counts_l, count = [], [], [], [], 0
    for d, lo, hi, slo, shi, _s, isz in cols:
        pc, st, ln, cn = counted_runs(lo, hi, slo, shi - slo, isz, max(MANY, 1))
        piece_l += [pc + count]
        start_l += [st]
        length_l += [ln]
        counts_l += [cn]
        count += len(d)
    piece, start, length = np.concatenate(piece_l), np.concatenate(start_l), np.concatenate(length_l)
    counts = np.concatenate(counts_l)
    first = np.searchsorted(piece, np.arange(len(dst)))
    order = np.argsort(dst, kind="stable")  # per destination, its pieces in message order
    cuts, ends, alone = message_buffers(dst[order], nbytes[order], counts == 1, order)
    packed = np.zeros(len(dst), bool)
    packed[order] = np.repeat(~alone, ends - cuts)
    # Packed pieces back to back in the send buffer, in the order the buffers go out.
    seq = order[packed[order]]
    pos = np.zeros(len(dst), np.int64)
    pos[seq] = np.cumsum(nbytes[seq]) - nbytes[seq]
    send = fresh_pages(int(nbytes[packed].sum()))
    populate([memoryview(send)])  # every byte of it is written: faulted in at once, not per page
    within = np.cumsum(length) - length
    within -= within[first[piece]] if len(piece) else 0
    mine = packed[piece]
    for s in unique(src[piece[mine]]).tolist():
        sel = mine & (src[piece] == s)
        copy_runs(sources[s], start[sel], send, pos[piece[sel]] + within[sel], length[sel])
    _copy_many(cols, sources, send, pos, packed & (counts > max(MANY, 1)))
    out: dict[int, list[memoryview]] = {}
    at = 0
    sizes = np.add.reduceat(nbytes[order], cuts).tolist() if len(cuts) else []
    for d, p, one, size in zip(dst[order[cuts]].tolist(), order[cuts].tolist(), alone.tolist(), sizes):
        if one:
            r = int(first[p])
            buf = memoryview(sources[src[p]][start[r] : start[r] + length[r]])
        else:
            buf, at = memoryview(send[at : at + size]), at + size
        out.setdefault(d, []).append(buf)
    return out


def _copy_many(cols: list[tuple[Any, ...]], sources: list[np.ndarray], send: np.ndarray, pos: np.ndarray,
               many: np.ndarray) -> None:
    """Pieces ``many`` (of more than :data:`MANY` runs) into ``send`` at ``pos``: one strided
    numpy copy each."""
    count = 0
    for d, lo, hi, slo, shi, s, isz in cols:
        idx = np.flatnonzero(many[count : count + len(d)])
        boxes: dict[int, np.ndarray] = {}  # each source buffer as an array of its box's shape
        for i, a, b, src, at in zip(s[idx].tolist(), (lo[idx] - slo[idx]).tolist(), (hi[idx] - slo[idx]).tolist(),
                                    (shi[idx] - slo[idx]).tolist(), pos[count + idx].tolist()):
            whole = boxes.get(i)
            if whole is None:
                whole = boxes[i] = box_view(sources[i], tuple(src), isz, (0,) * len(src), tuple(src))
            part = whole[tuple(slice(x, y) for x, y in zip(a, b))]
            send[at : at + part.size].reshape(part.shape)[...] = part
        count += len(d)


def message_buffers(peer: np.ndarray, nbytes: np.ndarray, one_run: np.ndarray, order: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers of every message, pieces listed per peer (``peer``, sorted; ``nbytes``; the
    pieces in their original numbering ``order``, which ``one_run`` is indexed by): each buffer's
    first and end piece (positions in the sorted list), and whether it is one piece alone that is
    one run (sent or received in place) rather than packed."""
    new = np.ones(len(peer), bool)
    new[1:] = peer[1:] != peer[:-1]
    cuts = groups(nbytes, SMALL, GROUP, new) if len(peer) else np.zeros(0, np.int64)
    ends = np.append(cuts[1:], len(peer)).astype(np.int64)
    alone = (ends - cuts == 1) & one_run[order[cuts]] if len(cuts) else np.zeros(0, bool)
    return cuts, ends, alone
