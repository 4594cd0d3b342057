"""A marker that makes stock Orbax say "call ckptio.orbax.register()" on a ckptio-written array.

With :func:`ckptio.orbax.register`, the ``jax.Array`` leaves of Orbax's own
items live in ckptio's store (``<item>/ckptio/``); Orbax's ``_METADATA`` still
lists them. A process that did not call ``register()`` restores them with
Orbax's own ``ArrayHandler``, which asks TensorStore for ``<leaf>/.zarray``
(``zarr.json`` for zarr3) and, finding none, fails with ``NOT_FOUND ... .zarray``
-- nothing says why. Orbax reads that metadata key before any array data and
TensorStore quotes the offending value when it cannot parse it, so ckptio
writes, for each of its leaves, a zarr metadata entry whose dtype *is* the
explanation:

    Error parsing object member "dtype": Unsupported zarr dtype:
    "this item was written by ckptio; call ckptio.orbax.register() ..."

This works without ckptio installed in the reading process. Where the entries
go follows Orbax's layout, so that Orbax itself publishes them:

* OCDBT items (Orbax's default): an OCDBT database in ``<item>/ocdbt.process_ckptio``;
  Orbax's ``finalize`` merges every ``ocdbt.process_*`` database into the
  item's root, where a stock restore looks. (It also stops Orbax's "Skipping
  merge of OCDBT checkpoints" warning on items whose arrays all went to ckptio.)
* non-OCDBT items: plain ``<item>/<leaf>/.zarray`` files, where Orbax looks.

A data key ``<leaf>/0`` accompanies each entry: Orbax's post-merge validation
requires every metadata key to have data. ckptio's own restore never reads
any of it. Only process 0 writes (the entries are the same on every host).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["MARKER_MESSAGE", "MARKER_SUBDIR", "marker_entries", "write_marker"]

log = logging.getLogger("ckptio.orbax")

#: What a stock Orbax restore of a ckptio-written leaf reports (quoted by TensorStore).
MARKER_MESSAGE = (
    "this item was written by ckptio (ckptio.orbax.register()); call ckptio.orbax.register() "
    "before restoring it -- stock Orbax cannot read its arrays"
)
#: Orbax merges every ``ocdbt.process_*`` database of an item at finalize.
MARKER_SUBDIR = "ocdbt.process_ckptio"


def marker_entries(names: Sequence[str], use_zarr3: bool) -> dict[str, bytes]:
    """The key-value entries that make a stock read of each of ``names`` fail with :data:`MARKER_MESSAGE`."""
    if use_zarr3:
        key, meta = "zarr.json", {"zarr_format": 3, "node_type": "array", "data_type": MARKER_MESSAGE}
    else:
        key, meta = ".zarray", {"zarr_format": 2, "dtype": MARKER_MESSAGE}
    # Enough of the rest of the format that the dtype is the first thing a parser rejects.
    meta |= {
        "shape": [1],
        "chunks": [1],
        "compressor": None,
        "fill_value": None,
        "order": "C",
        "filters": None,
    }
    body = json.dumps(meta).encode()
    out: dict[str, bytes] = {}
    for name in names:
        out[f"{name}/{key}"] = body
        out[f"{name}/0"] = b""  # the "data" Orbax's merge validation wants beside each metadata key
    return out


def write_marker(parent: Any, names: Sequence[str], *, use_ocdbt: bool, use_zarr3: bool) -> None:
    """Write the marker entries for ``names`` under the item directory ``parent`` (see the module doc).

    Best effort: the checkpoint is complete without them (they only improve a
    stock restore's error), so a failure is logged, never raised.
    """
    import jax

    if jax.process_index() != 0 or not names:
        return
    try:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        if use_ocdbt:
            spec = ts_utils.build_kvstore_tspec((parent / MARKER_SUBDIR).as_posix(), use_ocdbt=True)
        else:
            spec = ts_utils.build_kvstore_tspec(parent.as_posix(), use_ocdbt=False)
            if not str(spec.get("path", "/")).endswith("/"):
                spec["path"] += "/"  # a key prefix: "<item>/<leaf>/.zarray", not "<item><leaf>/..."
        # Orbax's context: its OCDBT specs name a cache pool only that context defines.
        kv = ts.KvStore.open(spec, context=ts_utils.get_ts_context(use_ocdbt=use_ocdbt)).result()
        txn = ts.Transaction()
        for key, value in marker_entries(names, use_zarr3).items():
            kv.with_transaction(txn)[key] = value
        txn.commit_sync()
    except Exception as e:  # never fail a committed save over an error message
        log.warning("ckptio.orbax: writing the stock-Orbax marker under %s failed: %r", parent, e)
