"""A multi-host incremental save's side (docs/incremental.md, "Many hosts").

Each host compares its own shards with its own shadows of the previous committed step and
references its own earlier objects: only it knows them, so its references live in its own
fragment, and it vouches for them before the commit as it vouches for its own objects. Its base
is its own record of that step (:func:`own_base`), kept in memory: a host never reads another's
fragment. Each host pins the steps it references under its own save id
(:func:`ckptio.saving.incremental.plan.pin_bases`), and a deleter judges such a pin by that host's
fragment (:meth:`ckptio.store.pins.Pins.judge`). The root names the union of the steps
the hosts reference (:func:`with_bases`): a handful, whatever the number of hosts.
"""

from __future__ import annotations

from typing import Any

from ckptio.errors import ManifestError
from ckptio.manifest import ArrayItem, Manifest, array_item
from ckptio.manifest.formats import HOST_REFS_VERSION, REFS_VERSION
from ckptio.manifest.refs import decode_refs
from ckptio.saving.incremental.plan import Reuse, reference_items

__all__ = ["own_base", "reference_record", "referenced_sizes", "with_bases"]


def reference_record(record: dict[str, Any], reuse: Reuse, block_size: int) -> dict[str, Any]:
    """A host's expanded record with each reused item as its base records it (its objects appended)
    and ``bases``: the steps it references, each with this host's save id there (flattened)."""
    doc = reference_items({**record, "block_size": block_size, "version": 1}, reuse)
    del doc["block_size"], doc["version"]
    return doc


def referenced_sizes(reuse: Reuse) -> dict[str, int]:
    """By key, the length each object of another step that ``reuse`` references must have at least."""
    base, need = reuse.base, {}
    for name in reuse.items:
        for s in base.items[name].shards:  # type: ignore[union-attr]
            for e in s.extents:
                key = base.objects[e.object]  # type: ignore[union-attr]
                need[key] = max(need.get(key, 0), e.offset + e.length)
    return need


def own_base(record: dict[str, Any], step: int, save_id: str, block_size: int, where: str) -> Manifest:
    """The base this host's next incremental save compares with: its own part of the step it just
    committed (its objects, references included; its array shards; its digests and bases), as a
    manifest whose checkpoint id is this host's save id (the one its fragment's key names)."""
    objects = list(record["objects"])
    items: dict[str, ArrayItem] = {}
    for name, raw in record["items"].items():
        if isinstance(raw, dict) and raw.get("kind") == "array" and raw.get("shards"):
            items[name] = array_item(raw, f"{where}: item {name!r}", len(objects), block_size, tiling=False)
    refs = decode_refs({"step": step, "bases": record.get("bases"), "digests": record.get("digests")},
                       REFS_VERSION, where)
    return Manifest(step=step, checkpoint_id=save_id, created=0.0, block_size=block_size, num_hosts=1, tree=None,
                    items=items, objects=objects, bases=refs.get("bases"), digests=refs.get("digests"))


def with_bases(root: dict[str, Any], summaries: list[dict[str, Any]], base: tuple[str, Manifest] | None,
               mine: Manifest | None, where: str) -> dict[str, Any]:
    """The coordinator's root document of an incremental save (``mine``: its own part, None for a save
    that is not incremental: ``root`` as is): format 11 even with no reference (the guard against an
    older ckptio: its deleters would judge every host's pin by a root that names no object), and ``bases``: every step a host's summary names, with the
    checkpoint id committed there, from ``base`` (the coordinator's own part of the last commit, whose
    ``bases`` hold every step that commit's root named). ManifestError for a step it does not know
    (the save then fails on every host: nothing references what no root vouches for). ``mine``
    keeps the new root's bases: what the next save's hosts may name."""
    if mine is None:
        return root
    known = {} if base is None else {**(base[1].bases or {}), base[0]: base[1].checkpoint_id}
    steps = sorted({s for r in summaries for s in r.get("bases", ())}, key=int)
    missing = [s for s in steps if s not in known]
    if missing:
        raise ManifestError(f"{where}: a host references step {missing[0]}, which the last commit does not name")
    bases = {s: known[s] for s in steps}
    mine.bases = {**bases, **(mine.bases or {})} or None
    return {**root, "version": max(root["version"], HOST_REFS_VERSION), **({"bases": bases} if bases else {})}
