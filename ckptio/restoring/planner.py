"""The read plan of a restore: which object byte ranges go to which destination buffers, and how leaves are built.

:func:`plan` is pure: it reads no byte and talks to no store or host. It
turns a manifest and a target into a :class:`ReadPlan`, a plain data
structure that says everything the restore will read (``requests``: object
key, byte range, destination buffers, the checksums to verify) and how to
build the restored tree from the filled buffers (``finish``). Executing it
(:mod:`ckptio.restoring.executor`) is IO only, so whoever routes the reads (the
tiers fetch a plan's objects from peers first; an elastic restore may share
them out between hosts) works on the plan, not inside the engine.

Planning a format-2 manifest needs its fragments for the boxes the target
meets first: :func:`select` names them (:meth:`Selection.boxes`), the caller
loads them, then plans.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from ckptio.engine import EngineConfig, ReadRequest
from ckptio.errors import CheckpointNotFoundError
from ckptio.manifest import ArrayItem, Extent, Manifest, PackTable, ValueItem, split_items
from ckptio.manifest.hoststate import HostStateItem
from ckptio.restoring.buffers import Finish
from ckptio.restoring.hoststates import host_state_finisher
from ckptio.restoring.packed import BULK_ITEM_BYTES, Batch, bulk_reads, table_reads
from ckptio.restoring.reshard import Region, coverage_gaps, plan_regions
from ckptio.restoring.scalars import PY_SCALARS, scalar_value
from ckptio.restoring.targets import (
    Box, inplace_view, is_target_leaf, replicated_jax, target_boxes, target_regions,
)
from ckptio.state.tree import flatten_named, unflatten

__all__ = ["ReadPlan", "Selection", "plan", "select"]

_MAX_READ = EngineConfig.max_read_size


@dataclasses.dataclass
class Selection:
    """The leaves a restore asks for, before anything is planned or allocated.

    ``wanted``: item name -> its target leaf (None: as saved); ``tables``: the
    format-5 pack tables a whole restore reads as columns (their members are
    not in ``wanted``); ``structure``: the tree the leaves are put back into.
    """

    wanted: dict[str, Any]
    tables: list[PackTable]
    structure: Any

    def boxes(self, manifest: Manifest) -> dict[str, list[Box]]:
        """Per wanted array item, the boxes of it this restore reads (to load a format-2 manifest's
        fragments holding them, and no others)."""
        return {n: target_boxes(manifest.items[n], t) for n, t in self.wanted.items()
                if isinstance(manifest.items[n], ArrayItem)}


def select(manifest: Manifest, target: Any, where: str = "") -> Selection:
    """What a restore of ``manifest`` into ``target`` asks for; CheckpointNotFoundError (naming
    ``where``) if the target names items the checkpoint does not hold."""
    if target is None:
        # A whole restore reads a format-5 manifest's pack tables in bulk, as columns.
        plain, tables = split_items(manifest.items)
        return Selection(dict.fromkeys(plain), tables, manifest.tree)
    names, values, structure = flatten_named(target, is_leaf=is_target_leaf)
    wanted = dict(zip(names, values))
    missing = [n for n in wanted if n not in manifest.items]
    if missing:
        raise CheckpointNotFoundError(
            f"{where}: the target asks for {missing[:5]} which the checkpoint does not hold "
            f"(it holds {sorted(manifest.items)[:10]}{'...' if len(manifest.items) > 10 else ''})"
        )
    return Selection(wanted, [], structure)


@dataclasses.dataclass
class ReadPlan:
    """Every read of one restore, and how the restored tree is built once they are done.

    ``requests`` are all the restore reads: each names an object key and a byte
    range, the caller-owned buffers the bytes land in, and the checksums they
    are verified against (:class:`ckptio.engine.ReadRequest`). Executing them in
    any order, split or routed to any backend holding those objects, then
    calling :meth:`finish` once, restores the tree. Nothing is read twice.
    """

    requests: list[ReadRequest]
    structure: Any
    #: Per leaf read on its own (or a saved value): builds it.
    finishers: dict[str, Finish]
    #: Builders of the leaves read in bulk (many per buffer): each returns name -> leaf.
    batches: list[Batch]
    #: Small arrays read in bulk for a numpy or torch target: its bytes to fill, and the target itself.
    into: dict[str, tuple[np.ndarray, Any]]
    #: Small arrays read in bulk for a replicated jax target: its sharding.
    placed: dict[str, Any]

    def keys(self) -> set[str]:
        """The object keys this plan reads."""
        return {r.key for r in self.requests}

    @property
    def nbytes(self) -> int:
        """Bytes this plan reads (checksum-block rounding included)."""
        return sum(r.rng.length for r in self.requests)

    def finish(self) -> Any:
        """The restored tree: call once, after every request was read and verified."""
        results = {name: finish() for name, finish in self.finishers.items()}
        for batch in self.batches:
            results.update(batch())
        for name, (view, tgt) in self.into.items():
            np.copyto(view, results[name])
            results[name] = tgt
        if self.placed:  # one batched transfer for all of them (per-array device_put costs ~60 us each)
            jax = sys.modules["jax"]
            names = list(self.placed)
            results.update(zip(names, jax.device_put([results[n] for n in names], [self.placed[n] for n in names])))
        return unflatten(self.structure, results.__getitem__)


def plan(manifest: Manifest, target: Any = None, *, where: str = "", max_read: int = _MAX_READ,
         host: tuple[int, int] | None = None) -> ReadPlan:
    """The :class:`ReadPlan` of restoring ``manifest``'s items as ``target`` asks (a target tree or a
    :class:`Selection` of it). Pure: no IO. A format-2 manifest must hold the fragments the target
    meets (see :meth:`Selection.boxes`). ``where`` names the checkpoint in errors; ``max_read``
    bounds one bulk read; ``host`` = ``(rank, num_hosts)`` picks each per-host item's state
    (None: the default coordinator's, :mod:`ckptio.restoring.hoststates`)."""
    sel = target if isinstance(target, Selection) else select(manifest, target, where)
    builder = _Builder(manifest, where, host)
    for name, tgt in sel.wanted.items():
        builder.add(name, tgt)
    bulk_requests, bulk_finish = bulk_reads(builder.small, manifest.objects, manifest.block_size, max_read)
    table_requests, table_finish = table_reads(sel.tables, manifest.objects, manifest.block_size, max_read)
    # Every region at once: scattered pieces adjacent in one object, of any array, are one read.
    region_requests = plan_regions(builder.regions, manifest.objects, manifest.block_size)
    return ReadPlan(region_requests + bulk_requests + table_requests, sel.structure, builder.finishers,
                    [bulk_finish, table_finish], builder.into, builder.placed)


class _Builder:
    """The per-leaf part of :func:`plan`: each wanted leaf becomes reads and a finisher, or joins the bulk."""

    def __init__(self, manifest: Manifest, where: str, host: tuple[int, int] | None = None) -> None:
        self.manifest, self.where, self.host = manifest, where, host
        self.regions: list[tuple[str, ArrayItem, Region]] = []
        self.finishers: dict[str, Finish] = {}
        self.small: list[tuple[str, ArrayItem, Extent]] = []
        self.placed: dict[str, Any] = {}
        self.into: dict[str, tuple[np.ndarray, Any]] = {}
        self.bulk_max = min(BULK_ITEM_BYTES, manifest.block_size)
        self.jax = sys.modules.get("jax")
        self.canonical: dict[np.dtype, bool] = {}  # per restore: jax's x64 setting may change between them

    def add(self, name: str, tgt: Any) -> None:
        item = self.manifest.items[name]
        if isinstance(item, HostStateItem):
            self.finishers[name] = host_state_finisher(name, item, tgt, self.host, self.where)
            return
        if isinstance(item, ValueItem):
            value = item.value
            if isinstance(tgt, PY_SCALARS):
                value = scalar_value(name, value, "the value", tgt)
            self.finishers[name] = lambda v=value: v
            return
        if not self._bulk(name, item, tgt):
            self._regions(name, item, tgt)

    def _bulk(self, name: str, item: ArrayItem, tgt: Any) -> bool:
        """Join the bulk reads if ``item`` is a whole small array its target takes as saved."""
        if not (self.manifest.tiles_known(name) and len(item.shards) == 1):
            return False
        shard = item.shards[0]
        # One checksum over the whole array (not an extent with small blocks of its own, format 6):
        # a bulk read verifies each member by one crc.
        if not (shard.tile is None and len(shard.extents) == 1 and 0 < shard.extents[0].length <= self.bulk_max
                and len(shard.extents[0].crcs) == 1):
            return False
        # A whole small array: read in bulk, then placed on jax devices or copied into the target.
        view = None if tgt is None else inplace_view(tgt, item)
        if not (tgt is None or view is not None or replicated_jax(self.jax, tgt, item, self.canonical)):
            return False
        self.small.append((name, item, shard.extents[0]))
        if view is not None:
            self.into[name] = (view, tgt)
        elif tgt is not None:
            self.placed[name] = tgt.sharding
        return True

    def _regions(self, name: str, item: ArrayItem, tgt: Any) -> None:
        """The general path: the target's regions, each planned against the saved shards it meets."""
        regions, self.finishers[name] = target_regions(name, item, tgt)
        for r in regions:
            whole = self.manifest.tiles_known(name) and r.dest.shape == item.shape  # a validated tiling covers it all
            gaps = 0 if whole else coverage_gaps(item, r.offsets, tuple(r.dest.shape))
            if gaps:
                raise CheckpointNotFoundError(
                    f"{self.where}: item {name!r}: {gaps} elements of the target slice are not saved")
            self.regions.append((name, item, r))

