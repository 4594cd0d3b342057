"""The DCP Reader's read-once: its read items restored by logical-box exchange.

A DCP load plan asks each rank for sub-boxes of saved chunks (``ReadItem``);
the Reader turns each into a destination :class:`~ckptio.restoring.reshard.Region` of
one manifest item (the tensor's, or the item holding a byte item's or a
transformed chunk's stored bytes, read whole). Here those regions become the
rank's *target boxes* of a restore by logical-box exchange
(:func:`ckptio.restoring.boxexchange.restore_exchange`) over the torch process
group: every rank learns every rank's boxes (one all-gather), arrays no two
ranks share are read by each rank itself, the others by the rank responsible
for their saved shards, once across the job, and sent to the ranks that use
them. The bytes land in the Reader's own buffers, verified where they are read
and sealed on the wire, so the Reader's finishers hand them to the planner as
after a plain read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ckptio.coord.distributed import Coordinator
from ckptio.coord.waits import waiting_for
from ckptio.manifest import ArrayItem, Manifest
from ckptio.restoring.agreement import agree, named
from ckptio.restoring.boxexchange import restore_exchange
from ckptio.restoring.planner import Selection
from ckptio.restoring.reshard import Region
from ckptio.state.leaves import Sharded
from ckptio.store import CheckpointStore

__all__ = ["exchange_regions"]

#: What the Reader wants read: (manifest item name, its item, the region to fill).
Want = tuple[str, ArrayItem, Region]


def exchange_regions(store: CheckpointStore, manifest: Manifest, step_dir: str, plan: Callable[[], Sequence[Want]],
                     coord: Coordinator) -> int:
    """Fill the regions ``plan()`` names with each stored byte read once across ``coord``'s hosts
    (collective: every rank calls it). A rank whose ``plan()`` fails joins the agreement anyway,
    and every rank raises, naming the rank at fault. The bytes this rank restored."""
    failure: BaseException | None = None
    wants: Sequence[Want] = ()
    try:
        wants = plan()
    except Exception as e:
        failure = named(e, coord.rank)
    config = store.engine.config
    with waiting_for(f"read-once load of {store.where(step_dir)}: agreeing on the read items",
                     config.collective_deadline_s()):
        agree(coord, failure, 0)
    pieces: dict[str, list[tuple[tuple[slice, ...], np.ndarray]]] = {}
    mine: dict[str, list[np.ndarray]] = {}
    for name, item, region in wants:
        if not region.dest.size:
            continue  # nothing to read: a box of no bytes is no row of anyone's target table
        dest = region.dest
        if dest.dtype != item.dtype and dest.dtype.itemsize == item.dtype.itemsize:
            dest = dest.view(item.dtype)  # the same bytes, named as the manifest names them
        index = tuple(slice(o, o + n) for o, n in zip(region.offsets, dest.shape))
        pieces.setdefault(name, []).append((index, dest))
        mine.setdefault(name, []).append(region.dest)
    names = sorted(pieces)
    items = manifest.items
    wanted = {n: Sharded(items[n].shape, items[n].dtype, pieces[n]) for n in names}  # type: ignore[union-attr]
    # A flat list of leaves named by item: no tree path to escape.
    out = restore_exchange(store, manifest, step_dir, Selection(wanted, [], {"list": [{"leaf": n} for n in names]}),
                           coord)
    for name, got in zip(names, out):
        for dest, (_index, data) in zip(mine[name], got.pieces):
            if not np.may_share_memory(dest, data):  # a buffer the restore could not fill in place
                dest.reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return sum(r.dest.nbytes for _n, _i, r in wants)
