"""System helpers at the bottom of ckptio: both the backends and the core import them.

They know nothing of checkpoints or storage, only of the machine: flat byte views and
GIL-free copies (:mod:`.bytes`), fresh pages and faulting them in early (:mod:`.pages`),
worker threads that yield the CPU to the training step (:mod:`.threads`), sorted unique
values without numpy's lazy ``numpy.ma`` import (:mod:`.arrays`). This package
imports nothing else from ckptio, so every layer may import it without a cycle.
"""

from __future__ import annotations

from ckptio.system.arrays import unique, unique_rows
from ckptio.system.bytes import (
    GIL_FREE_MIN, address, byte_views, copy_bytes, flat_bytes, gather_bytes, scatter_bytes,
)
from ckptio.system.pages import (
    FRESH_MIN, HUGE_PAGE, POPULATE_MIN, ask_huge_pages, collapse, collapse_shared, fresh_pages, libc,
    populate,
)
from ckptio.system.threads import background_pool, lower_this_thread, start_workers

__all__ = [
    "FRESH_MIN",
    "GIL_FREE_MIN",
    "HUGE_PAGE",
    "POPULATE_MIN",
    "address",
    "ask_huge_pages",
    "background_pool",
    "byte_views",
    "collapse",
    "collapse_shared",
    "copy_bytes",
    "flat_bytes",
    "fresh_pages",
    "gather_bytes",
    "libc",
    "lower_this_thread",
    "populate",
    "scatter_bytes",
    "start_workers",
    "unique",
    "unique_rows",
]
