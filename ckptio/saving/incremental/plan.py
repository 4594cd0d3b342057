"""An incremental save's side: digest the staged arrays, decide what the base already holds, and
make the committed document reference it (docs/incremental.md, sections 1 and 2).

Granularity in this first part: a whole array item of a single-host save is reused when every
one of its shards has the same box and tiling in the base and the same bytes: a shard staged as a
private copy is compared with its shadow (:mod:`.shadow`, a byte compare against the copy the last
save wrote), on the caller's thread while the training step waits (the caller's array may
change once ``save`` returns); a view of an immutable array by its sha256 (of its C-order
bytes), on the save's thread (:func:`settle_views`: a view does not change). Its bytes are then
neither copied to staging nor written; the commit's document names the base's objects and
extents for it. Packed small arrays are always written. A private copy without a shadow (no
manager) is digested from the caller's array, on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ckptio.errors import SaveFailedError
from ckptio.manifest import ArrayItem, Manifest
from ckptio.manifest.formats import REFS_VERSION
from ckptio.manifest.itemjson import item_to_json
from ckptio.manifest.model import Box
from ckptio.manifest.names import step_of_key
from ckptio.saving.incremental.reuse import digest_of
from ckptio.saving.incremental.shadow import Shadows, ShardKey
from ckptio.state.leaves import StagedArray
from ckptio.store.pins import pin_key
from ckptio.system.checksum import crc32c

__all__ = ["Reuse", "pin_bases", "plan_reuse", "reference_items", "settle_views"]

log = logging.getLogger("ckptio.incremental")


@dataclasses.dataclass
class Reuse:
    """What one incremental save takes from its base."""

    base_dir: str
    base: Manifest | None
    #: The array items the base holds unchanged: not written, referenced.
    items: set[str]
    #: The digest of every staged array shard (reused or written) that has no shadow, by item and box.
    digests: dict[str, dict[Box, str]]
    #: Shards staged as private copies (compared with shadows, never digested), and those of them
    #: whose bytes equal their shadow's.
    private: set[ShardKey] = dataclasses.field(default_factory=set)
    matched: set[ShardKey] = dataclasses.field(default_factory=set)
    #: Shards staged as views (immutable arrays, private host copies: stable once the save
    #: returns), digested on the save's thread (:func:`settle_views`), and the items holding them
    #: that the base may hold (same dtype and shape): laid out only once that thread decides.
    views: set[ShardKey] = dataclasses.field(default_factory=set)
    deferred: set[str] = dataclasses.field(default_factory=set)
    #: ``matched`` by item.
    matched_boxes: dict[str, set[Box]] = dataclasses.field(default_factory=dict)

    def writers(self, writers_of: Callable[[Iterable[str]], set[str]]) -> dict[str, set[str]]:
        """By base step, the save ids that wrote the objects the reused items reference there."""
        keys: dict[str, set[str]] = {}
        for name in self.items:
            for s in self.base.items[name].shards:  # type: ignore[union-attr]
                for e in s.extents:
                    key = self.base.objects[e.object]  # type: ignore[union-attr]
                    keys.setdefault(step_of_key(key) or "", set()).add(key)
        return {step: writers_of(ks) for step, ks in keys.items()}

    def kept(self) -> set[ShardKey]:
        """The shards reused by a byte compare (their shadows stay valid for this save's commit)."""
        return {k for k in self.matched if k[0] in self.items}

    def written_private(self) -> set[ShardKey]:
        """The private copies this save writes (the shadows it offers)."""
        return {k for k in self.private if k[0] not in self.items}

    def bases(self) -> dict[str, str]:
        """The steps the reused items' objects lie in, each with its checkpoint id (flattened)."""
        if self.base is None:
            return {}
        known = {**(self.base.bases or {}), self.base_dir: self.base.checkpoint_id}
        out: dict[str, str] = {}
        for name in sorted(self.items):
            item = self.base.items[name]
            for s in item.shards:  # type: ignore[union-attr]
                for e in s.extents:
                    step = step_of_key(self.base.objects[e.object])
                    if step not in known:
                        raise ValueError(f"base step {self.base_dir} names an object of step {step!r} "
                                         "it records no base for")
                    out[step] = known[step]  # type: ignore[index]
        return out


def _box(offsets: Any, shape: Any) -> Box:
    return (tuple(offsets), tuple(shape))


def plan_reuse(staged: dict[str, Any], source_of: Callable[[np.ndarray], np.ndarray],
               base: tuple[str, Manifest] | None, shadows: Shadows | None = None) -> Reuse:
    """Find the items the base (its step directory and manifest; None: a first save) holds
    unchanged: a shard staged as a private copy (``source_of(staged buffer)`` is another array)
    by a byte compare with its shadow (with ``shadows``), any other by its digest (from its source)."""
    base_dir, manifest = base if base is not None else ("", None)
    reuse = Reuse(base_dir, manifest, set(), {})
    arrays = {name: item for name, item in staged.items() if isinstance(item, StagedArray)}
    compared: dict[ShardKey, np.ndarray] = {}  # private copies the base records: compared all at once
    for name, item in arrays.items():
        old = manifest.items.get(name) if manifest is not None else None
        mine = reuse.digests[name] = {}
        for offsets, shape, data in item.shards:
            box, source = _box(offsets, shape), source_of(data)
            if shadows is not None and source is not data:
                reuse.private.add((name, box))
                if old is not None:
                    compared[(name, box)] = source
                continue
            if source is data:  # a view: its bytes stay as they are: digested off the training step
                reuse.views.add((name, box))
                continue
            _digest(mine, source, old, box)
        # Only an item of views alone: a private copy is filled for the objects laid out here.
        if isinstance(old, ArrayItem) and (old.dtype, tuple(old.shape)) == (item.dtype, tuple(item.shape)) and all(
                (name, _box(o, s)) in reuse.views and d.nbytes for o, s, d in item.shards) and item.shards:
            reuse.deferred.add(name)
    if shadows is not None and compared:
        reuse.matched = shadows.unchanged_many(manifest, compared)
    for n, b in reuse.matched:
        reuse.matched_boxes.setdefault(n, set()).add(b)
    for name, item in arrays.items():
        if name not in reuse.deferred and _same_as_base(reuse, name, item):
            reuse.items.add(name)
    log.info("incremental save: %d of %d array items unchanged since step %s (%d shards by shadow)",
             len(reuse.items), len(reuse.digests), base_dir, len(reuse.kept()))
    return reuse


def _same_as_base(reuse: Reuse, name: str, item: StagedArray) -> bool:
    old = reuse.base.items.get(name) if reuse.base is not None else None
    if old is None:
        return False
    return _same(item, reuse.digests[name], reuse.matched_boxes.get(name, set()), old,
                 (reuse.base.digests or {}).get(name, {}))  # type: ignore[union-attr]


def _digest(into: dict[Box, str], source: np.ndarray, old: Any, box: Box) -> None:
    """Record the digest of ``source`` (shard ``box``) in ``into``, unless the cheap crc filter
    already tells it changed since ``old``: no digest then (one is taken once its crcs match again)."""
    raw = memoryview(np.ascontiguousarray(source).reshape(-1).view(np.uint8))
    if not _crcs_differ(raw, old, box):
        into[box] = digest_of(raw)


def settle_views(reuse: Reuse, staged: dict[str, Any]) -> list[str]:
    """On the save's thread: digest the view shards, add the deferred items the base holds
    unchanged to ``reuse.items``, and return the other deferred items (to write), in staged order.
    Sound because a view's bytes do not change once the save returns: the writer writes them then."""
    for name, box in reuse.views:
        item = staged[name]
        old = reuse.base.items.get(name) if reuse.base is not None else None
        for offsets, shape, data in item.shards:
            if _box(offsets, shape) == box:
                _digest(reuse.digests[name], data, old, box)
    for name in reuse.deferred:
        if _same_as_base(reuse, name, staged[name]):
            reuse.items.add(name)
    log.info("incremental save: %d of %d array items held as views unchanged since step %s",
             len(reuse.deferred & reuse.items), len({n for n, _b in reuse.views}), reuse.base_dir)
    return [name for name in staged if name in reuse.deferred and name not in reuse.items]


def _crcs_differ(raw: memoryview, old: Any, box: Box) -> bool:
    """The cheap filter (crc32c runs ~20x faster than sha256): True when the base's record of the
    same box, stored in C order, has a block whose crc32c these bytes do not match (the first
    mismatch ends it). A box the base does not hold that way is not filtered: it is digested."""
    if not isinstance(old, ArrayItem):
        return False
    for s in old.shards:
        if _box(s.offsets, s.shape) == box and s.tile is None:
            for e in s.extents:
                for j, crc in enumerate(e.crcs):
                    start = e.shard_offset + j * e.block
                    if crc32c(raw[start:min(start + e.block, e.shard_offset + e.length)]) != crc:
                        return True
            return False
    return False


def _same(item: StagedArray, digests: dict[Box, str], matched: set[Box], old: Any,
          old_digests: dict[Box, str]) -> bool:
    if not isinstance(old, ArrayItem) or old.dtype != item.dtype or tuple(old.shape) != tuple(item.shape):
        return False
    tiles = {_box(s.offsets, s.shape): s.tile for s in old.shards}
    if len(old.shards) != len(item.shards):
        return False
    for i, (offsets, shape, _data) in enumerate(item.shards):
        box = _box(offsets, shape)
        tile = item.tile_of(i)
        if box not in tiles or tiles[box] != (tuple(tile) if tile is not None else None):
            return False
        if box in matched:
            continue  # its bytes equal the shadow of the base's record
        if box not in digests or old_digests.get(box) != digests[box]:
            return False
    return True


def reference_items(doc: dict[str, Any], reuse: Reuse) -> dict[str, Any]:
    """The committed document of an incremental save: each reused item as the base records it,
    its objects appended to ``objects``; ``bases``, ``digests`` and the version of format 9."""
    objects = list(doc["objects"])
    number = {k: i for i, k in enumerate(objects)}
    items = dict(doc["items"])
    base = reuse.base
    for name in sorted(reuse.items):
        old = base.items[name]  # type: ignore[union-attr]
        assert isinstance(old, ArrayItem)
        shards = []
        for s in old.shards:
            extents = []
            for e in s.extents:
                key = base.objects[e.object]  # type: ignore[union-attr]
                if key not in number:
                    number[key] = len(objects)
                    objects.append(key)
                extents.append(dataclasses.replace(e, object=number[key]))
            shards.append(dataclasses.replace(s, extents=extents))
        items[name] = item_to_json(dataclasses.replace(old, shards=shards), name, doc["block_size"])
    out = {**doc, "objects": objects, "items": items}
    bases = reuse.bases()
    if bases:
        out["bases"] = dict(sorted(bases.items(), key=lambda kv: int(kv[0])))
    digests = {name: [[list(o), list(s), d] for (o, s), d in sorted(rows.items())]
               for name, rows in reuse.digests.items() if rows}
    if digests:
        out["digests"] = digests
    # Always format 9, even with no reference: an older ckptio then never deletes an incremental
    # step by its manifest (its retention skips it, its gc keeps it: "unreadable"), and its objects
    # that later saves reference are spared by name through their holds (ckptio.store.pins).
    out["version"] = max(doc["version"], REFS_VERSION)
    return out


async def pin_bases(store: Any, step_dir: str, save_id: str, reuse: Reuse) -> None:
    """R1 and R2 for every base of ``reuse`` (``store``: a :class:`ckptio.store.CheckpointStore`,
    whose intent for ``save_id`` already beats). SaveFailedError if a base is being deleted (or
    is not the commit read): the save then references nothing; the next one writes in full."""
    via, cid = reuse.base_dir, reuse.base.checkpoint_id  # type: ignore[union-attr]
    pins, made = store.deletion.pins, []
    writers = reuse.writers(store.deletion.ctx.writers_of)
    for base in reuse.bases():
        if await pins.pin(base, step_dir, save_id, cid, via=via, covers=writers.get(base, ())):
            made.append(pin_key(base, step_dir, save_id))
        else:
            await pins.unpin(made)  # the save references nothing: its pins would only wait for a judge
            raise SaveFailedError(f"{store.where(step_dir)}: step {base}, which this incremental save "
                                  "references, is being deleted or was replaced; nothing was committed")
