"""Checksums of a staged state dict, computed while it is being staged.

``dcp.async_save`` returns to the trainer once :meth:`ckptio.dcp.Writer.stage` has
copied the state; the rest of the save runs beside the training step, in the same
process. There each block's checksum is a call that releases the GIL and must then
win it back from the step. Measured with the step alone on one core and the save on
the other (issue 35; 1 GiB as 32 tensors, dcp.async_save with ckptio's Writer): the
save cost the step 97-119 ms with the checksums in the background and 36-52 ms
without them (step 1.028-1.034x against 1.014-1.018x). So the Writer checksums each
staged tensor on a helper thread while the trainer's thread copies the next one --
the stall grows by about the last tensor's checksum -- and its write reuses them.

A :class:`StagedSums` answers only for the exact bytes of the tensors it staged, in
the checksum blocks their extents will have, and holds those tensors: their pooled
buffers cannot go back to the pool, and be refilled by another save, while it lives.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptio.dcp._tensorbytes import plain_array
from ckptio.engine.layout import extent_block
from ckptio.system.bytes import address
from ckptio.system.checksum import block_crcs
from ckptio.system.threads import background_pool

__all__ = ["StagedSums"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    """One thread per process: it keeps pace with the copy it runs beside."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = background_pool(1, "ckptio-stage-sums", 0)
        return _pool


class StagedSums:
    """Block checksums of staged tensors, keyed by their bytes' address and length."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._sums: dict[tuple[int, int], tuple[Any, int, Future[list[int]]]] = {}

    def add(self, staged: Any, host: Any) -> None:
        """Start checksumming ``host``, the bytes of ``staged`` (a staged tensor, or a DTensor whose local
        tensor ``host`` is: a shard, whose extents have a shard's blocks)."""
        arr = plain_array(host)
        if arr is None or arr.nbytes == 0:
            return
        view = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        block = extent_block(view.nbytes, staged is host, self.block_size) or self.block_size
        self._sums[(address(view), view.nbytes)] = (staged, block, _helper().submit(block_crcs, view, block))

    def wait(self) -> None:
        """Until every checksum is done (raises what one raised)."""
        for _tensor, _block, fut in self._sums.values():
            fut.result()

    def take(self, view: memoryview, block: int) -> list[int] | None:
        """The checksums of ``view`` in ``block``-byte blocks, if it is the whole of a staged tensor."""
        entry = self._sums.get((address(view), view.nbytes)) if view.nbytes else None
        if entry is None or entry[1] != block:
            return None
        return entry[2].result()
