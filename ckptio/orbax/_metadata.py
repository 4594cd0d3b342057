"""Orbax's metadata objects for ckptio items: ``TreeMetadata``, ``ArrayMetadata`` with storage metadata.

Tools built on Orbax (its own ``metadata()`` callers, ``CheckpointManager.item_metadata``,
checkpoint browsers) read ``.tree``, ``.custom_metadata`` and each array's
``shape`` / ``dtype`` / ``sharding`` / ``storage.write_shape``; a ckptio item
answers with the same classes. ``write_shape`` is the shape of the saved
shards (what each host wrote: Orbax records the same), ``chunk_shape`` too:
ckptio stores each shard as one contiguous run of bytes, its own chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.metadata import value as value_metadata

from ckptio.manifest import ArrayItem, ValueItem

__all__ = ["leaf_metadata", "storage_metadata", "tree_metadata_of", "write_shape"]


def write_shape(item: ArrayItem) -> tuple[int, ...]:
    """The shape of the item's saved shards (the first one's: a sharding's shards share it but at the edges)."""
    if item.shards:
        return tuple(item.shards[0].shape)
    table = getattr(item, "locator", None)  # format 2 manifests: rows of [fragment, offsets..., shape...]
    if table is not None and len(table):
        return tuple(int(d) for d in table[0][1 + len(item.shape) :])
    return tuple(item.shape)


def storage_metadata(item: ArrayItem) -> value_metadata.StorageMetadata:
    shape = write_shape(item)
    return value_metadata.StorageMetadata(chunk_shape=shape, write_shape=shape)


def leaf_metadata(name: str, item: ArrayItem | ValueItem | Any, directory: Any, sharding: Any = None) -> Any:
    """Orbax's metadata for one ckptio item (``sharding``: a ``ShardingMetadata`` if one was recorded)."""
    if isinstance(item, ArrayItem):
        return value_metadata.ArrayMetadata(
            name=name,
            directory=directory,
            shape=tuple(item.shape),
            sharding=sharding,
            dtype=np.dtype(item.dtype),
            storage=storage_metadata(item),
        )
    value = item.value if isinstance(item, ValueItem) else item
    if isinstance(value, str):
        return value_metadata.StringMetadata(name=name, directory=directory)
    if isinstance(value, (bool, int, float, complex)):
        # Orbax's ScalarMetadata dtypes for Python numbers (int64 / float64, as its ScalarHandler).
        dtype = np.int64 if isinstance(value, int) and not isinstance(value, bool) else type(value)
        return value_metadata.ScalarMetadata(name=name, directory=directory, dtype=np.dtype(dtype))
    return value  # bytes, None: no Orbax metadata class describes them; the value itself


def tree_metadata_of(tree: Any, custom_metadata: Any = None) -> Any:
    """``tree`` (of per-leaf metadata) as Orbax's ``TreeMetadata``, with the user's custom metadata."""
    return tree_metadata.build_default_tree_metadata(tree, custom_metadata=custom_metadata)
