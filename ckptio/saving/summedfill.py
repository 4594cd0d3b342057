"""The staging copy with its block checksums: each block checksummed as it is copied.

A save copies the caller's arrays into its staging buffers (the stall), then checksums and
writes them. Checksummed in a later pass, every staged byte is read from memory once more,
while the copies of the next arrays and the device's reads compete for the same bus: on this
2-core VM the copy cost 1.4x and crc32c 1.5x their lone cost inside a save (issue 35). So the
copy checksums each chunk right after copying it (:func:`ckptio.system.checksum.copy_summed`), and the
extents that cover the array take those checksums (``PlannedExtent.sums``), which the engine --
in this process or the writer process -- then uses instead of a pass of its own.

Only where the blocks line up: an extent whose bytes start on a block boundary of its array
and end on one (or at the array's end), of a plain C-order copy (not a pack, a tile or a strided
source: those keep the engine's checksums, as before).

Only where no core is spare (:func:`wanted`): the checksums then run inside the copy, which is
the step's stall -- a 1 GiB save's stall rose from 93-98 to 96-114 ms here while its CPU fell
from 240-245 to 200-230 ms. Where the copy leaves cores idle, a later pass costs the step
nothing and the stall stays the copy alone; where it takes every core the step may use (this
2-core VM; a training thread pinned to its core), that pass would take them from the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ckptio.engine.layout import ObjectPlan, PlannedExtent
from ckptio.saving import fillers
from ckptio.saving.staging import StagingArea
from ckptio.system import address
from ckptio.system.checksum import copy_summed

__all__ = ["SummedFill", "staging_fill", "wanted"]


def wanted(threads: int) -> bool:
    """True if a staging copy on ``threads`` threads (the caller's included) should checksum as it
    copies: it already runs on every core the calling thread may use."""
    return threads >= fillers.usable_cores()


def staging_fill(area: StagingArea, plans: Sequence[ObjectPlan], arrays: dict[object, np.ndarray],
                 block_size: int, threads: int) -> Callable[[np.ndarray], None]:
    """The ``fill`` a save's staging copy on ``threads`` threads runs: a :class:`SummedFill` where
    :func:`wanted`, else ``area``'s plain copy."""
    return SummedFill(area, plans, arrays, block_size) if wanted(threads) else area.fill


class SummedFill:
    """A ``fill`` for :func:`ckptio.saving.fillers.fill_objects`: runs ``area``'s pending copy into a staged
    array, checksumming as it copies, and gives each extent of ``plans`` over that array its sums.

    An extent's sums are set before its object is released for writing (``fill_objects`` resolves
    an object's future only after all its arrays are filled), so the write sees them.
    """

    def __init__(self, area: StagingArea, plans: Sequence[ObjectPlan], arrays: dict[object, np.ndarray],
                 block_size: int) -> None:
        self._area = area
        self._block_size = block_size
        self._extents: dict[int, list[PlannedExtent]] = {}
        for plan in plans:
            for e in plan.extents:
                arr = arrays.get((e.item, e.shard))
                plain = e.data is not None and e.cuts is None and e.fill is None and e.sums is None
                if arr is not None and plain:
                    self._extents.setdefault(id(arr), []).append(e)

    def __call__(self, out: np.ndarray) -> None:
        job = self._area.take(out)
        if job is None:
            return
        dest, src = job
        extents = self._extents.get(id(out))
        if not extents or isinstance(src, list):
            self._area.run(job)
            return
        src, device = self._area.to_host(src)
        if not _plain_copy(dest, src):
            self._area.run((dest, src))
            self._area.done_with(device)
            return
        block = extents[0].block or self._block_size
        staged = memoryview(dest.reshape(-1).view(np.uint8))
        sums = copy_summed(staged, memoryview(src.reshape(-1).view(np.uint8)), block)
        base, total = address(staged), dest.nbytes
        for e in extents:
            assert e.data is not None
            start = address(e.data) - base
            end = start + e.length
            lined_up = start % block == 0 and (end % block == 0 or end == total)
            if (e.block or self._block_size) == block and lined_up:
                e.sums = sums[start // block : -(-end // block)]
        self._area.done_with(device)


def _plain_copy(dest: np.ndarray, src: np.ndarray) -> bool:
    """True if copying ``src`` into ``dest`` is copying its bytes in order."""
    return (dest.dtype == src.dtype and dest.shape == src.shape and dest.flags.c_contiguous
            and src.flags.c_contiguous and dest.nbytes > 0)
