"""Where the pieces of a restore exchange land: straight in the target buffers where they can.

A receiver of :mod:`ckptio.restore.boxexchange` knows, before anything is
sent, every piece each host sends it (array, box, in the canonical order) and
how the sender cuts its message into buffers (each piece of ``_SMALL`` bytes
or more alone, runs of smaller ones joined). So it can name, per buffer, where
the bytes go: a piece that is one contiguous run of its target buffer is
received right there (a replicated array, a band of rows); only runs of small
pieces and pieces strided in their target (a column block) go through a
staging buffer and are copied in after. A receiver then holds at most the
strided part of one round beside its targets, never a whole message.

Used with a coordinator's ``exchange_into`` (see
:class:`ckptio.distributed.ExchangeCoordinator`); the status byte and the seal
of each message land in small buffers of their own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..reshard import Region

__all__ = ["Landing", "Piece", "dest_run"]

#: One received piece: its target regions (a box held twice has two), its box, its bytes.
Piece = tuple[list[Region], tuple[int, ...], tuple[int, ...], int]


def dest_run(region: Region, lo: tuple[int, ...], hi: tuple[int, ...]) -> np.ndarray | None:
    """The bytes of box ``[lo, hi)`` in ``region``'s buffer as one flat uint8 view, if they are one
    contiguous run of it; else None."""
    view = region.dest[(*(slice(a - o, b - o) for a, b, o in zip(lo, hi, region.offsets)), ...)]
    return view.reshape(-1).view(np.uint8) if view.flags.c_contiguous else None


@dataclasses.dataclass
class _Staged:
    """A buffer received in staging, and the pieces it holds (copied to their targets after)."""

    buf: bytearray
    pieces: list[tuple[Piece, np.dtype]]


class Landing:
    """The buffers one round's messages are received into (``into``: per source, the status byte,
    then one buffer per buffer the sender sends, then the seal), and what :meth:`finish` copies
    to the targets once they are in and checked."""

    def __init__(self, pieces: dict[int, list[tuple[Piece, np.dtype]]], groups: dict[int, list[tuple[int, int]]],
                 seal: int) -> None:
        """``pieces``: per source, its pieces in message order with their dtypes; ``groups``: per
        source, the pieces ``[i, j)`` of each buffer it sends (as the sender cuts them)."""
        self.into: dict[int, list[memoryview]] = {}
        self._staged: list[_Staged] = []
        self._twice: list[tuple[Piece, np.ndarray]] = []  # received in place in a box held twice
        self.nbytes = 0
        for src, mine in pieces.items():
            views = [memoryview(bytearray(1))]
            for i, j in groups[src]:
                views.append(self._buffer(mine[i:j]))
            views.append(memoryview(bytearray(seal)))
            self.into[src] = views

    def _buffer(self, run: list[tuple[Piece, np.dtype]]) -> memoryview:
        size = sum(p[3] for p, _ in run)
        self.nbytes += size
        if len(run) == 1:
            (regions, lo, hi, _n), _dtype = run[0]
            direct = dest_run(regions[0], lo, hi)
            if direct is not None:
                if len(regions) > 1:
                    self._twice.append((run[0][0], direct))
                return memoryview(direct)
        staged = _Staged(bytearray(size), run)
        self._staged.append(staged)
        return memoryview(staged.buf)

    def statuses(self) -> dict[int, int]:
        """Per source, the status byte it sent (non-zero: it failed and sent zeros)."""
        return {src: views[0][0] for src, views in self.into.items()}

    def finish(self) -> None:
        """Copy the staged pieces into their targets, and the pieces received in place into the
        other regions of a box held twice."""
        for staged in self._staged:
            pos = 0
            for (regions, lo, hi, n), dtype in staged.pieces:
                shape = [b - a for a, b in zip(lo, hi)]
                data = np.frombuffer(staged.buf, dtype, n // dtype.itemsize if dtype.itemsize else 0, pos)
                for region in regions:
                    region.dest[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, region.offsets))] = \
                        data.reshape(shape)
                pos += n
        for (regions, lo, hi, _n), direct in self._twice:
            for region in regions[1:]:
                run = dest_run(region, lo, hi)
                if run is not None:
                    run[:] = direct
                else:
                    box = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, region.offsets))
                    region.dest[box] = direct.view(region.dest.dtype).reshape([b - a for a, b in zip(lo, hi)])
        self._staged.clear()
        self._twice.clear()
