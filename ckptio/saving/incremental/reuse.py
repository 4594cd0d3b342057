"""Which shards an incremental save may take from its base, and the manifest that references them.

A shard is unchanged (docs/incremental.md, section 1) when its record in the
base manifest has the same item, dtype, global shape, box, tiling and
checksum blocks, equal crc32c blocks, and the same sha256 digest. The new
manifest then names the base's object and extents for it instead of writing
its bytes: references are flattened (the base's own references are copied as
they are), so a restore reads one key per extent, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping

from ckptio.manifest import ArrayItem, Manifest, ShardRecord
from ckptio.manifest.model import Box
from ckptio.manifest.names import step_of_key

__all__ = ["ShardKey", "digest_of", "rebase", "same_record", "unchanged"]

#: A shard of a manifest: its item and box.
ShardKey = tuple[str, Box]


def digest_of(data: memoryview | bytes) -> str:
    """The digest an incremental save records and compares: sha256, hex (measured twice blake2b's
    speed on this project's machines, and it releases the GIL on large buffers)."""
    return hashlib.sha256(data).hexdigest()


def _box(s: ShardRecord) -> Box:
    return (tuple(s.offsets), tuple(s.shape))


def same_record(new: ArrayItem, new_shard: ShardRecord, old: ArrayItem, old_shard: ShardRecord) -> bool:
    """Whether two records describe the same bytes as far as their layout and crc32c blocks tell
    (the digest confirms): dtype, shape, box, tiling, extent lengths, blocks and crcs all equal."""
    if new.dtype != old.dtype or tuple(new.shape) != tuple(old.shape) or _box(new_shard) != _box(old_shard):
        return False
    if new_shard.tile != old_shard.tile or len(new_shard.extents) != len(old_shard.extents):
        return False
    return all(a.shard_offset == b.shard_offset and a.length == b.length and a.block == b.block and a.crcs == b.crcs
               for a, b in zip(new_shard.extents, old_shard.extents))


def rebase(manifest: Manifest, base: Manifest, base_dir: str, reuse: Iterable[ShardKey]) -> Manifest:
    """``manifest`` with each shard of ``reuse`` stored where ``base`` (the manifest of step
    ``base_dir``) stores it; objects no extent names any more are dropped.

    The caller has judged each shard unchanged (:func:`same_record` and equal digests); this
    checks that ``base`` holds each with the same record, and raises ValueError naming the first
    that it does not. The result's ``bases`` names ``base_dir`` and every base ``base`` itself
    references (with the checkpoint ids ``base`` recorded), and keeps ``base``'s digests of the
    reused shards."""
    wanted = set(reuse)
    objects: list[str] = []
    number: dict[str, int] = {}

    def num(key: str) -> int:
        if key not in number:
            number[key] = len(objects)
            objects.append(key)
        return number[key]

    items: dict[str, object] = {}
    digests = {name: dict(rows) for name, rows in (manifest.digests or {}).items()}
    used_bases: set[str] = set()
    for name, item in manifest.items.items():
        if not isinstance(item, ArrayItem):
            items[name] = item
            continue
        shards = []
        for s in item.shards:
            src, src_objects = s, manifest.objects
            if (name, _box(s)) in wanted:
                src = _base_shard(base, name, item, s)
                src_objects = base.objects
                digest = (base.digests or {}).get(name, {}).get(_box(s))
                if digest is None:
                    raise ValueError(f"item {name!r} shard {_box(s)}: the base records no digest for it")
                digests.setdefault(name, {})[_box(s)] = digest
                used_bases |= {step_of_key(src_objects[e.object]) or "" for e in src.extents}
            extents = [dataclasses.replace(e, object=num(src_objects[e.object])) for e in src.extents]
            shards.append(dataclasses.replace(s, extents=extents))
        items[name] = dataclasses.replace(item, shards=shards)
    bases = dict(manifest.bases or {})
    known = {**(base.bases or {}), base_dir: base.checkpoint_id}
    for b in sorted(used_bases):
        if b not in known:
            raise ValueError(f"base step {base_dir!r} names an object of step {b!r} it records no base for")
        bases[b] = known[b]
    return dataclasses.replace(manifest, items=items, objects=objects, bases=bases or None,  # type: ignore[arg-type]
                               digests=digests or None)


def _base_shard(base: Manifest, name: str, item: ArrayItem, s: ShardRecord) -> ShardRecord:
    old = base.items.get(name)
    if isinstance(old, ArrayItem):
        for o in old.shards:
            if same_record(item, s, old, o):
                return o
    raise ValueError(f"item {name!r} shard {_box(s)}: the base holds no shard with the same record")


def unchanged(manifest: Manifest, base: Manifest, digests: Mapping[ShardKey, str]) -> set[ShardKey]:
    """The shards of ``manifest`` (its records, crcs computed) that ``base`` holds with the same
    record and the same digest (``digests``: the new bytes' sha256 by shard)."""
    found: set[ShardKey] = set()
    for name, item in manifest.items.items():
        old = base.items.get(name)
        if not isinstance(item, ArrayItem) or not isinstance(old, ArrayItem):
            continue
        old_digests = (base.digests or {}).get(name, {})
        for s in item.shards:
            key = (name, _box(s))
            d = digests.get(key)
            if d is None or old_digests.get(key[1]) != d:
                continue
            if any(same_record(item, s, old, o) for o in old.shards):
                found.add(key)
    return found
