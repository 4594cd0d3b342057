"""The table of manifest formats: what each version adds, and which one a writer picks.

=======  =====================================================================
version  what it adds (each reader of version ``n`` reads every version <= n)
=======  =====================================================================
1        one document naming every item, shard, extent and checksum
2        a small root plus one sealed fragment per host (:mod:`.fragments`):
         the root holds each array's boxes as a locator, the fragments the extents
3        tiled shards (:mod:`ckptio.engine.tiling`), in a format 1 or 2 document
         (a root has ``fragments``): a reader that predates tiles refuses the
         checkpoint instead of reading tile streams as C order
4        compact rows in a format-1 document: a small whole array as
         ``[dtype, shape, object, offset, crcs]``, for states of 100k leaves
5        ``packs`` in a format-4 document: the small whole arrays of a pack as one
         columnar table (:mod:`.codec.packs`) instead of as items
6        per-extent checksum blocks, in a document of any format above (root and
         fragments alike): an extent may carry a 6th element, its own block size
         (``[object, offset, shard_offset, length, crcs, block]``), so that a small
         shard is checksummed in small blocks and a partial read of it rounds out
         little; a reader that predates it would verify with the manifest's
         ``block_size`` and report corruption, so it refuses the checkpoint instead
7        columnar fragments in a format-2 root: each fragment (version 3) holds its
         shards as compressed int64/uint32 columns (:mod:`.codec.columns`), which a
         reader that predates them cannot parse: it refuses the root instead
8        per-host state items (:mod:`.hoststate`): ``{"kind": "per_host", "states":
         {host: state}}``, each host's own small state (a data loader's position)
         inline, in a document of any format above; a reader that predates them
         refuses the checkpoint rather than restore one host's state on every host
9        references (:mod:`.refs`, incremental saves): ``bases`` names older steps whose
         objects ``objects`` may list, and ``digests`` the sha256 of shards; a reader that
         predates them would refuse the foreign keys as a copied manifest, so it refuses
         the version instead, plainly
10       fragments with a head (:mod:`.codec.sections`)
11       a multi-host incremental save's root (:mod:`ckptio.saving.incremental.hosts`): ``bases``
         in a format-2 root, whose fragments may list objects of those steps; a reader of
         version 10 would read the root and find no reference in it (its ``objects`` is
         empty), so its deleters would judge every host's pin dead: it refuses the version
=======  =====================================================================

A writer states the features its document uses and :func:`version_for` picks the
lowest version that has them all, so a checkpoint stays readable by the oldest
ckptio that can read it. Readers refuse any version above :data:`VERSION`.
"""

from __future__ import annotations

__all__ = [
    "BLOCKS_VERSION",
    "COLUMNS_VERSION",
    "FEATURES",
    "FORMAT",
    "FRAGMENTS_VERSION",
    "HEADS_VERSION",
    "HOST_REFS_VERSION",
    "HOST_STATES_VERSION",
    "MANIFEST_NAME",
    "PACKS_VERSION",
    "REFS_VERSION",
    "ROWS_VERSION",
    "TILED_VERSION",
    "TOMBSTONE_NAME",
    "VERSION",
    "version_for",
]

FORMAT = "ckptio"
#: The newest format this ckptio reads (the table above).
VERSION = 11
FRAGMENTS_VERSION = 2
TILED_VERSION = 3
ROWS_VERSION = 4
PACKS_VERSION = 5
BLOCKS_VERSION = 6
COLUMNS_VERSION = 7
HOST_STATES_VERSION = 8
REFS_VERSION = 9
HEADS_VERSION = 10
HOST_REFS_VERSION = 11
#: The least version that can express each feature a document may use.
FEATURES = {"fragments": FRAGMENTS_VERSION, "tiles": TILED_VERSION, "rows": ROWS_VERSION, "packs": PACKS_VERSION,
            "blocks": BLOCKS_VERSION, "columns": COLUMNS_VERSION, "host_states": HOST_STATES_VERSION,
            "refs": REFS_VERSION, "heads": HEADS_VERSION,
            "host_refs": HOST_REFS_VERSION}
MANIFEST_NAME = "ckptio.manifest.json"
#: Written before a checkpoint's objects are deleted; readers skip such checkpoints.
TOMBSTONE_NAME = "ckptio.deleting"


def version_for(*, fragments: bool = False, tiles: bool = False, rows: bool = False, packs: bool = False,
                blocks: bool = False, columns: bool = False, host_states: bool = False,
                refs: bool = False, heads: bool = False, host_refs: bool = False) -> int:
    """The lowest format version that expresses a document using the given features (``blocks``:
    some extent records a checksum block size of its own; ``columns``: format-2 fragments as columns;
    ``host_states``: some item is per-host; ``refs``: bases or digests, :mod:`.refs`; ``heads``:
    fragments of version 4, :mod:`.codec.sections`; ``host_refs``: a format-2 root of an incremental save)."""
    used = {"fragments": fragments, "tiles": tiles, "rows": rows, "packs": packs, "blocks": blocks,
            "columns": columns, "host_states": host_states, "refs": refs,
            "heads": heads, "host_refs": host_refs}
    return max((FEATURES[name] for name, on in used.items() if on), default=1)
