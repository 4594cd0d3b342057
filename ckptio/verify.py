"""Re-read a whole checkpoint and check every checksum (``ckptio verify``, publishing)."""

from __future__ import annotations

import numpy as np

from ckptio.backends import Backend

from .engine import Progress, ReadRequest
from .manifest import ArrayItem, Manifest
from .reshard import Region, plan_region
from .store import CheckpointStore

__all__ = ["verify_checkpoint", "verify_requests"]


def verify_requests(m: Manifest) -> list[ReadRequest]:
    """Reads of every saved shard, whole, with their checksums (scratch buffers, one shard at a time)."""
    requests: list[ReadRequest] = []
    for name, it in m.items.items():
        if isinstance(it, ArrayItem):
            for s in it.shards:
                requests += plan_region(name, it, Region(s.offsets, np.empty(s.shape, it.dtype)), m.objects, m.block_size)
    return requests


async def verify_checkpoint(
    target: Backend | CheckpointStore, step_dir: str, progress: Progress | None = None
) -> tuple[int, int]:
    """Read every byte of a committed checkpoint; IntegrityError names the first bad object and item.

    Returns ``(objects, bytes)`` checked.
    """
    store = target if isinstance(target, CheckpointStore) else CheckpointStore(target.url, backend=target)
    m = await store.read_manifest(step_dir)
    requests = verify_requests(m)
    await store.engine.read(requests, progress)
    return len(m.objects), sum(r.rng.length for r in requests)
