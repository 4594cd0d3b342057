"""The DCP Reader's view of a format-2 root: chunks from the root, shards only where read.

A format-2 manifest's root names every shard's box (each array item's
locator: ``[fragment, offsets..., shape...]`` rows) but not where its bytes
are: that is in the per-host fragments. DCP's ``Metadata`` needs only the
boxes (the chunks), so the Reader builds it from :func:`boxed` -- the root
with each array item's shards made from its locator, without extents -- and
reads no fragment for it. At ``read_data`` a plain read loads only the
fragments holding the chunks its read items name (:func:`wanted`), and
:func:`located` swaps those chunks' box-only shards for the loaded ones; a
read-once load reads no fragment here at all (the exchange reads the ones
its rank is responsible for). A rank then reads the root plus what it needs,
not every host's fragment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ckptio.dcp._codec import ChunkRef
from ckptio.manifest import ArrayItem, Manifest
from ckptio.manifest.model import Box, ShardRecord

__all__ = ["boxed", "located", "wanted"]


def boxed(root: Manifest) -> Manifest:
    """``root`` with each format-2 array item's shards as their boxes (no extents: not readable),
    from its locator; ``root`` itself when every shard is at hand."""
    if root.complete:
        return root
    hosts = [f.host for f in root.fragments or []]
    items: dict[str, object] = {}
    for name, item in root.items.items():
        if isinstance(item, ArrayItem) and item.locator is not None:
            ndim = len(item.shape)
            rows = item.locator.tolist()
            shards = [ShardRecord(tuple(r[1 : 1 + ndim]), tuple(r[1 + ndim :]), hosts[r[0]], []) for r in rows]
            item = ArrayItem(item.dtype, item.shape, shards, item.scalar, item.origin)
        items[name] = item
    return dataclasses.replace(root, items=items)


def wanted(refs: Iterable[ChunkRef]) -> dict[str, list[Box]]:
    """Item name -> the boxes of the shards ``refs`` name: what a plain read loads fragments for."""
    out: dict[str, list[Box]] = {}
    for ref in refs:
        shard = ref.item.shards[0]
        out.setdefault(ref.name, []).append((shard.offsets, shard.shape))
    return out


def located(refs: Mapping[tuple[str, tuple[int, ...]], ChunkRef], keys: Iterable[tuple[str, tuple[int, ...]]],
            loaded: Manifest, where: str) -> dict[tuple[str, tuple[int, ...]], ChunkRef]:
    """``refs`` with the chunks ``keys`` holding their shards as ``loaded`` (the root with the
    fragments holding them read) has them: readable. ManifestError naming the chunk if a fragment
    does not hold the shard its root row promises."""
    from ckptio.errors import ManifestError

    out = dict(refs)
    by_box: dict[str, dict[Box, ShardRecord]] = {}
    for key in keys:
        ref = refs[key]
        box = (ref.item.shards[0].offsets, ref.item.shards[0].shape)
        item = loaded.items.get(ref.name)
        if not isinstance(item, ArrayItem):
            raise ManifestError(f"{where}: chunk {key} names no array item {ref.name!r}")
        shards = by_box.get(ref.name)
        if shards is None:
            shards = by_box[ref.name] = {(s.offsets, s.shape): s for s in item.shards}
        shard = shards.get(box)
        if shard is None:
            raise ManifestError(f"{where}: item {ref.name!r} has no shard {list(box[0])}+{list(box[1])} "
                                "in the fragment its root names")
        # One single-shard view per chunk, as metadata_from_manifest makes (a byte item has one shard).
        out[key] = dataclasses.replace(ref, item=ArrayItem(item.dtype, item.shape, [shard], item.scalar, item.origin))
    return out
