"""Re-read a whole checkpoint and check every checksum (``ckptio verify``, publishing)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ckptio.backends import Backend
from ckptio.engine import Progress, ReadRequest
from ckptio.manage.copying import stored_extents, verified_reads
from ckptio.manifest import ArrayItem, Manifest
from ckptio.restoring.reshard import Region, plan_region
from ckptio.store import CheckpointStore
from ckptio.store.parts import PartRecord

__all__ = ["verify_batches", "verify_checkpoint", "verify_part"]


def verify_batches(m: Manifest, batch_bytes: int = 256 << 20) -> Iterator[list[ReadRequest]]:
    """Reads of every saved shard with their checksums, in batches of about ``batch_bytes``
    (scratch buffers for one batch at a time, so verifying needs little memory)."""
    batch: list[ReadRequest] = []
    size = 0
    for name, it in m.items.items():
        if not isinstance(it, ArrayItem):
            continue
        for s in it.shards:
            if not s.size:
                continue
            region = Region(s.offsets, np.empty(s.shape, it.dtype))
            batch += plan_region(name, it, region, m.objects, m.block_size)
            size += s.size * it.dtype.itemsize
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


async def verify_checkpoint(
    target: Backend | CheckpointStore, step_dir: str, progress: Progress | None = None
) -> tuple[int, int]:
    """Read every byte of a committed checkpoint; IntegrityError names the first bad object and item.

    Returns ``(objects, bytes)`` checked. Memory stays at about one batch of shards.
    """
    store = target if isinstance(target, CheckpointStore) else CheckpointStore(target.url, backend=target)
    m = await store.read_manifest(step_dir)
    done = 0
    for batch in verify_batches(m):
        await store.engine.read(batch, progress)
        done += sum(r.rng.length for r in batch)
    return len(m.objects), done


async def verify_part(store: CheckpointStore, record: PartRecord, progress: Progress | None = None) -> tuple[int, int]:
    """Read every object of a host's part committed by its record (no manifest: :mod:`ckptio.store.parts`)
    and check each extent against the block checksums the record carries; IntegrityError names the first
    bad object and item, FileNotFoundError a missing one. Returns ``(objects, bytes)`` checked; memory: one
    object at a time."""
    extents = record.extra.get("extents")
    if record.sizes is None or not isinstance(extents, list) or len(extents) != len(record.objects):
        raise ValueError(f"commit record {record.key!r} carries no sizes or extents to check its objects by")
    done = 0
    for key, size, ex in zip(record.objects, record.sizes, extents):
        if not size:
            await store.io.stat(key)
            continue
        buf = memoryview(bytearray(size))
        await store.engine.read(verified_reads(key, buf, stored_extents(ex)), progress)
        done += size
    return len(record.objects), done
