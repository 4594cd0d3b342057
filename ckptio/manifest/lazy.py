"""A manifest loaded as far as a reader needs: "which shards of these items meet these boxes".

A format-1 manifest holds every shard; a format-2 root holds only each
array's boxes, and its shards are in per-host fragments. Readers should not
care which: they ask :func:`with_shards_meeting` for the shards meeting the
boxes they will read (or :func:`with_every_shard` for all of them), handing
it a callback that reads fragments by number; the answer is the same
manifest when nothing is missing (no callback call, and for ``wanted`` given
as a callable, no boxes made), else one with the fragments holding those
shards loaded. Afterwards :meth:`Manifest.tiles_known` says whether an item's
shards at hand were checked to tile it exactly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import numpy as np

from ckptio.manifest.codec.split import FragmentLoader
from ckptio.manifest.model import ArrayItem, Box, Manifest

__all__ = ["Boxes", "Fetch", "FetchRanges", "Wanted", "fragments_for", "with_every_shard", "with_fragments", "with_shards_meeting"]


#: Item name -> target boxes ``(offsets, shape)``.
Boxes = Mapping[str, Iterable[Box]]
#: The boxes a reader wants: themselves, made on demand, or None for every shard.
Wanted = Boxes | Callable[[], Boxes] | None
#: Reads fragments by number: the store's reads, with its retries and errors (a new mapping a call).
Fetch = Callable[[list[int]], Awaitable[Mapping[int, bytes]]]
#: Reads byte ranges ``(fragment number, start, end)`` of fragments, each range's bytes in order.
FetchRanges = Callable[[list[tuple[int, int, int]]], Awaitable[list[bytes]]]
#: Fragments read at a time (each a few KiB to a few hundred): enough to keep the store busy.
FETCH_BATCH = 256
#: Fragments read by range at a time (heads, index entries, sections: ~0.3-1 KiB each).
RANGED_BATCH = 8192


def fragments_for(manifest: Manifest, wanted: Wanted) -> list[int]:
    """Fragment numbers holding shards that meet ``wanted`` (item -> target boxes; a callable: asked
    only if some fragment is unread; None: all), and none once every shard is at hand."""
    if manifest.complete:
        return []
    if callable(wanted):
        wanted = wanted()
    if wanted is None:
        return list(range(len(manifest.fragments or [])))
    out: set[int] = set()
    asked: set[tuple[int, tuple[Any, ...]]] = set()  # arrays sharing a layout and target boxes: asked once
    for name, boxes in wanted.items():
        item = manifest.items.get(name)
        if not isinstance(item, ArrayItem) or item.locator is None or not len(item.locator):
            continue
        boxes = [(tuple(o), tuple(sh)) for o, sh in boxes]
        key = (id(item.locator), tuple(boxes))
        if key in asked:
            continue
        asked.add(key)
        table, ndim = item.locator, len(item.shape)
        offs, sizes = table[:, 1 : 1 + ndim], table[:, 1 + ndim :]
        for off, shape in boxes:
            lo, hi = np.asarray(off, np.int64), np.asarray(off, np.int64) + np.asarray(shape, np.int64)
            meets = ((offs < hi) & (offs + sizes > lo)).all(axis=1) & (sizes > 0).all(axis=1) if ndim else \
                np.ones(len(table), bool)
            out.update(table[meets, 0].tolist())
    return sorted(out)


async def with_shards_meeting(manifest: Manifest, wanted: Wanted, fetch: Fetch, step_dir: str,
                              where: str, *, fetch_ranges: FetchRanges | None = None) -> Manifest:
    """``manifest`` with every shard that meets ``wanted`` at hand (``wanted`` None: every shard);
    array items ``wanted`` does not name are left without shards.

    ``fetch`` reads the fragments it is given (their numbers in ``manifest.fragments``); it is
    called only when some are needed. ``where`` (the manifest's URL) names the faults.
    ``fetch_ranges``: reads parts of fragments, so that a reader wanting few arrays of
    version-4 fragments reads their heads and sections only (None: fragments are read whole).
    """
    if manifest.complete:
        return manifest
    if callable(wanted):
        wanted = wanted()
    numbers = fragments_for(manifest, wanted)
    return await with_fragments(manifest, numbers, fetch, step_dir, where, complete=wanted is None,
                                names=None if wanted is None else set(wanted), fetch_ranges=fetch_ranges)


async def with_fragments(manifest: Manifest, numbers: list[int], fetch: Fetch, step_dir: str, where: str, *,
                         complete: bool = False, names: Collection[str] | None = None,
                         fetch_ranges: FetchRanges | None = None) -> Manifest:
    """``manifest`` (a format-2 root) with the shards of fragments ``numbers`` at hand, only the
    rows of items ``names`` (None: every item); ``complete``: ``numbers`` are all of them. What a
    host reads that sends the shards of the fragments it is responsible for
    (:mod:`ckptio.restoring.boxroute`), whatever its own target."""
    # Only the wanted items' rows are made into shards: nobody parses what it does not restore.
    # Fragments are read in batches and each dropped once decoded: a host that meets every
    # fragment holds one batch of their bytes, not all of them.
    loader = FragmentLoader(manifest, step_dir, where, complete=complete, names=names, few=len(numbers) <= 8,
                            expect=len(numbers))
    ranged = fetch_ranges is not None and loader.ranged()
    # Read by range, a fragment is held as a few hundred bytes: batches as large as a job (two
    # round trips in all, not two per batch).
    size = RANGED_BATCH if ranged else FETCH_BATCH
    for i in range(0, len(numbers), size):
        batch = numbers[i : i + size]
        if ranged:
            assert fetch_ranges is not None
            await _ranged_batch(loader, batch, fetch_ranges)
            continue
        datas = await fetch(batch)
        loader.add_batch(batch, datas)
        del datas
    return loader.done()


async def _ranged_batch(loader: FragmentLoader, batch: list[int], fetch_ranges: FetchRanges) -> None:
    """Fragments ``batch`` read by range: every head (and index entries) at once, then every section."""
    heads = await _read(fetch_ranges, {f: loader.head_ranges(f) for f in batch})
    sections = await _read(fetch_ranges, {f: loader.section_ranges(f, heads[f]) for f in batch})
    for f in batch:
        loader.add_sections(f, sections[f])


async def _read(fetch_ranges: FetchRanges, asked: dict[int, list[tuple[int, int]]]) -> dict[int, list[bytes]]:
    """The bytes of each fragment's ranges ``asked``, all read at once."""
    blobs = await fetch_ranges([(f, a, b) for f, ranges in asked.items() for a, b in ranges])
    got, at = {}, 0
    for f, ranges in asked.items():
        got[f], at = blobs[at : at + len(ranges)], at + len(ranges)
    return got


async def with_every_shard(manifest: Manifest, fetch: Fetch, step_dir: str, where: str) -> Manifest:
    """``manifest`` with all of its shards at hand (see :func:`with_shards_meeting`)."""
    return await with_shards_meeting(manifest, None, fetch, step_dir, where)
