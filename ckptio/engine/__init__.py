"""The IO engine: objects written and byte ranges read concurrently, within a byte budget, with
checksums and retries, on an event loop of its own (:mod:`.core`).

Below it: how shards are packed into objects and named (:mod:`.layout`, tiles in :mod:`.tiling`),
read requests cut into verifiable pieces (:mod:`.readpieces`) and scratch for reads that are
copied out (:mod:`.scratch`). Beside it: the interpreter's switch interval while a save runs
(:mod:`.gilswitch`) and a progress bar (:mod:`.progressbar`).
"""

from __future__ import annotations

from ckptio.engine.core import (
    UNLABELLED_S, ByteBudget, Engine, EngineConfig, Progress, ReadRequest, WrittenObject, gather_or_cancel, run_sync,
    split_request, submit, thread_done, threads_done,
)

__all__ = ["UNLABELLED_S", "ByteBudget", "Engine", "EngineConfig", "Progress", "ReadRequest", "WrittenObject",
           "gather_or_cancel", "run_sync", "split_request", "submit", "thread_done", "threads_done"]
