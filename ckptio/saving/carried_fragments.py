"""Format 2 on a host-local store: each host's fragment carried to the coordinator in the save's gather.

A host-local store (a tiers fast tier: each host's own disk or RAM) cannot read another host's
fragment, so a native format-2 save (:mod:`ckptio.manifest.fragments`) could not commit there, and
such saves merged every host's shards into one format-1 manifest at the coordinator (87.68 MB, a
minute of parsing, merging and validating at 4096 hosts x 128 shards, issue #33). Carried, they commit
a format-2 checkpoint there instead:

* each host seals its own fragment (its objects and shards, built from its own record) and sends it
  in the gather beside the summary a native save sends (its fragment's reference and its boxes);
* the coordinator checks each fragment's bytes against its reference (size, crc32c, a fragment key
  of this step, the sending host) and writes them into its own store -- under its save's intent,
  which first covers the other hosts' save ids, so no deleter takes them before the commit; a deleter
  that revoked one of those ids anyway makes the commit roll back (:mod:`ckptio.store.fence`: the root
  names the fragments) -- then commits the small root built from the summaries
  (:func:`~ckptio.manifest.fragments.build_root`: tiling checked on the boxes, vectorised). It never
  parses, merges or validates another host's shards: its work is O(bytes received), not O(shards);
* every host keeps its own part (objects, least sizes, extents: :func:`own_part`) for a commit record
  of its own (:mod:`ckptio.tiers.fastcommit`). An object's index in the checkpoint is its index in its
  host's fragment plus that fragment's *base* (the objects of the fragments before it, in host order:
  the order a reader loads them in), which the coordinator works out (:func:`write_carried`).

The coordinator's store thus holds a whole format-2 checkpoint (root and every fragment), which every
reader of a committed checkpoint (restore, copy, verify, gc, deletion) reads as any other; a crash
before the root leaves fragments that no manifest names, a dead save's keys like its objects.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from ckptio.engine import gather_or_cancel
from ckptio.errors import ManifestError
from ckptio.manifest import fragment_doc, fragment_key, fragment_ref, summary_of
from ckptio.manifest.names import parse_object
from ckptio.system.checksum import crc32c

__all__ = ["CARRIED", "carried_summary", "carried_save_ids", "own_part", "write_carried"]

#: The summary's field holding the fragment's bytes (base64; None: the host has no array shard).
CARRIED = "fragment_data"


def carried_summary(record: Mapping[str, Any], step_dir: str, step: int | None, save_id: str,
                    host: int) -> dict[str, Any]:
    """What ``host`` sends the coordinator: its summary (:func:`summary_of`), its sealed fragment and its
    number of objects. ``record``: its expanded record (``manifest.builder.expanded``)."""
    ref, data = None, None
    if any(it["kind"] == "array" and it["shards"] for it in record["items"].values()):
        data = fragment_doc(record, step, save_id, host)
        ref = fragment_ref(fragment_key(step_dir, save_id), data, host)
    summary = summary_of(record, ref, coordinator=host == 0)
    summary[CARRIED] = base64.b64encode(data).decode() if data is not None else None
    summary["n_objects"] = len(record["objects"])
    return summary


def own_part(record: Mapping[str, Any], block_size: int) -> dict[str, Any]:
    """``record``'s objects as a commit record carries them: keys, least sizes (the end of the last extent)
    and, per object, its extents ``[offset, length, crcs, item, block]`` (:func:`ckptio.manage.copying.object_extents`)."""
    objects = list(record["objects"])
    sizes = [0] * len(objects)
    extents: list[list[list[Any]]] = [[] for _ in objects]
    for name, item in record["items"].items():
        if item["kind"] != "array":
            continue
        for shard in item["shards"]:
            for row in shard["extents"]:  # [object, offset, shard_offset, length, crcs(, block)]
                obj, offset, length = row[0], row[1], row[3]
                extents[obj].append([offset, length, list(row[4]), name, row[5] if len(row) > 5 else block_size])
                sizes[obj] = max(sizes[obj], offset + length)
    return {"objects": objects, "sizes": sizes, "extents": extents}


def carried_save_ids(summaries: list[dict[str, Any]], step_dir: str, where: str) -> list[str]:
    """The save ids of the fragments ``summaries`` carry (ManifestError naming the host whose reference is
    not a fragment key of ``step_dir``, or not its own)."""
    out = []
    for rank, s in enumerate(summaries):
        ref = s.get("fragment")
        if ref is None:
            continue
        name = parse_object(str(ref.get("key")))
        if name is None or name.step_dir != step_dir or ref["key"] != fragment_key(step_dir, name.save_id):
            raise ManifestError(f"{where}: host {rank}'s fragment key {str(ref.get('key'))[:80]!r} is not one of this step")
        if ref.get("host") != rank:
            raise ManifestError(f"{where}: host {rank} sent a fragment of host {ref.get('host')!r}")
        out.append(name.save_id)
    return out


async def write_carried(io: Any, summaries: list[dict[str, Any]], where: str) -> list[int]:
    """Write every fragment ``summaries`` carry through ``io`` (a store's IO; the keys checked first by
    :func:`carried_save_ids`) and return each host's base (-1: no fragment). Each fragment's bytes are dropped
    from its summary once checked; ManifestError naming a host whose bytes are not
    what its reference says (then nothing is written)."""
    bases, base, checked = [], 0, []
    for rank, s in enumerate(summaries):
        ref, raw = s.get("fragment"), s.pop(CARRIED, None)
        if ref is None:
            bases.append(-1)
            continue
        try:
            data = base64.b64decode(raw or "", validate=True)
        except ValueError as e:
            raise ManifestError(f"{where}: host {rank}'s fragment is not base64: {e}") from None
        if len(data) != ref["size"] or crc32c(data) != ref["crc32c"]:
            raise ManifestError(f"{where}: host {rank}'s fragment does not match its reference (size or crc32c)")
        bases.append(base)
        base += int(s["n_objects"])
        checked.append((ref["key"], data))
    # Every fragment checked before the first write: a bad one leaves nothing of this save behind.
    await gather_or_cancel((io.write(key, [memoryview(data)]) for key, data in checked), limit=64)
    await io.sync()
    return bases
