"""Whether a manifest's objects are there, as long as its records need: listings, not reads.

A commit checks its objects before it creates its manifest (a gc, an
``rm -rf`` or a lost write must fail the save, never commit a checkpoint that
cannot restore), and "the latest step" checks the newest manifest's objects
before it is restored.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ckptio.engine import gather_or_cancel
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.manifest import ArrayItem, Manifest, split_items
from ckptio.store.context import StoreContext

__all__ = ["Listed", "Objects", "manifest_object_sizes"]

#: Fewer keys than this in one directory are stat-ed one by one rather than listed.
_LIST_FROM = 4
#: Listings kept between calls: directory -> every key listed there -> its size.
Listed = dict[str, dict[str, int]]


def manifest_object_sizes(manifest: Manifest) -> dict[str, int]:
    """The least size of each object of ``manifest``: the end of its last extent (0 if it holds none)."""
    ends = [0] * len(manifest.objects)  # by object number: one list index per extent (100k-leaf states)
    plain, tables = split_items(manifest.items)
    for t in tables:  # a pack table: one extent
        ends[t.object] = max(ends[t.object], t.offset + t.ends[-1])
    columns = np.zeros(len(manifest.objects), np.int64)
    for item in plain.values():
        if not isinstance(item, ArrayItem):
            continue
        if item.table is not None:
            # Shards read from columnar fragments: their extents as columns, not a record per
            # shard (a column block of every array of 4096 hosts: 1 M shards, ~0.6 s and ~100 MB
            # of records per 256 fragments).
            if len(item.table.object):
                np.maximum.at(columns, item.table.object, item.table.offset + item.table.length)
            continue
        for shard in item.shards:
            for e in shard.extents:
                end = e.offset + e.length
                if end > ends[e.object]:
                    ends[e.object] = end
    need = dict.fromkeys(manifest.objects, 0)
    for key, end in zip(manifest.objects, map(max, ends, columns.tolist())):
        need[key] = max(need[key], end)  # a key listed twice keeps its larger need
    return need


class Objects:
    """Sizes and presence of one store's objects."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx

    async def object_sizes(self, keys: Iterable[str], listed: Listed | None = None) -> dict[str, int]:
        """Sizes of ``keys`` that exist (absent ones are left out).

        One listing per directory the keys live in (a step directory, or each
        hashed prefix of it), not one request per object; ``listed`` keeps the
        listings for the next call (a restore checking its objects batch by batch
        lists each directory once).
        """
        wanted = set(keys)
        by_dir: dict[str, list[str]] = {}
        for k in wanted:
            by_dir.setdefault(k.rpartition("/")[0], []).append(k)
        sizes: dict[str, int] = {}
        io = self.ctx.io

        async def one(directory: str, ks: list[str]) -> None:
            if not directory or len(ks) < _LIST_FROM:  # the root lists everything under it: stat instead
                for k in ks:
                    try:
                        sizes[k] = (await io.stat(k)).size
                    except FileNotFoundError:
                        pass
                return
            if listed is None:
                sizes.update((i.key, i.size) for i in await io.list(directory + "/") if i.key in wanted)
                return
            got = listed.get(directory)
            if got is None:
                got = listed[directory] = {i.key: i.size for i in await io.list(directory + "/")}
            sizes.update((k, got[k]) for k in ks if k in got)

        await gather_or_cancel((one(d, ks) for d, ks in by_dir.items()), limit=self.ctx.concurrency * 2)
        return sizes

    async def check_whole(self, step_dir: str, manifest: Manifest) -> None:
        """FileNotFoundError / IntegrityError unless every key ``manifest`` names is there, as long as
        its records need: a format-1 checkpoint's objects, a format-2 root's fragments (each
        fragment's objects are checked when it is loaded). Costs listings, not reads. A missing
        key of a committed checkpoint is damage: IntegrityError names it."""
        try:
            await self.check_objects(manifest, f"checkpoint {self.ctx.where(step_dir)}")
        except CheckpointNotFoundError:
            raise
        except FileNotFoundError as e:
            raise IntegrityError(str(e)) from None

    async def check_objects(self, manifest: Manifest, where: str, listed: Listed | None = None) -> None:
        """FileNotFoundError unless every object ``manifest`` names exists, at least as long as its
        extents need (``listed``: see :meth:`object_sizes`)."""
        need = manifest_object_sizes(manifest)
        need.update((f.key, f.size) for f in manifest.fragments or [])
        have = await self.object_sizes(need, listed)
        for key, size in need.items():
            if key not in have:
                raise FileNotFoundError(f"{where}: object {key!r} is missing (deleted by someone, or never written)")
            if have[key] < size:
                raise IntegrityError(f"{where}: object {key!r} holds {have[key]} bytes, its extents need {size}",
                                     key=key)
