"""Where the pieces of a restore exchange land: straight in the target buffers where they can.

A receiver of :mod:`ckptio.restoring.boxexchange` knows, before anything is
sent, every piece each host sends it (array, box, in the canonical order) and
how the sender cuts its message into buffers (:func:`ckptio.restoring.runs.groups`:
each piece of ``_SMALL`` bytes or more alone, runs of smaller ones joined). So
it can name, per buffer, where the bytes go: a piece alone in its buffer that
is one contiguous run of its target buffer is received right there (a
replicated array, a band of rows); every other buffer (runs of small pieces,
pieces strided in their target: a column block) lands in one flat staging
buffer for the round and is copied in after, as runs
(:func:`ckptio.restoring.runs.copy_runs`: one gather per run length and target,
not a Python step per piece). A receiver then holds at most the strided part
of one round beside its targets, never a whole message.

Used with a coordinator's ``exchange_into`` (see
:class:`ckptio.coord.distributed.ExchangeCoordinator`); the status byte and the seal
of each message land in small buffers of their own.
"""

from __future__ import annotations

import numpy as np

from ckptio.restoring import packing
from ckptio.restoring.packing import message_buffers
from ckptio.restoring.reshard import Region
from ckptio.restoring.runs import box_view, copy_runs, counted_runs, flat
from ckptio.system import fresh_pages, populate, unique

__all__ = ["Landing", "dest_run"]

_I64 = np.int64


def dest_run(region: Region, lo: tuple[int, ...], hi: tuple[int, ...]) -> np.ndarray | None:
    """The bytes of box ``[lo, hi)`` in ``region``'s buffer as one flat uint8 view, if they are one
    contiguous run of it; else None."""
    view = region.dest[(*(slice(a - o, b - o) for a, b, o in zip(lo, hi, region.offsets)), ...)]
    return view.reshape(-1).view(np.uint8) if view.flags.c_contiguous else None


class Landing:
    """The buffers one round's messages are received into (``into``: per source, the status byte,
    then one buffer per buffer the sender sends, then the seal), and what :meth:`finish` copies
    to the targets once they are in and checked. Pieces are added per array (:meth:`add`, in
    message order), then :meth:`build` cuts the buffers."""

    def __init__(self, seal: int) -> None:
        self.into: dict[int, list[memoryview]] = {}
        self.nbytes = 0
        self._seal = seal
        self._cols: list[tuple[np.ndarray, ...]] = []  # per add: src, nbytes, target id
        self._runs: list[tuple[np.ndarray, ...]] = []  # per add: piece (global), start, length
        self._count = 0
        self._boxes: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []  # per add: its pieces' boxes
        self._targets: list[list[Region]] = []
        self._stage = np.zeros(0, np.uint8)
        self._staged: np.ndarray = np.zeros(0, bool)
        self._at = np.zeros(0, _I64)

    def add(self, src: np.ndarray, lo: np.ndarray, hi: np.ndarray, off: np.ndarray, shape: np.ndarray,
            target: np.ndarray, itemsize: int) -> None:
        """Pieces ``[lo, hi)`` of one array from hosts ``src``, each into target box ``(off,
        shape)`` (its row), whose regions are ``target`` (an index into :meth:`build`'s list)."""
        piece, start, length, counts = counted_runs(lo, hi, off, shape, itemsize, max(packing.MANY, 1))
        self._cols.append((np.asarray(src, _I64), np.prod(hi - lo, axis=1, dtype=_I64) * itemsize,
                           np.asarray(target, _I64), counts))
        self._runs.append((piece + self._count, start, length))
        self._boxes.append((self._count, lo - off, hi - off, shape, itemsize))
        self._count += len(src)

    def build(self, targets: list[list[Region]]) -> None:
        """Cut each source's message into the buffers it is received in (``targets``: the
        regions of each target id; a box held twice has two)."""
        self._targets = targets
        cat = [np.concatenate(c) if c else np.zeros(0, _I64) for c in zip(*self._cols)] or [np.zeros(0, _I64)] * 4
        src, nbytes, tid, counts = cat
        piece, start, length = [np.concatenate(c) if c else np.zeros(0, _I64) for c in zip(*self._runs)] \
            or [np.zeros(0, _I64)] * 3
        self._runs_all = (piece, start, length)
        self.nbytes = int(nbytes.sum())
        first = np.searchsorted(piece, np.arange(len(src)))  # each piece's first run
        order = np.argsort(src, kind="stable")  # per source, its pieces in message order
        cuts, ends, alone = message_buffers(src[order], nbytes[order], counts == 1, order)
        staged = np.zeros(len(src), bool)
        staged[order] = np.repeat(~alone, ends - cuts)
        seq = order[staged[order]]  # staged pieces back to back in the staging buffer, in message order
        at = np.zeros(len(src), _I64)
        at[seq] = np.cumsum(nbytes[seq]) - nbytes[seq]
        self._stage = fresh_pages(int(nbytes[staged].sum()))
        populate([memoryview(self._stage)])  # the receive writes it all: faulted in at once, not per page
        sizes = np.add.reduceat(nbytes[order], cuts).tolist() if len(cuts) else []
        pos = 0
        for s, p, one, size in zip(src[order[cuts]].tolist(), order[cuts].tolist(), alone.tolist(), sizes):
            views = self.into.get(s)
            if views is None:
                views = self.into[s] = [memoryview(bytearray(1))]
            if one:  # alone and one run of its target: received right there
                r = int(first[p])
                views.append(memoryview(flat(targets[tid[p]][0].dest)[start[r] : start[r] + length[r]]))
            else:
                views.append(memoryview(self._stage[pos : pos + size]))
                pos += size
        for views in self.into.values():
            views.append(memoryview(bytearray(self._seal)))
        self._staged, self._at, self._tid, self._many = staged, at, tid, staged & (counts > max(packing.MANY, 1))

    def statuses(self) -> dict[int, int]:
        """Per source, the status byte it sent (non-zero: it failed and sent zeros)."""
        return {src: views[0][0] for src, views in self.into.items()}

    def finish(self) -> None:
        """Copy the staged pieces into their targets, and the pieces received in place into the
        other regions of a box held twice."""
        piece, start, length = self._runs_all
        within = np.cumsum(length) - length
        if len(piece):
            within -= within[np.searchsorted(piece, piece)]  # bytes of the piece before each run
        tid = self._tid[piece]
        for t in unique(tid).tolist():
            regions = self._targets[t]
            mine = tid == t
            staged = mine & self._staged[piece]
            if staged.any():
                for region in regions:
                    copy_runs(self._stage, self._at[piece[staged]] + within[staged], flat(region.dest),
                              start[staged], length[staged])
            direct = mine & ~self._staged[piece]
            if direct.any():
                for region in regions[1:]:  # a box held twice: from the region it landed in
                    copy_runs(flat(regions[0].dest), start[direct], flat(region.dest), start[direct],
                              length[direct])
        self._copy_many()
        self._stage = np.zeros(0, np.uint8)

    def _copy_many(self) -> None:
        """The staged pieces of more than :data:`~ckptio.restoring.packing.MANY` runs: one strided
        numpy copy each, into each region of its box."""
        for count, lo, hi, shape, isz in self._boxes:
            idx = np.flatnonzero(self._many[count : count + len(lo)])
            for i, a, b, box, at in zip(idx.tolist(), lo[idx].tolist(), hi[idx].tolist(), shape[idx].tolist(),
                                        self._at[count + idx].tolist()):
                part = self._stage[at : at + int(np.prod(np.subtract(b, a))) * isz]
                for region in self._targets[self._tid[count + i]]:
                    box_view(flat(region.dest), tuple(box), isz, tuple(a), tuple(b))[...] = \
                        part.reshape(*np.subtract(b, a).tolist(), isz)
