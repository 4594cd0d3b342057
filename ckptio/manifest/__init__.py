"""The manifest: the JSON document whose presence makes a checkpoint exist.

One package, its modules layered bottom to top (each imports only those above it in this list):

* :mod:`.limits` -- the bounds of everything read, and the one integer validator;
* :mod:`.formats` -- the table of format versions (1 to 5), what each adds, and
  :func:`~.formats.version_for`, which picks the lowest version a document needs;
* :mod:`.model` -- the in-memory manifest: Manifest, ArrayItem, ShardRecord, Extent,
  ValueItem, PackTable / Items, FragmentRef (dataclasses, no JSON);
* :mod:`.geometry` -- box overlaps and "these shards tile the array exactly once";
* :mod:`.table` -- an array item's shards as numpy columns (:class:`~.table.ShardTable`), for planning;
* :mod:`.values`, :mod:`.sealing` -- value items' JSON; the checksummed envelope of a stored manifest;
* :mod:`.hoststate` -- per-host state items (format 8): each host's own small state, as JSON;
* :mod:`.itemjson` -- the one writer of item JSON (objects, compact rows, pack tables);
* :mod:`.refs` -- format 9: references to older steps' objects (``bases``) and shard digests;
* :mod:`.codec` -- one reader per format family (``single``: 1/3/4/5, ``split``: 2 and 3 with
  fragments, plus ``arrays`` and ``packs``), behind ``decode`` (dispatches on the version)
  and ``encode``;
* :mod:`.fragments` -- writing format 2: a host's fragment, its summary, the coordinator's root;
* :mod:`.lazy` -- "which shards meet these boxes": loads a format-2 root's fragments as needed;
* :mod:`.builder` -- host records and their merge: the one builder save, DCP and converters use.

Everything that used to be imported from ``ckptio.manifest``, ``ckptio.fragments`` and
``ckptio.packtable`` is importable from here.
"""

from __future__ import annotations

from ckptio.manifest.builder import (
    PACKED, ObjectNumbers, expanded, host_record, merge_records, merged_doc, validated,
)
from ckptio.manifest.codec import decode, decode_json, encode, encode_json
from ckptio.manifest.codec.arrays import array_item, row_item
from ckptio.manifest.codec.packs import table_from_doc
from ckptio.manifest.codec.single import head_fields
from ckptio.manifest.codec.split import FRAGMENT_FORMAT, load_fragments, root_from_doc
from ckptio.manifest.formats import (
    BLOCKS_VERSION, FORMAT, FRAGMENTS_VERSION, MANIFEST_NAME, PACKS_VERSION, ROWS_VERSION, TILED_VERSION,
    TOMBSTONE_NAME, VERSION, version_for,
)
from ckptio.manifest.fragments import (
    FRAGMENT_PREFIX, build_root, fragment_doc, fragment_key, fragment_ref, summary_of,
)
from ckptio.manifest.geometry import check_table, check_tiling, first_overlap, overlap, without_replicas
from ckptio.manifest.itemjson import (
    array_json, document, dtype_code, extent_json, item_row, item_to_json, row_object, shard_json, table_doc,
)
from ckptio.manifest.lazy import (
    Boxes, Fetch, Wanted, fragments_for, with_every_shard, with_fragments, with_shards_meeting,
)
from ckptio.manifest.limits import MAX_MANIFEST_BYTES
from ckptio.manifest.model import (
    ArrayItem, Box, Extent, FragmentRef, Items, Manifest, PackTable, ShardRecord, ValueItem, split_items,
)
from ckptio.manifest.sealing import seal, unseal
from ckptio.manifest.table import ShardTable, table_of
from ckptio.manifest.values import decode_value, encode_value

#: The name this check had when it was private to the one-module manifest (tests import it).
_check_tiling = check_tiling

__all__ = [
    "FORMAT",
    "BLOCKS_VERSION",
    "FRAGMENTS_VERSION",
    "FRAGMENT_FORMAT",
    "FRAGMENT_PREFIX",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "PACKED",
    "PACKS_VERSION",
    "ROWS_VERSION",
    "TILED_VERSION",
    "TOMBSTONE_NAME",
    "VERSION",
    "ArrayItem",
    "Box",
    "Boxes",
    "Extent",
    "Fetch",
    "FragmentRef",
    "Items",
    "Manifest",
    "ObjectNumbers",
    "PackTable",
    "ShardRecord",
    "ShardTable",
    "ValueItem",
    "Wanted",
    "array_item",
    "array_json",
    "build_root",
    "check_table",
    "check_tiling",
    "decode",
    "decode_json",
    "decode_value",
    "document",
    "dtype_code",
    "encode",
    "encode_json",
    "encode_value",
    "expanded",
    "extent_json",
    "first_overlap",
    "fragment_doc",
    "fragment_key",
    "fragment_ref",
    "fragments_for",
    "head_fields",
    "host_record",
    "item_row",
    "item_to_json",
    "load_fragments",
    "merge_records",
    "merged_doc",
    "overlap",
    "root_from_doc",
    "row_item",
    "row_object",
    "seal",
    "shard_json",
    "split_items",
    "summary_of",
    "table_doc",
    "table_of",
    "table_from_doc",
    "unseal",
    "validated",
    "version_for",
    "with_every_shard",
    "with_fragments",
    "with_shards_meeting",
    "without_replicas",
]
