"""Formats 1, 3, 4 and 5: a manifest in one document (see :mod:`ckptio.manifest.formats`).

Schema (version 1; 3 adds ``tile`` to shards, 4 compact rows among the items,
5 ``packs``)::

    {"format": "ckptio", "version": 1, "step": 100 | null,
     "checkpoint_id": "<hex>", "created": <unix seconds>, "block_size": 4194304,
     "num_hosts": 4, "tree": <structure, see ckptio.state.tree>,
     "objects": ["h3f/100/<id>/h00000-00000", ...],        # keys relative to the checkpoint root
     "items": {"params/w": {"kind": "array", "dtype": "bfloat16", "shape": [8, 4],
                            "scalar": false, "origin": "jax",
                            "shards": [{"offsets": [0, 0], "shape": [4, 4], "host": 0,
                                        "extents": [[object, offset, shard_offset, length, [crc, ...], block?]]}]},
               "step": {"kind": "value", "type": "int", "value": 100}},
     "metadata": {...user JSON...}, "fence": "<12 hex digits>"?}

An array's shards tile its global shape; each shard's C-order bytes are cut
into extents, each stored at ``offset`` in ``objects[object]`` with the
crc32c of every ``block_size`` bytes from the extent's start (or of every ``block``
bytes where the extent records a block of its own: version 6). Everything read
is validated (bounded sizes, keys that cannot escape the root, dtypes from an
allow-list); nothing is ever unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ckptio.backends.base import check_key
from ckptio.errors import ManifestError
from ckptio.manifest.codec.arrays import array_item, row_item
from ckptio.manifest.codec.packs import table_from_doc
from ckptio.manifest.formats import HOST_STATES_VERSION, PACKS_VERSION, version_for
from ckptio.manifest.hoststate import HostStateItem, host_state_item
from ckptio.manifest.itemjson import document, item_to_json
from ckptio.manifest.limits import MAX_COUNT, check_int
from ckptio.manifest.model import ArrayItem, Items, Manifest, ValueItem, split_items
from ckptio.manifest.refs import decode_refs, encode_refs, uses_refs
from ckptio.manifest.values import decode_value
from ckptio.state.tree import tree_leaf_names

__all__ = ["encode", "from_doc", "head_fields"]

_FENCE_ID = re.compile(r"[0-9a-f]{12}")


def from_doc(doc: dict[str, Any], version: int, where: str) -> Manifest:
    """A one-document manifest of ``version`` (checked by the caller), validated."""
    block_size = check_int(doc["block_size"], "block_size", where, lo=1)
    objects = doc["objects"]
    if not isinstance(objects, list) or len(objects) > MAX_COUNT:
        raise ManifestError(f"{where}: 'objects' must be a list of keys")
    for key in objects:
        try:
            check_key(key)
        except ValueError as e:
            raise ManifestError(f"{where}: object key escapes the checkpoint root: {e}") from e
    raw_items = doc["items"]
    if not isinstance(raw_items, dict) or len(raw_items) > MAX_COUNT:
        raise ManifestError(f"{where}: 'items' must be a JSON object")
    items: dict[str, ArrayItem | ValueItem] = {}
    for name, raw in raw_items.items():
        if type(raw) is list:  # a compact row: a small whole array
            items[name] = row_item(raw, f"{where}: item {name!r}", len(objects), block_size)
            continue
        here = f"{where}: item {name!r}"
        if not isinstance(raw, dict):
            raise ManifestError(f"{here}: not a JSON object")
        if raw.get("kind") == "value":
            items[name] = ValueItem(decode_value(raw, here))
        elif raw.get("kind") == "array":
            items[name] = array_item(raw, here, len(objects), block_size)
        elif raw.get("kind") == "per_host" and version >= HOST_STATES_VERSION:
            items[name] = host_state_item(raw, here)
        else:
            raise ManifestError(f"{here}: unknown kind {raw.get('kind')!r}")
    if "packs" in doc:
        items = _with_packs(items, doc["packs"], version, where, len(objects), block_size)
    return Manifest(block_size=block_size, items=items, objects=objects, **head_fields(doc, items, where),
                    **decode_refs(doc, version, where))


def _with_packs(items: dict[str, ArrayItem | ValueItem], raw: Any, version: int, where: str, n_objects: int,
                block_size: int) -> Items:
    """``items`` and the members of a format-5 manifest's pack tables, validated."""
    if version < PACKS_VERSION or type(raw) is not list or len(raw) > MAX_COUNT:
        raise ManifestError(f"{where}: 'packs' must be a list of pack tables (format {PACKS_VERSION})")
    tables = [table_from_doc(t, f"{where}: pack {i}", n_objects, block_size) for i, t in enumerate(raw)]
    return Items(items, tables, where)


def head_fields(doc: dict[str, Any], items: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The validated fields every manifest format shares (step, id, time, hosts, tree, metadata, fence)."""
    step = doc.get("step")
    if step is not None:
        check_int(step, "step", where)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: 'metadata' must be a JSON object")
    _check_tree(doc["tree"], items, where)
    fence = doc.get("fence")
    if fence is not None and not (isinstance(fence, str) and _FENCE_ID.fullmatch(fence)):
        raise ManifestError(f"{where}: 'fence' must be 12 hex digits, got {str(fence)[:40]!r}")
    return {"fence": fence, "step": step, "checkpoint_id": str(doc.get("checkpoint_id", "")),
            "created": float(doc.get("created", 0.0)),
            "num_hosts": check_int(doc.get("num_hosts", 1), "num_hosts", where, lo=1), "tree": doc["tree"],
            "metadata": metadata}


def _check_tree(tree: Any, items: Mapping[str, Any], where: str) -> None:
    try:
        plain, tables = split_items(items)
        missing = set(tree_leaf_names(tree)).difference(plain, *(t.names for t in tables))
    except (AttributeError, ValueError, TypeError) as e:
        raise ManifestError(f"{where}: malformed tree: {e}") from e
    if missing:
        raise ManifestError(f"{where}: tree names items the manifest lacks: {sorted(missing)[:5]}")


def encode(manifest: Manifest) -> dict[str, Any]:
    """``manifest`` as one document (every shard in it), in the lowest version that expresses it."""
    if not manifest.complete:
        raise ManifestError("a manifest loaded with only some of its fragments cannot be written whole")
    arrays = [it for it in manifest.items.values() if isinstance(it, ArrayItem)]
    tiles = any(s.tile for it in arrays for s in it.shards)
    bs = manifest.block_size
    blocks = any(e.block != bs for it in arrays for s in it.shards for e in s.extents)
    host_states = any(isinstance(it, HostStateItem) for it in manifest.items.values())
    version = version_for(tiles=tiles, blocks=blocks, host_states=host_states, refs=uses_refs(manifest))
    doc = document(
        version=version, step=manifest.step, checkpoint_id=manifest.checkpoint_id,
        created=manifest.created, block_size=bs, num_hosts=manifest.num_hosts, tree=manifest.tree,
        objects=manifest.objects, items={name: item_to_json(item, name, bs) for name, item in manifest.items.items()},
        metadata=manifest.metadata, fence=manifest.fence,
    )
    doc.update(encode_refs(manifest))
    return doc
